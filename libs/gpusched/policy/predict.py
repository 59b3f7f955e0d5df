"""How long a job will still run, learned from the jobs that finished before it (no oracle).

What is learned: the run time of every completed job, as GPU-seconds of service over its gang
size (`service_gpu_s / gpus`: all attempts, at full size), the same measure a running job's
progress is read in. Where it is kept: per key, from the most specific to the least,

    (team, user, gpus, command) > (team, user, gpus) > (team, gpus) > (team,) > (gpus,) > ()

(a level whose user or command is empty is skipped), each key holding its last `keep` run
times. Memory is bounded: at most `max_keys` keys, the least recently fed evicted first.

How it answers (`estimate`): run times are heavy-tailed, so the answer is conditional on what
the job already ran (`elapsed`): among the run times of the most specific key that has at least
`min_samples` of them longer than `elapsed`, the quantiles of what is left (`x - elapsed`): the
median is the point estimate, the `low_q`..`high_q` quantiles its range. A job that already ran
longer than every run time the history knows gets the Lindy guess (as long again as it ran,
range 0..`lindy_high`x).

Batches: a team submits many jobs together at one size (a sweep, retries of one experiment), and
those run about as long as each other: on the bundled Philly week two consecutive jobs of one
team and size submitted within a minute differ by a median factor of 1.17, against 1.95 for two
of the same key picked at random. So the point estimate of a job with such siblings is theirs:
the median of the (up to) `siblings` completed jobs of its team and size (the same user and
command first, where known) submitted nearest to it, within `sibling_window_s` (an hour: a
working session), among those that ran longer than it has; the range stays the key's (widened
to hold the point).

A user's time limit bounds every answer from above. Everything is a function of the completed
jobs in the order they finished (ties by job id) and of the job's own spec, submission and
elapsed time: never of its true duration, which nothing here can see.
"""

from __future__ import annotations

import heapq
import math
import zlib
from bisect import bisect_left, bisect_right, insort
from collections import OrderedDict, deque

from msgspec import Struct

from ..core.state import ClusterState, Job


class Estimate(Struct, frozen=True):
    """The predicted remaining run time of a job, in seconds from now."""

    remaining_s: float  # the median: the point estimate
    low_s: float  # the `low_q` quantile
    high_s: float  # the `high_q` quantile
    samples: int  # run times the answer rests on (0: the Lindy guess)
    basis: str  # which key answered, e.g. "team+gpus", or "lindy"

    @property
    def uncertain(self) -> bool:
        """Wide enough to be shown as a range: the high end over twice the low end, and apart
        by more than five minutes."""
        return self.high_s - self.low_s > 300.0 and self.high_s > 2.0 * max(self.low_s, 1.0)


_LEVELS = ("team+user+gpus+command", "team+user+gpus", "team+gpus", "team", "gpus", "all")


def _keys(job: Job) -> list[tuple]:
    spec = job.spec
    cmd = zlib.crc32("\0".join(spec.command).encode()) if spec.command else None
    user = job.user or None
    keys: list[tuple] = []
    if user is not None and cmd is not None:
        keys.append((0, spec.team, user, spec.gpus, cmd))
    if user is not None:
        keys.append((1, spec.team, user, spec.gpus))
    keys += [(2, spec.team, spec.gpus), (3, spec.team), (4, spec.gpus), (5,)]
    return keys


def run_time(job: Job) -> float:
    """What a finished job ran, all attempts, at full size (GPU-seconds over its gang size)."""
    return job.service_gpu_s / max(1, job.spec.gpus)


def elapsed(job: Job, now: float) -> float:
    """What a job has run so far in the same measure (all attempts, the current one to `now`)."""
    return job.attained_gpu_s(now) / max(1, job.spec.gpus)


def _quantile(xs: list[float], q: float, first: int = 0) -> float:
    """The `q` quantile of sorted `xs[first:]` (linear interpolation; no copy of the slice)."""
    pos = q * (len(xs) - first - 1)
    i = int(pos)
    if i + 1 >= len(xs) - first:
        return xs[-1]
    return xs[first + i] + (xs[first + i + 1] - xs[first + i]) * (pos - i)


