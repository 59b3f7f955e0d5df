"""For the first blocked jobs, in order, then (with fair share) for every team below its
guarantee the waiting jobs that fit within it (`_within_guarantees`): start on GPUs freed
earlier in this cycle; else claim GPUs already coming free (preemptions in flight); else shrink
elastic jobs; else preempt. Without a checkpoint handshake the freed GPUs are granted at once.

Reclaim counts what is already coming free: the GPUs of preemptions in flight (asked in an
earlier cycle or earlier in this one) form a second pool (`plan.coming`) from which blocked jobs
claim, in queue order, before any new victim is chosen; a blocked job whose need is covered
triggers no preemption, and the GPUs claimed count as its team's when judging fairness and
limits.
"""

from __future__ import annotations

from collections.abc import Callable

from ...core.reasons import BehindReservation, ComingFree, WaitingForCheckpoint
from ...core.state import Job
from ..elastic import extras, shrink_plan
from ..eligibility import constrained, not_eligible
from ..fairshare import may_preempt
from ..ordering import las_queue
from ..placement import Pool
from ..plan import Context, CyclePlan
from ..resources import asks, hold
from .victims import victims


def run(plan: CyclePlan, ctx: Context) -> None:
    if not plan.blocked and not ctx.state.pending:
        return
    max_tries = 1 if ctx.strict else ctx.config.max_preemptors_per_cycle
    max_searches = 1 if ctx.strict else ctx.config.searches_per_cycle()
    tries = searches = 0  # blocked jobs that triggered a preemption or shrink; victim searches
    failed: set[tuple] = set()  # jobs alike in what a victim search reads fail alike
    acted: set[str] = set()
    plan.coming = _coming(plan, ctx)
    for job in list(plan.blocked):
        if tries >= max_tries or searches >= max_searches:
            break
        acted.add(job.job_id)
        before = len(plan.events)
        if _act(plan, ctx, job, failed):
            searches += 1
            tries += len(plan.events) > before
    if not ctx.strict and ctx.config.fairshare:
        _within_guarantees(plan, ctx, acted, failed)


def _act(plan: CyclePlan, ctx: Context, job: Job, failed: set[tuple]) -> bool:
    """Start, claim, shrink or preempt for one blocked job. True: it cost a victim search."""
    config = ctx.config
    if isinstance(plan.reason_of(job), BehindReservation):
        return False
    lo = ctx.floor(job)
    room = plan.job_room(job)
    if room is not None and room - plan.incoming.get(job.team, 0) < lo:
        return False  # its team's limit: what is already coming to it is all it may get
    fits = plan.fits(job, lo)
    # 1. GPUs freed earlier in this cycle (shrinks, kills without checkpoint)
    if plan.pool.count >= lo and fits(plan.pool):
        if _may_start_now(plan, job):
            plan.start_blocked(job, room)
        else:
            plan.note(job, BehindReservation())
        return False
    # 2. GPUs already coming free: no new victim for a need they cover
    if _claim(plan, ctx, job, lo):
        return False
    # 3. extra GPUs of elastic jobs, 4. preemption
    if config.elastic and _shrink(plan, job, fits, room):
        return True
    if config.preemption:
        _preempt(plan, ctx, job, lo, fits, room, failed)
    return True


def _within_guarantees(plan: CyclePlan, ctx: Context, acted: set[str], failed: set[tuple]) -> None:
    """Every team below its guarantee (and owed, `QueueIndex.owed`) reclaims for its waiting jobs
    that fit within it, beyond the blocked jobs the walk handed over: fewest GPUs first, then in
    the team's own order, while its holding plus what is coming to it leaves room. The walk
    stops after `max_preemptors_per_cycle` blocked jobs, and those are the first teams' first
    jobs: a team whose first jobs are gangs no reclaim can place (a node held partly by teams at
    their guarantee), or a team further down the order, never had its smaller jobs asked about,
    and stayed below its guarantee for days (issue 26: a team 8 GPUs short for 1.08M s on
    1x16x8). Cost: per team, the jobs it gets GPUs for (at most its shortfall) and, per class of
    job (size, priority, LAS level), the first it cannot serve, which ends that class's turn
    this cycle (a team's thousands of 1-GPU jobs, each asked every cycle, tripled the time of
    a saturated run; ending the whole team's pass there left a job waiting 1.4M s)."""
    st, now = ctx.state, ctx.now
    idx = ctx.indexes.queue(st, ctx.config)
    for team in list(idx.by_size):
        t = st.teams.get(team)
        if t is None or plan.held(team) >= t.quota.guaranteed or not idx.owed(team, now):
            continue
        for lo, jobs in idx.fitting(team):
            if plan.held(team) + plan.incoming.get(team, 0) + lo > t.quota.guaranteed:
                break  # the rest ask for at least as many GPUs
            for job in jobs:
                if plan.held(team) + plan.incoming.get(team, 0) + lo > t.quota.guaranteed:
                    break
                if job.job_id in acted or job.job_id in plan.status or job.spec.partial \
                        or not_eligible(st, job, now):
                    continue
                acted.add(job.job_id)
                before = (len(plan.events), plan.incoming.get(team, 0))
                _act(plan, ctx, job, failed)
                if (len(plan.events), plan.incoming.get(team, 0)) == before:
                    break  # nothing for it: none for its class (size, priority, LAS level) this cycle


