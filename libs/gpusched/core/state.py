"""The fold: `ClusterState.apply(event)` is the only writer of scheduler state.

Pure and deterministic: no clock (time is the events' `at`), no I/O, no hash-ordered
iteration. An illegal event is still applied as far as it safely can be, and the broken
invariant is recorded in `violations` so that an audit replay names it instead of crashing.

`ClusterState` keeps the data, `apply` with its one dispatch table (`_HANDLERS`), and the
queries; the reducers `apply` dispatches to live by concern in `core/fold/` (jobs, nodes,
teams, forgetting, ...), the records in `core/records.py`.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from . import events as ev
from .fold import fence, jobs, nodes, slices, teams
from .fold.arrays import array_index, array_task_known
from .fold.checks import clocked, refused
from .fold.forgetting import forget_old
from .fold.teams import decayed_usage
from .model import DEFAULT_HALF_LIFE_S, FORGET_AFTER_S, GpuId  # noqa: F401  (FORGET_AFTER_S: re-exported)

# The records, and their helpers, re-exported (noqa: F401): some forty modules (policies,
# services, the node daemon, tests) import them from here, where they were before the fold split.
from .records import (  # noqa: F401
    JOB_STATES,
    TERMINAL,
    Job,
    Position,
    TeamUsage,
    Tombstone,
    Violation,
    job_node_order,
    stale_live,
)
from .retired import RetiredIds
from .topology import Gpu, Node, span_level


class ClusterState(Struct):
    """Nodes and topology, who holds each GPU, jobs and their lifecycle, team usage."""

    half_life_s: float | None = DEFAULT_HALF_LIFE_S  # the log's `FoldSettingsSet` changes it
    nodes: dict[str, Node] = {}
    gpus: dict[GpuId, Gpu] = {}
    jobs: dict[str, Job] = {}
    teams: dict[str, TeamUsage] = {}
    requests: dict[str, str] = {}  # client request id -> job id (idempotent submit)
    pending: dict[str, None] = {}  # jobs waiting, in submission order
    running: dict[str, None] = {}  # jobs holding GPUs
    idle_jobs: dict[str, None] = {}  # running jobs reported idle, or asked to yield for it
    placement_degraded: bool = False
    last_seq: int = 0
    last_alloc_seq: int = 0
    events: int = 0
    now: float = 0.0
    free_count: int = 0
    node_live: dict[str, dict[str, None]] = {}  # node -> jobs with `Live` processes there
    label_changes: int = 0  # node labels or nodes changed (placement's constraint memo)
    windows: dict[str, list[tuple[float, float]]] = {}  # node -> maintenance windows [start, until)
    broken: list[Violation] = []  # every invariant an event broke, in log order
    # Forgetting (None: keep every job whole, the simulator's and the tests' fold). Measured in
    # log time (the events' `at`), so every replica and every audit forgets the same jobs.
    forget_after_s: float | None = None
    keep_whole: bool = False  # a reader's fold that forgets no job, whatever the log's settings say
    finished: list[str] = []  # finished jobs not yet forgotten, in the order they ended
    finished_head: int = 0  # `finished[:finished_head]` were looked at already (compacted lazily)
    forgotten: dict[str, Tombstone] = {}
    forgotten_counts: dict[str, int] = {}  # final state -> forgotten jobs that ended so
    arrays: dict[str, tuple[int, int]] = {}  # job array id -> (first, last) task index, so that a
    # command naming an array finds its tasks by id, not by scanning every job and tombstone
    retiring: list[str] = []  # forgotten jobs, in the order they were forgotten
    retiring_head: int = 0  # `retiring[:retiring_head]` were retired already (compacted lazily)
    retired: RetiredIds = msgspec.field(default_factory=RetiredIds)
    handover: dict[str, None] = {}  # jobs GPUs were freed for since the last grant (`core/fold/jobs._nominate`)
    shared: dict[GpuId, None] = {}  # GPUs with fractional holders, in the order they got the first
    chains: dict[str, int] = {}  # writer chain (`Position.chain`) -> the highest fact number applied

    # --- the fold ------------------------------------------------------------------------

    def apply(self, event: ev.Event, seq: int | None = None, stored_at: float | None = None,
              position: Position | None = None) -> None:
        """Apply one event. `seq`: its log sequence (the simulator numbers its own); `stored_at`: its
        store time, the fold's clock (`core/fold/checks.clocked`; None: its `at`); `position`: in its signed chain."""
        self.last_seq = seq if seq is not None else self.last_seq + 1
        if event.ALLOC:
            self.last_alloc_seq = self.last_seq
        self.events += 1
        event = clocked(self, event, stored_at)
        handler = _HANDLERS.get(type(event))
        if handler is not None and not refused(self, event, position):
            handler(self, event)
        if self.finished_head < len(self.finished) or self.retiring_head < len(self.retiring):
            forget_old(self)

    def team(self, name: str) -> TeamUsage:
        """A team's usage record, made on its first mention (a team with no quota set has one)."""
        t = self.teams.get(name)
        if t is None:
            t = self.teams[name] = TeamUsage(usage_at=self.now)
        return t

    # --- queries (pure, used by policies, CLI and the simulator) ------------------------

    def violations(self) -> list[Violation]:
        """Every broken invariant of the README (Invariants) seen so far, each with its log sequence."""
        return list(self.broken)

    def team_usage(self, name: str, at: float | None = None) -> float:
        """Decayed GPU-seconds a team has used, as of `at` (default: the latest event)."""
        return decayed_usage(self, self.team(name), self.now if at is None else at)

    def team_gpu_seconds(self, name: str, at: float | None = None) -> tuple[float, float]:
        """(held, busy) GPU-seconds of a team, undecayed, as of `at` (default: the latest event)."""
        t = self.team(name)
        now = self.now if at is None else at
        held = t.held_gpu_s + t.held * max(0.0, now - t.usage_at)
        idle = t.idle_gpu_s + t.idle_gpus * max(0.0, now - t.idle_at)
        return held, max(0.0, held - idle)

    def gpu_blocker(self, g: GpuId) -> str:
        """Why a GPU is not free (or "free")."""
        rec = self.gpus[g]
        node = self.nodes[rec.node]
        if rec.occupied:
            if rec.holder is not None:
                return f"held by {rec.holder}"
            if rec.shares:
                return f"shared by {', '.join(sorted(rec.shares))}"
            return f"MIG slices held by {', '.join(sorted(set(rec.slices.values())))}"
        if node.lost:
            return f"node {node.name} lost"
        if node.drained:
            return f"node {node.name} drained"
        if rec.quarantined is not None:
            return f"quarantined: {rec.quarantined}"
        if rec.zombie_pids is not None:
            return f"zombie pids {rec.zombie_pids}"
        return "free"

    def span(self, gpus: list[GpuId]) -> str:
        return span_level(gpus, self.gpus, self.nodes)

    @property
    def total_gpus(self) -> int:
        return len(self.gpus)

    @property
    def held_gpus(self) -> int:
        return sum(1 for g in self.gpus.values() if g.occupied)

    def job_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(JOB_STATES, 0)
        for job in self.jobs.values():
            counts[job.state] += 1
        for state, n in self.forgotten_counts.items():
            counts[state] += n
        return counts

    def job_status(self, job_id: str) -> str | None:
        """A job's state, whole or forgotten (None: the log never had it)."""
        job = self.jobs.get(job_id)
        if job is not None:
            return job.state
        tomb = self.forgotten.get(job_id)
        return None if tomb is None else tomb.state

    def knows(self, job_id: str) -> bool:
        """The log has (had) this job or job array: whole, forgotten, or retired."""
        return (job_id in self.jobs or job_id in self.forgotten or job_id in self.arrays or job_id in self.retired
                or array_task_known(self, job_id))

    def summary(self) -> dict:
        """What `gpusched replay --json` prints."""
        held = self.held_gpus
        return {
            "last_seq": self.last_seq,
            "events": self.events,
            "time": self.now,
            "jobs": self.job_counts(),
            "gpus": {"total": self.total_gpus, "held": held, "free": self.free_count,
                     "unavailable": self.total_gpus - held - self.free_count},
            "nodes": {"total": len(self.nodes), "lost": sum(n.lost for n in self.nodes.values()),
                      "drained": sum(n.drained for n in self.nodes.values())},
            "teams": {name: {"held": t.held, "guaranteed": t.quota.guaranteed, "limit": t.quota.limit,
                             "usage_gpu_s": round(self.team_usage(name), 3),
                             **dict(zip(("held_gpu_s", "busy_gpu_s"),
                                        (round(x, 3) for x in self.team_gpu_seconds(name))))}
                      for name, t in sorted(self.teams.items())},
            "placement_degraded": self.placement_degraded,
            "violations": [msgspec.to_builtins(v) for v in self.broken],
        }

    def snapshot(self) -> bytes:
        """A compact encoding of the whole state (Redis snapshots: snapshot + tail)."""
        return msgspec.msgpack.encode(self)

    @classmethod
    def restore(cls, data: bytes | memoryview) -> ClusterState:
        state = msgspec.msgpack.decode(data, type=cls)
        if not state.arrays:  # a snapshot from before the index: rebuild it from the tasks
            state.arrays = array_index(state)
        return state


