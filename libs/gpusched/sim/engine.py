"""The trace simulator: the real fold and the real policies, driven by a virtual clock.

The simulator plays the node daemons and the world. It appends `NodeRegistered` and
`TeamQuotaSet`, then `JobSubmitted` at trace times, `JobStarted` right after a grant,
`CheckpointSaved` (periodically, and on a preemption request when the policy has
`checkpoint`, after which the job idles until the policy releases it), and `JobCompleted`
when a job's work is done. It also plays the reconciler for jobs whose trace gives a
utilization under the policy's `idle_util_pct`: `JobIdle` `idle_after_s` after each start.
Everything else (grants, resizes, preemptions, forced releases) comes from
`policy.cycle.cycle(state, now, config)`, exactly as the placement service would append it.

The loop keeps a heap of future world events. At each distinct time it applies the events
due, then calls the policy only if something changed (or a preemption deadline or the tick
came due), and applies what it returns. Every event goes through `ClusterState.apply`, and a
broken invariant aborts the run naming the event that broke it.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable

import msgspec

from ..accounting import Ledger, gpu_hours_by_team
from ..core import events as ev
from ..core.model import DEFAULT_HALF_LIFE_S, JobSpec, TeamQuota, TopologyConstraint
from ..core.pools import canonical_model
from ..core.state import ClusterState, Violation, stale_live
from ..policy.config import PolicyConfig
from ..policy.predict import Estimate, RuntimePredictor, run_time
from .metrics import GuaranteeWaits, Recorder, eta_error, runtime_error
from .pools import pool_summary
from .runtime_model import REALISTIC, RuntimeModel
from .traces import TraceJob
from .world import Cluster, _Run, default_quotas  # noqa: F401  (re-exported: the simulator's API)

#: How trace jobs (which carry no placement constraints) map to `JobSpec.topology`.
TOPOLOGY_MAPPINGS = ("pack", "any")
#: How a job asking for a share of one GPU (`TraceJob.gpu_milli`) runs: as a fractional job
#: (`honour`), or on a whole GPU (`round`: gpusched before fractional GPUs, docs/gpu-sharing.md).
FRACTIONS = ("honour", "round")
_ONE_NODE = TopologyConstraint(required="node", preferred="nvlink")
_ANYWHERE = TopologyConstraint(required="cluster", preferred="nvlink")

# Kinds of world events, in the order they run when due at the same time.
_COMPLETE, _YIELD, _CHECKPOINT, _SUBMIT, _WAKE, _IDLE, _AGE = range(7)


class SimStalled(RuntimeError):
    """The policy keeps deciding at one virtual instant without time moving on (a livelock)."""


class SimViolation(RuntimeError):
    """An event broke an invariant of the README (Invariants); the run stops there."""

    def __init__(self, event: ev.Event, violations: list[Violation]):
        self.event, self.violations = event, violations
        detail = "; ".join(f"{v.rule}: {v.detail}" for v in violations)
        super().__init__(f"invariant broken at t={event.at:.0f}s by {event.kind} {_describe(event)}: {detail}")


def as_asked(jobs: list[TraceJob], fractions: str) -> list[TraceJob]:
    """The trace's jobs as `fractions` runs them (see `FRACTIONS`)."""
    if fractions not in FRACTIONS:
        raise ValueError(f"unknown fractions mode {fractions!r}; expected {', '.join(FRACTIONS)}")
    if fractions == "honour":
        return jobs
    return [msgspec.structs.replace(j, gpu_milli=1000) if j.fraction is not None else j for j in jobs]


def sharing_summary(jobs: list[TraceJob], fractions: str) -> dict:
    return {"fractions": fractions, "fractional_jobs": sum(1 for j in jobs if j.fraction is not None)}


def _same_estimate(a: tuple, b: tuple) -> bool:
    """The same start (and range) said again, e.g. with a new reason: one estimate, scored once.
    (The ETA is said rounded to the millisecond, so the absolute times match to about that.)"""
    return all((x is None) == (y is None) and (x is None or abs(x - y) < 0.01) for x, y in zip(a[:3], b[:3]))


def _describe(event: ev.Event) -> str:
    job = getattr(event, "job_id", None)
    return f"(job {job})" if job else ""


