"""Whom to preempt for a blocked job: the smallest, cheapest, fairest victim set.

A running job is a candidate victim when it is preemptible, has run `min_runtime_s` since its
(re)start (anti-thrash), is not already being preempted, and the blocked job outranks it: a
higher priority class, or (fair share) the blocked job's team is below its guaranteed share and
the victim's team above its own. The fold's fairness rule is checked for every request with the
holdings at the moment it is applied, so the fold never flags `unfair_preemption`.
Candidates are taken teams-furthest-over-their-share first, then least work lost since the last
checkpoint, then biggest first (fewest victims); the set is then pruned of victims it does not
need, and among topology groups (one per node/rack/block when the job requires one) the cheapest
set wins.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.model import GpuId
from ..core.state import ClusterState, Job
from .config import PolicyConfig
from .fairshare import may_preempt, over_share
from .placement import Pool


def work_since_checkpoint(job: Job, now: float) -> float:
    """GPU-seconds a job loses if it stops now: since its last checkpoint of this attempt, or start."""
    since = job.started_at if job.started_at is not None else now
    ck = job.checkpoint
    if ck is not None and ck.attempt == job.attempt:
        since = max(since, ck.at)
    return len(job.gpus) * max(0.0, now - since)


def choose_victims(state: ClusterState, pool: Pool, job: Job, need: int, now: float, config: PolicyConfig,
                   candidates: list[Job], held: Callable[[str], int],
                   fits: Callable[[Pool], bool], scope: Callable[[GpuId], object] | None,
                   leaving: dict[str, int] | None = None) -> list[Job] | None:
    """The victims to preempt so that `job` fits (`fits(pool)` after their GPUs return), or None.
    `candidates` are already filtered for preemptibility, runtime and rank; `scope` maps a GPU to
    its group at the job's required topology level (None: the whole cluster); `leaving`: GPUs per
    team already asked to yield, counted as gone when judging whether a team may lose more. Within a group,
    free GPUs plus victims' GPUs are counted (exact at every level but a partial NVLink domain);
    only the cheapest group's set is checked with a real placement."""
    if not candidates:
        return None
    # First, cheaply: can any group free enough at all? (Most searches end here.)
    if scope is None:
        base: dict[object, int] = {None: pool.count}
        totals: dict[object, int] = {None: sum(len(v.gpus) for v in candidates)}
    else:
        base = {}
        for name, k in pool.counts().items():
            if k > 0:
                key = scope(state.nodes[name].gpus[0])
                base[key] = base.get(key, 0) + k
        totals = {}
        for v in candidates:
            for g in v.gpus:
                key = scope(g)
                totals[key] = totals.get(key, 0) + 1
    feasible = {key for key, t in totals.items() if t + base.get(key, 0) >= need}
    if not feasible:
        return None
    lost = {v.job_id: work_since_checkpoint(v, now) for v in candidates}
    leaving = leaving or {}
    over = {t: over_share(state, t, held(t) - leaving.get(t, 0)) for t in {v.spec.team for v in candidates}}
    cand = sorted(candidates, key=lambda v: (-over[v.spec.team], lost[v.job_id], -len(v.gpus), v.job_id))
    groups: dict[object, list[tuple[Job, int]]] = {}
    if scope is None:
        groups[None] = [(v, len(v.gpus)) for v in cand]
    else:
        for v in cand:
            per: dict[object, int] = {}
            for g in v.gpus:
                key = scope(g)
                if key in feasible:
                    per[key] = per.get(key, 0) + 1
            for key, k in per.items():
                groups.setdefault(key, []).append((v, k))
    options = []
    for key, group in groups.items():
        chosen = _greedy(state, job, group, need - base.get(key, 0), held, lost, leaving)
        if chosen is not None:
            options.append(((sum(lost[v.job_id] for v in chosen), len(chosen), sum(len(v.gpus) for v in chosen),
                             [v.job_id for v in chosen]), chosen))
    options.sort(key=lambda o: o[0])
    for _, chosen in options[:4]:
        hyp = pool.copy()
        for v in chosen:
            hyp.add(v.gpus)
        if fits(hyp):
            return chosen
    return None


def _greedy(state, job, group: list[tuple[Job, int]], want: int, held, lost, leaving) -> list[Job] | None:
    """Take victims in order until they free `want` GPUs in the group, never one the fairness
    rule forbids; then drop the ones the set does not need, the most expensive first."""
    if want <= 0:
        return None  # it fits already: not a preemption question
    drop: dict[str, int] = {}  # GPUs each victim team gives up in this set
    chosen: list[tuple[Job, int]] = []
    freed = 0
    for v, k in group:
        vh = held(v.team) - drop.get(v.team, 0) - leaving.get(v.team, 0)
        if not may_preempt(state, v.team, vh, job.team, held(job.team)):
            continue
        chosen.append((v, k))
        drop[v.team] = drop.get(v.team, 0) + len(v.gpus)
        freed += k
        if freed >= want:
            break
    else:
        return None
    for v, k in sorted(chosen, key=lambda vk: -lost[vk[0].job_id]):
        if len(chosen) > 1 and freed - k >= want:
            chosen = [x for x in chosen if x[0] is not v]
            freed -= k
    return [v for v, _ in chosen]
