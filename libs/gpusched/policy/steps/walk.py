"""Each pending job in queue order: start it if it fits (and cannot delay the reserved head).

Once nothing more can start (the strict head is blocked, no GPU is left, or every free GPU is
in the blocked head's reservation and no waiting job may use it) and enough blocked jobs are
known for reclaim, the rest of the queue gets its stable tail reason: under churn a cycle costs
the jobs it can start, not the length of the queue.
"""

from __future__ import annotations

import functools

from ...core import rules
from ...core.model import JobSpec
from ...core.pools import accepted
from ...core.reasons import (
    BehindReservation,
    BeyondGuarantee,
    NoFreeSlices,
    NoRoom,
    NoRoomOnPools,
    QueuedBehind,
    Reason,
    TeamLimit,
)
from ...core.state import Job
from .. import mig, sharing
from ..backfill import Reservation
from ..eligibility import array_full, not_eligible
from ..ordering import QueueIndex
from ..placement import Placement
from ..plan import Context, CyclePlan
from ..pools import choices, limit_left, pools
from ..predict import predicted_free, queued_at
from .reservation import due_soon, head_reservation


def run(plan: CyclePlan, ctx: Context) -> None:
    st, config, pool = ctx.state, ctx.config, plan.pool
    idx = ctx.indexes.queue(st, config)
    processed: dict[str, None] = {}
    reclaimers = config.searches_per_cycle() if (config.preemption or config.elastic) else 0
    limit_stop = False
    claimants = 0  # blocked jobs that reclaim may act for (those behind the reservation it skips)
    shares_only = False  # nothing whole may start any more: only fractional jobs, while shared GPUs have room
    for job in idx.ordered(ctx.now, plan.held):
        if ctx.strict and plan.blocked or limit_stop:
            break
        if shares_only or (not ctx.strict and pool.count <= 0 and len(plan.blocked) >= reclaimers + plan.inflight_gpus) \
                or (plan.head is not None and claimants >= reclaimers + plan.inflight_gpus
                    and _all_reserved(plan, ctx, idx)):
            # (blocked jobs covered by GPUs in flight trigger no preemption: see reclaim)
            if not _shares_may_fit(plan, ctx, idx):
                break
            shares_only = True
            if not job.spec.partial:
                continue  # its reason: the tail's
        if job.job_id in plan.status:
            continue  # started by the hand-over
        processed[job.job_id] = None
        blocked = len(plan.blocked)
        limit_stop = _consider(plan, ctx, job)
        if len(plan.blocked) > blocked and plan.reason_of(job) is not _BEHIND:
            claimants += 1
    else:
        if not shares_only:
            return _tail(plan, ctx, idx, processed, complete=True)
    _tail(plan, ctx, idx, processed, complete=False)


def _consider(plan: CyclePlan, ctx: Context, job: Job) -> bool:
    """Start `job`, or record why it waits. True: a strict queue stops at its team's limit."""
    barred = not_eligible(ctx.state, job, ctx.now, plan.pool.topo) or array_full(plan, job)
    if barred is not None:  # held, dependencies, array limit: it blocks nobody and is reserved nothing
        plan.note(job, barred)
        return False
    if job.spec.shared:
        _consider_share(plan, ctx, job)
        return False
    if job.spec.sliced:
        _consider_slices(plan, ctx, job)
        return False
    pool = plan.pool
    room = plan.job_room(job)
    lo = ctx.floor(job)
    if room is not None and room < lo:
        plan.note(job, _room_reason(plan, ctx, job, lo))
        if _limit_head(plan, ctx, job, lo):
            plan.blocked.append(job)
            plan.head, plan.head_limited = job, True
        return ctx.strict
    if _pools_barred(plan, ctx, job, lo):  # per-model limits or guarantees bar every pool it accepts
        plan.note(job, _no_room_for(plan, ctx, job, lo))
        return False
    if plan.head is not None and pool.count >= lo:
        p = _backfill_fit(plan, ctx, job, room)
        if p is not None:
            plan.grant(job, p, backfill=True)
            return False
        plan.blocked.append(job)
        plan.note(job, _BEHIND if plan.fits_pool(job, room) else
                  plan.wait_reason(job, lo, _no_room_for(plan, ctx, job, lo)))
        return False
    p = plan.fit(job, pool, room) if pool.count >= lo else None
    if p is None:
        plan.blocked.append(job)
        plan.note(job, plan.wait_reason(job, lo, _no_room_for(plan, ctx, job, lo)))
        if ctx.config.backfill and plan.head is None and not ctx.strict and _may_reserve(plan, ctx, job):
            plan.head = job
        return False
    plan.grant(job, p, backfill=False)
    return False


