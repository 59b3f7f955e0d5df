"""When each waiting job should start: a plan of the whole queue, made by running the policy's
own cycle forward on a copy of the state.

Why a plan: the start of a waiting job depends less on when the GPUs it needs free up than on
who else takes them first (another job becomes the head, a reclaim or a LAS preemption starts
it). So the forecast copies the jobs that matter (pending and running), and plays the world
forward with `cycle.cycle` under the same config, with no new arrivals: each running job ends
when the run-time predictor (`policy/predict.py`, learned from completed jobs, never the true
run time) says, at its median; a job asked to yield gives its GPUs back by its deadline; the
policy is also called when a preemptible job's `min_runtime_s` protection ends; a job
the plan starts ends after its own predicted run time. The first grant of each waiting job in
the plan is its forecast start, and the range around it is the low..high quantiles of the
predicted end of the job whose end let it start (the trigger), shifted by as much.

Bounded: at most `max_cycles` cycles and `horizon_s` of plan time; jobs the plan did not start
by then get no ETA (nothing is said rather than a guess). Pure and deterministic: a function of
the state, `now`, the config and the predictor's history (no clock, no random).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

import msgspec
from msgspec import Struct

from ..core import events as ev
from ..core.state import ClusterState, Job, stale_live
from .config import PolicyConfig
from .predict import RuntimePredictor


class Start(Struct, frozen=True, array_like=True):
    """A waiting job's forecast start (absolute times): the point and its low..high range."""

    at: float
    low: float
    high: float


class Forecast(Struct):
    """One plan of the queue, made at `made_at`: the forecast start of every waiting job it
    started (`starts`), how many cycles it ran, and whether it ran out of its bounds."""

    made_at: float
    first: list[str]  # the waiting jobs it planned (the first of the queue, in order)
    starts: dict[str, Start]
    cycles: int
    complete: bool  # every waiting job got a start within the bounds
    pending: int  # waiting jobs when it was made
    running: int  # running jobs when it was made


def fork(state: ClusterState, pending: list[str]) -> ClusterState:
    """A copy of what a cycle reads, for the plan to fold its own events into: nodes, GPUs,
    teams, the running jobs and the waiting jobs `pending` (plus their dependencies); finished
    jobs and the rest of the queue are left out (the plan is bounded in jobs: the first of
    the queue).

    Copied as deep as the fold writes: it edits the records of jobs, GPUs, nodes and teams
    (attributes), a node's free set, the sets of jobs live per node and the state's own maps
    and lists, each of which is copied; everything a job record holds (its spec, GPU list,
    checkpoints, processes, ...) the fold replaces whole, never edits, so the copies share it.
    (A deep copy through msgpack was about 6% of the week's simulation under `full`.)"""
    keep = dict.fromkeys(pending) | dict.fromkeys(state.running)
    for jid in pending:
        for d in state.jobs[jid].spec.dependency:
            if d.job in state.jobs:
                keep[d.job] = None
    replace = msgspec.structs.replace
    own = {
        "nodes": {name: replace(node, free=dict(node.free)) for name, node in state.nodes.items()},
        "gpus": {g: replace(gpu) for g, gpu in state.gpus.items()},
        "jobs": {jid: replace(state.jobs[jid]) for jid in keep},
        "teams": {name: replace(team) for name, team in state.teams.items()},
        "node_live": {name: dict(jobs) for name, jobs in state.node_live.items()},
        "pending": {jid: None for jid in state.pending if jid in keep},  # in submission order
        "requests": {}, "broken": [],
        "retired": replace(state.retired, runs=list(state.retired.runs), other=dict(state.retired.other)),
    }
    fresh = {name: value.copy() for name in state.__struct_fields__
             if name not in own and isinstance(value := getattr(state, name), (dict, list))}
    return replace(state, **own, **fresh)


Cycle = Callable[[ClusterState, float, PolicyConfig], list[ev.Event]]


