"""Preemptions asked in earlier cycles: release the jobs that checkpointed since, or whose grace
period is over; the others stay in flight (their GPUs are coming free)."""

from __future__ import annotations

from ...core.rules import work_since_checkpoint
from ..plan import Context, CyclePlan


def run(plan: CyclePlan, ctx: Context) -> None:
    st, now = ctx.state, ctx.now
    jobs = st.jobs
    for jid in [j for j in st.running if jobs[j].preemption is not None and j not in plan.status]:
        job = jobs[jid]  # (a job that ran out of time this cycle has ended already)
        p = job.preemption
        assert p is not None
        ck = job.checkpoint
        if ck is not None and ck.attempt == job.attempt and ck.at >= p.at:
            plan.release(job, forced=False, lost=len(job.gpus) * max(0.0, now - ck.at))
        elif now >= p.deadline:
            plan.release(job, forced=True, lost=work_since_checkpoint(job, now))
        else:
            plan.in_flight(job, p.for_job)
            plan.inflight_gpus += len(job.gpus)