_BEHIND = BehindReservation()


def _may_reserve(plan: CyclePlan, ctx: Context, job: Job) -> bool:
    """With `reserve_after_s`, only a job that has waited that long gets the reservation, or
    one of a team below its guarantee and owed (`QueueIndex.owed`): without a reservation a big
    gang of a guaranteed team would wait for GPUs that small jobs of others keep taking (a
    team at 7% of its entitlement on the 2017-11-06 week, 2x32x8)."""
    after = ctx.config.reserve_after_s
    if after is None or ctx.now - queued_at(job) >= after:
        return True
    t = ctx.state.teams.get(job.team)
    return (t is not None and plan.held(job.team) < t.quota.guaranteed
            and ctx.indexes.queue(ctx.state, ctx.config).owed(job.team, ctx.now))


def _consider_share(plan: CyclePlan, ctx: Context, job: Job) -> None:
    """Start a fractional job on a share of one GPU (`policy/sharing.py`), or record why it
    waits. A free GPU it opens is one the blocked head's reservation does not hold; it never
    blocks the queue, never gets a reservation and never preempts (its share frees no GPU). A
    GPU on a pool where the share would take its team past its per-model limit is passed over
    for the next choice."""
    spec = job.spec
    room = plan.share_room(job.team)  # a team's limit counts shares (no guarantee is reclaimed for them)
    barred: set[str] = set()
    while (pick := _share_pick(plan, ctx, spec, frozenset(barred))) is not None:
        pool = rules.pool_of(ctx.state, [pick.gpu])
        left = limit_left(ctx.state, job.team, pool, plan.pool_held(job.team, pool)) if pool is not None else None
        if left is None or left >= pick.share - rules.SHARE_SLACK:
            break
        barred.add(pool)  # type: ignore[arg-type]
    if pick is None:
        plan.note(job, _pools_reason(1, spec.topology.required, tuple(sorted(barred)), (), tuple(sorted(barred)), ())
                  if barred else _no_room(1, spec.topology.required))
    elif room is not None and room < pick.share - rules.SHARE_SLACK:
        plan.note(job, _limit(ctx, job, 1))
    else:
        plan.grant_share(job, pick, backfill=plan.head is not None)


def _share_pick(plan: CyclePlan, ctx: Context, spec: JobSpec, barred: frozenset[str]) -> sharing.SharePick | None:
    """A GPU for a fractional job's share, outside the pools `barred`: a shared one, else a
    free one the blocked head's reservation does not hold."""
    pick = sharing.on_shared(plan.pool, spec, plan.share_load, ctx.now, barred)
    if pick is None:
        pool = plan.pool
        if plan.head is not None and (res := head_reservation(plan, ctx)) is not None:
            if plan.outside is None:
                plan.outside = plan.pool.without(res.gpus)
            pool = plan.outside
        pick = sharing.on_free(pool, spec, ctx.placer, barred)
    return pick


