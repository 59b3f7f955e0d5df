"""MIG slices: which slices of which partitioned GPU a job asking for `--mig PROFILE[xN]` gets
(docs/gpu-sharing.md#mig-slices).

A slice is a hard partition of a GPU the admin laid out (`MigGeometrySet`): placement never
changes a geometry, it only hands out free slices of the profile asked for, all of a job's on
one GPU. Among the GPUs with enough free slices it packs: a GPU some job already uses before an
untouched one (so the fewest GPUs are partly used and whole partitioned GPUs stay free for a
later reconfiguration), then the one left with the fewest free slices (best fit), then the
GPUs' order. A partitioned GPU is never in the pool of whole GPUs nor shared by fractions.
"""

from __future__ import annotations

from typing import NamedTuple

from ..core import rules
from ..core.mig import slice_share
from ..core.model import GpuId, JobSpec
from ..core.state import ClusterState
from .placement import Pool
from .resources import room_on
from .sharing import allowed_nodes


class SlicePick(NamedTuple):
    gpu: GpuId
    slices: list[int]
    share: float  # what the slices are charged: their compute slices of the GPU's 7


def partitioned(state: ClusterState) -> list[GpuId]:
    """The GPUs with a MIG geometry, in the fold's order (a scan: only MIG jobs ask)."""
    return [g for g, rec in state.gpus.items() if rec.geometry]


def pick(pool: Pool, spec: JobSpec, taken: dict[GpuId, list[int]], now: float | None,
         gpus: list[GpuId] | None = None) -> SlicePick | None:
    """The slices the job gets (None: no partitioned GPU has them free). `taken`: slices this
    cycle granted already; `gpus`: the partitioned GPUs (`partitioned`)."""
    assert spec.mig is not None
    state = pool.state
    ok = allowed_nodes(state, spec, now)
    best: tuple[tuple[int, int, int], GpuId, list[int]] | None = None
    for order, g in enumerate(partitioned(state) if gpus is None else gpus):
        rec = state.gpus[g]
        if (ok is not None and rec.node not in ok) or not room_on(pool, rec.node, spec):
            continue
        free = rec.free_slices(spec.mig, taken.get(g, ()))
        if len(free) < spec.mig_count:
            continue
        chosen = free[:spec.mig_count]
        if rules.slice_problem(state, g, spec.mig, chosen, taken.get(g, ())) is not None:
            continue
        used = len(rec.slices) + len(taken.get(g, ()))
        key = (0 if used else 1, len(free) - spec.mig_count, order)
        if best is None or key < best[0]:
            best = (key, g, chosen)
    if best is None:
        return None
    return SlicePick(best[1], best[2], slice_share(spec.mig, spec.mig_count))


def spare(state: ClusterState, taken: dict[GpuId, list[int]], gpus: list[GpuId] | None = None) -> bool:
    """Some partitioned GPU has a free slice (so a full pool of whole GPUs does not end the
    queue's walk while MIG jobs might fit)."""
    for g in partitioned(state) if gpus is None else gpus:
        rec = state.gpus[g]
        if len(rec.slices) + len(taken.get(g, ())) < len(rec.geometry):
            return True
    return False


__all__ = ["SlicePick", "partitioned", "pick", "spare"]
