"""The blocked head's reservation as this cycle sees it: every holder of GPUs by expected end
(`holders`), the reserved set (`head_reservation`), whether it is due (`due_soon`), and when
the policy will start the head on it (`freed_at`)."""

from __future__ import annotations

import math
from collections.abc import Iterator

from ...core.model import GpuId
from ...core.state import Job
from ..backfill import Reservation, expected_end, reserve
from ..plan import Context, CyclePlan
from .victims import yields


def holders(plan: CyclePlan, ctx: Context, only: set[str] | None = None,
            ) -> Iterator[tuple[float, Job, list[GpuId]]]:
    """Every job holding GPUs as this cycle sees it, soonest expected end first: known ends
    (time limits, preemption deadlines, borrowers) sorted, then unknown ends in start order.
    A borrower yields on demand, so its GPUs count as free within one checkpoint grace: the
    head's reservation stays on the set it lent (counted as an unknown end, the newest of
    all, the set would move to older holders when the rest of it frees, and the loan and
    the GPUs next to it would be taken for good). `only`: just these jobs, in the same order
    (the others are never built)."""
    st, now, config = ctx.state, ctx.now, ctx.config
    known: list[tuple[float, int, Job, list[GpuId]]] = []
    unknown: list[tuple[float, int, Job, list[GpuId]]] = []
    status, inflight = plan.status, plan.inflight
    lent = ctx.running.borrowers
    soon = now + ctx.grace
    for i, jid in enumerate(lent):
        if status.get(jid) not in ("released", "preempting") and (only is None or jid in only):
            job = st.jobs[jid]
            known.append((min(soon, expected_end(job, now, config)), (1 << 30) + i, job, job.gpus))
    for i, jid in enumerate(ctx.running.timed):
        if status.get(jid) not in ("released", "preempting") and jid not in lent and (only is None or jid in only):
            job = st.jobs[jid]
            known.append((expected_end(job, now, config), i, job, job.gpus))
    for i, jid in enumerate(inflight):
        if status.get(jid) != "released" and (only is None or jid in only):
            job = st.jobs[jid]
            known.append((expected_end(job, now, config), -1 - i, job, job.gpus))
    for i, (job, gpus) in enumerate(plan.started):
        if only is not None and job.job_id not in only:
            continue
        end = expected_end(job, now, config) if job.spec.time_limit_s is not None else math.inf
        if status.get(job.job_id) == "borrowed":
            end = min(end, soon)
        (known if end < math.inf else unknown).append((end, (1 << 40) + i, job, gpus))
    timed = ctx.running.timed
    lazy: Iterator[Job] = (st.jobs[jid] for jid in st.running
                           if jid not in timed and status.get(jid) not in ("released", "preempting")
                           and jid not in lent and (only is None or jid in only))
    if config.unknown_runtime_s is not None:  # every end is known: one sorted list
        known.extend((expected_end(j, now, config), (1 << 20) + i, j, j.gpus) for i, j in enumerate(lazy))
        known.extend(unknown)
        lazy, unknown = iter(()), []
    known.sort(key=lambda t: t[:2])
    for end, _, job, gpus in known:
        yield end, job, gpus
    for job in lazy:
        yield math.inf, job, job.gpus
    for end, _, job, gpus in unknown:
        yield end, job, gpus


def head_reservation(plan: CyclePlan, ctx: Context) -> Reservation | None:
    """The reserved set of the blocked head (computed once per cycle)."""
    if plan.reservation is None and plan.head is not None:
        head = plan.head
        plan.reservation = reserve(ctx.state, plan.pool, head, ctx.floor(head), ctx.now, ctx.config,
                                   holders(plan, ctx), ctx.placer.for_spec(head.spec))
        plan.outside = None
    return plan.reservation


def due_soon(res: Reservation, ctx: Context) -> bool:
    """The reserved set is free or comes free within one checkpoint grace (its holders are
    being preempted, are borrowers, or end by their time limit): the GPUs are the head's. A
    borrower would have to yield at once, pushing the head's start back by its checkpoint."""
    return res.known and res.at <= ctx.now + ctx.grace


def freed_at(plan: CyclePlan, ctx: Context, res: Reservation) -> float:
    """When the reserved set frees as the policy will act on it: the head's ETA. `res.at` counts
    every borrower within one grace (so the set stays where it was lent, `holders`), but one is
    evicted only once the rest of the set is free, and only if the eviction rule asks it then
    (`victims.yields`, with the rest's teams' holdings without them): a borrower it would leave
    holds its GPUs to its own end, one it asks yields within one grace of the rest freeing."""
    if not res.holders or not res.known:
        return res.at
    now, head, held = ctx.now, plan.head, set(res.holders)
    assert head is not None
    lent = ctx.running.borrowers
    ends = [(end, job) for end, job, _ in holders(plan, ctx, held)]
    borrowed = [job for _, job in ends if job.job_id in lent or plan.status.get(job.job_id) == "borrowed"]
    rest = [(end, job) for end, job in ends if job not in borrowed]
    gone = [job for _, job in rest]
    when = max((end for end, _ in rest), default=now)
    evicted = False
    for job in borrowed:
        if yields(plan, ctx, head, job, gone, max(now, when)):
            evicted = True
        else:
            rest.append((expected_end(job, now, ctx.config), job))
        gone.append(job)
    at = max((end for end, _ in rest), default=now)
    return max(now, at) + ctx.grace if evicted else max(now, at)
