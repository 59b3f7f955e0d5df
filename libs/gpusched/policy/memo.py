"""The indexes a cycle keeps across cycles of one fold, owned by whoever runs the cycles.

A service or the simulator runs many cycles on one `ClusterState` that its fold moves on; the
queue order (`ordering.QueueIndex`), the running jobs (`running.RunningIndex`) and the topology
(`placement.Topology`) are each an incremental memo of that state, not state: each gives what a
full scan would. The caller makes one `Indexes` per fold and passes it to every cycle
(`cycle(state, now, config, indexes)`); a cycle without one builds its own (correct, slower).
Each index is checked against the state it was built for and rebuilt when it cannot prove it is
current (another state object, e.g. a fold that adopted a snapshot); `forget()` drops them all.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate

from ..core.model import GpuId
from ..core.state import ClusterState, Job
from .config import PolicyConfig
from .forecast import Forecast
from .ordering import QueueIndex, las_queue, queue_mode
from .placement import Topology
from .predict import RuntimePredictor
from .running import RunningIndex


class Indexes:
    """The derived indexes of one fold (see the module docstring)."""

    __slots__ = ("queues", "running_", "topology_", "tail_reasons", "predictor_", "forecast_", "pinned", "groups_",
                 "las_levels_")

    def __init__(self, tail_reasons: int | None = None) -> None:
        self.queues: dict[tuple, QueueIndex] = {}  # one per ordering mode (config knobs)
        self.running_: RunningIndex | None = None
        self.topology_: Topology | None = None
        #: At most this many changed reasons of jobs the walk did not reach per cycle (None: all).
        #: A writer that appends only so many reasons per round (placement's `--max-reasons`)
        #: sets it: a queue of 20,000 whose reasons all changed is then explained over several
        #: cycles, each costing what it can append, instead of each re-explaining the whole queue.
        self.tail_reasons = tail_reasons
        self.predictor_: RuntimePredictor | None = None
        #: The latest plan of the queue (`policy.forecast`), the ETAs between two plans.
        self.forecast_: Forecast | None = None
        self.pinned = False  # `predictor_` is another fold's, as it learned (see `for_plan`)
        self.groups_: dict[str, GpuGroups] = {}  # see `gpu_groups`
        self.las_levels_: LasLevels | None = None  # see `las_levels`

    @classmethod
    def for_plan(cls, predictor: RuntimePredictor) -> Indexes:
        """The indexes of a plan run on a copy of the state (`policy.forecast`): its run-time
        predictor is the live fold's, as learned now. The plan's simulated ends are predictions,
        not history to learn from, and relearning the history for every plan cost the week's
        simulation 17%."""
        idx = cls()
        idx.predictor_, idx.pinned = predictor, True
        return idx

    def forget(self) -> None:
        """Drop every index: the next cycle rebuilds them from its state."""
        self.queues.clear()
        self.groups_.clear()
        self.las_levels_ = None
        self.running_ = self.topology_ = self.predictor_ = self.forecast_ = None
        self.pinned = False

    def queue(self, state: ClusterState, config: PolicyConfig) -> QueueIndex:
        """The (updated) queue index of `state` for the ordering knobs of `config`."""
        mode = queue_mode(config)
        idx = self.queues.get(mode)
        if idx is None or idx.state is not state:
            predictor = self.predictor(state, record=True) if config.las and config.las_predicted else None
            idx = self.queues[mode] = QueueIndex(state, config, mode, predictor)
        elif idx.frozen is not None:
            self.predictor(state)  # learns what completed since (the index's keys read it)
        idx.update()
        return idx

    def reclaim_shares(self, state: ClusterState, config: PolicyConfig) -> dict[str, float] | None:
        """The fair shares reclaim restores under `config` (`reclaim_to="share"`, with fair
        share: `QueueIndex.fair_shares`); else None, without building or updating the index
        (every victim search and every `show` asks)."""
        if not (config.fairshare and config.reclaim_to == "share"):
            return None
        return self.queue(state, config).fair_shares()

    def running(self, state: ClusterState) -> RunningIndex:
        """The (updated) index of the running jobs of `state`."""
        idx = self.running_
        if idx is None or idx.state is not state:
            idx = self.running_ = RunningIndex(state)
        idx.update()
        return idx

    def predictor(self, state: ClusterState, record: bool = False) -> RuntimePredictor:
        """The (updated) run-time predictor of `state`: it has learned every completed job.
        `record`: it keeps the jobs it learned in order (`predict.FrozenEstimates` reads them)."""
        p = self.predictor_
        if self.pinned and p is not None and not (record and p.completed is None):
            return p
        if p is None or p.state is not state or (record and p.completed is None):
            p = self.predictor_ = RuntimePredictor(state, record=record)
        p.update()
        return p

    def started(self, job_ids: list[str]) -> None:
        """Jobs a cycle just granted: the predictor watches them (they may complete before its
        next update). A plan's predictor (`for_plan`) is the live fold's and learns nothing from
        the plan: its starts are guesses about jobs that, in the fold, still wait."""
        if self.predictor_ is not None and not self.pinned:
            self.predictor_.watch(job_ids)

    def topology(self, state: ClusterState) -> Topology:
        """The topology of `state` (nodes only ever register, never leave: a count suffices)."""
        t = self.topology_
        if t is None or t.nodes is not state.nodes or len(t.names) != len(state.nodes):
            t = self.topology_ = Topology(state)
        return t

    def gpu_groups(self, state: ClusterState, level: str) -> GpuGroups:
        """The GPUs' groups at a topology level ("node", "rack", or "block": a node's block, else
        its rack), for victim searches. Built with the topology it belongs to, and rebuilt when
        that is (a node's GPUs, rack and block never change once registered)."""
        topo = self.topology(state)
        memo = self.groups_.get(level)
        if memo is None or memo.topology is not topo:
            memo = self.groups_[level] = GpuGroups(state, topo, level)
        return memo

    def las_levels(self, state: ClusterState, now: float, config: PolicyConfig) -> LasLevels:
        """The running jobs' LAS queues at `now` (`LasLevels`), for the victim searches of the
        cycles at this instant. Kept while the state is the same object, has applied no event
        since (the fold is its only writer, and counts every event) and `now` and the queues'
        bounds are the same: a job's queue is a function of those alone."""
        memo = self.las_levels_
        key = (state.events, now, tuple(config.las_queues_gpu_s))
        if memo is None or memo.state is not state or memo.key != key:
            memo = self.las_levels_ = LasLevels(state, now, config, key)
        return memo


class LasLevels:
    """GPUs held by running jobs above each LAS level, at one instant of one state. Without
    priority classes a LAS victim search takes only jobs of a later queue than the blocked
    job's; when those hold too few GPUs the search cannot succeed, and this says so without
    walking every running job's attained service once per blocked job (tiresias: 12 million
    such tests a week, 0.3% of them passing)."""

    __slots__ = ("state", "key", "levels", "above")

    def __init__(self, state: ClusterState, now: float, config: PolicyConfig, key: tuple) -> None:
        self.state, self.key = state, key
        held = sorted((las_queue(job.attained_gpu_s(now), config), len(job.gpus))
                      for job in (state.jobs[jid] for jid in state.running))
        self.levels = [level for level, _ in held]
        self.above = list(accumulate(reversed([k for _, k in held]), initial=0))[::-1]  # above[i]: held[i:]

    def gpus_above(self, level: float) -> int:
        """GPUs held by running jobs in a queue after `level`."""
        return self.above[bisect_right(self.levels, level)]


class GpuGroups:
    """Each GPU's group at one topology level, and each running job's GPUs per group. A
    victim search counts them for every candidate, and the same few hundred running jobs are
    candidates of tens of thousands of searches a week: a lookup here costs less than walking
    GPU -> node -> rack each time. A job's counts are kept while it holds the same GPU list
    (the fold gives a job a new list whenever its GPUs change, and never edits one)."""

    __slots__ = ("state", "topology", "by_node", "of", "of_node", "_spread")

    def __init__(self, state: ClusterState, topology: Topology, level: str) -> None:
        self.state, self.topology = state, topology
        self.by_node = level == "node"  # each group is one node, named as the node
        nodes = state.nodes
        if level == "node":
            self.of_node: dict[str, object] = {name: name for name in nodes}
        elif level == "rack":
            self.of_node = {name: node.rack for name, node in nodes.items()}
        else:
            self.of_node = {name: node.block or node.rack for name, node in nodes.items()}
        self.of = {g: self.of_node[gpu.node] for g, gpu in state.gpus.items()}
        self._spread: dict[str, tuple[list[GpuId], dict[object, int]]] = {}

    def spread(self, job: Job) -> dict[object, int]:
        """The job's GPUs per group (read-only: shared by every search)."""
        memo = self._spread.get(job.job_id)
        if memo is not None and memo[0] is job.gpus:
            return memo[1]
        if len(self._spread) > max(_SPREAD_KEEP, 2 * len(self.state.running)):
            running = self.state.running  # forget the jobs that hold no GPUs now
            self._spread = {jid: m for jid, m in self._spread.items() if jid in running}
        per: dict[object, int] = {}
        for g in job.gpus:
            key = self.of[g]
            per[key] = per.get(key, 0) + 1
        self._spread[job.job_id] = (job.gpus, per)
        return per


#: Jobs whose GPU counts a `GpuGroups` keeps (or twice the running jobs, if more) before it
#: forgets those no longer running: bounded memory, amortized constant cost.
_SPREAD_KEEP = 4096


__all__ = ["GpuGroups", "Indexes", "LasLevels"]
