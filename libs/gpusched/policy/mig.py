"""MIG slices: which slices of which partitioned GPU a job asking for `--mig PROFILE[xN]` gets
(docs/gpu-sharing.md#mig-slices).

A slice is a hard partition of a GPU the admin laid out (`MigGeometrySet`): placement never
changes a geometry, it only hands out free slices of the profile asked for, all of a job's on
one GPU. Among the GPUs with enough free slices it packs: a GPU some job already uses before an
untouched one (so the fewest GPUs are partly used and whole partitioned GPUs stay free for a
later reconfiguration), then the one left with the fewest free slices (best fit), then the
GPUs' order. A partitioned GPU is never in the pool of whole GPUs nor shared by fractions.

`SliceIndex` keeps that order per profile for one cycle, so a job's pick is the first GPU of
its profile's list that fits it, not a scan of every partitioned GPU.
"""

from __future__ import annotations

from bisect import insort
from typing import NamedTuple

from ..core import rules
from ..core.mig import slice_share
from ..core.model import GpuId, JobSpec
from ..core.state import ClusterState
from .placement import Pool
from .resources import room_on
from .sharing import allowed_nodes

#: A GPU's place in a profile's packing order: (untouched, free slices of the profile, order, GPU).
Key = tuple[int, int, int, GpuId]


class SlicePick(NamedTuple):
    gpu: GpuId
    slices: list[int]
    share: float  # what the slices are charged: their compute slices of the GPU's 7


class SliceIndex:
    """One cycle's view of the partitioned GPUs: the slices it granted, the free slices left,
    and per profile the placeable GPUs with free slices of it in packing order. Nothing is
    looked up until a MIG job asks (a profile's order when one first asks for it); `take`
    keeps it in step."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.taken: dict[GpuId, list[int]] = {}
        self._order: dict[GpuId, int] | None = None
        self._free = 0
        self._lists: dict[str, list[Key]] = {}
        self._keys: dict[tuple[str, GpuId], Key] = {}

    @property
    def order(self) -> dict[GpuId, int]:
        """The placeable partitioned GPUs, each with its place in the fold's order."""
        if self._order is None:
            st = self.state
            gpus = [g for g, rec in st.gpus.items() if rec.geometry and rules.gpu_healthy(st, g)
                    and not st.nodes[rec.node].partitioned]
            self._order = {g: i for i, g in enumerate(gpus)}
            self._free = sum(len(st.gpus[g].geometry) - len(st.gpus[g].slices) for g in gpus)
        return self._order

    @property
    def free(self) -> int:
        """Free slices left on the placeable partitioned GPUs, after this cycle's grants."""
        return self._free if self.order else 0  # (looking the GPUs up counts them)

    def _key(self, profile: str, g: GpuId) -> Key:
        rec = self.state.gpus[g]
        taken = self.taken.get(g, ())
        return (0 if rec.slices or taken else 1, len(rec.free_slices(profile, taken)), self.order[g], g)

    def ordered(self, profile: str) -> list[Key]:
        """The GPUs with free slices of `profile`, in packing order."""
        keys = self._lists.get(profile)
        if keys is None:
            keys = self._lists[profile] = []
            for g in self.order:
                k = self._key(profile, g)
                if k[1]:
                    keys.append(k)
                    self._keys[(profile, g)] = k
            keys.sort()
        return keys

    def take(self, g: GpuId, slices: list[int]) -> None:
        """A grant of `slices` of `g`: every profile's order moves `g` to its new place."""
        self.taken[g] = [*self.taken.get(g, []), *slices]
        self._free -= len(slices) if g in self.order else 0
        for profile, keys in self._lists.items():
            old = self._keys.pop((profile, g), None)
            if old is not None:
                keys.remove(old)
            new = self._key(profile, g)
            if new[1]:
                insort(keys, new)
                self._keys[(profile, g)] = new


def pick(pool: Pool, spec: JobSpec, index: SliceIndex, now: float | None) -> SlicePick | None:
    """The slices the job gets (None: no partitioned GPU has them free): the first GPU in its
    profile's packing order with enough free slices, on a node its constraints, windows and
    CPUs and memory allow."""
    assert spec.mig is not None
    state = pool.state
    ok = allowed_nodes(state, spec, now)
    for _, free, _, g in index.ordered(spec.mig):
        rec = state.gpus[g]
        if free < spec.mig_count or (ok is not None and rec.node not in ok) or not room_on(pool, rec.node, spec):
            continue
        chosen = rec.free_slices(spec.mig, index.taken.get(g, ()))[:spec.mig_count]
        if rules.slice_problem(state, g, spec.mig, chosen, index.taken.get(g, ())) is None:
            return SlicePick(g, chosen, slice_share(spec.mig, spec.mig_count))
    return None


__all__ = ["SliceIndex", "SlicePick", "pick"]
