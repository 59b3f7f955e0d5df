"""In which order pending jobs are considered: priority class, then submission time (or least
attained service), then job id; with fair share, teams take turns by `fairshare.team_rank` and
priority orders each team's own queue.

Requeued jobs keep their original submission time, so a preempted job goes back near the front;
a job requeued by its idle timeout (`Job.yielded_idle`) goes behind the whole queue instead
(behind every team's jobs with fair share), until it is granted again: else it would take back
the GPUs it just gave up.

The order is kept by a `QueueIndex`, an incremental memo of the sorted queue (a cache, not
state: it gives exactly the order a full sort would, and is rebuilt whenever it cannot prove it
is current). It makes a cycle cost O(jobs that changed + jobs considered), not O(queue): it
finds the jobs (re)queued since the last call by walking the fold's insertion-ordered `pending`
backwards, and it remembers which waiting jobs already carry the stable reason a cycle would
give them (`settled`), so a long queue costs nothing per cycle.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterator

from ..core import rules
from ..core.model import PRIORITY_RANK
from ..core.state import ClusterState, Job
from .config import PolicyConfig
from .fairshare import entitlement, fair_shares, team_rank
from .predict import FrozenEstimates, RuntimePredictor, queued_at

#: Every this many updates to a new fold version the index forgets which reasons it has seen
#: settled and checks them all again (a guard against reasons appended by another writer).
#: Counted per fold version, not per call, so that reading the queue an extra time in a cycle
#: (the hand-over, the ETA plan) changes nothing the cycle emits.
REVERIFY_EVERY = 256
#: The queue of jobs yielded by their idle timeout (with fair share: after every team's queue).
_YIELDED = "\x00yielded"


def las_queue(attained_gpu_s: float, config: PolicyConfig) -> float:
    """The LAS level of a job that attained this much: its discretized queue (2D-LAS) when
    `las_queues_gpu_s` is set, else the attained GPU-seconds themselves."""
    if config.las_queues_gpu_s:
        return float(bisect_right(config.las_queues_gpu_s, attained_gpu_s))
    return attained_gpu_s


def job_key(job: Job, config: PolicyConfig, frozen: FrozenEstimates | None = None) -> tuple:
    """Lower sorts first, within one team (or the whole queue without fair share). With
    `las_predicted` (and `frozen`), the LAS level is the job's predicted remaining GPU-seconds,
    frozen when it entered the queue, instead of its attained service."""
    prio = -PRIORITY_RANK[job.spec.priority] if config.priority else 0
    # A pending job holds nothing: its attained service is static while it waits.
    if frozen is not None and config.las and config.las_predicted:
        level = frozen.remaining_gpu_s(job)
    else:
        level = las_queue(job.service_gpu_s, config) if config.las else 0.0
    return (job.yielded_idle, prio, level, job.submitted_at, job.job_id)


class QueueIndex:
    """The pending queue of one state, sorted (per team with fair share), kept incrementally."""

    def __init__(self, state: ClusterState, config: PolicyConfig, mode: tuple,
                 predictor: RuntimePredictor | None = None) -> None:
        self.state, self.config, self.mode = state, config, mode
        #: With `las_predicted`: each pending job's predicted remaining GPU-seconds, frozen.
        self.frozen: FrozenEstimates | None = None
        if config.las and config.las_predicted:
            self.frozen = FrozenEstimates(predictor if predictor is not None else RuntimePredictor(state, record=True))
        self.entries: dict[str, tuple[tuple, tuple[int, int]]] = {}  # job -> (sort key, (attempt, updates))
        #: job -> the queue its key is in: a job that left the queue may be gone from the fold
        #: too (forgotten in the fold step that ended it), so removal never looks it up there.
        self.queue_of: dict[str, str | None] = {}
        self.queues: dict[str | None, list[tuple]] = {}  # team (None without fair share) -> keys
        self.settled: dict[str, None] = {}  # waiting jobs whose state shows their tail reason
        #: Waiting jobs that could start on a blocked head's reservation: with a time limit
        #: (ending before it is due) or preemptible (borrowing it). The walk stops early without.
        self.timed: dict[str, None] = {}
        self.preemptible: dict[str, None] = {}
        self.shares: dict[str, None] = {}  # waiting fractional and MIG jobs (they may fit on shared or MIG GPUs)
        #: With fair share: per team, a heap of (queued at, job) of its waiting jobs (not the
        #: yielded ones), stale entries dropped when they reach the top (`oldest`).
        self.by_age: dict[str, list[tuple[float, str]]] = {}
        #: With fair share: per team, per class (fewest GPUs it may start with, priority, LAS
        #: level), a heap of the sort keys of its waiting whole-GPU jobs (`fitting`); stale
        #: entries are dropped when they reach the top, or when they outnumber the live ones.
        self.by_size: dict[str, dict[tuple, list[tuple]]] = {}
        self.queued: dict[str, float] = {}  # waiting job -> when it entered the queue
        self._mean: tuple[float, float] | None = None  # (now, guaranteed teams' usage per GPU)
        #: GPUs the waiting jobs ask for, per team, and each job's part of it (`fair_shares`).
        self.asked: dict[str, float] = {}
        self.ask_of: dict[str, tuple[str, float]] = {}
        self._shares: tuple[int, dict[str, float]] | None = None  # (fold version, the shares)
        self.calls = 0  # updates at a new fold version (`state.events`)
        self.seen = -1

    def _queue_of(self, job: Job, key: tuple) -> str | None:
        if not self.config.fairshare:
            return None
        return _YIELDED if key[0] else job.spec.team

    def _insert(self, job: Job) -> None:
        key = job_key(job, self.config, self.frozen)
        self.entries[job.job_id] = (key, (job.attempt, job.updates))
        queue = self.queue_of[job.job_id] = self._queue_of(job, key)
        insort(self.queues.setdefault(queue, []), key)
        if job.spec.time_limit_s is not None:
            self.timed[job.job_id] = None
        if job.spec.preemptible:
            self.preemptible[job.job_id] = None
        if job.spec.partial:
            self.shares[job.job_id] = None
        team, n = job.spec.team, job.spec.gpus if not job.spec.partial else job.spec.gpu_fraction or 1.0
        self.ask_of[job.job_id] = (team, n)
        self.asked[team] = self.asked.get(team, 0.0) + n
        if queue is not None and queue != _YIELDED:
            at = self.queued[job.job_id] = queued_at(job)
            heapq.heappush(self.by_age.setdefault(queue, []), (at, job.job_id))
            if not job.spec.shared:
                cls = (rules.gang_floor(job.spec, self.config.elastic), *key[1:3])
                heapq.heappush(self.by_size.setdefault(queue, {}).setdefault(cls, []), key)

    @property
    def shared(self) -> int:
        """How many fractional and MIG jobs wait."""
        return len(self.shares)

    def _remove(self, job_id: str, left: bool = True) -> None:
        key, _ = self.entries.pop(job_id)
        q = self.queues[self.queue_of.pop(job_id)]
        i = bisect_left(q, key)
        del q[i]
        self.settled.pop(job_id, None)
        if left and self.frozen is not None:
            self.frozen.forget(job_id)
        self.timed.pop(job_id, None)
        self.preemptible.pop(job_id, None)
        self.shares.pop(job_id, None)
        self.queued.pop(job_id, None)
        team, n = self.ask_of.pop(job_id)
        self.asked[team] -= n

    def fair_shares(self) -> dict[str, float]:
        """Each team's fair share of the cluster now (`fairshare.fair_shares`): its demand is
        what it holds plus what its waiting jobs ask for. Once per fold version."""
        st = self.state
        if self._shares is None or self._shares[0] != st.events:
            teams = st.teams
            demand = {t: (teams[t].held if t in teams else 0.0) + self.asked.get(t, 0.0)
                      for t in teams.keys() | self.asked.keys()}
            quotas = {t: u.quota for t, u in teams.items()}
            self._shares = (st.events, fair_shares(st.total_gpus, demand, quotas))
        return self._shares[1]

    def oldest(self, team: str) -> tuple[float, str] | None:
        """(when it entered the queue, job) of the team's longest-waiting job (None: none waits)."""
        heap = self.by_age.get(team)
        while heap:
            at, jid = heap[0]
            if self.queued.get(jid) == at and self.queue_of.get(jid) == team:
                return heap[0]
            heapq.heappop(heap)
        return None

    def fitting(self, team: str) -> Iterator[tuple[int, Iterator[Job]]]:
        """The team's waiting whole-GPU jobs by class, (fewest GPUs they may start with, the
        class's jobs in the team's own order, lazily), classes by fewest GPUs, then priority,
        then LAS level: a caller that stops at the first class too big for it, and leaves a
        class at its first job it cannot serve, costs the classes it looks at, not the queue."""
        classes = self.by_size.get(team)
        if not classes:
            return
        for cls in sorted(classes):
            heap = classes[cls]
            while heap and not self._current(team, heap[0]):
                heapq.heappop(heap)
            if not heap:
                del classes[cls]
                continue
            if len(heap) > 64 and len(heap) > 2 * len(self.queues.get(team, ())):
                heap[:] = sorted(dict.fromkeys(k for k in heap if self._current(team, k)))
            yield cls[0], self._lazily(team, heap)

    def _lazily(self, team: str, heap: list[tuple]) -> Iterator[Job]:
        """A heap's live entries in sorted order, without popping them."""
        frontier = [(heap[0], 0)]
        jobs, seen = self.state.jobs, set()
        while frontier:
            key, i = heapq.heappop(frontier)
            for c in (2 * i + 1, 2 * i + 2):
                if c < len(heap):
                    heapq.heappush(frontier, (heap[c], c))
            jid = key[-1]
            if jid not in seen and self._current(team, key):  # a requeue may repeat a key
                seen.add(jid)
                yield jobs[jid]

    def _current(self, team: str, key: tuple) -> bool:
        """Whether `key` is the sort key a job of `team` waits with now (not a stale entry)."""
        jid = key[-1]
        e = self.entries.get(jid)
        return e is not None and e[0] == key and self.queue_of.get(jid) == team

    def owed(self, team: str, now: float) -> bool:
        """With `fair_owed_after_s`: whether a team below its guarantee is owed (goes first and
        reclaims): at once if it has not run ahead over the horizon (its decayed usage per
        entitled GPU at most the teams' mean, `behind`), else once its oldest waiting job has
        waited that long (it repays first). Without the knob: always."""
        after = self.config.fair_owed_after_s
        if after is None:
            return True
        first = self.oldest(team)
        return first is not None and (now - first[0] >= after or self.behind(team, now))

    def behind(self, team: str, now: float) -> bool:
        """Whether the team's decayed usage per entitled GPU (`fairshare.entitlement`) is at most
        that of all guaranteed teams together (their usage over their guarantees)."""
        st = self.state
        if self._mean is None or self._mean[0] != now:
            used = sum(st.team_usage(t, now) for t, u in st.teams.items() if u.quota.guaranteed > 0)
            total = sum(u.quota.guaranteed for u in st.teams.values())
            self._mean = (now, used / total if total else 0.0)
        t = st.teams.get(team)
        return st.team_usage(team, now) / entitlement(t.quota if t is not None else None) <= self._mean[1]

    def update(self) -> None:
        st = self.state
        pend, jobs, entries = st.pending, st.jobs, self.entries
        if st.events != self.seen:
            self.seen = st.events
            self.calls += 1
            if self.calls % REVERIFY_EVERY == 0:
                self.settled.clear()
        # Jobs (re)queued since the last call sit at the end of the insertion-ordered `pending`:
        # a job that left the queue was granted (its attempt moved) or ended for good.
        changed = []
        for jid in reversed(pend):
            e = entries.get(jid)
            if e is not None and e[1] == (jobs[jid].attempt, jobs[jid].updates):
                break
            changed.append(jid)
        fresh = sum(1 for jid in changed if jid not in entries)
        if len(entries) > len(pend) - fresh:
            gone = entries.keys() - pend.keys()
            for jid in gone:
                self._remove(jid)
            if self.frozen is not None:
                self.frozen.left_queue(gone)
        if self.frozen is not None:  # frozen predictions are asked in order of queue time
            changed.sort(key=lambda j: (queued_at(jobs[j]), j), reverse=True)
        for jid in reversed(changed):
            if jid in entries:
                self._remove(jid, left=False)  # re-keyed: its frozen prediction stays
            self._insert(jobs[jid])

    def starving(self, now: float) -> list[Job]:
        """Jobs promoted to the front of their team's queue (of the whole queue without fair
        share), by submission: with `starve_after_s`, each team's oldest waiting job once it
        has waited that long (one per team: O(teams)); with `las_starve_factor`, jobs past the
        first LAS queue that waited at least that many times their run so far (Tiresias's
        STARVE; one pass over the queue: only when that knob is on)."""
        config, jobs = self.config, self.state.jobs
        out: list[Job] = []
        if config.starve_after_s is not None and config.fairshare:
            for team in self.by_age:
                first = self.oldest(team)
                if first is not None and now - first[0] >= config.starve_after_s:
                    out.append(jobs[first[1]])
        factor = config.las_starve_factor
        if factor is None or not config.las or not config.las_queues_gpu_s:
            out.sort(key=lambda j: (j.submitted_at, j.job_id))
            return out
        aged = {j.job_id for j in out}
        for key, _ in self.entries.values():
            job = jobs[key[-1]]
            if las_queue(job.service_gpu_s, config) <= 0 or job.yielded_idle or job.job_id in aged:
                continue
            ran = job.service_gpu_s / max(1, job.spec.gpus)
            if now - queued_at(job) >= factor * ran:
                out.append(job)
        out.sort(key=lambda j: (j.submitted_at, j.job_id))
        return out

    def ordered(self, now: float, held: Callable[[str], float]) -> Iterator[Job]:
        """Pending jobs in order, the starving ones (`starving`) first: first of all without
        fair share, first of their team's queue with it (fair share still decides which team
        goes next: the starvation bound never overrides another team's entitlement)."""
        first = self.starving(now)
        if not first:
            yield from self._ordered(now, held)
            return
        if self.config.fairshare:
            yield from self._ordered(now, held, first)
            return
        yield from first
        promoted = {j.job_id for j in first}
        yield from (j for j in self._ordered(now, held) if j.job_id not in promoted)

    def _promoted(self, first: list[Job]) -> dict[str | None, list[tuple]]:
        """The queues of the teams with starving jobs, those jobs first (in `first`'s order)."""
        by_team: dict[str | None, list[tuple]] = {}
        for j in first:
            by_team.setdefault(self._queue_of(j, self.entries[j.job_id][0]), []).append(self.entries[j.job_id][0])
        out = {}
        for t, keys in by_team.items():
            ids = {k[-1] for k in keys}
            out[t] = keys + [k for k in self.queues.get(t, ()) if k[-1] not in ids]
        return out

    def _ordered(self, now: float, held: Callable[[str], float], first: list[Job] | None = None) -> Iterator[Job]:
        """Pending jobs in order. With fair share the order is lazy: `held(team)` is read after
        each job is yielded, so grants made meanwhile move the team down. Teams of equal rank
        go in the order of their next jobs' keys (unique: they end with the job id), never by
        team name. `first`: starving jobs, each put first in its team's queue."""
        st, jobs = self.state, self.state.jobs
        if not self.config.fairshare:
            for key in self.queues.get(None, ()):
                yield jobs[key[-1]]
            return
        queues = {**self.queues, **self._promoted(first)} if first else self.queues
        promoted = {j.job_id for j in first} if first else ()
        config = self.config
        horizon = config.fair_owed_after_s is not None and config.las

        def level(key: tuple) -> float:  # a promoted job ranks its team as a fresh one would
            return key[2] if horizon and key[-1] not in promoted else 0.0

        heap = []
        usage, owed = {}, {}
        for t, q in queues.items():
            if q and t is not None and t != _YIELDED:  # with fair share every other queue is a team's
                usage[t], owed[t] = st.team_usage(t, now), self.owed(t, now)
                heap.append((team_rank(st, t, held(t), usage[t], config, owed=owed[t], level=level(q[0])), q[0], t, 0))
        heapq.heapify(heap)
        while heap:
            _, _, t, i = heapq.heappop(heap)
            q = queues[t]
            yield jobs[q[i][-1]]
            if i + 1 < len(q):
                rank = team_rank(st, t, held(t), usage[t], config, owed=owed[t], level=level(q[i + 1]))
                heapq.heappush(heap, (rank, q[i + 1], t, i + 1))
        for key in self.queues.get(_YIELDED, ()):
            yield jobs[key[-1]]


def queue_mode(config: PolicyConfig) -> tuple:
    """The config knobs the queue order depends on: one `QueueIndex` per mode."""
    return (config.priority, config.las, tuple(config.las_queues_gpu_s), config.fairshare,
            config.strict_fifo or not config.gang, config.elastic, config.las_starve_factor, config.las_predicted,
            config.fair_owed_after_s, config.starve_after_s)


def ordered(state: ClusterState, now: float, config: PolicyConfig,
            held: Callable[[str], float] | None = None) -> Iterator[Job]:
    """Pending jobs in the order a cycle considers them (a fresh index: for tests and tools)."""
    idx = QueueIndex(state, config, ())
    idx.update()
    return idx.ordered(now, held or (lambda t: state.teams[t].held))
