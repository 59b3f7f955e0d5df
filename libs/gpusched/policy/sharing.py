"""Fractional GPUs: which GPU a job asking for a share of one GPU gets (docs/gpu-sharing.md).

A share packs onto a GPU that is already shared, the fullest one it still fits on (so the
fewest GPUs are partly used, KAI's bin-packing of fractions); only when none has room does it
open a free GPU, the one the placer would give a one-GPU job (best fit: the fullest node). A
shared GPU is never in the pool of whole GPUs (the fold keeps it out of its node's free set),
so a whole-GPU gang never lands beside shares and a share never beside a gang.
"""

from __future__ import annotations

from typing import NamedTuple

from ..core import rules
from ..core.model import GpuId, JobSpec
from ..core.pools import canonical_model
from ..core.state import ClusterState
from .eligibility import barred_nodes, node_matches
from .placement import Pool
from .placer import Placer
from .pools import pools
from .resources import room_on


class SharePick(NamedTuple):
    gpu: GpuId
    share: float
    opened: bool  # a free GPU it is the first share of (it leaves the pool of whole GPUs)


def allowed_nodes(state: ClusterState, spec: JobSpec, now: float | None) -> set[str] | None:
    """The nodes the job's constraints and maintenance windows leave (None: every node)."""
    if spec.gpu_type is None and not spec.constraints and not (now is not None and state.windows):
        return None
    barred = set(barred_nodes(state, spec, now)) if now is not None and state.windows else set()
    return {n for n in state.nodes if n not in barred and node_matches(state, n, spec)}


def on_shared(pool: Pool, spec: JobSpec, load: dict[GpuId, float], now: float | None,
              barred: frozenset[str] = frozenset()) -> SharePick | None:
    """The fullest shared GPU the job's share still fits on, on a node with its CPUs and memory
    free (`resources.room_on`), outside the GPU pools `barred` (its team's per-model limits).
    `load`: the cycle's view of the shares' sums of the GPUs it changed (the fold's for the rest)."""
    state = pool.state
    ok = allowed_nodes(state, spec, now)
    best: tuple[float, GpuId] | None = None
    for g in dict.fromkeys([*state.shared, *load]):
        rec = state.gpus[g]
        used = load.get(g, rec.shared_load)
        if used <= rules.SHARE_SLACK or (ok is not None and rec.node not in ok) or not room_on(pool, rec.node, spec):
            continue  # (a GPU this cycle emptied is back in the pool: `on_free` opens it)
        if barred and canonical_model(rec.model) in barred:
            continue
        share = spec.share_on(rec.memory_mb)
        if share is None or rules.share_problem(state, g, share, used) is not None:
            continue
        if best is None or used + share > best[0] + rules.SHARE_SLACK:
            best = (used + share, g)
    if best is None:
        return None
    g = best[1]
    share = spec.share_on(state.gpus[g].memory_mb)
    assert share is not None
    return SharePick(g, share, False)


def on_free(pool: Pool, spec: JobSpec, placer: Placer, barred: frozenset[str] = frozenset()) -> SharePick | None:
    """A free GPU for the job's first share: the placer's choice for one GPU (its filters and
    best fit), among the GPUs with the memory it asks for, outside the GPU pools `barred`."""
    pool = placer.feasible(pool, spec)
    st = pool.state
    if barred:
        pool = pool.without([g for p in barred for g in pools(st, pool.topo).get(p, [])])
    if spec.gpu_memory_mb is not None:
        small = [g for n in st.nodes for g in pool.free_on(n) if spec.share_on(st.gpus[g].memory_mb) is None]
        if small:
            pool = pool.without(small)
    if pool.count < 1:
        return None
    p = placer.best(pool, spec, 1)
    if p is None:
        return None
    share = spec.share_on(st.gpus[p.gpus[0]].memory_mb)
    return None if share is None else SharePick(p.gpus[0], share, True)


def spare(state: ClusterState, load: dict[GpuId, float]) -> bool:
    """Some shared GPU still has room for a share (so a full pool of whole GPUs does not end
    the queue's walk while fractional jobs might fit)."""
    return any(rules.SHARE_SLACK < load.get(g, state.gpus[g].shared_load) < 1.0 - 0.001
               for g in dict.fromkeys([*state.shared, *load]))


__all__ = ["SharePick", "allowed_nodes", "on_free", "on_shared", "spare"]