def _preempt(plan: CyclePlan, ctx: Context, job: Job, lo: int, fits: Callable[[Pool], bool],
             room: int | None, failed: set[tuple]) -> None:
    config = ctx.config
    las = las_queue(job.service_gpu_s, config) if config.las and config.las_preempt else None
    alike = (job.team, job.spec.priority, las, lo, job.spec.topology.required, job is plan.head, job.spec.cpus,
             job.spec.memory_mb)
    if alike in failed:
        return
    chosen = victims(plan, ctx, job, lo, fits)
    if not chosen:
        failed.add(alike)
        return
    for v in chosen:
        plan.request_preemption(v, job, f"preempted for {job.job_id} ({job.spec.priority}, team {job.team})")
    if not ctx.config.checkpoint:
        plan.start_blocked(job, room)
    else:
        _claim(plan, ctx, job, lo, own=True)
        plan.note(job, WaitingForCheckpoint([v.job_id for v in chosen]))


def _coming(plan: CyclePlan, ctx: Context) -> Pool:
    """The pool plus the GPUs of preemptions in flight (they come free at their deadline)."""
    coming = plan.pool.copy()
    jobs = ctx.state.jobs
    for jid in plan.inflight:
        if plan.status.get(jid) != "released":
            coming.add(jobs[jid].gpus)
            hold(coming, jobs[jid].spec, jobs[jid].gpus, -1)
    return coming


def _may_start_now(plan: CyclePlan, job: Job) -> bool:
    """GPUs freed by reclaim go to the reserved head first."""
    head = plan.head
    return head is None or job is head or not any(b is head for b in plan.blocked)


def _claim(plan: CyclePlan, ctx: Context, job: Job, lo: int, own: bool = False) -> bool:
    """Claim GPUs coming free for a blocked job, if they cover its need: they count as its
    team's from now on (fairness, limits), and no later job of the cycle counts on them."""
    coming = plan.coming
    required = job.spec.topology.required
    key = ("claim", lo, required)
    if coming is None or coming.count < lo or key in coming.fails:
        return False
    p = ctx.placer.place(coming, job.spec, lo)
    if p is None:
        t = ctx.state.teams.get(job.team)
        pooled = t is not None and bool(t.quota.models)  # placed on one of its team's pools (`pools.choices`)
        if not constrained(job.spec) and not ctx.state.windows and not pooled \
                and not asks(job.spec):  # a constrained job's failure says nothing of the whole pool
            coming.fails.add(key)
        return False
    coming.take(p.gpus)
    hold(coming, job.spec, p.gpus)
    plan.claim(job.team, p.gpus)
    if own:
        return True
    mine = plan.preempting.get(job.job_id)
    if mine:
        plan.note(job, WaitingForCheckpoint(list(mine)))
    else:
        gi, status = ctx.state.gpus, plan.status
        # the holders still to yield: a GPU released earlier in this cycle is free, not coming
        plan.note(job, ComingFree(sorted({h for g in p.gpus if (h := gi[g].holder) is not None
                                          and status.get(h) != "released"})))
    return True


def _shrink(plan: CyclePlan, job: Job, fits: Callable[[Pool], bool], room: int | None) -> bool:
    """Take extra GPUs back from elastic jobs (as this cycle sees them) so that `job` starts.
    A job shrunk earlier in this cycle may give back more. Extras are opportunistic, but the
    fairness rule of preemption holds: a team at or under its guarantee is never shrunk for a
    team at or over its own (issue 26)."""
    st = plan.ctx.state
    jobs = st.jobs
    for_held = plan.held(job.team) + plan.incoming.get(job.team, 0)
    cands = []
    for jid in plan.ctx.running.elastic:
        v = jobs[jid]
        if v.team != job.team and not may_preempt(st, v.team, plan.held(v.team) - plan.leaving.get(v.team, 0),
                                                  job.team, for_held):
            continue
        if plan.touchable(v) or (plan.status.get(jid) == "shrunk" and v.preemption is None):
            gpus = plan.gpus_of(v)
            if extras(v, gpus) > 0:
                cands.append((v, gpus))
    if not cands:
        return False
    cands.sort(key=lambda c: (-extras(*c), c[0].job_id))
    chosen = shrink_plan(cands, plan.pool, fits)
    if chosen is None:
        return False
    for victim, removed in chosen:
        plan.shrink(victim, removed, job)
    plan.start_blocked(job, room)
    return True
