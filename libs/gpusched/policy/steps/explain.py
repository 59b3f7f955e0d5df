"""Why jobs wait: one `JobPending` per job whose reason changed, carrying the typed reason the
deciding step recorded. The head gets the detail: the free counts of the domains considered,
and the jobs whose end would let it start (protected by a reservation, or not).

ETAs: with `eta_plan_every_s`, from the latest plan of the queue (`policy/forecast.py`), made
again when it is that old: every waiting job the plan starts gets its planned start (less
`now`), and a range when the start rests on an uncertain predicted end; without it, the head
alone gets the reservation's ETA (or, with `predict_runtimes`, its own predicted one). A new
ETA is said when the reason changes or the planned start moved (`_moved`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import islice

import msgspec

from ...core import events as ev
from ...core.reasons import NoRoom, NoRoomOnPools, Reason, Topology
from ...core.state import ClusterState, Job
from ..backfill import Reservation, reserve
from ..forecast import Forecast, forecast
from ..memo import Indexes
from ..placement import no_fit
from ..plan import Context, CyclePlan
from ..predict import predicted_free
from .reservation import freed_at, head_reservation, holders

#: The policy's cycle, `cycle.cycle(state, now, config, indexes)` (passed in: no import cycle).
Cycle = Callable[..., list[ev.Event]]


def run(plan: CyclePlan, ctx: Context, cycle: Cycle | None = None) -> None:
    """`cycle`: the policy's cycle (`cycle.cycle`), for the plan of the queue."""
    ranges: dict[str, tuple[float, float]] = {}
    plan_with = cycle if ctx.config.eta_plan_every_s is not None else None
    # With a plan of the queue, the plan gives every ETA (`_emit`): the head's own is not worked out.
    _head(plan, ctx, ranges, predicted=ctx.config.predict_runtimes and plan_with is None, eta=plan_with is None)
    planned = None if plan_with is None else _planned(plan, ctx, plan_with, ranges)
    _emit(plan, ctx, ranges, planned)


#: A queue that was empty at the last plan gets a new plan once the last is this old (not at
#: once: arrivals come in bursts). Other new jobs wait for the periodic plan: each plan costs
#: up to `eta_plan_jobs` cycles, and a plan per arrival would cost more than the policy itself.
NEW_JOB_REPLAN_S = 300.0
#: The steps a plan's cycles do not run (`cycle.decide`'s `skip`).
_FORK_SKIPS = ("explain",)


def _plan_of(plan: CyclePlan, ctx: Context, cycle: Cycle) -> Forecast:
    """The latest plan of the queue: made again when it is `eta_plan_every_s` old,
    `NEW_JOB_REPLAN_S` old when it planned no job and jobs wait now, or `eta_replan_stale_s`
    old when it went wrong (`_stale`). The plan starts from the
    state this cycle leaves (its events applied), so it never disagrees with what this cycle
    just decided."""
    st, now, cfg, idx = ctx.state, ctx.now, ctx.config, ctx.indexes
    every = cfg.eta_plan_every_s
    f = idx.forecast_
    age = math.inf if f is None else now - f.made_at
    if every is not None and f is not None and 0.0 <= age < min(every, NEW_JOB_REPLAN_S):
        return f
    stale_after = cfg.eta_replan_stale_s
    # The plan still holds unless it is old or stale; the queue's head (`first`, a walk of the
    # ordered queue every cycle) is asked only where it decides: a plan that planned nothing.
    kept = f if f is not None and every is not None and 0.0 <= age < every \
        and not (stale_after is not None and age >= stale_after and _stale(f, st, now)) else None
    if kept is not None and kept.first:
        return kept
    started = {job.job_id for job, _ in plan.started}
    queue = idx.queue(st, cfg).ordered(now, lambda t: st.teams[t].held if t in st.teams else 0)
    first = [j.job_id for j in islice((j for j in queue if j.job_id not in started), cfg.eta_plan_jobs)]
    if kept is not None and not first:
        return kept
    if not first:  # nothing waits: nothing to plan (no copy made)
        f = idx.forecast_ = Forecast(made_at=now, first=[], starts={}, cycles=0, complete=True, pending=0,
                                     running=len(st.running))
        return f
    predictor = idx.predictor(st)
    fork_idx = Indexes.for_plan(predictor)
    quiet = cfg.replace(eta_plan_every_s=None, predict_runtimes=False)
    # The plan reads only the fork's grants, preemptions and resizes: its cycles skip this step
    # (a fork's reasons and ETAs, which no decision reads, were a sixteenth of the plan's cost).
    f = idx.forecast_ = forecast(st, now, quiet, predictor,
                                 lambda s, t, c: cycle(s, t, c, fork_idx, skip=_FORK_SKIPS),
                                 first, plan.events, max_cycles=cfg.eta_plan_jobs,
                                 horizon_s=cfg.eta_plan_horizon_s)
    return f