class _World:
    """The forecast's world: predicted ends of running jobs, deadlines of yielding ones."""

    def __init__(self, st: ClusterState, predictor: RuntimePredictor) -> None:
        self.st, self.predictor = st, predictor
        self.heap: list[tuple[float, int, str, int, float, float]] = []  # (at, kind, job, attempt, low, high)

    def ends(self, job: Job, now: float) -> None:
        """Plan the end of a running job (kind 0) at its predicted run time."""
        e = self.predictor.estimate(job, now)
        heapq.heappush(self.heap, (now + max(0.0, e.remaining_s), 0, job.job_id, job.attempt,
                                   now + max(0.0, e.low_s), now + max(0.0, e.high_s)))

    def wake(self, at: float, job: Job) -> None:
        """Call the policy at a preemption deadline (kind 1: it releases the job then)."""
        heapq.heappush(self.heap, (at, 1, job.job_id, job.attempt, at, at))

    def react(self, events: list[ev.Event], t: float, pending: dict[str, None],
              starts: dict[str, Start], trigger: tuple[float, float, float]) -> None:
        st = self.st
        for e in events:
            st.apply(e)
            if isinstance(e, ev.GpusGranted):
                job = st.jobs[e.job_id]
                if e.job_id in pending and e.job_id not in starts:
                    point, low, high = trigger
                    starts[e.job_id] = Start(t, max(t - (point - low), 0.0), t + (high - point))
                self.ends(job, t)
            elif isinstance(e, ev.PreemptionRequested):
                self.wake(max(t, e.deadline), st.jobs[e.job_id])
            elif isinstance(e, ev.JobResized) and e.job_id in st.running:
                self.ends(st.jobs[e.job_id], t)

    def advance(self) -> tuple[float, tuple[float, float, float]] | None:
        """Play the world up to the next planned end or wake: the time, and the end's range."""
        st = self.st
        while self.heap:
            at, kind, jid, attempt, low, high = heapq.heappop(self.heap)
            job = st.jobs.get(jid)
            if job is None or job.attempt != attempt or not job.holding:
                continue  # planned before the job's situation changed
            if kind == 1:
                return at, (at, at, at)
            st.apply(ev.JobCompleted(at=at, job_id=jid, attempt=attempt))
            for x in stale_live(job):
                st.apply(ev.ProcessesEnded(at=at, job_id=jid, attempt=x.attempt, node=x.node,
                                           generation=x.generation, reason="forecast"))
            return at, (at, low, high)
        return None


def _unprotected_at(job: Job, now: float, config: PolicyConfig) -> list[float]:
    """When a preemptible running job may first be preempted (its `min_runtime_s` run, and its
    back-off across teams): the plan calls the policy then, as the live timer does, or a job
    waiting out that protection would get no start."""
    if not (config.preemption and job.spec.preemptible) or job.started_at is None:
        return []
    run = config.min_runtime_s
    runs = {run}
    if config.preempt_backoff_max_s is not None:
        runs.add(min(max(run, config.preempt_backoff_max_s), run * 2 ** min(job.preemptions, 32)))
    return sorted(at for r in runs if (at := job.started_at + r) > now)


def forecast(state: ClusterState, now: float, config: PolicyConfig, predictor: RuntimePredictor,
             cycle: Cycle, first: list[str], prelude: Sequence[ev.Event] = (), max_cycles: int = 64,
             horizon_s: float = 7 * 24 * 3600.0) -> Forecast:
    """Plan the waiting jobs `first` (the head of the queue, in the policy's order) from `now`
    (see the module docstring), after the events `prelude` (the deciding cycle's own, so that
    the plan starts where that cycle leaves the state). `cycle`: the policy's cycle on a fresh
    `Indexes`, passed in to keep the import graph acyclic; `config` must not ask for a forecast
    itself."""
    granted = [e.job_id for e in prelude if isinstance(e, ev.GpusGranted)]
    st = fork(state, [*first, *(j for j in granted if j in state.pending)])
    pending = dict.fromkeys(j for j in first if j in st.pending)
    world = _World(st, predictor)
    for jid in st.running:
        job = st.jobs[jid]
        if job.preemption is not None:
            world.wake(max(now, job.preemption.deadline), job)
        else:
            world.ends(job, now)
            for at in _unprotected_at(job, now, config):
                world.wake(at, job)
    starts: dict[str, Start] = {}
    t, trigger, cycles = now, (now, now, now), 0
    world.react(list(prelude), t, pending, starts, trigger)
    while cycles < max_cycles:
        cycles += 1
        world.react(cycle(st, t, config), t, pending, starts, trigger)
        if len(starts) == len(pending):
            break
        nxt = world.advance()
        if nxt is None or nxt[0] - now > horizon_s or not math.isfinite(nxt[0]):
            break
        t, trigger = nxt
        while world.heap and world.heap[0][0] == t:  # ends at the same instant: one cycle for all
            more = world.advance()
            if more is None:
                break
    return Forecast(made_at=now, first=list(pending), starts=starts, cycles=cycles, complete=len(starts) == len(pending),
                    pending=len(pending), running=len(state.running))


__all__ = ["Forecast", "Start", "fork", "forecast"]
