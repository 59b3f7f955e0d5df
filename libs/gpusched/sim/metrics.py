"""What a simulation measured, with every definition in one place.

- JCT: completion - submission. Queue time: every second a job spent pending (first wait plus
  the waits after each preemption). Sizes: "1", "2-4", "5-8", ">8" GPUs requested.
- utilization: GPU-seconds held / GPU-seconds of capacity, over the time work was waiting
  (at least one job pending): idle GPUs then are the scheduler's fault.
- locality: share of grants of multi-GPU jobs placed at the best level any placement of that
  size can reach on the cluster (NVLink domain, else node, else rack).
- jain_fairness: Jain's index over teams of x = allocated / entitled GPU-seconds, integrated
  over the busy windows. A team's entitlement at an instant is its guaranteed share (capped by
  its demand) plus a weighted water-filling share of the rest, capped by demand and hard limit;
  demand is the GPUs its unfinished jobs ask for.
- jain_shortfall: Jain's index over min(x, 1), beside jain_fairness (never instead): how evenly
  the teams short of their entitlement are short. A team given more than its entitlement counts
  as served: GPUs no other team's waiting job could use, or one whole GPU to a team entitled to
  less than one, lower jain_fairness but left no team short (issue 26).
- lost_gpu_hours: GPU time spent on work that a forced release threw away (since the last
  checkpoint). overhead_gpu_hours: GPU time spent saving and restoring checkpoints on
  preemption. gpu_hours: the trace's work (duration x GPUs).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..core.model import LEVEL_RANK, LEVELS, TeamQuota
from ..policy.fairshare import fair_shares as entitlements  # the one water-filling: the policy's fair share

if TYPE_CHECKING:
    from .world import Cluster, _Run

SIZE_BUCKETS = ("1", "2-4", "5-8", ">8")


def size_bucket(gpus: int) -> str:
    if gpus <= 1:
        return "1"
    if gpus <= 4:
        return "2-4"
    if gpus <= 8:
        return "5-8"
    return ">8"


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def jain(xs: list[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one gets everything."""
    if not xs:
        return 1.0
    s, s2 = sum(xs), sum(x * x for x in xs)
    return (s * s) / (len(xs) * s2) if s2 > 0 else 1.0


def _by_priority(runs) -> dict[str, float]:
    """Mean time waiting (all attempts) of the jobs that started, per priority class."""
    out: dict[str, list[float]] = {}
    for r in runs.values():
        if r.first_start is not None:
            out.setdefault(r.trace.priority, []).append(r.queue_s)
    return {p: _r(sum(v) / len(v)) for p, v in sorted(out.items())}