def _stale(f: Forecast, state: ClusterState, now: float) -> bool:
    """The plan went wrong: a start it planned is past and the job still waits (a running job
    ran past its predicted end, or another job took the GPUs). Its other starts rest on the
    same wrong guess."""
    jobs = state.jobs
    for jid, s in f.starts.items():
        if s.at < now and (job := jobs.get(jid)) is not None and job.state == "pending":
            return True
    return False


def _planned(plan: CyclePlan, ctx: Context, cycle: Cycle,
             ranges: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Each waiting job's ETA from the plan (none for a start already overdue, or due now in an
    older plan while this cycle did not start the job: the plan is wrong there, and nothing
    better is known until the next one), its range when uncertain."""
    now, jobs = ctx.now, ctx.state.jobs
    etas: dict[str, float] = {}
    f = _plan_of(plan, ctx, cycle)
    for jid, s in f.starts.items():
        job = jobs.get(jid)
        if job is None or job.state != "pending" or s.at < now or (s.at == now and f.made_at < now):
            continue  # overdue (an older plan's start came and this cycle did not start it)
        etas[jid] = s.at - now
        _range(ranges, jid, max(0.0, s.low - now), s.high - now)
    return etas


def _range(ranges: dict[str, tuple[float, float]], jid: str, low: float, high: float) -> None:
    """Show an ETA as a range (seconds from now) when it is uncertain: the range is wider than
    five minutes and its far end more than twice its near end."""
    if high - low > 300.0 and high > 2.0 * max(low, 1.0):
        ranges[jid] = (round(max(0.0, low), 3), round(high, 3))


def _pooled(why: Reason, first: Reason | None) -> Reason:
    """The head's detailed reason, naming the GPU pools it accepts and those it does not when
    the walk found no room on them (`NoRoomOnPools`)."""
    if isinstance(first, NoRoomOnPools) and isinstance(why, Topology):
        return msgspec.structs.replace(why, pools=list(first.pools), not_accepted=list(first.not_accepted),
                                         at_limit=list(first.at_limit))
    return why


def _head(plan: CyclePlan, ctx: Context, ranges: dict[str, tuple[float, float]], predicted: bool,
          eta: bool = True) -> None:
    """The head's reason in detail, and (with `eta`) its ETA: the reservation's, or with
    `predicted` the one worked out from predicted run times (`_eta`). Without `eta` the plan of
    the queue gives it (the reservation's, worked out again after this cycle's grants and
    its borrowers' evictions, was 2% of a week's simulation under `full`, and thrown away)."""
    head = plan.head if any(b is plan.head for b in plan.blocked) else (plan.blocked[0] if plan.blocked else None)
    first = plan.reason_of(head) if head is not None else None
    if head is None or not isinstance(first, (NoRoom, NoRoomOnPools)):
        return
    lo = ctx.floor(head)
    pool = ctx.placer.feasible(plan.pool, head.spec)  # a constrained head: what is free on its nodes
    if ctx.config.backfill and head is plan.head:
        res = head_reservation(plan, ctx)
        if res is not None:
            why = no_fit(pool, lo, head.spec.topology.required, res.holders, reserved=True)
            if not eta:
                plan.note(head, _pooled(why, first))
                return
            now = _overtaken(plan, ctx, head, res, lo)
            plan.note(head, _pooled(why, first), _eta(plan, ctx, head, why, ranges) if predicted else (
                None if not now.known else max(0.0, freed_at(plan, ctx, now) - ctx.now)))
            return
    # No protected reservation: still name the jobs whose end would let it start.
    lo_res = reserve(ctx.state, plan.pool, head, lo, ctx.now, ctx.config, holders(plan, ctx),
                     ctx.placer.for_spec(head.spec))
    why = no_fit(pool, lo, head.spec.topology.required, lo_res.holders if lo_res is not None else [])
    plan.note(head, _pooled(why, first), _eta(plan, ctx, head, why, ranges) if predicted else None)


def _overtaken(plan: CyclePlan, ctx: Context, head: Job, res: Reservation, lo: int) -> Reservation:
    """The head's reservation after this cycle's grants: one on its reserved GPUs (a job of a
    team within its guarantee passes a reservation, `walk._entitled_past`) holds them until its
    own end, so the set is worked out again with this cycle's grants among the holders."""
    reserved = set(res.gpus)
    if not any(g in reserved for _, gpus in plan.started for g in gpus):
        return res
    again = reserve(ctx.state, plan.pool, head, lo, ctx.now, ctx.config, holders(plan, ctx),
                    ctx.placer.for_spec(head.spec))
    return res if again is None else again