class Simulation:
    """One run of a trace on a cluster under one policy configuration."""

    def __init__(
        self,
        jobs: list[TraceJob],
        cluster: Cluster,
        config: PolicyConfig,
        runtime: RuntimeModel = REALISTIC,
        *,
        quotas: dict[str, TeamQuota] | None = None,
        cycle: Callable | None = None,
        policy_name: str = "",
        tick_s: float | None = None,
        cycle_cap: int = 4,
        topology: str = "pack",
        stall_cycles: int = 1000, fractions: str = "honour",
        job_types: dict[str, tuple[str, ...]] | None = None,
    ):
        if cycle is None:
            from ..policy.cycle import cycle as policy_cycle
            from ..policy.memo import Indexes

            indexes = Indexes()  # the simulator's indexes of its fold, kept across cycles
            cycle = lambda state, now, config: policy_cycle(state, now, config, indexes)  # noqa: E731
        self.cycle = cycle
        self.cluster, self.config, self.runtime = cluster, config, runtime
        self.policy_name = policy_name
        self.tick_s = tick_s
        if topology not in TOPOLOGY_MAPPINGS:
            raise ValueError(f"unknown topology mapping {topology!r}; expected {', '.join(TOPOLOGY_MAPPINGS)}")
        self.topology = topology
        self.cycle_cap = cycle_cap
        self.job_types = job_types or {}  # job -> the GPU types it accepts, in order (sim/pools.py)
        self.pool_waits: dict[str, list[float]] = {}  # pool -> the waits of the grants there
        self.stall_cycles = stall_cycles
        total, jobs, self.fractions = cluster.total_gpus, as_asked(jobs, fractions), fractions
        self.skipped = [j for j in jobs if (j.min_gpus or j.gpus) > total]
        self.jobs = [j for j in jobs if (j.min_gpus or j.gpus) <= total]
        self.quotas = quotas if quotas is not None else default_quotas(self.jobs, total)
        half_life = getattr(config, "half_life_s", DEFAULT_HALF_LIFE_S)
        self.state = ClusterState(half_life_s=half_life)
        self.checkpoint_on_request = bool(getattr(config, "checkpoint", True))
        teams = sorted({j.team for j in self.jobs} | set(self.quotas))
        self.rec = Recorder(cluster, teams, self.quotas)
        self.ledger = Ledger()  # the same accounting as `gpusched history`
        self.runs: dict[str, _Run] = {}
        self._heap: list[tuple[float, int, int, str, int]] = []
        self._seq = 0
        self.now = 0.0
        self.cycles = 0
        self._eta: dict[str, list[tuple[float, float | None, float | None, float]]] = {}  # job -> every
        # distinct start the policy predicted (JobPending.eta_s), with its range if it gave one
        # (absolute times), and the ETA as said (seconds ahead)
        self.eta_errors: list[float] = []  # actual start - predicted start, for every prediction made
        self.guarantee_waits = GuaranteeWaits()
        #: How long after a job enters the queue the policy's fairness may decide otherwise.
        self._ages = [x for x in (config.fair_owed_after_s, config.starve_after_s, config.reserve_after_s) if x is not None]
        self.eta_ahead: list[float] = []  # per prediction: how far ahead it was said (its eta_s)
        self.eta_first: list[float] = []  # actual - predicted start of the first estimate of each wait
        self.eta_ranges: list[bool] = []  # per prediction with a range: the start fell in it
        self._waited: dict[str, None] = {}  # jobs told why they wait (a JobPending) since their last grant
        self.eta_waits = [0, 0]  # starts after a JobPending: all, and those shown an ETA before
        # The run-time predictor's own error: at each job's first start, what it predicted
        # (learned from the jobs completed so far: the same fold the policy reads).
        self.predictor = RuntimePredictor(self.state)
        self._predicted: dict[str, Estimate] = {}
        self.runtime_errors: list[tuple[float, bool]] = []  # (actual - predicted run time, in range)
        self.wall_s = 0.0
        self._dirty = False
        self._last_decided: deque[list[ev.Event]] = deque(maxlen=4)
        self.idle_reports = 0

    # --- the log --------------------------------------------------------------------------

    def _apply(self, event: ev.Event) -> None:
        broken = len(self.state.broken)
        self.state.apply(event, stored_at=self.now)  # the log's clock is the simulator's, as the server's live
        self.ledger.observe(self.state, event)
        if len(self.state.broken) > broken:
            raise SimViolation(event, self.state.broken[broken:])
        job = self.state.jobs.get(getattr(event, "job_id", ""))
        if job is not None and job.live and not isinstance(event, ev.ProcessesEnded):
            for x in stale_live(job):  # simulated processes end the moment they are stopped
                self._apply(ev.ProcessesEnded(at=event.at, job_id=job.job_id, attempt=x.attempt, node=x.node,
                                              generation=x.generation, reason="simulated"))

    def _push(self, t: float, kind: int, job_id: str = "", epoch: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, job_id, epoch))

    # --- the run --------------------------------------------------------------------------

    def run(self) -> dict:
        started = time.perf_counter()
        for e in self.cluster.registrations():
            self._apply(e)
        for team, quota in sorted(self.quotas.items()):
            self._apply(ev.TeamQuotaSet(at=0.0, team=team, quota=quota))
        for j in self.jobs:
            self.runs[j.job_id] = _Run(j, j.duration_s, j.duration_s)
            self._push(j.submit_s, _SUBMIT, j.job_id)
        self._submits_left = len(self.jobs)
        heap = self._heap
        last_mark = None
        instant, instant_cycles = -1.0, 0
        while heap:
            t = heap[0][0]
            if t != instant:
                instant, instant_cycles = t, self.cycles
            elif self.cycles - instant_cycles > self.stall_cycles:
                raise SimStalled(f"policy livelock at t={t:.0f}s: {self.cycles - instant_cycles} cycles without "
                                 f"time moving on; the last cycles decided: "
                                 + " | ".join("; ".join(f"{e.kind} {_describe(e)}" for e in d
                                                        if not isinstance(e, ev.JobPending))
                                              for d in self._last_decided))
            self.now = t
            while heap and heap[0][0] == t:
                _, kind, _, job_id, epoch = heapq.heappop(heap)
                self._world(kind, job_id, epoch, t)
            rounds = 0
            while self._dirty and rounds < self.cycle_cap:
                self._dirty = False
                rounds += 1
                self._schedule(t)
            if self._dirty:  # still releasing after `cycle_cap` rounds: decide again at this instant
                self._dirty = False
                self._push(t, _WAKE)
            mark = (self.state.last_alloc_seq, self._submits_left)
            if mark != last_mark:  # holdings, queue or demand changed: integrate up to now
                last_mark = mark
                self.rec.step(t, self.state, self.runs)
                self.guarantee_waits.observe(self.state, t)
            if (self.tick_s and self.state.pending and (self.state.running or self._submits_left)
                    and not (heap and heap[0][0] <= t + self.tick_s)):
                self._push(t + self.tick_s, _WAKE)  # time-driven decisions (aging, decay)
        self.wall_s = time.perf_counter() - started
        return self.summary()

    def _world(self, kind: int, job_id: str, epoch: int, t: float) -> None:
        if kind == _WAKE:
            self._dirty = True
            return
        run = self.runs[job_id]
        if kind == _SUBMIT:
            self._submit(run, t)
        elif kind == _IDLE:  # epoch: the attempt the idle evidence is about
            self._idle(run, epoch, t)
        elif epoch != run.epoch:
            return  # planned before the job's situation changed
        elif kind == _COMPLETE:
            self._complete(run, t)
        elif kind == _CHECKPOINT:
            self._checkpoint(run, t)
            self._next_checkpoint(run, t)
        elif kind == _YIELD:  # checkpoint written: the policy's next cycle releases the GPUs
            self._checkpoint(run, t)
            self._dirty = True
        elif kind == _AGE:  # still waiting: its team may be owed now, or the job may lead its team
            self._dirty = run.mode == "pending" or self._dirty

    def _schedule(self, t: float) -> None:
        """One policy cycle: apply its decisions in order, then play the world's reaction."""
        self.cycles += 1
        decided = self.cycle(self.state, t, self.config)
        self._last_decided.append(decided)
        started: list[str] = []
        for e in decided:
            self._apply(e)
            self._react(e, t, started)
        self._start(started, t)

    def _shown(self, e: ev.GpusGranted, t: float) -> None:
        """Score the start estimates shown for a job that starts now, and predict its run time."""
        shown = self._eta.pop(e.job_id, ())
        if e.job_id in self._waited:
            del self._waited[e.job_id]
            self.eta_waits[0] += 1
            self.eta_waits[1] += bool(shown)
        for predicted, low, high, ahead in shown:
            self.eta_errors.append(t - predicted)
            self.eta_ahead.append(ahead)
            if low is not None and high is not None:
                self.eta_ranges.append(low - 1e-6 <= t <= high + 1e-6)
        if shown:
            self.eta_first.append(t - shown[0][0])
        if e.attempt == 1:
            self.predictor.update()
            self._predicted[e.job_id] = self.predictor.estimate(self.state.jobs[e.job_id], t)
            self.predictor.watch([e.job_id])

    def _react(self, e: ev.Event, t: float, started: list[str]) -> None:
        """The world's reaction to one decision already in the fold (`started`: jobs granted)."""
        if isinstance(e, ev.GpusGranted):
            started.append(e.job_id)
            self._granted(self.runs[e.job_id], e, t)
            self._shown(e, t)
        elif isinstance(e, ev.JobPending):
            self._waited[e.job_id] = None
            if e.eta_s is not None:  # a later withdrawal ("ETA unknown") does not excuse what a user was shown
                low = None if e.eta_low_s is None else e.at + e.eta_low_s
                high = None if e.eta_high_s is None else e.at + e.eta_high_s
                shown = self._eta.setdefault(e.job_id, [])
                if not shown or not _same_estimate(shown[-1], (e.at + e.eta_s, low, high)):
                    shown.append((e.at + e.eta_s, low, high, e.eta_s))
        elif isinstance(e, ev.JobResized):
            self._resized(self.runs[e.job_id], e, t)
        elif isinstance(e, ev.PreemptionRequested):
            self._preempt_requested(self.runs[e.job_id], e, t)
        elif isinstance(e, ev.GpusReleased):
            self._dirty = True  # freed GPUs: decide again at once
            self._stopped(self.runs[e.job_id], t, forced=e.forced)
        elif isinstance(e, ev.JobTimedOut):  # past its time limit: killed
            self._timed_out(self.runs[e.job_id], t)
        elif isinstance(e, ev.JobFailed):  # past its time limit (or idle timeout): processes killed
            self._timed_out(self.runs[e.job_id], t, idle=e.reason.startswith("idle timeout"))

    def _start(self, started: list[str], t: float) -> None:
        """The node daemons start the processes of the jobs just granted."""
        for job_id in started:
            job = self.state.jobs[job_id]
            for node in dict.fromkeys(g.rpartition("/")[0] for g in job.gpus):
                self._apply(ev.JobStarted(at=t, job_id=job_id, attempt=job.attempt, node=node))

    # --- the world's reactions ------------------------------------------------------------

    def _submit(self, run: _Run, t: float) -> None:
        j = run.trace
        types = self.job_types.get(j.job_id, ())
        spec = JobSpec(team=j.team, gpus=j.max_gpus or j.gpus, min_gpus=j.min_gpus, priority=j.priority,
                       preemptible=j.preemptible, time_limit_s=j.time_limit_s, name=j.job_id, cpus=j.cpus,
                       topology=self._constraint(j.max_gpus or j.gpus), gpu_fraction=j.fraction, memory_mb=j.memory_mb,
                       gpu_type=types[0] if types else None, gpu_type_fallback=list(types[1:]))
        self._apply(ev.JobSubmitted(at=t, job_id=j.job_id, spec=spec, request_id=f"sim-{j.job_id}"))
        self._wait_from(run, t)
        self._submits_left -= 1
        self.rec.submitted(run)
        self._dirty = True

    def _constraint(self, gpus: int) -> TopologyConstraint:
        """`pack`: a job that fits on one node must run on one node (one pod per node, as on
        Kubernetes; Philly too kept such jobs on one server); `any`: only a preference."""
        if self.topology == "pack" and gpus <= self.cluster.gpus_per_node:
            return _ONE_NODE
        return _ANYWHERE

    def _advance(self, run: _Run, t: float) -> None:
        if run.mode == "running":
            start = max(run.since, run.resume_at)
            if t > start:
                run.remaining = max(0.0, run.remaining - run.rate * (t - start))
        run.since = t

    def _plan(self, run: _Run, t: float) -> None:
        """(Re)schedule the completion and the next periodic checkpoint of a running job."""
        run.epoch += 1
        begin = max(t, run.resume_at)
        run.done_at = begin + run.remaining / run.rate if run.rate > 0 else math.inf
        if run.done_at < math.inf:
            self._push(run.done_at, _COMPLETE, run.trace.job_id, run.epoch)
        self._next_checkpoint(run, t)

    def _next_checkpoint(self, run: _Run, t: float) -> None:
        interval = self.runtime.checkpoint_interval_s
        if interval > 0:
            nxt = max(run.ckpt_at, run.resume_at) + interval
            if nxt < run.done_at:
                self._push(max(nxt, t), _CHECKPOINT, run.trace.job_id, run.epoch)

    def _wait_from(self, run: _Run, t: float) -> None:
        run.pending_since = t
        self.guarantee_waits.begin(run, self.state, t)
        for after in self._ages:  # the policy's time-driven rules of fairness (`QueueIndex.owed`, `starving`)
            self._push(t + after, _AGE, run.trace.job_id, run.epoch)

    def _granted(self, run: _Run, e: ev.GpusGranted, t: float) -> None:
        if self.cluster.models:
            self.pool_waits.setdefault(canonical_model(self.state.gpus[e.gpus[0]].model), []).append(t - run.pending_since)
        run.queue_s += t - run.pending_since
        self.guarantee_waits.granted(run, t)
        if run.first_start is None:
            run.first_start = t
        level = self.state.span(e.gpus)
        run.held = len(e.gpus)
        run.rate = self.runtime.speed(run.held, run.trace.gpus, level)
        run.grants.append((run.held, level, self.runtime.slowdown.get(level, 1.0)))
        restore = self.runtime.restore_s if run.resumed else 0.0
        run.overhead_gpu_s += restore * run.held
        run.resume_at, run.since, run.ckpt_at, run.mode = t + restore, t, t, "running"
        self._plan(run, t)
        if run.trace.time_limit_s is not None:  # the policy ends an overrunning job then
            self._push(t + run.trace.time_limit_s, _WAKE)
        util = run.trace.util_pct
        if util is not None and util < getattr(self.config, "idle_util_pct", 0.0):
            self._push(t + self.config.idle_after_s, _IDLE, run.trace.job_id, e.attempt)

    def _idle(self, run: _Run, attempt: int, t: float) -> None:
        """The simulated reconciler: the attempt's GPUs stayed under the threshold since its start."""
        job = self.state.jobs[run.trace.job_id]
        if job.state != "running" or job.attempt != attempt or job.idle is not None:
            return
        cfg = self.config
        util = run.trace.util_pct or 0.0
        self.idle_reports += 1
        self._apply(ev.JobIdle(at=t, job_id=job.job_id, attempt=attempt, since=t - cfg.idle_after_s,
                               window_s=cfg.idle_after_s, threshold_pct=cfg.idle_util_pct, util_pct=util,
                               util_pct_max=util))
        limit = cfg.idle_timeout_s.get(job.spec.priority)
        if limit is not None:  # the policy acts then
            self._push(max(t, t - cfg.idle_after_s + limit), _WAKE)

    def _resized(self, run: _Run, e: ev.JobResized, t: float) -> None:
        self._advance(run, t)
        job = self.state.jobs[e.job_id]
        run.held = len(job.gpus)
        run.rate = self.runtime.speed(run.held, run.trace.gpus, self.state.span(job.gpus)) if job.gpus else 0.0
        if run.mode == "running":
            self._plan(run, t)

    def _preempt_requested(self, run: _Run, e: ev.PreemptionRequested, t: float) -> None:
        run.preemptions += 1
        self._push(max(e.deadline, t), _WAKE)  # the policy releases overdue jobs: call it then
        if not self.checkpoint_on_request or run.mode != "running":
            return
        self._advance(run, t)
        run.mode = "yielding"  # progress pauses while the checkpoint is written
        run.overhead_gpu_s += self.runtime.checkpoint_s * run.held
        run.epoch += 1
        self._push(t + self.runtime.checkpoint_s, _YIELD, run.trace.job_id, run.epoch)

    def _checkpoint(self, run: _Run, t: float) -> None:
        self._advance(run, t)
        run.saved, run.ckpt_at = run.remaining, t
        job = self.state.jobs[run.trace.job_id]
        step = int(run.trace.duration_s - run.remaining)
        self._apply(ev.CheckpointSaved(at=t, job_id=run.trace.job_id, attempt=job.attempt,
                                       path=f"sim://{run.trace.job_id}/{step}", step=step))

    def _stopped(self, run: _Run, t: float, forced: bool) -> None:
        """The job's GPUs were released: it goes back to the queue from its checkpoint."""
        if run.mode in ("pending", "done"):
            return
        rate = run.rate
        self._advance(run, t)
        if self.runtime.lossless:
            run.saved = run.remaining
        elif run.saved > run.remaining and rate > 0:  # GPU time spent on the work now lost
            run.lost_gpu_s += run.held * (run.saved - run.remaining) / rate
        run.forced_releases += forced
        run.remaining = run.saved
        run.mode, run.held, run.rate, run.resumed = "pending", 0, 0.0, True
        run.epoch += 1
        self._wait_from(run, t)
        self._dirty = True

    def _timed_out(self, run: _Run, t: float, idle: bool = False) -> None:
        self._advance(run, t)
        run.mode, run.finish, run.held = "done", t, 0
        run.timed_out, run.idle_ended = not idle, idle
        run.epoch += 1
        self.rec.completed(run)
        self._dirty = True

    def _complete(self, run: _Run, t: float) -> None:
        job = self.state.jobs[run.trace.job_id]
        self._apply(ev.JobCompleted(at=t, job_id=run.trace.job_id, attempt=job.attempt))
        guess = self._predicted.pop(run.trace.job_id, None)
        if guess is not None:
            actual = run_time(job)
            self.runtime_errors.append((actual - guess.remaining_s, guess.low_s <= actual <= guess.high_s))
        run.remaining, run.mode, run.finish, run.held = 0.0, "done", t, 0
        run.epoch += 1
        self.rec.completed(run)
        self._dirty = True

    # --- results --------------------------------------------------------------------------

    def summary(self) -> dict:
        out = self.rec.summary(self.runs, self.state)
        out.update({
            "policy": self.policy_name,
            "cluster": str(self.cluster),
            "gpus": self.cluster.total_gpus,
            "runtime_model": self.runtime.name, **sharing_summary(self.jobs, self.fractions),
            "skipped_too_large": len(self.skipped),
            "unfinished": sum(1 for r in self.runs.values() if r.mode != "done"),
            "events": self.state.events,
            "cycles": self.cycles,
            "eta_error": eta_error(self.eta_errors, self.eta_ranges, unscored=sum(map(len, self._eta.values())),
                                   waits=self.eta_waits, first=self.eta_first, ahead=self.eta_ahead),
            "runtime_prediction": runtime_error(self.runtime_errors),
            "timed_out": sum(1 for r in self.runs.values() if r.timed_out),
            "guarantee_wait": self.guarantee_waits.summary(self.runs.values(), self.state.now),
            **used_vs_held(self),
            "sim_wall_s": round(self.wall_s, 3),
            "gpu_hours_by_team": gpu_hours_by_team(self.ledger, self.state.now),
        })
        if self.cluster.models:
            out["pools"] = pool_summary(self.state, self.rec.pool_gpu_s, self.pool_waits, self.state.now)
        return out


def used_vs_held(sim: Simulation) -> dict:
    """GPU-hours held and busy (not idle) from the fold, and what the idle timeout did (outside
    the class for its size)."""
    st = sim.state
    held = busy = 0.0
    for team in st.teams:
        h, b = st.team_gpu_seconds(team)
        held, busy = held + h, busy + b
    return {
        "gpu_hours_held": round(held / 3600, 3),
        "gpu_hours_busy": round(busy / 3600, 3),
        "held_efficiency": round(busy / held, 4) if held else 1.0,
        "idle_reports": sim.idle_reports,
        "idle_requeues": sum(j.idle_requeues for j in st.jobs.values()),
        "idle_ended": sum(1 for r in sim.runs.values() if r.idle_ended),
    }
