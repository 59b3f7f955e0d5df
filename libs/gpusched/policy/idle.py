"""Idle timeout: take back GPUs that a job holds while doing nothing with them.

The reconciler appends `JobIdle` once every GPU of a running job stayed under `idle_util_pct`
for `idle_after_s`. This policy answers one question: which idle jobs have been idle longer
than their class's `idle_timeout_s`, and what happens to them (`idle_action`):

- "requeue" (default): `PreemptionRequested(cause="idle")`, naming the job itself: it is asked to
  checkpoint, its GPUs are released once it did (or at the deadline, the work lost counted),
  and it waits behind the queue (`Job.yielded_idle`) until it is granted again;
- "end": `JobFailed` with the idle reason (Slurm-like: the session is over).

Never for a job already asked to checkpoint (a preemption or idle request in flight). Every
decision carries its reason and the idle evidence, so `gpusched show` explains it from the log.
Settling an idle request (release on checkpoint or deadline) is the cycle's `settle` when
preemption is on; with preemption off this module settles its own requests.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..core import events as ev
from ..core.state import ClusterState, Job
from .config import PolicyConfig
from .preemption import work_since_checkpoint


def idle_evidence(job: Job, now: float) -> str:
    """One line a person can check: since when, how idle, under which threshold."""
    idle = job.idle
    if idle is None:
        return "not idle"
    return (f"GPUs under {idle.threshold_pct:g}% utilization for {now - idle.since:.0f} s "
            f"(mean {idle.util_pct:.1f}%, max {idle.util_pct_max:.1f}%, {idle.memory_mb:.0f} MB used per GPU)")


def idle_timeouts(state: ClusterState, now: float, config: PolicyConfig,
                  decided: Iterable[ev.Event] = ()) -> list[ev.Event]:
    """The idle-timeout decisions at `now`. Jobs that `decided` (the events of the same cycle,
    applied before these) already touches are left alone, so each job is touched once."""
    if not state.idle_jobs:
        return []
    touched = {getattr(e, "job_id", None) for e in decided}
    out: list[ev.Event] = []
    for jid in state.idle_jobs:
        job = state.jobs[jid]
        if jid in touched or not job.holding:
            continue
        p = job.preemption
        if p is not None:
            if p.cause == "idle" and not config.preemption:
                out.extend(_settle(job, now))
            continue  # never for a job that is checkpointing
        limit = config.idle_timeout_s.get(job.spec.priority)
        if job.idle is None or limit is None or now - job.idle.since < limit:
            continue
        reason = (f"idle timeout of {limit:g} s for {job.spec.priority} jobs: "
                  f"{idle_evidence(job, now)}")
        if config.idle_action.get(job.spec.priority, "requeue") == "end":
            out.append(ev.JobFailed(at=now, job_id=jid, attempt=job.attempt, reason=reason))
            continue
        grace = config.checkpoint_grace_s if config.checkpoint else 0.0
        out.append(ev.PreemptionRequested(at=now, job_id=jid, for_job=jid, reason=reason,
                                          deadline=now + grace, cause="idle"))
        if not config.checkpoint:
            out.append(ev.GpusReleased(at=now, job_id=jid, reason="preempted", forced=True,
                                       lost_gpu_s=round(work_since_checkpoint(job, now), 6)))
    return out


def _settle(job: Job, now: float) -> list[ev.Event]:
    """Release an idle job that checkpointed since it was asked, or whose deadline passed."""
    p, ck = job.preemption, job.checkpoint
    assert p is not None  # (called for jobs with an idle request in flight)
    if ck is not None and ck.attempt == job.attempt and ck.at >= p.at:
        lost = len(job.gpus) * max(0.0, now - ck.at)
        return [ev.GpusReleased(at=now, job_id=job.job_id, reason="preempted", lost_gpu_s=round(lost, 6))]
    if now >= p.deadline:
        return [ev.GpusReleased(at=now, job_id=job.job_id, reason="preempted", forced=True,
                                lost_gpu_s=round(work_since_checkpoint(job, now), 6))]
    return []


__all__ = ["idle_evidence", "idle_timeouts"]