def _consider_slices(plan: CyclePlan, ctx: Context, job: Job) -> None:
    """Start a MIG job on free slices of a partitioned GPU (`policy/mig.py`), or record why it
    waits. Like a share it never blocks the queue, gets no reservation and never preempts: the
    slices are outside the pool of whole GPUs, and a geometry changes only by the admin. Its
    team's limits count the slices' charge, the per-model one on the GPU's pool too."""
    spec = job.spec
    room = plan.share_room(job.team)
    pick = mig.pick(plan.pool, spec, plan.slices, ctx.now)
    pool = rules.pool_of(ctx.state, [pick.gpu]) if pick is not None else None
    left = limit_left(ctx.state, job.team, pool, plan.pool_held(job.team, pool)) if pool is not None else None
    if pick is None:
        plan.note(job, NoFreeSlices(profile=spec.mig or "", count=spec.mig_count))
    elif left is not None and left < pick.share - rules.SHARE_SLACK:
        plan.note(job, _pools_reason(1, spec.topology.required, (pool,), (), (pool,), ()))
    elif room is not None and room < pick.share - rules.SHARE_SLACK:
        plan.note(job, _limit(ctx, job, 1))
    else:
        plan.slices.take(pick.gpu, pick.slices)
        plan.grant_part(job, pick.gpu, pick.share, plan.head is not None, pick.slices)


def _shares_may_fit(plan: CyclePlan, ctx: Context, idx: QueueIndex) -> bool:
    """A fractional or MIG job waits and some shared GPU or MIG slice has room: the walk goes on for it."""
    return idx.shared > 0 and (sharing.spare(ctx.state, plan.share_load) or plan.slices.free > 0)


def _all_reserved(plan: CyclePlan, ctx: Context, idx: QueueIndex) -> bool:
    """With a blocked head, a later job starts only beside the head's reservation, or on it if
    its time limit ends before the reservation is due, or by borrowing it (preemptible): when no
    GPU is free beside it and no waiting job could do either, the rest of the queue starts
    nothing (`_backfill_fit` would refuse each one)."""
    res = head_reservation(plan, ctx)
    if res is None:
        return False
    if plan.outside is None:
        plan.outside = plan.pool.without(res.gpus)
    if plan.outside.count > 0 or (res.known and idx.timed):
        return False
    head, st = plan.head, ctx.state
    assert head is not None
    if plan.held(head.team) + ctx.floor(head) > st.teams[head.team].quota.guaranteed and any(
            t != head.team and q and (u := st.teams.get(t)) is not None and 0 < u.quota.guaranteed >= plan.held(t)
            for t, q in idx.queues.items() if t is not None):
        return False  # a waiting job of an entitled team may pass the borrowing head (`_entitled_past`)
    config = ctx.config
    return not (config.preemption and config.borrow and idx.preemptible and not due_soon(res, ctx))


@functools.lru_cache(maxsize=256)
def _no_room(need: int, required: str) -> NoRoom:
    """One reason object per shape (a long queue records thousands: they share it)."""
    return NoRoom(need, required)


def _no_room_for(plan: CyclePlan, ctx: Context, job: Job, lo: int) -> NoRoom | NoRoomOnPools:
    """NoRoom, naming the GPU pools for a job tried on pools (`pools.choices`) or of one type on
    a mixed cluster: "waiting for 1 free H100 GPUs; A100 not accepted"."""
    st, spec = ctx.state, job.spec
    order = choices(st, spec, lambda p: plan.pool_held(job.team, p), always=True, topo=plan.pool.topo)
    every = pools(st, plan.pool.topo)
    if order is None or len(every) < 2:
        return _no_room(lo, spec.topology.required)
    tried = list(dict.fromkeys(p for _, p in order))
    rooms = dict(zip((p for _, p in order), plan.pool_rooms(job, order)))
    limited = [p for p in tried if (r := rooms[p][0]) is not None and r < lo]
    firm = [p for p in tried if p not in limited and (r := rooms[p][1]) is not None and r < lo]
    return _pools_reason(lo, spec.topology.required, tuple(tried), tuple(p for p in every if p not in tried),
                         tuple(limited), tuple(firm))


def _pools_barred(plan: CyclePlan, ctx: Context, job: Job, lo: int) -> bool:
    """Every pool the job accepts is barred by its team's per-model limit or (non-preemptible)
    by other teams' per-model guarantees: it waits for holdings to change, and blocks nobody
    (as a job over its team's limit, or beyond its guarantee)."""
    order = choices(ctx.state, job.spec, lambda p: plan.pool_held(job.team, p), topo=plan.pool.topo)
    if not order:
        return False
    return all(r is not None and r < lo for r in (_least_room(*rs) for rs in plan.pool_rooms(job, order)))