def _eta(plan: CyclePlan, ctx: Context, head: Job, why: Reason,
         ranges: dict[str, tuple[float, float]]) -> float | None:
    """The head's ETA with predicted run times: when the first GPU set it fits frees, the
    holders taken in order of their predicted end (a plan of its own: the reservation stays
    where the walk put it); the range from the low and high ends of that set's holders.
    Worked out only when the reason changes or half of the ETA shown has passed (a cycle's
    cost): `None` otherwise, and nothing is said."""
    now, job = ctx.now, head
    if job.pending_eta_s is not None and job.pending_reason == why.text and job.pending_blockers == why.blockers \
            and now - job.pending_at <= max(300.0, 0.25 * job.pending_eta_s):
        return None
    predictor = ctx.indexes.predictor(ctx.state)
    ends: dict[str, tuple[float, float, float]] = {}
    ordered = []
    for end, h, gpus in holders(plan, ctx):
        point = low = high = end
        if h.preemption is None and plan.status.get(h.job_id) != "borrowed" and h.job_id not in ctx.running.borrowers:
            point, low, high = predicted_free([h], now, ctx.grace, ctx.running.borrowers, predictor)
        ends[h.job_id] = (point, low, high)
        ordered.append((point, h.job_id, h, gpus))
    ordered.sort(key=lambda t: t[:2])
    res = reserve(ctx.state, plan.pool, head, ctx.floor(head), now, ctx.config,
                  ((p, h, g) for p, _, h, g in ordered), ctx.placer.for_spec(head.spec))
    if res is None:
        return None
    low = max((ends[j][1] for j in res.holders), default=now)
    high = max((ends[j][2] for j in res.holders), default=now)
    _range(ranges, head.job_id, low - now, high - now)
    return max(0.0, res.at - now)


def _emit(plan: CyclePlan, ctx: Context, ranges: dict[str, tuple[float, float]],
          planned: dict[str, float] | None) -> None:
    st, now = ctx.state, ctx.now
    words: dict[int, tuple[str, list[str]]] = {}  # reasons are shared by many jobs: word each once
    moving = ctx.config.predict_runtimes or planned is not None
    for jid, (why, eta) in plan.reasons.items():
        job = st.jobs[jid]
        if job.state != "pending":
            continue
        if planned is not None:
            eta = planned.get(jid)
        said = words.get(id(why))
        if said is None:
            said = words[id(why)] = (why.text, why.blockers)
        text, blockers = said
        if job.pending_reason != text or job.pending_blockers != blockers or (moving and _moved(job, eta, now)):
            _say(plan, jid, text, blockers, why, eta, ranges.get(jid))
    for jid, eta in (planned or {}).items():  # same reason, the planned start moved
        job = st.jobs[jid]
        if jid not in plan.reasons and job.pending_reason and _moved(job, eta, now):
            _say(plan, jid, job.pending_reason, job.pending_blockers, job.pending_why, eta, ranges.get(jid))


def _say(plan: CyclePlan, jid: str, text: str, blockers: list[str], why: Reason | None, eta: float | None,
         span: tuple[float, float] | None) -> None:
    plan.events.append(ev.JobPending(at=plan.ctx.now, job_id=jid, reason=text, blockers=list(blockers), why=why,
                                     eta_s=None if eta is None or not math.isfinite(eta) else round(eta, 3),
                                     eta_low_s=None if span is None else span[0],
                                     eta_high_s=None if span is None else span[1]))


def _moved(job: Job, eta: float | None, now: float) -> bool:
    """The ETA a user was shown is off by more than a quarter of the wait (and ten minutes):
    say the new one. (Same reason, new ETA: one event per big move, not one per cycle.)"""
    if eta is None or not math.isfinite(eta):
        return False
    if job.pending_eta_s is None:
        return True
    shown = job.pending_at + job.pending_eta_s
    return abs(now + eta - shown) > max(300.0, 0.2 * eta)
