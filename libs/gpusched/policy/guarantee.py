"""Keeping every guarantee reclaimable (issue 26): only preemptible GPUs can be taken back, so
the GPUs non-preemptible jobs hold beyond their teams' guarantees must fit in the GPUs nobody
is guaranteed (the slack). Then every team can always reclaim its guarantee. Guarantees that
sum to the cluster leave no slack: a non-preemptible job runs only within its team's guarantee,
and a borrower must be preemptible (as KAI's non-preemptible jobs run only within their queue's
quota). An elastic job's extras can be shrunk, so only its minimum counts.

The rule starves nobody: a barred job starts once its own team's non-preemptible jobs (and other
teams' beyond their guarantees) end. A job larger than its team's guarantee plus the slack could
never start under it, so it is not barred (`Firm.never_fits`): the one exception, which keeps
the old risk to other teams' guarantees.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..core.model import GpuId
from ..core.state import ClusterState, Job


def guaranteed(state: ClusterState, team: str) -> int:
    t = state.teams.get(team)
    return t.quota.guaranteed if t is not None else 0


class Firm:
    """The non-preemptible holdings of one cycle, by team, and the slack they may share."""

    def __init__(self, state: ClusterState, started: Iterable[tuple[Job, list[GpuId]]], capacity: int) -> None:
        self.state = state
        self.held: dict[str, int] = {}
        total = sum(t.quota.guaranteed for t in state.teams.values())
        self.active = total > 0  # with no guarantee set, nothing is restricted
        self.slack = max(0, capacity - total)
        if not self.active:
            return
        for jid in state.running:
            j = state.jobs[jid]
            if not j.spec.preemptible:
                self.add(j, len(j.gpus))
        for j, gpus in started:
            if not j.spec.preemptible:
                self.add(j, len(gpus))

    def add(self, job: Job, n: int) -> None:
        self.held[job.team] = self.held.get(job.team, 0) + min(n, job.spec.gang_min)

    def never_fits(self, team: str, need: int) -> bool:
        return need > guaranteed(self.state, team) + self.slack

    def room(self, team: str) -> int:
        """GPUs the team's non-preemptible jobs may still take."""
        st = self.state
        excess = sum(max(0, n - guaranteed(st, t)) for t, n in self.held.items() if t != team)
        return guaranteed(st, team) + max(0, self.slack - excess) - self.held.get(team, 0)