def _least_room(*rooms: int | None) -> int | None:
    bounded = [r for r in rooms if r is not None]
    return min(bounded) if bounded else None


@functools.lru_cache(maxsize=256)
def _pools_reason(need: int, required: str, tried: tuple, not_accepted: tuple, limited: tuple,
                  firm: tuple) -> NoRoomOnPools:
    return NoRoomOnPools(need, required, list(tried), list(not_accepted), list(limited), list(firm))


def _limit(ctx: Context, job: Job, lo: int) -> TeamLimit:
    return TeamLimit(job.team, ctx.state.teams[job.team].quota.limit or 0, lo)


def _limit_head(plan: CyclePlan, ctx: Context, job: Job, lo: int) -> bool:
    """A job its own team's hard limit bars, though the limit could hold it, becomes the
    blocked head: it gets a reservation, and its team's later jobs may start only if they end
    before it is due (`_backfill_fit`), so they cannot keep the limit's room from it (issue 26).
    A non-preemptible job barred by a guarantee does not: it waits for its team's holding."""
    if not ctx.config.backfill or plan.head is not None or ctx.strict:
        return False
    limit = ctx.state.teams[job.team].quota.limit
    room = plan.room(job.team)
    return limit is not None and lo <= limit and room is not None and room < lo and plan.job_room(job) == room


def _room_reason(plan: CyclePlan, ctx: Context, job: Job, lo: int) -> TeamLimit | BeyondGuarantee:
    """Why a job its room bars waits: its team's hard limit, or (non-preemptible) a guarantee."""
    room = plan.room(job.team)
    if room is not None and room < lo:
        return _limit(ctx, job, lo)
    return BeyondGuarantee(job.team, ctx.state.teams[job.team].quota.guaranteed, lo)


def _backfill_fit(plan: CyclePlan, ctx: Context, job: Job, room: int | None) -> Placement | None:
    """A placement for `job` that cannot delay the reserved head, or None: outside the
    reserved set, or anywhere if its time limit ends before the reservation is due (or, with
    `backfill_predicted`, before it is predicted to be due at the earliest), or if it is
    preemptible and will yield (`borrow`) while the reservation is not yet due."""
    res = head_reservation(plan, ctx)
    if res is None:
        return plan.fit(job, plan.pool, room)  # the head can never fit as the cluster is
    if plan.outside is None:
        plan.outside = plan.pool.without(res.gpus)
    spec, config = job.spec, ctx.config
    lo = ctx.floor(job)
    assert plan.head is not None
    if plan.head_limited and job.team == plan.head.team:  # the head waits for its team's room: only what ends first
        if res.known and spec.time_limit_s is not None and ctx.now + spec.time_limit_s <= res.at:
            return plan.fit(job, plan.pool, room)
        return None
    if _entitled_past(plan, ctx, job, plan.head):
        return plan.fit(job, plan.pool, room)
    if plan.outside.count >= lo:
        q = plan.fit(job, plan.outside, _head_room_kept(plan, ctx, job, room))
        if q is not None:
            return q
    if res.known and spec.time_limit_s is not None and ctx.now + spec.time_limit_s <= res.at:
        return plan.fit(job, plan.pool, room)
    if config.backfill_predicted and not res.known and spec.time_limit_s is not None \
            and ctx.now + spec.time_limit_s <= _predicted_low(res, ctx):
        return plan.fit(job, plan.pool, room)  # it ends by its limit: the head waits at most that
    if config.preemption and config.borrow and spec.preemptible and not due_soon(res, ctx):
        t = ctx.state.teams.get(job.team)
        guaranteed = t.quota.guaranteed if t is not None else 0
        if job.team == plan.head.team or plan.held(job.team) + lo > guaranteed:
            return plan.fit(job, plan.pool, room)  # it yields when the head could start
    return None


