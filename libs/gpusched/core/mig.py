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


def published_profiles(model: str, memory_mb: int) -> list[MigProfile]:
    """The published profiles of a GPU by its model name and memory ([] for a GPU without MIG
    or one whose table is not modelled)."""
    name = model.upper()
    if "A100" in name and memory_mb <= 48 * 1024:
        return list(PUBLISHED["A100-40GB"])
    if "H100" in name and 64 * 1024 <= memory_mb <= 96 * 1024:
        return list(PUBLISHED["H100-80GB"])
    return []


__all__ = ["PUBLISHED", "MigInfo", "MigMode", "MigProfile", "profile_name", "published_profiles"]
