"""Whether a pending job may be considered for placement at all, before any question of room:
not held, and its dependencies satisfied. A job that is not eligible is never placed, never
reserved for and never preempted for; its typed reason says why (`gpusched show`).

One small module called from the walk (and its tail), so the queue order, placement and
backfill stay untouched for jobs that use none of these features.
"""

from __future__ import annotations

from ..core.reasons import DependencyNever, DependencyWait, Held, Reason
from ..core.state import ClusterState, Job

#: End states that satisfy each dependency kind.
_SATISFIED = {"afterok": ("completed",), "afterany": ("completed", "failed", "cancelled", "timeout")}
_ENDED = ("completed", "failed", "cancelled", "timeout")


def not_eligible(state: ClusterState, job: Job) -> Reason | None:
    """Why `job` may not start whatever the room (None: it may)."""
    if job.hold is not None:
        return Held(job.hold)
    deps = job.spec.dependency
    if deps:
        return dependency_reason(state, job)
    return None


def dependency_reason(state: ClusterState, job: Job) -> Reason | None:
    """Unsatisfied dependencies: never (an `afterok` job ended otherwise), or not yet."""
    waiting: list[str] = []
    never: list[str] = []
    for d in job.spec.dependency:
        dep = state.jobs.get(d.job)
        dep_state = dep.state if dep is not None else "unknown"
        if dep_state in _SATISFIED[d.kind]:
            continue
        if dep_state in _ENDED or dep is None:
            never.append(f"{d.job} {dep_state}")
        else:
            waiting.append(f"{d.kind}:{d.job}")
    if never:
        return DependencyNever(never)
    if waiting:
        return DependencyWait(waiting)
    return None


__all__ = ["dependency_reason", "not_eligible"]