class Recorder:
    """Integrates the cluster's state over virtual time; the engine calls `step` at each time."""

    def __init__(self, cluster: Cluster, teams: list[str], quotas: dict[str, TeamQuota]):
        self.cluster = cluster
        self.capacity = cluster.total_gpus
        self.teams = list(teams)
        self.quotas = quotas
        self.demand: dict[str, int] = dict.fromkeys(self.teams, 0)
        self.last_t: float | None = None
        self.held: tuple[int, ...] = (0,) * len(self.teams)
        self.busy = False
        self.entitled: dict[str, float] = {}
        self._key: tuple | None = None
        self.busy_s = 0.0
        self.busy_held_gpu_s = 0.0
        self.alloc_gpu_s = dict.fromkeys(self.teams, 0.0)
        self.entitled_gpu_s = dict.fromkeys(self.teams, 0.0)
        self.held_gpu_s = 0.0
        #: (time, GPUs held per team) at every change, for the plots
        self.timeline: list[tuple[float, tuple[int, ...]]] = []
        #: On a mixed cluster (`--gpu-types`): pool -> team -> GPU-seconds held (sim/pools.py).
        self.pooled = bool(getattr(cluster, "models", ()))
        self.pool_gpu_s: dict[str, dict[str, float]] = {}
        self._pool_held: list[tuple[str, str, int]] = []

    def submitted(self, run: _Run) -> None:
        j = run.trace
        self.demand[j.team] = self.demand.get(j.team, 0) + (j.max_gpus or j.gpus)

    def completed(self, run: _Run) -> None:
        j = run.trace
        self.demand[j.team] -= j.max_gpus or j.gpus

    def step(self, t: float, state, runs) -> None:
        if self.last_t is not None and t > self.last_t:
            dt = t - self.last_t
            total = sum(self.held)
            self.held_gpu_s += total * dt
            if self.busy:
                self.busy_s += dt
                self.busy_held_gpu_s += total * dt
                for team, h in zip(self.teams, self.held):
                    self.alloc_gpu_s[team] += h * dt
                for team, e in self.entitled.items():
                    self.entitled_gpu_s[team] += e * dt
            for team, pool, n in self._pool_held:
                per = self.pool_gpu_s.setdefault(pool, {})
                per[team] = per.get(team, 0.0) + n * dt
        self.last_t = t
        teams = state.teams
        if self.pooled:
            self._pool_held = [(name, pool, n) for name, tu in teams.items() for pool, n in tu.pool_held.items()]
        held = tuple(teams[name].held if name in teams else 0 for name in self.teams)
        self.busy = bool(state.pending)
        if held != self.held or not self.timeline:
            self.timeline.append((t, held))
        self.held = held
        key = tuple(self.demand.get(team, 0) for team in self.teams)
        if self.busy and key != self._key:
            self._key = key
            self.entitled = entitlements(self.capacity, self.demand, self.quotas)

    def summary(self, runs: dict[str, _Run], state) -> dict:
        done = [(r, r.finish) for r in runs.values() if r.finish is not None]
        jct = [finish - r.trace.submit_s for r, finish in done]
        queue = [r.queue_s for r in runs.values() if r.first_start is not None]
        by_size: dict[str, list[float]] = {b: [] for b in SIZE_BUCKETS}
        for r in runs.values():
            if r.first_start is not None:
                by_size[size_bucket(r.trace.gpus)].append(r.queue_s)
        multi = [(g, level) for r in runs.values() for g, level, _ in r.grants if g >= 2]
        best = sum(1 for g, level in multi if LEVEL_RANK[level] <= LEVEL_RANK[self.cluster.best_level(g)])
        xs = [self.alloc_gpu_s[t] / self.entitled_gpu_s[t] for t in self.teams if self.entitled_gpu_s.get(t, 0) > 0]
        gpu_hours = sum(r.trace.gpu_s for r in runs.values()) / 3600
        lost = sum(r.lost_gpu_s for r in runs.values()) / 3600
        starts = [r.trace.submit_s for r in runs.values()]
        ends = [finish for _, finish in done]
        return {
            "jobs": len(runs),
            "completed": len(done),
            "avg_jct_s": _r(sum(jct) / len(jct)) if jct else 0.0,
            "p50_jct_s": _r(percentile(jct, 50)),
            "p99_jct_s": _r(percentile(jct, 99)),
            "avg_queue_s": _r(sum(queue) / len(queue)) if queue else 0.0,
            "avg_queue_s_by_size": {b: _r(sum(v) / len(v)) if v else 0.0 for b, v in by_size.items()},
            "avg_queue_s_by_priority": _by_priority(runs),
            "jobs_by_size": {b: len(v) for b, v in by_size.items()},
            "max_queue_s": _r(max(queue, default=0.0)),
            "utilization": _r(self.busy_held_gpu_s / (self.capacity * self.busy_s), 4) if self.busy_s else 0.0,
            "busy_s": _r(self.busy_s),
            "locality": _r(best / len(multi), 4) if multi else 1.0,
            "multi_gpu_grants": len(multi),
            "locality_levels": {lvl: n for lvl in LEVELS if (n := sum(1 for _, level in multi if level == lvl))},
            "jain_fairness": _r(jain(xs), 4),
            "jain_shortfall": _r(jain([min(x, 1.0) for x in xs]), 4),
            "team_share_ratio": {t: _r(self.alloc_gpu_s[t] / self.entitled_gpu_s[t], 4)
                                 for t in self.teams if self.entitled_gpu_s.get(t, 0) > 0},
            "preemptions": sum(j.preemptions for j in state.jobs.values()),
            "preemption_requests": sum(r.preemptions for r in runs.values()),
            "max_preemptions_of_a_job": max((j.preemptions for j in state.jobs.values()), default=0),
            "forced_releases": sum(r.forced_releases for r in runs.values()),
            "gpu_hours": _r(gpu_hours),
            "lost_gpu_hours": _r(lost),
            "lost_share": _r(lost / gpu_hours, 5) if gpu_hours else 0.0,
            "overhead_gpu_hours": _r(sum(r.overhead_gpu_s for r in runs.values()) / 3600),
            "makespan_s": _r(max(ends) - min(starts)) if ends else 0.0,
        }


#: How far ahead an estimate was said, for its error by size: (label, up to this many seconds).
ETA_SIZES = (("<5m", 300.0), ("5-30m", 1800.0), (">30m", math.inf))


