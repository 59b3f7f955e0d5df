"""Why jobs wait: one `JobPending` per job whose reason changed, carrying the typed reason the
deciding step recorded. The head gets the detail: the free counts of the domains considered,
and the jobs whose end would let it start (protected by a reservation, or not)."""

from __future__ import annotations

import math

from ...core import events as ev
from ...core.reasons import NoRoom
from ..backfill import reserve
from ..eligibility import restrict
from ..placement import no_fit
from ..plan import Context, CyclePlan
from .reservation import head_reservation, holders


def run(plan: CyclePlan, ctx: Context) -> None:
    _head(plan, ctx)
    _emit(plan, ctx)


def _head(plan: CyclePlan, ctx: Context) -> None:
    head = plan.head if any(b is plan.head for b in plan.blocked) else (plan.blocked[0] if plan.blocked else None)
    if head is None or not isinstance(plan.reason_of(head), NoRoom):
        return
    lo = ctx.floor(head)
    pool = restrict(plan.pool, head.spec, ctx.now)  # a constrained head: what is free on its nodes
    if ctx.config.backfill and head is plan.head:
        res = head_reservation(plan, ctx)
        if res is not None:
            eta = None if not res.known else max(0.0, res.at - ctx.now)
            plan.note(head, no_fit(pool, lo, head.spec.topology.required, res.holders, reserved=True), eta)
            return
    # No protected reservation: still name the jobs whose end would let it start.
    lo_res = reserve(ctx.state, plan.pool, head, lo, ctx.now, ctx.config, holders(plan, ctx), ctx.placer.place)
    plan.note(head, no_fit(pool, lo, head.spec.topology.required, lo_res.holders if lo_res is not None else []))


def _emit(plan: CyclePlan, ctx: Context) -> None:
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
        if job.pending_reason != text or job.pending_blockers != blockers:
            plan.events.append(ev.JobPending(at=now, job_id=jid, reason=text, blockers=blockers, why=why,
                                             eta_s=None if eta is None or not math.isfinite(eta) else round(eta, 3)))
