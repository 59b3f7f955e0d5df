"""Where and when the blocked head job will start, and who may start before it.

The reservation is the GPU set that frees soonest: free GPUs first, then the GPUs of running jobs
in order of their expected end — `started_at + spec.time_limit_s` where a time limit is known, the
preemption deadline for a job being preempted, and otherwise `started_at +
config.unknown_runtime_s` (None, the default: never, i.e. the end is unknown and ordered after
every known end, oldest start first). With an unknown end the reservation has no time (`at` is
inf): the set is protected and accumulates as its holders end. Another job may start before the
head only if it cannot delay it: it fits outside the reserved set, or its time limit ends before
the reservation is due, or it is preemptible (and its team would be over its guaranteed share) so
the head can take the GPUs back when its reservation comes due, and the reservation is not due
already (free or coming free within one checkpoint grace: then the GPUs are the head's, and a
borrower would only push its start back by a checkpoint). A running borrower counts as ending
within one grace (it yields on demand), so the reservation stays on the set it lent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from msgspec import Struct

from ..core.model import LEVEL_RANK, GpuId
from ..core.state import ClusterState, Job
from .config import PolicyConfig
from .eligibility import constrained, matching, restrict
from .placement import Placement, Pool, first_free, place
from .resources import hold


class Reservation(Struct, frozen=True):
    job_id: str
    gpus: list[GpuId]
    at: float  # when the set is expected to be free (inf: unknown)
    holders: list[str]  # running jobs holding part of the set, soonest end first

    @property
    def known(self) -> bool:
        return math.isfinite(self.at)


def expected_end(job: Job, now: float, config: PolicyConfig) -> float:
    if job.preemption is not None:
        return max(now, job.preemption.deadline)
    start = job.started_at if job.started_at is not None else now
    if job.spec.time_limit_s is not None:
        return max(now, start + job.spec.time_limit_s)
    if config.unknown_runtime_s is not None:
        return max(now, start + config.unknown_runtime_s)
    return math.inf


def reserve(state: ClusterState, pool: Pool, job: Job, need: int, now: float, config: PolicyConfig,
            holders: Iterable[tuple[float, Job, list[GpuId]]],
            placer: Callable[[Pool, int, str], Placement | None] | None = None) -> Reservation | None:
    """The soonest-freeing set of `need` GPUs for `job`. `holders`: (expected end, job, GPUs)
    of every job holding GPUs as this cycle sees it, soonest end first; `placer`: the cycle's
    placement strategy (default: by `config.topology`). None when no set can ever fit."""
    required = job.spec.topology.required
    if placer is None:
        placer = place if config.topology else first_free
    strategy = placer

    def fit(p: Pool) -> Placement | None:
        return strategy(p, need, required)
    p = fit(pool)
    if p is not None:
        return Reservation(job.job_id, p.gpus, now, [])
    ok: set[str] | None = None
    if constrained(job.spec):  # narrowed once: the GPUs of other nodes can never be its
        pool, ok = restrict(pool, job.spec), set(matching(state, job.spec, pool.topo))
    hyp = pool.copy()
    owner: dict[GpuId, tuple[float, str]] = {}
    gi = state.gpus
    # A set no wider than a node lies on one node, and whether one fits there reads that node
    # alone: once a try failed, only a node a holder just freed GPUs on can make the next one
    # succeed, and only if it now holds `need` free GPUs (the placer's filters only narrow).
    on_one_node = LEVEL_RANK[required] <= LEVEL_RANK["node"] and not job.spec.partial
    for end, h, gpus in holders:
        if ok is not None:
            gpus = [g for g in gpus if gi[g].node in ok]
            if not gpus:
                continue
        hyp.add(gpus)
        hold(hyp, h.spec, gpus, -1)
        for g in gpus:
            owner[g] = (end, h.job_id)
        if hyp.count < need:
            continue
        if on_one_node:
            cnt, index = hyp.node_counts(), hyp.topo.index
            if all(cnt[index[gi[g].node]] < need for g in gpus):
                continue
        p = fit(hyp)
        if p is not None:
            held_by: dict[str, float] = {}
            for g in p.gpus:
                o = owner.get(g)
                if o is not None:
                    held_by[o[1]] = o[0]
            at = max(held_by.values(), default=now)
            return Reservation(job.job_id, p.gpus, at, sorted(held_by, key=lambda j: (held_by[j], j)))
    return None
