"""MIG (Multi-Instance GPU): what a node can say of each GPU's partitioning (docs/gpu-sharing.md).

A MIG-capable GPU is in MIG mode or not (a change is pending until the GPU resets), and offers
GPU-instance profiles: `<compute slices>g.<memory>gb`, each with the most instances of it the
GPU can hold and how many more it can hold now. The NVML backend reads them from the driver;
the simulated backend models NVIDIA's published profiles of the A100 40GB and the H100 80GB.
"""

from __future__ import annotations

import math
from typing import Literal

from msgspec import Struct

MigMode = Literal["enabled", "disabled", "unsupported"]


class MigProfile(Struct, frozen=True):
    """One GPU-instance profile: `slices` compute slices (of 7), `memory_mb` of memory, at most
    `instances` at once on the GPU, `remaining` more of it placeable now."""

    name: str
    slices: int
    memory_mb: int
    instances: int
    remaining: int


class MigInfo(Struct, frozen=True):
    """A GPU's MIG mode (`pending`: the mode after its next reset) and its profiles."""

    mode: MigMode
    pending: MigMode
    profiles: list[MigProfile] = []


def profile_name(slices: int, memory_mb: int) -> str:
    """NVIDIA's name of a profile: compute slices and its memory in whole GB rounded up, `3g.20gb`
    (the driver's 19968 MiB is its "20gb"; a driver that names its profiles is asked instead)."""
    return f"{slices}g.{max(1, math.ceil(memory_mb / 1024 - 0.05))}gb"


def _table(rows: list[tuple[int, int, int]]) -> list[MigProfile]:
    return [MigProfile(profile_name(s, gb * 1024), s, gb * 1024, n, n) for s, gb, n in rows]


#: NVIDIA's published GPU-instance profiles (MIG user guide), nominal memory: (slices, GB, instances).
PUBLISHED: dict[str, list[MigProfile]] = {
    "A100-40GB": _table([(1, 5, 7), (1, 10, 4), (2, 10, 3), (3, 20, 2), (4, 20, 1), (7, 40, 1)]),
    "H100-80GB": _table([(1, 10, 7), (1, 20, 4), (2, 20, 3), (3, 40, 2), (4, 40, 1), (7, 80, 1)]),
}


#: Compute slices of a whole MIG-capable GPU (A100, H100): a slice's charge is its share of them.
COMPUTE_SLICES = 7


def profile_slices(name: str) -> int:
    """The compute slices of a profile by its name (`3g.40gb` -> 3)."""
    return int(name.split("g.", 1)[0])


def slice_share(profile: str, count: int = 1) -> float:
    """What `count` slices of `profile` are charged, as a share of one GPU: their compute slices
    of its 7 (fair share and accounting count a `1g.10gb` as 1/7 of a GPU). Not rounded here:
    the fold's sums round (`state.gpu_count`), so seven 1/7 slices hold exactly one GPU."""
    return min(1.0, count * profile_slices(profile) / COMPUTE_SLICES)


def slice_uuid(gpu_uuid: str, index: int) -> str:
    """The MIG device UUID a job on slice `index` of a GPU is given (`CUDA_VISIBLE_DEVICES`). The
    driver names each GPU instance `MIG-<uuid>`; a simulated one is derived from its GPU's."""
    return f"MIG-{gpu_uuid.removeprefix('GPU-')}-{index}"


def geometry_problem(info: MigInfo | None, memory_mb: int, profiles: list[str]) -> str | None:
    """Why `profiles` (one per slice) cannot be a GPU's MIG geometry, or None: the GPU must be
    in MIG mode (or switching to it) and offer each profile, no profile beyond its most
    instances, and the slices must fit its 7 compute slices and its memory. (The driver also
    places instances at fixed offsets; a geometry it refuses stays unapplied on the node.)"""
    if not profiles:
        return None  # no geometry: the GPU is whole again
    if info is None or "enabled" not in (info.mode, info.pending):
        return "the GPU is not in MIG mode (enable it on the node: nvidia-smi -mig 1)"
    offered = {p.name: p for p in info.profiles}
    for name in dict.fromkeys(profiles):
        p = offered.get(name)
        if p is None:
            return f"profile {name} is not offered by this GPU (offered: {', '.join(offered) or 'none'})"
        if profiles.count(name) > p.instances:
            return f"profile {name} fits at most {p.instances} times on this GPU, not {profiles.count(name)}"
    used = sum(offered[n].slices for n in profiles)
    if used > COMPUTE_SLICES:
        return f"the profiles take {used} compute slices; a GPU has {COMPUTE_SLICES}"
    mem = sum(offered[n].memory_mb for n in profiles)
    if memory_mb and mem > memory_mb + 1024:
        return f"the profiles take {mem} MiB; the GPU has {memory_mb}"
    return None


def published_profiles(model: str, memory_mb: int) -> list[MigProfile]:
    """The published profiles of a GPU by its model name and memory ([] for a GPU without MIG
    or one whose table is not modelled)."""
    name = model.upper()
    if "A100" in name and memory_mb <= 48 * 1024:
        return list(PUBLISHED["A100-40GB"])
    if "H100" in name and 64 * 1024 <= memory_mb <= 96 * 1024:
        return list(PUBLISHED["H100-80GB"])
    return []


__all__ = ["COMPUTE_SLICES", "PUBLISHED", "MigInfo", "MigMode", "MigProfile", "geometry_problem",
           "profile_name", "profile_slices", "published_profiles", "slice_share", "slice_uuid"]