class RuntimeHistory:
    """Run times of completed jobs by key (see the module docstring). Deterministic: the same
    jobs learned in the same order give the same answers."""

    def __init__(self, keep: int = 128, max_keys: int = 4096, min_samples: int = 8,
                 low_q: float = 0.1, high_q: float = 0.9, lindy_high: float = 3.0,
                 sibling_window_s: float = 3600.0, siblings: int = 3) -> None:
        self.keep, self.max_keys, self.min_samples = keep, max_keys, min_samples
        self.low_q, self.high_q, self.lindy_high = low_q, high_q, lindy_high
        self.sibling_window_s, self.siblings = sibling_window_s, siblings
        self.by_key: OrderedDict[tuple, deque[float]] = OrderedDict()
        #: key -> (submitted at, run time) of its last `keep` completions, in submission order
        #: (the keys that name a team and a gang size: a batch is one team's, at one size)
        self.by_submit: dict[tuple, list[tuple[float, float]]] = {}
        self._sorted: dict[tuple, list[float]] = {}  # key -> its run times sorted (a memo)
        self.learned = 0

    def learn(self, job: Job) -> None:
        """Feed one completed job."""
        x = run_time(job)
        if not math.isfinite(x) or x <= 0:
            return
        self.learned += 1
        for key in _keys(job):
            d = self.by_key.get(key)
            if d is None:
                d = self.by_key[key] = deque(maxlen=self.keep)
            else:
                self.by_key.move_to_end(key)
            d.append(x)
            self._sorted.pop(key, None)
            if key[0] <= 2:
                near = self.by_submit.setdefault(key, [])
                insort(near, (job.submitted_at, x))
                if len(near) > self.keep:
                    del near[0]
        while len(self.by_key) > self.max_keys:
            old = self.by_key.popitem(last=False)[0]
            self._sorted.pop(old, None)
            self.by_submit.pop(old, None)

    def _batch(self, job: Job, keys: list[tuple], ran: float) -> float | None:
        """The job's batch: the median run time of the (up to) `siblings` completed jobs
        submitted nearest to it, within `sibling_window_s`, among those that ran longer than it
        has, in the most specific of its team-and-size keys that has one (None: no key has).
        Why: jobs a team submits together at one
        size are mostly one experiment (a sweep, retries), and run about as long as each other,
        far closer than a random job of the same key."""
        sub, window, want = job.submitted_at, self.sibling_window_s, self.siblings
        for key in keys:
            if key[0] > 2:
                return None
            near = self.by_submit.get(key)
            if not near:
                continue
            hi = bisect_left(near, (sub, -math.inf))
            lo = hi - 1
            got: list[float] = []
            while len(got) < want:
                back = sub - near[lo][0] if lo >= 0 else math.inf
                ahead = near[hi][0] - sub if hi < len(near) else math.inf
                if min(back, ahead) > window:
                    break
                if back <= ahead:
                    x, lo = near[lo][1], lo - 1
                else:
                    x, hi = near[hi][1], hi + 1
                if x > ran:
                    got.append(x)
            if got:
                got.sort()
                return _quantile(got, 0.5)
        return None

    def estimate(self, job: Job, now: float) -> Estimate:
        """The remaining run time of a pending or running `job` at `now`."""
        ran = elapsed(job, now)
        answer: Estimate | None = None
        keys = _keys(job)
        for key in keys:
            xs = self._sorted.get(key)
            if xs is None:
                d = self.by_key.get(key)
                if d is None:
                    continue
                xs = self._sorted[key] = sorted(d)
            first = bisect_right(xs, ran)  # xs[first:]: the run times longer than it ran
            longer = len(xs) - first
            need = 1 if key[0] == 5 else self.min_samples
            if longer >= need:
                answer = Estimate(_quantile(xs, 0.5, first) - ran, _quantile(xs, self.low_q, first) - ran,
                                  _quantile(xs, self.high_q, first) - ran, longer, _LEVELS[key[0]])
                break
        if answer is None:
            guess = max(ran, 60.0)
            answer = Estimate(guess, 0.0, self.lindy_high * guess, 0, "lindy")
        batch = self._batch(job, keys, ran) if self.siblings > 0 else None
        if batch is not None:
            point = batch - ran
            answer = Estimate(point, min(answer.low_s, point), max(answer.high_s, point), answer.samples,
                              answer.basis + "+batch")
        limit = job.spec.time_limit_s
        if limit is not None:
            # the limit counts from the current attempt's start (a restart gets a fresh limit)
            start = job.started_at if job.started_at is not None and job.holding else now
            cap = max(0.0, limit - (now - start))
            answer = Estimate(min(answer.remaining_s, cap), min(answer.low_s, cap), min(answer.high_s, cap),
                              answer.samples, answer.basis if answer.high_s <= cap else answer.basis + "+limit")
        return answer


class RuntimePredictor:
    """The history of one fold, kept current incrementally (an index like `memo.Indexes`'s):
    it learns every job that completed since the last update, in order of completion. It
    watches the running jobs, and the jobs a cycle just granted (`watch`), which may complete
    before the next cycle runs; a fresh predictor learns the fold's whole past once. A job
    granted by another writer (the fallback) that completes between two updates is not learned
    by a long-lived predictor (a fresh one learns it): its answers may differ by that much."""

    def __init__(self, state: ClusterState, history: RuntimeHistory | None = None, record: bool = False) -> None:
        self.state = state
        self.history = history if history is not None else RuntimeHistory()
        #: With `record`: every job learned, in the order learned (append-only: `FrozenEstimates`
        #: reads it). Off otherwise: the list would hold every completed job for the life of a
        #: service, past the fold's forgetting horizon.
        self.completed: list[Job] | None = [] if record else None
        done = [j for j in state.jobs.values() if j.state == "completed"]
        for job in sorted(done, key=lambda j: (j.finished_at or 0.0, j.job_id)):
            self._learn(job)
        self.watching: dict[str, None] = dict.fromkeys(state.running)

    def watch(self, job_ids: list[str]) -> None:
        """Jobs granted by a cycle whose events the fold has not applied yet."""
        for jid in job_ids:
            self.watching[jid] = None

    def update(self) -> None:
        st = self.state
        running, jobs = st.running, st.jobs
        left = [jid for jid in self.watching if jid not in running]
        if left:
            ended = []
            for jid in left:
                del self.watching[jid]
                job = jobs.get(jid)
                if job is not None and job.state == "completed":
                    ended.append(job)
            for job in sorted(ended, key=lambda j: (j.finished_at or 0.0, j.job_id)):
                self._learn(job)
        if len(self.watching) < len(running):
            for jid in running:
                if jid not in self.watching:
                    self.watching[jid] = None

    def _learn(self, job: Job) -> None:
        self.history.learn(job)
        if self.completed is not None:
            self.completed.append(job)

    def estimate(self, job: Job, now: float) -> Estimate:
        return self.history.estimate(job, now)


