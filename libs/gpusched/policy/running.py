"""The running jobs of one state, indexed for the questions a cycle asks of them: which are
preemptible (by team and priority class, oldest start first), which are elastic, which have a
time limit. An incremental memo like ordering.QueueIndex: rebuilt whenever it cannot prove it
is current, and giving exactly what a full scan of `state.running` would.
"""

from __future__ import annotations

from ..core.model import PRIORITY_RANK
from ..core.state import ClusterState, Job


class RunningIndex:
    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.entries: dict[str, int] = {}  # job -> attempt
        #: preemptible running jobs by (team, priority rank), in start order
        self.preemptible: dict[tuple[str, int], dict[str, None]] = {}
        self.elastic: dict[str, None] = {}  # running elastic jobs, in start order
        self.timed: dict[str, None] = {}  # running jobs with a time limit, in start order
        #: preemptible jobs that started by backfill: they yield to the reserved head on demand
        self.borrowers: dict[str, None] = {}

    def _insert(self, job: Job) -> None:
        jid, spec = job.job_id, job.spec
        self.entries[jid] = job.attempt
        if spec.preemptible and not spec.partial:  # a share or slice frees no whole GPU: never a victim for room
            self.preemptible.setdefault((spec.team, PRIORITY_RANK[spec.priority]), {})[jid] = None
        if spec.elastic:
            self.elastic[jid] = None
        if spec.time_limit_s is not None:
            self.timed[jid] = None
        if job.backfill and spec.preemptible and not spec.partial:
            self.borrowers[jid] = None

    def _remove(self, jid: str) -> None:
        del self.entries[jid]
        spec = self.state.jobs[jid].spec
        if spec.preemptible and not spec.partial:
            key = (spec.team, PRIORITY_RANK[spec.priority])
            bucket = self.preemptible[key]
            del bucket[jid]
            if not bucket:
                del self.preemptible[key]
        self.elastic.pop(jid, None)
        self.timed.pop(jid, None)
        self.borrowers.pop(jid, None)

    def update(self) -> None:
        st = self.state
        running, jobs, entries = st.running, st.jobs, self.entries
        changed = []
        for jid in reversed(running):
            a = entries.get(jid)
            if a is not None and a == jobs[jid].attempt:
                break
            changed.append(jid)
        fresh = sum(1 for jid in changed if jid not in entries)
        if len(entries) > len(running) - fresh:
            for jid in entries.keys() - running.keys():
                self._remove(jid)
        for jid in reversed(changed):
            if jid in entries:
                self._remove(jid)
            self._insert(jobs[jid])