def eta_error(errors: list[float], ranges: list[bool] | None = None, unscored: int = 0,
              waits: list[int] | None = None, first: list[float] | None = None,
              ahead: list[float] | None = None) -> dict:
    """How good the start estimates of `gpusched show` are. Every distinct start estimate a job
    was shown (a `JobPending` with an ETA; the same start said again with a new reason counts
    once) is one prediction, scored when the job next starts: actual start minus predicted
    start (negative: it started early); a later estimate, or a withdrawal, never replaces an
    earlier one. `ranges`: for each estimate shown as a range, whether the start fell in it.
    `unscored`: predictions of jobs that never started (cancelled, or the trace ended).
    `waits`: (starts after a `JobPending`, those of them shown an ETA before it): how many
    waits had an estimate at all (`shown_share`). `first`: the error of the first estimate of
    each wait (what a user saw first: more estimates later cannot improve it). `ahead`: per
    prediction, how far ahead it was said: the median error by that size (`median_abs_s_by_eta`)."""
    absolute = [abs(e) for e in errors]
    ranges = ranges or []
    waited, shown = waits or (0, 0)
    firsts = [abs(e) for e in first or []]
    by_size: dict[str, list[float]] = {label: [] for label, _ in ETA_SIZES}
    for a, e in zip(ahead or [], absolute):
        by_size[next(label for label, top in ETA_SIZES if a < top)].append(e)
    return {
        "unscored": unscored,
        "waits": waited,
        "shown_share": _r(shown / waited, 4) if waited else None,
        "ranges": len(ranges),
        "range_coverage": _r(sum(ranges) / len(ranges), 4) if ranges else None,
        "predictions": len(errors),
        "median_abs_s": _r(percentile(absolute, 50)) if errors else None,
        "p90_abs_s": _r(percentile(absolute, 90)) if errors else None,
        "late_share": _r(sum(1 for e in errors if e > 1e-6) / len(errors), 4) if errors else None,
        "first_median_abs_s": _r(percentile(firsts, 50)) if firsts else None,
        "first_p90_abs_s": _r(percentile(firsts, 90)) if firsts else None,
        "median_abs_s_by_eta": {label: _r(percentile(v, 50)) if v else None for label, v in by_size.items()}
        if ahead else {},
    }


def runtime_error(errors: list[tuple[float, bool]]) -> dict:
    """How good the run-time predictor is: for every job, at its first start, its actual run
    time (all attempts, at full size) minus the predicted one; `range_coverage`: the share of
    actual run times inside the predicted low..high range."""
    absolute = [abs(e) for e, _ in errors]
    return {
        "jobs": len(errors),
        "median_abs_s": _r(percentile(absolute, 50)) if errors else None,
        "p90_abs_s": _r(percentile(absolute, 90)) if errors else None,
        "under_share": _r(sum(1 for e, _ in errors if e > 1e-6) / len(errors), 4) if errors else None,
        "range_coverage": _r(sum(1 for _, c in errors if c) / len(errors), 4) if errors else None,
    }


def _r(x: float, digits: int = 1) -> float:
    return round(float(x), digits)


class GuaranteeWaits:
    """How long a team's demand within its guarantee waits for GPUs (issue 26's bound): every
    wait (a submission or a requeue) that began with the team's whole demand, what it holds plus
    the minimums of all its waiting jobs, within a non-zero guarantee, until the job's next grant.

    Beside it, per team (`shortfalls`): every stretch of time during which the team held less
    than its guarantee while one of its waiting jobs would have fit within it (held + the job's
    minimum <= guaranteed), from its start to the first instant that was no longer so. A job's
    wait counts its own place in its team's queue; a shortfall only what the team is owed."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.waiting: dict[str, int] = {}  # team -> minimums of its waiting jobs
        self.sizes: dict[str, dict[int, int]] = {}  # team -> waiting jobs' minimum -> how many
        self.short_since: dict[str, float] = {}  # team -> when its open shortfall began
        self.shortfalls: list[float] = []

    @staticmethod
    def _need(run: _Run) -> int:
        j = run.trace
        return j.min_gpus or j.max_gpus or j.gpus

    def begin(self, run: _Run, state, t: float) -> None:
        name = run.trace.team
        team = state.teams.get(name)
        need = self._need(run)
        waiting = self.waiting[name] = self.waiting.get(name, 0) + need
        sizes = self.sizes.setdefault(name, {})
        sizes[need] = sizes.get(need, 0) + 1
        g = team.quota.guaranteed if team is not None else 0
        run.entitled_since = t if 0 < g and team.held + waiting <= g else None

    def granted(self, run: _Run, t: float) -> None:
        need = self._need(run)
        self.waiting[run.trace.team] -= need
        sizes = self.sizes[run.trace.team]
        sizes[need] -= 1
        if not sizes[need]:
            del sizes[need]
        if run.entitled_since is not None:
            self.waits.append(t - run.entitled_since)
            run.entitled_since = None

    def observe(self, state, t: float) -> None:
        """At each change of holdings or queue: open or close each team's shortfall."""
        for name, sizes in self.sizes.items():
            team = state.teams.get(name)
            g = team.quota.guaranteed if team is not None else 0
            short = 0 < g and bool(sizes) and team.held + min(sizes) <= g
            since = self.short_since.get(name)
            if short and since is None:
                self.short_since[name] = t
            elif not short and since is not None:
                self.shortfalls.append(t - self.short_since.pop(name))

    def summary(self, runs, now: float) -> dict:
        """Waits still open at the end count with their length so far (`unserved`); so do
        shortfalls (`team_shortfall`)."""
        open_waits = [now - r.entitled_since for r in runs if r.entitled_since is not None and r.mode == "pending"]
        waits = self.waits + open_waits
        short = self.shortfalls + [now - since for since in self.short_since.values()]
        return {"waits": len(waits), "unserved": len(open_waits), "p50_s": _r(percentile(waits, 50)),
                "p99_s": _r(percentile(waits, 99)), "max_s": _r(max(waits, default=0.0)),
                "team_shortfall": {"count": len(short), "p99_s": _r(percentile(short, 99)),
                                   "max_s": _r(max(short, default=0.0))}}
