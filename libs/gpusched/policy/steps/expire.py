"""Jobs past their time limit end (Slurm's TIMEOUT): reservations and backfill count on time
limits, so a job that overruns must not push the reserved job's start back."""

from __future__ import annotations

from ..plan import Context, CyclePlan


def run(plan: CyclePlan, ctx: Context) -> None:
    if not ctx.running.timed:
        return  # no running job has a time limit (the index holds exactly those): nothing to scan
    st, now = ctx.state, ctx.now
    for jid in list(st.running):
        job = st.jobs[jid]
        limit = job.spec.time_limit_s
        if limit is not None and job.started_at is not None and now >= job.started_at + limit:
            plan.time_out(job, limit)
