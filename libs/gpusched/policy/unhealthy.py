"""Jobs on a quarantined GPU: which ones to move, and the request that moves them.

The reconciler appends `JobOnUnhealthyGpu` when a GPU a running job holds is quarantined; this
policy answers one question: which of those jobs to ask to checkpoint and yield now, so that
they resume elsewhere (placement never grants a quarantined GPU). A move is a preemption that
serves the job itself. Only preemptible jobs are moved (a non-preemptible one keeps running and
`show` says where); `checkpoint_grace_s` bounds the wait for its checkpoint.
"""

from __future__ import annotations

from ..core import events as ev
from ..core.state import ClusterState
from .plan import Context, CyclePlan


def moves(state: ClusterState, now: float, grace_s: float, skip: set[str] | frozenset[str] = frozenset()
          ) -> list[ev.PreemptionRequested]:
    """One PreemptionRequested per running preemptible job on an unhealthy GPU, not yet asked."""
    out = []
    for job_id in state.running:
        job = state.jobs[job_id]
        if not job.unhealthy or job.preemption is not None or not job.spec.preemptible or job_id in skip:
            continue
        gpus = ", ".join(job.unhealthy)
        out.append(ev.PreemptionRequested(at=now, job_id=job_id, for_job=job_id, deadline=now + grace_s,
                                          reason=f"moving off unhealthy GPU(s) {gpus}: {job.unhealthy_reason}"))
    return out


def run(plan: CyclePlan, ctx: Context) -> None:
    """The cycle's step: each job to move is asked through the plan (in flight from now on,
    so no later step of the cycle touches it); jobs the cycle already settled are left."""
    skip = {jid for jid, status in plan.status.items() if status == "released"}
    for e in moves(ctx.state, ctx.now, ctx.config.checkpoint_grace_s, skip):
        plan.move(ctx.state.jobs[e.job_id], e.reason)


__all__ = ["moves", "run"]
