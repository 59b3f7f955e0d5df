"""Why jobs wait: one `JobPending` per job whose reason changed, carrying the typed reason the
deciding step recorded. The head gets the detail: the free counts of the domains considered,
and the jobs whose end would let it start (protected by a reservation, or not)."""

from __future__ import annotations

import math

from ...core import events as ev
from ...core.reasons import NoRoom, Reason
from ...core.state import Job
from ..backfill import reserve
from ..eligibility import restrict
from ..placement import no_fit
from ..plan import Context, CyclePlan
from ..predict import predicted_free
from .reservation import head_reservation, holders


def run(plan: CyclePlan, ctx: Context) -> None:
    ranges: dict[str, tuple[float, float]] = {}
    _head(plan, ctx, ranges)
    _emit(plan, ctx, ranges)


def _head(plan: CyclePlan, ctx: Context, ranges: dict[str, tuple[float, float]]) -> None:
    head = plan.head if any(b is plan.head for b in plan.blocked) else (plan.blocked[0] if plan.blocked else None)
    if head is None or not isinstance(plan.reason_of(head), NoRoom):
        return
    lo = ctx.floor(head)
    pool = restrict(plan.pool, head.spec, ctx.now)  # a constrained head: what is free on its nodes
    if ctx.config.backfill and head is plan.head:
        res = head_reservation(plan, ctx)
        if res is not None:
            why = no_fit(pool, lo, head.spec.topology.required, res.holders, reserved=True)
            eta = _eta(plan, ctx, head, why, ranges) if ctx.config.predict_runtimes else (
                None if not res.known else max(0.0, res.at - ctx.now))
            plan.note(head, why, eta)
            return
    # No protected reservation: still name the jobs whose end would let it start.
    lo_res = reserve(ctx.state, plan.pool, head, lo, ctx.now, ctx.config, holders(plan, ctx), ctx.placer.place)
    why = no_fit(pool, lo, head.spec.topology.required, lo_res.holders if lo_res is not None else [])
    plan.note(head, why, _eta(plan, ctx, head, why, ranges) if ctx.config.predict_runtimes else None)


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
                  ((p, h, g) for p, _, h, g in ordered), ctx.placer.place)
    if res is None:
        return None
    low = max((ends[j][1] for j in res.holders), default=now)
    high = max((ends[j][2] for j in res.holders), default=now)
    if high - low > 300.0 and high - now > 2.0 * max(low - now, 1.0):
        ranges[head.job_id] = (round(max(0.0, low - now), 3), round(high - now, 3))
    return max(0.0, res.at - now)


def _emit(plan: CyclePlan, ctx: Context, ranges: dict[str, tuple[float, float]]) -> None:
    st, now = ctx.state, ctx.now
    words: dict[int, tuple[str, list[str]]] = {}  # reasons are shared by many jobs: word each once
    for jid, (why, eta) in plan.reasons.items():
        job = st.jobs[jid]
        if job.state != "pending":
            continue
        said = words.get(id(why))
        if said is None:
            said = words[id(why)] = (why.text, why.blockers)
        text, blockers = said
        if job.pending_reason != text or job.pending_blockers != blockers or (
                ctx.config.predict_runtimes and _moved(job, eta, now)):
            span = ranges.get(jid)
            plan.events.append(ev.JobPending(at=now, job_id=jid, reason=text, blockers=blockers, why=why,
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