#: Each fact's reducer (`core/fold/`); a fact not here changes nothing but the clock.
_HANDLERS: dict[type, Any] = {
    ev.NodeLabeled: nodes.on_labeled,
    ev.JobSubmitted: jobs.on_submitted,
    ev.JobHeld: jobs.on_held,
    ev.JobUpdated: jobs.on_updated,
    ev.JobPending: jobs.on_pending,
    ev.GpusGranted: jobs.on_granted,
    ev.JobResized: jobs.on_resized,
    ev.JobStarted: jobs.on_started,
    ev.ProcessesEnded: fence.on_processes_ended,
    ev.JobOnUnhealthyGpu: jobs.on_unhealthy,
    ev.JobTimedOut: jobs.on_terminal,
    ev.PreemptionRequested: jobs.on_preemption,
    ev.JobIdle: teams.on_idle,
    ev.JobBusy: teams.on_busy,
    ev.CheckpointSaved: jobs.on_checkpoint,
    ev.GpusReleased: jobs.on_released,
    ev.JobCompleted: jobs.on_terminal,
    ev.JobFailed: jobs.on_terminal,
    ev.JobCancelled: jobs.on_terminal,
    ev.NodeRegistered: nodes.on_registered,
    ev.NodeLost: nodes.on_lost,
    ev.PartitionDeclared: nodes.on_partition,
    ev.PartitionEnded: nodes.on_partition,
    ev.NodeDrained: nodes.on_drained,
    ev.GpuQuarantined: nodes.on_quarantined,
    ev.GpuRestored: nodes.on_restored,
    ev.MigGeometrySet: slices.on_geometry,
    ev.ZombieDetected: nodes.on_zombie,
    ev.ZombieReclaimed: nodes.on_zombie_reclaimed,
    ev.TeamQuotaSet: teams.on_quota,
    ev.FoldSettingsSet: teams.on_fold_settings,
    ev.PlacementDegraded: nodes.on_degraded,
    ev.PlacementRecovered: nodes.on_recovered,
}


def fold(events, half_life_s: float | None = 7 * 24 * 3600.0) -> ClusterState:
    """Replay a sequence of events (or (seq, event) pairs) into a fresh state."""
    state = ClusterState(half_life_s=half_life_s)
    for item in events:
        if isinstance(item, tuple):
            state.apply(item[1], item[0])
        else:
            state.apply(item)
    return state
