"""GPUs a preemption freed go first to the job they were freed for (as Kubernetes' nominated
node): when a victim asked to yield for a pending job releases, that job starts, before the walk
hands the pool out in queue order, if it fits now and its team's limit allows.

Why: the preemption was decided for that job by the rules (fair share, LAS, the reserved head),
and its victims paid a checkpoint and a restore. Without the hand-over the next walk gives the
freed GPUs to whichever job comes first in the queue and fits, and the job they were freed for
asks again: another preemption, another victim (on the bundled week, 176 of 424 LAS preemptions
served nobody; docs/policy.md, "Hand-over").

The jobs to hand over to are those of releases this cycle decides, and those the fold names
(`ClusterState.handover`: releases appended since the last grant, by the preemptor service, say,
while placement decides grants). A job that became ineligible meanwhile (held, a dependency) gets
nothing, and one that does not fit yet (another victim still checkpointing) gets nothing: the
first grant after a release ends its turn, so a hand-over never reorders the queue later; the
next release for it gives it another.
"""

from __future__ import annotations

from ..eligibility import array_full, not_eligible
from ..plan import Context, CyclePlan


def run(plan: CyclePlan, ctx: Context) -> None:
    st = ctx.state
    jobs = st.jobs
    for_jobs = dict(st.handover)
    for jid, status in plan.status.items():  # in the order the settle step released them
        asked = jobs[jid].preemption
        if status == "released" and asked is not None and asked.for_job != jid:
            for_jobs[asked.for_job] = None
    for fid in for_jobs:
        if fid not in st.pending or fid in plan.status:
            continue  # ended, or started already
        job = jobs[fid]
        if not_eligible(st, job, ctx.now) is not None or array_full(plan, job):
            continue
        room = plan.room(job.team)
        if room is not None and room < ctx.floor(job):
            continue
        placed = plan.fit(job, plan.pool, room)
        if placed is not None:
            plan.grant(job, placed, backfill=False)