def queued_at(job: Job) -> float:
    """When a pending job entered the queue: its submission, or its last requeue (the fold
    sets `held_since` when a job's GPUs go back)."""
    return job.submitted_at if job.attempt == 0 else job.held_since


class FrozenEstimates:
    """Predicted remaining GPU-seconds of pending jobs, each frozen when the job entered the
    queue (`queued_at`), from the jobs that completed strictly before that instant: so a
    job's key is a function of the log alone, the same for a long-lived index and a fresh one
    (a restarted service, `gpusched show`), and it never moves while the job waits.

    It keeps its own `RuntimeHistory`, fed from the predictor's completions (`completed`) in
    order of completion, never past the queue time of the job it is asked about: callers ask
    in order of queue time (`QueueIndex.update` sorts what it inserts). A completion appended
    with an earlier time than a queue time already answered (writers' clocks out of step) is
    learned late: the incremental answer may then differ from a fresh one by that job."""

    def __init__(self, predictor: RuntimePredictor) -> None:
        if predictor.completed is None:
            raise ValueError("FrozenEstimates reads a predictor made with record=True")
        self.predictor = predictor
        # Without batches: ordering by them was no better on the bundled week (las_predicted avg
        # JCT 17,305 s against 17,186 s by the key's median), so the ordering keeps the key's.
        self.history = RuntimeHistory(siblings=0)
        self.read = 0  # how many of `predictor.completed` are in `backlog` or learned
        self.backlog: list[tuple[float, str, Job]] = []  # completions not learned yet, a heap
        self.frozen: dict[str, tuple[float, int, float]] = {}  # job -> (queued at, attempt, GPU-s)

    def remaining_gpu_s(self, job: Job) -> float:
        """The median remaining run time of pending `job` times its gang, as of its queue time."""
        at = queued_at(job)
        hit = self.frozen.get(job.job_id)
        if hit is not None and hit[0] == at and hit[1] == job.attempt:
            return hit[2]
        done = self.predictor.completed
        assert done is not None  # checked in __init__
        backlog = self.backlog
        for j in done[self.read:]:
            heapq.heappush(backlog, (j.finished_at or 0.0, j.job_id, j))
        self.read = len(done)
        while backlog and backlog[0][0] < at:
            self.history.learn(heapq.heappop(backlog)[2])
        gpu_s = self.history.estimate(job, at).remaining_s * max(1, job.spec.gpus)
        self.frozen[job.job_id] = (at, job.attempt, gpu_s)
        return gpu_s

    def left_queue(self, job_ids) -> None:
        """Jobs that left the queue since the last look: one that was granted and has already
        completed (by another writer, between two cycles) is learned all the same, so that no
        completion in the log escapes the frozen keys."""
        p = self.predictor
        p.watch([j for j in job_ids if j not in p.watching])
        p.update()

    def forget(self, job_id: str) -> None:
        """A job left the queue for good or was granted (it is frozen afresh when requeued)."""
        self.frozen.pop(job_id, None)


def predicted_free(holders: list[Job], now: float, grace: float, borrowers: dict[str, None],
                   predictor: RuntimePredictor) -> tuple[float, float, float]:
    """When a set held by `holders` is predicted to be free: (point, low, high), absolute times.
    A job being preempted ends by its deadline, a borrower within one checkpoint grace (it
    yields on demand), any other job when its predicted run time (bounded by its time limit)
    is over. The set is free when its last holder ends."""
    point = low = high = now
    for job in holders:
        if job.preemption is not None:
            p = lo = hi = max(now, job.preemption.deadline)
        elif job.job_id in borrowers:
            p = lo = hi = now + grace
        else:
            e = predictor.estimate(job, now)
            p, lo, hi = now + e.remaining_s, now + e.low_s, now + e.high_s
        point, low, high = max(point, p), max(low, lo), max(high, hi)
    return point, low, high


__all__ = ["Estimate", "FrozenEstimates", "RuntimeHistory", "RuntimePredictor", "elapsed", "predicted_free",
           "queued_at", "run_time"]
