"""GPUs a preemption freed go first to the job they were freed for (as Kubernetes' nominated
node): when a victim asked to yield for a pending job releases, that job starts, before the walk
hands the pool out in queue order, if it fits now, its team's limit allows, and no job of
another team would come first: the hand-over reorders a team's own queue, never the fair-share
order across teams.

Why: the preemption was decided for that job by the rules (LAS or priority within its team,
reclaim to a guarantee, the reserved head), and its victims paid a checkpoint and a restore.
Without the hand-over the next walk gives the freed GPUs to whichever job comes first and fits,
often one that could not have asked for them (held then, behind the reservation, past the
cycle's preemption budget), and the job they were freed for asks again: another victim, another
checkpoint and restore. When the first in line is another team's job, fair share says that team
goes next, so it does (handing over there cost 2% avg JCT on the Alibaba trace; docs/policy.md,
"Hand-over").

The jobs to hand over to are those of releases this cycle decides, and those the fold names
(`ClusterState.handover`: releases appended since the last grant, by the preemptor service, say,
while placement decides grants). A job that became ineligible meanwhile (held, a dependency) gets
nothing, and one that does not fit yet (another victim still checkpointing) gets nothing: the
first grant after a release ends its turn, so a hand-over never reorders the queue later; the
next release for it gives it another.

Two cases reorder across teams. A job that, started, stays within its team's guarantee gets
what was freed for it: the reclaim that freed them may have taken a gang bigger than its owner's
guarantee (`preemption._Rule.within`), whose team, further below its guarantee then, comes first
by the totals and would take them straight back (issue 26: a guarantee reclaimable from any
preemptible borrower). And per-model terms (issue 30): GPUs freed for a job on a pool
where its team is under its per-model guarantee go to it even if another team comes first by
the totals the queue is ordered by. The reclaim that freed them judged the teams on that pool
(`preemption._Rule.standings`); without this, the victim's team, first by its totals, would
take them straight back.
"""

from __future__ import annotations

from ...core import rules
from ...core.model import GpuId
from ...core.state import Job
from ..eligibility import array_full, not_eligible
from ..fairshare import standing
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
        if fid not in st.pending:
            continue  # ended meanwhile
        job = jobs[fid]
        if not _may_start(plan, ctx, job):
            continue
        placed = plan.fit(job, plan.pool, plan.job_room(job))
        if placed is not None and (_first_in_line(plan, ctx, job).team == job.team
                                   or _within_guarantee(plan, ctx, job, placed.gpus)
                                   or _entitled_on_pool(plan, ctx, job, placed.gpus)):
            plan.grant(job, placed, backfill=False, handover=True)


def _may_start(plan: CyclePlan, ctx: Context, job: Job) -> bool:
    """A pending job this cycle has not started yet, eligible (not held, its dependencies met,
    its array below its limit), whose team's limit leaves room for its smallest start."""
    if job.job_id in plan.status or not_eligible(ctx.state, job, ctx.now, plan.pool.topo) is not None \
            or array_full(plan, job):
        return False
    room = plan.job_room(job)
    return room is None or room >= ctx.floor(job)


def _within_guarantee(plan: CyclePlan, ctx: Context, job: Job, gpus: list[GpuId]) -> bool:
    """The job, started on `gpus`, keeps its team within its guarantee: the reclaim that freed
    them may take a gang bigger than its owner's guarantee (`preemption._Rule.within`), whose
    team, further below its own then, comes first by the totals and would take them back."""
    t = ctx.state.teams.get(job.team)
    return t is not None and not t.quota.models and plan.held(job.team) + len(gpus) <= t.quota.guaranteed


def _entitled_on_pool(plan: CyclePlan, ctx: Context, job: Job, gpus: list[GpuId]) -> bool:
    """`gpus` lie on one pool where the job's team, which has per-model terms, is under its
    per-model guarantee (see the module docstring)."""
    st = ctx.state
    t = st.teams.get(job.team)
    pool = rules.pool_of(st, gpus) if t is not None and t.quota.models else None
    if pool is None:
        return False
    held, guaranteed = standing(st, job.team, plan.held(job.team), pool, plan.pool_held(job.team, pool))
    return held < guaranteed


def _first_in_line(plan: CyclePlan, ctx: Context, job: Job) -> Job:
    """The first job in queue order that would fit the pool as it is, reservations aside: `job`
    at the latest (it fits), so the walk stops there."""
    idx = ctx.indexes.queue(ctx.state, ctx.config)
    for other in idx.ordered(ctx.now, plan.held):
        if other is job:
            return job
        if _may_start(plan, ctx, other) and plan.fits_pool(other, plan.job_room(other)):
            return other
    return job