def _head_room_kept(plan: CyclePlan, ctx: Context, job: Job, room: int | None) -> int | None:
    """What a job of the head's team may take outside the reserved GPUs: its `room` less what the
    head needs of their team's hard limit. The reservation owes the head that room as well as its
    GPUs, or the head, its GPUs free, waits behind its team's limit (one that ends first, below, may)."""
    assert plan.head is not None
    left = plan.room(job.team)
    if job.team != plan.head.team or left is None:
        return room
    keep = left - ctx.floor(plan.head)
    return keep if room is None else min(room, keep)


def _entitled_past(plan: CyclePlan, ctx: Context, job: Job, head: Job) -> bool:
    """A reservation never outranks an entitlement: a job of a team at or under its (non-zero)
    guarantee may start on the GPUs reserved for a head whose team would exceed its own guarantee with it
    (the head borrows; issue 26). Bound: a team passes only while at or under its guarantee, so
    the head waits at most for the other teams' guarantees (and one job each) to fill."""
    if job.team == head.team:
        return False
    st = ctx.state
    g = st.teams[job.team].quota.guaranteed
    return (0 < g and plan.held(job.team) <= g
            and plan.held(head.team) + ctx.floor(head) > st.teams[head.team].quota.guaranteed)


def _predicted_low(res: Reservation, ctx: Context) -> float:
    """The earliest the reserved set is predicted to free (its holders' low-quantile ends)."""
    jobs = ctx.state.jobs
    return predicted_free([jobs[j] for j in res.holders], ctx.now, ctx.grace, ctx.running.borrowers,
                          ctx.indexes.predictor(ctx.state))[1]


def _tail(plan: CyclePlan, ctx: Context, idx: QueueIndex, processed: dict[str, None], complete: bool) -> None:
    """Reasons of the jobs the walk did not reach; only those whose state does not already
    show it are looked at (the index remembers the settled ones)."""
    st = ctx.state
    settled = idx.settled
    for jid in processed:
        settled.pop(jid, None)
    if complete:
        return
    rest = st.pending.keys() - settled.keys() - processed.keys()
    if not rest:
        return
    jobs, teams = st.jobs, st.teams
    cache: dict[tuple, tuple[Reason, str, list[str]]] = {}
    budget = ctx.indexes.tail_reasons
    for jid in sorted(rest):
        if budget is not None and budget <= 0:
            break  # the rest next cycle (see `Indexes.tail_reasons`)
        job = jobs[jid]
        barred = not_eligible(st, job, ctx.now, plan.pool.topo)
        if barred is not None:  # never settled: a release or a dependency's end changes it
            if job.pending_why != barred:
                plan.note(job, barred)
                budget = None if budget is None else budget - 1
            continue
        r, text, blockers = _tail_reason(plan, ctx, job, cache)
        if job.pending_reason == text and job.pending_blockers == blockers:
            t = teams.get(job.team)
            if ctx.strict or t is None or t.quota.limit is None:
                settled[jid] = None
        else:
            plan.note(job, r)
            budget = None if budget is None else budget - 1


def _tail_reason(plan: CyclePlan, ctx: Context, job: Job,
                 cache: dict[tuple, tuple[Reason, str, list[str]]]) -> tuple[Reason, str, list[str]]:
    """Why a job the walk did not reach waits (its reason, text and blockers; texts cached)."""
    spec = job.spec
    lo = ctx.floor(job)
    key: tuple
    if ctx.strict:
        key = ("fifo",)
    else:
        room = plan.job_room(job)
        key = (("limit", job.team, lo, spec.preemptible) if room is not None and room < lo
               else ("room", lo, spec.topology.required, accepted(spec), job.team))
        if key[0] == "room" and plan.head is not None and plan.pool.count >= lo and plan.fits_pool(job, room):
            key = ("behind",)  # as the walk would say: it fits, but only on the head's reservation
    hit = cache.get(key)
    if hit is None:
        r: Reason = (QueuedBehind() if key[0] == "fifo" else _room_reason(plan, ctx, job, lo) if key[0] == "limit"
                     else _BEHIND if key[0] == "behind" else _no_room_for(plan, ctx, job, lo))
        hit = cache[key] = (r, r.text, r.blockers)
    return hit
