"""Elastic jobs (`min_gpus < gpus`): start at what fits (at least the minimum) when space is
short, grow into idle GPUs when nothing that could use them is waiting, and give extra GPUs back
(never below the minimum) before any non-elastic job is preempted.

Extra GPUs above the minimum are opportunistic: a blocked job may take them back whatever its
priority, but not across the team contract: a team at or under its guarantee is never shrunk
for a team at or over its own (the preemption rule, `fairshare.may_preempt`, asked by
`steps/reclaim._shrink`; issue 26).

A cycle may shrink one job for several blocked jobs; it passes each job's holding *as the cycle
sees it* (less what it already took back), so a GPU is never taken back twice.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.model import LEVEL_RANK, GpuId
from ..core.state import ClusterState, Job
from .placement import Pool
from .resources import room_on


def extras(job: Job, gpus: list[GpuId] | None = None) -> int:
    """GPUs above the job's gang minimum (of `gpus`, its holding as a cycle sees it; default: the fold's)."""
    return max(0, len(job.gpus if gpus is None else gpus) - job.spec.gang_min)


def shrink_plan(candidates: list[Job] | list[tuple[Job, list[GpuId]]], pool: Pool,
                fits: Callable[[Pool], bool]) -> list[tuple[Job, list[GpuId]]] | None:
    """Which extra GPUs to take back so that `fits` holds, or None: candidates in order, the most
    recently added GPUs first; the last job gives back only as many as are needed.
    `candidates`: jobs, or (job, its GPUs as the cycle sees them)."""
    hyp = pool.copy()
    plan: list[tuple[Job, list[GpuId]]] = []
    for c in candidates:
        job, gpus = (c, c.gpus) if isinstance(c, Job) else c
        k = extras(job, gpus)
        if k <= 0:
            continue
        trial = hyp.copy()
        trial.add(gpus[-k:])
        if not fits(trial):
            plan.append((job, gpus[-k:]))
            hyp = trial
            continue
        # the smallest tail of this job that is enough (fits is monotone in added GPUs)
        lo, hi = 1, k
        while lo < hi:
            mid = (lo + hi) // 2
            t = hyp.copy()
            t.add(gpus[-mid:])
            if fits(t):
                hi = mid
            else:
                lo = mid + 1
        plan.append((job, gpus[-lo:]))
        return plan
    return None


def grow_gpus(state: ClusterState, pool: Pool, job: Job, room: int | None) -> list[GpuId]:
    """Idle GPUs for a running elastic job, nearest first (its own nodes, then its racks), never
    beyond its gang size, its team's limit, or its required topology level."""
    want = job.spec.gpus - len(job.gpus)
    if room is not None:
        want = min(want, room)
    if want <= 0 or pool.count <= 0:
        return []
    nodes = state.nodes
    own = list(dict.fromkeys(state.gpus[g].node for g in job.gpus))
    racks = {nodes[n].rack for n in own}
    required = job.spec.topology.required
    limit = LEVEL_RANK[required]
    if limit <= LEVEL_RANK["node"]:
        order = own if len(own) == 1 else []
    else:
        order = list(own)
        same_rack = [n for n, nd in nodes.items() if nd.rack in racks and n not in own]
        order += same_rack
        if limit > LEVEL_RANK["rack"]:
            order += [n for n in nodes if n not in own and nodes[n].rack not in racks]
    out: list[GpuId] = []
    for name in order:
        if pool.n_free(name) <= 0 or (name not in own and not room_on(pool, name, job.spec)):
            continue
        for g in pool.free_on(name):
            out.append(g)
            if len(out) == want:
                break
        if len(out) == want:
            break
    if out and LEVEL_RANK[state.span(job.gpus + out)] > limit:
        # e.g. one NVLink domain or one block: keep only what stays within the level
        kept: list[GpuId] = []
        for g in out:
            if LEVEL_RANK[state.span(job.gpus + kept + [g])] <= limit:
                kept.append(g)
        out = kept
    return out
