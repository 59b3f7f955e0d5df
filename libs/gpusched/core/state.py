"""The fold: `ClusterState.apply(event)` is the only writer of scheduler state.

Pure and deterministic: no clock (time is the events' `at`), no I/O, no hash-ordered
iteration. An illegal event is still applied as far as it safely can be, and the broken
invariant is recorded in `violations` so that an audit replay names it instead of crashing.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec
from msgspec import Struct

from . import events as ev
from . import rules
from .model import DEFAULT_HALF_LIFE_S, FORGET_AFTER_S, GpuId, JobSpec, TeamQuota, gpu_id  # noqa: F401
from .pools import canonical_model
from .reasons import Reason
from .retired import RetiredIds
from .topology import Gpu, Node, span_level

JobStatus = Literal["pending", "starting", "running", "completed", "failed", "cancelled", "timeout"]
HOLDING = ("starting", "running")
TERMINAL = ("completed", "failed", "cancelled", "timeout")
JOB_STATES: tuple[str, ...] = ("pending", "starting", "running", "completed", "failed", "cancelled", "timeout")
#: Partial checkpoints kept per job (steps some but not all ranks saved), newest last.
PARTIAL_CHECKPOINTS = 8
#: A tombstone lives this many horizons after the job ended (a year at the default 90 days); then
#: only the job's id is kept (`RetiredIds`, 4 bytes), so that no id is ever handed out twice:
#: request-id dedupe, `afterok` on the job and `show` end there (docs/operating.md, "Retention").
RETIRE_AFTER_HORIZONS = 4
#: How far a fact's `at` may run ahead of the log's store time of it (writers' clock skew and
#: the append's latency are far less); later, the fold bounds it (`ClusterState.apply`).
AT_LEAD_S = 60.0


class Checkpoint(Struct):
    """A complete checkpoint: every rank that must save saved `step`. `path` is rank 0's,
    `paths` every saving rank's, by rank."""

    path: str
    step: int
    at: float
    attempt: int
    paths: list[str] = []
    sha256: str = ""  # rank 0's, as the job's SDK recorded it: a resume verifies the file against it


class Live(Struct, array_like=True):
    """Processes of one attempt (and generation) that may exist on `node`: from the grant (or
    resize) until its daemon reports them ended or the node is declared lost."""

    node: str
    attempt: int
    generation: int = 0


class LogRef(Struct, array_like=True):
    """Where one rank's stdout/stderr of one attempt is kept (on `node`, served over NATS)."""

    attempt: int
    generation: int
    rank: int
    node: str
    path: str


class Preemption(Struct):
    for_job: str
    reason: str
    deadline: float
    at: float
    cause: str = "preempt"  # "idle": the idle timeout of the job's class


class IdleStatus(Struct):
    """The reconciler's last conclusion that a running job is idle, with its evidence."""

    since: float
    at: float
    window_s: float
    threshold_pct: float
    util_pct: float = 0.0
    util_pct_max: float = 0.0
    memory_mb: float = 0.0


class Job(Struct):
    job_id: str
    spec: JobSpec
    submitted_at: float
    state: JobStatus = "pending"
    attempt: int = 0
    gpus: list[GpuId] = []
    placer: str = ""
    level: str = ""
    backfill: bool = False
    started_at: float | None = None  # start of the current attempt (grant time)
    first_started_at: float | None = None
    finished_at: float | None = None
    held_since: float = 0.0  # last change of `gpus`, for service accounting
    service_gpu_s: float = 0.0  # attained service, all attempts (least-attained-service order)
    checkpoint: Checkpoint | None = None
    previous_checkpoint: Checkpoint | None = None  # the fallback when `checkpoint` fails its checksum
    preemption: Preemption | None = None
    preemptions: int = 0
    restarts: int = 0
    lost_gpu_s: float = 0.0
    end_reason: str = ""
    pending_reason: str = ""
    pending_blockers: list[str] = []
    pending_eta_s: float | None = None
    pending_eta_range: tuple[float, float] | None = None  # (low, high) seconds from `pending_at`
    pending_at: float = 0.0  # when the last JobPending was decided
    pending_why: Reason | None = None  # the typed reason of the policy's last JobPending
    nodes_started: list[str] = []
    request_id: str = ""
    generation: int = 0  # restarts of every rank within the attempt (elastic resizes)
    resized_at: float | None = None
    prev_nodes: int = 0  # nodes of the generation before the latest resize (its ranks still save)
    live: list[Live] = []  # the fence: attempts whose processes may still run
    partial: dict[int, dict[int, str]] = {}  # step -> {rank: path}, this attempt and generation
    unhealthy: list[GpuId] = []  # quarantined GPUs the job holds
    unhealthy_reason: str = ""
    logs: list[LogRef] = []
    idle: IdleStatus | None = None  # the current attempt's GPUs are idle (reconciler's JobIdle)
    idle_gpu_s: float = 0.0  # held GPU-seconds while idle, all attempts, as of `idle_at`
    idle_at: float = 0.0
    idle_requeues: int = 0
    yielded_idle: bool = False  # requeued by an idle timeout: waits behind the queue until granted
    user: str = ""
    hold: str | None = None  # held (`gpusched hold`): who held it and why; None: not held
    updates: int = 0  # `JobUpdated` applied (the queue index re-sorts a job whose count moved)
    array_job: str = ""  # a task of a job array: the array's id (the task's id is `<array>_<index>`)
    share: float = 1.0  # the share of each of its GPUs it holds: below 1 for a fractional job (its grant)

    @property
    def team(self) -> str:
        return self.spec.team

    @property
    def holding(self) -> bool:
        return self.state in HOLDING

    @property
    def weight(self) -> float:
        """The GPUs it is charged for: its GPUs, or its share of its one GPU (fractional)."""
        return len(self.gpus) * self.share

    def attained_gpu_s(self, now: float) -> float:
        return self.service_gpu_s + self.weight * max(0.0, now - self.held_since)

    def idle_gpu_s_at(self, now: float) -> float:
        ongoing = self.weight * max(0.0, now - self.idle_at) if self.idle is not None else 0.0
        return self.idle_gpu_s + ongoing

    def gpu_seconds(self, now: float) -> tuple[float, float]:
        """(held, busy) GPU-seconds over all attempts: busy is held while not idle (seff-like)."""
        held = self.attained_gpu_s(now)
        return held, max(0.0, held - self.idle_gpu_s_at(now))


class Tombstone(Struct, array_like=True):
    """What the fold keeps of a finished job past the horizon: enough for `afterok`, request-id
    dedupe, job-id uniqueness, array cancel and `show` to answer; its history stays in the log
    and the exported segments (`gpusched replay`)."""

    state: JobStatus
    finished_at: float
    request_id: str = ""
    team: str = ""
    array_job: str = ""


class TeamUsage(Struct):
    quota: TeamQuota = TeamQuota()
    held: int | float = 0  # GPUs held: whole GPUs, plus the shares of fractional jobs (`gpu_count`)
    usage_gpu_s: float = 0.0  # decayed GPU-seconds as of `usage_at`
    usage_at: float = 0.0
    held_gpu_s: float = 0.0  # GPU-seconds held, undecayed (accounting), as of `usage_at`
    idle_gpus: int | float = 0  # GPUs of the team's jobs the reconciler reports idle
    idle_gpu_s: float = 0.0  # GPU-seconds held while idle, as of `idle_at`
    idle_at: float = 0.0
    pool_held: dict[str, float] = {}  # GPU pool (canonical model, core/pools.py) -> GPUs held there (shares count their share)


def gpu_count(value: float) -> int | float:
    """A count of GPUs that shares may make fractional: a whole count stays an int (as shown
    and stored before shares), a fractional one is rounded so that sums of shares do not drift."""
    r = round(float(value), 9)
    return int(r) if r.is_integer() else r


class Position(Struct, frozen=True, array_like=True):
    """Where a signed fact sits in its writer's chain (`security.signing.position`): `chain`
    names the scope its subject is in, the signer and the chain id; `n` its number there."""

    chain: str
    n: int


class Violation(Struct, frozen=True):
    seq: int
    rule: str
    detail: str
    jobs: list[str] = []
    gpus: list[GpuId] = []


def _set_checkpoint(job: Job, ck: Checkpoint) -> None:
    """`ck` is the job's newest complete checkpoint; the one before stays as the fallback."""
    if job.checkpoint is not None and job.checkpoint.path != ck.path:
        job.previous_checkpoint = job.checkpoint
    job.checkpoint = ck


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
    handover: dict[str, None] = {}  # jobs GPUs were freed for since the last grant (_nominate)
    shared: dict[GpuId, None] = {}  # GPUs with fractional holders, in the order they got the first
    chains: dict[str, int] = {}  # writer chain (`Position.chain`) -> the highest fact number applied

    # --- the fold ------------------------------------------------------------------------

    def apply(self, event: ev.Event, seq: int | None = None, stored_at: float | None = None,
              position: Position | None = None) -> None:
        """Apply one event. `seq`: its log sequence (the simulator numbers its own); `stored_at`: its
        store time, the fold's clock (`_clocked`; None: its `at`); `position`: in its signed chain."""
        self.last_seq = seq if seq is not None else self.last_seq + 1
        if event.ALLOC:
            self.last_alloc_seq = self.last_seq
        self.events += 1
        event = _clocked(self, event, stored_at)
        handler = _HANDLERS.get(type(event))
        if handler is not None and not _refused(self, event, position):
            handler(self, event)
        if self.finished_head < len(self.finished) or self.retiring_head < len(self.retiring):
            _forget_old(self)

    def _violate(self, rule: str, detail: str, jobs: list[str] = (), gpus: list[str] = ()) -> None:  # type: ignore[assignment]
        self.broken.append(Violation(self.last_seq, rule, detail, list(jobs), list(gpus)))

    # jobs

    def _on_submitted(self, e: ev.JobSubmitted) -> None:
        if e.spec.array is not None:
            return _submit_array(self, e)
        if e.job_id in self.jobs or e.job_id in self.forgotten:
            self._violate("duplicate_job", f"job {e.job_id} submitted twice", [e.job_id])
            return
        self.jobs[e.job_id] = Job(e.job_id, e.spec, e.at, held_since=e.at, request_id=e.request_id, user=e.user)
        self.pending[e.job_id] = None
        if e.request_id:
            self.requests[e.request_id] = e.job_id
        self.team(e.spec.team)

    def _on_pending(self, e: ev.JobPending) -> None:
        job = self.jobs.get(e.job_id)
        if job is not None:
            job.pending_reason, job.pending_blockers, job.pending_eta_s = e.reason, list(e.blockers), e.eta_s
            low, high = e.eta_low_s, e.eta_high_s
            job.pending_eta_range = None if low is None or high is None else (low, high)
            job.pending_at = e.at
            job.pending_why = e.why

    def _on_processes_ended(self, e: ev.ProcessesEnded) -> None:
        job = self.jobs.get(e.job_id)
        if job is not None:
            self._end_live(job, lambda x: x.node == e.node and (x.attempt, x.generation) == (e.attempt, e.generation))

    def _on_unhealthy(self, e: ev.JobOnUnhealthyGpu) -> None:
        job = self.jobs.get(e.job_id)
        if job is not None and job.holding and job.attempt == e.attempt:
            job.unhealthy = [g for g in dict.fromkeys([*job.unhealthy, *e.gpus]) if g in job.gpus]
            job.unhealthy_reason = e.reason

    def _on_released(self, e: ev.GpusReleased) -> None:
        job = self.jobs.get(e.job_id)
        if job is None or not job.holding:
            return  # two observers may report the same loss; the first one counts
        idle = e.reason == "preempted" and job.preemption is not None and job.preemption.cause == "idle"
        if idle:
            job.idle_requeues += 1
        elif e.reason == "preempted":
            job.preemptions += 1
            _nominate(self, job)
        elif e.reason in ("no_process", "process_failed"):
            job.restarts += 1
        job.lost_gpu_s += e.lost_gpu_s
        self._requeue(job, e.at, "requeued: idle timeout" if idle else f"requeued: {e.reason}")
        job.yielded_idle = idle

    def _on_terminal(self, e: ev.JobCompleted | ev.JobFailed | ev.JobCancelled | ev.JobTimedOut) -> None:
        job = self.jobs.get(e.job_id)
        if job is None or job.state in TERMINAL:
            return
        attempt = getattr(e, "attempt", None)
        if (job.holding and attempt not in (None, job.attempt)) or (not job.holding and getattr(e, "node", None)):
            return  # a late exit of an attempt already released (a node's report of a waiting job is one)
        if job.holding:
            self._release_all(job, e.at)
            del self.running[job.job_id]
        else:
            del self.pending[job.job_id]
        job.state = _END_STATE[type(e)]
        job.finished_at = e.at
        job.preemption = None
        if isinstance(e, ev.JobTimedOut):
            job.end_reason = f"time limit of {e.limit_s:g} s exceeded"
        else:
            job.end_reason = getattr(e, "reason", "") or f"exit code {getattr(e, 'exit_code', 0)}"
        if self.forget_after_s is not None:
            self.finished.append(job.job_id)

    # nodes and GPUs

    def _on_node_registered(self, e: ev.NodeRegistered) -> None:
        old = self.nodes.get(e.node)
        self.label_changes += 1
        if old is not None:
            old.registered_at = max(old.registered_at, e.at)
            if e.labels:  # the agent's labels fill in; an admin's `NodeLabeled` keeps winning
                old.labels = {**e.labels, **old.labels}
            if old.lost:
                old.lost = False
                for g in old.gpus:
                    self._refresh(g)
            return  # re-registration after a restart keeps what the log already knows
        ids = [gpu_id(e.node, g.index) for g in e.gpus]
        self.nodes[e.node] = Node(e.node, e.rack, e.block, ids, e.address, e.nvlink, e.at, free={},
                                  labels=dict(e.labels))
        for gid, info in zip(ids, e.gpus):
            self.gpus[gid] = Gpu(gid, e.node, info.index, info.uuid, info.model, info.memory_mb, info.nvlink_domain,
                                 mig=info.mig)
            self._refresh(gid)

    def _on_node_lost(self, e: ev.NodeLost) -> None:
        node = self.nodes.get(e.node)
        if node is None:
            return
        node.lost = True
        for job_id in list(self.node_live.get(e.node, {})):  # fenced: the node kills them on return
            self._end_live(self.jobs[job_id], lambda x: x.node == e.node)
        victims: dict[str, None] = {}
        for g in node.gpus:
            for holder in self.gpus[g].holders:
                victims[holder] = None
            self._refresh(g)
        for job_id in victims:
            job = self.jobs[job_id]
            job.lost_gpu_s += rules.work_since_checkpoint(job, e.at)
            self._requeue(job, e.at, f"requeued: node {e.node} lost")

    def _on_node_drained(self, e: ev.NodeDrained) -> None:
        node = self.nodes.get(e.node)
        if node is None:
            return
        if e.until is not None:  # a window: the policy keeps jobs off it by the clock, no event ends it
            kept = [w for w in self.windows.get(e.node, []) if w[1] > e.at]
            self.windows[e.node] = sorted(kept + [(e.at if e.start is None else e.start, e.until)])
            return
        node.drained = e.drain
        if not e.drain:
            self.windows.pop(e.node, None)
        for g in node.gpus:
            self._refresh(g)

    def _on_quarantined(self, e: ev.GpuQuarantined) -> None:
        if e.gpu in self.gpus:
            self.gpus[e.gpu].quarantined = e.reason
            self._refresh(e.gpu)

    def _on_restored(self, e: ev.GpuRestored) -> None:
        if e.gpu in self.gpus:
            self.gpus[e.gpu].quarantined = None
            self._refresh(e.gpu)

    def _on_zombie(self, e: ev.ZombieDetected) -> None:
        if e.gpu in self.gpus:
            self.gpus[e.gpu].zombie_pids = list(e.pids)
            self._refresh(e.gpu)

    def _on_zombie_reclaimed(self, e: ev.ZombieReclaimed) -> None:
        if e.gpu in self.gpus:
            self.gpus[e.gpu].zombie_pids = None
            self._refresh(e.gpu)

    # teams and control plane

    def _on_quota(self, e: ev.TeamQuotaSet) -> None:
        # Lowering a limit below current use is legal: running jobs finish, no new ones start.
        self.team(e.team).quota = e.quota

    def _on_fold_settings(self, e: ev.FoldSettingsSet) -> None:
        """Usage up to this fact decays with the old half-life (each team settled at it), after
        it with the new; a `keep_whole` fold (a reader's) forgets nothing whatever it says."""
        for name in self.teams:
            self._team_held(name, 0, self.now)
        self.half_life_s = e.settings.half_life_s
        if not self.keep_whole:
            self.forget_after_s = e.settings.forget_after_s

    def _on_degraded(self, e: ev.PlacementDegraded) -> None:
        self.placement_degraded = True

    def _on_recovered(self, e: ev.PlacementRecovered) -> None:
        self.placement_degraded = False

    # --- helpers of the fold -------------------------------------------------------------

    def team(self, name: str) -> TeamUsage:
        t = self.teams.get(name)
        if t is None:
            t = self.teams[name] = TeamUsage(usage_at=self.now)
        return t

    def _take(self, job_id: str, gpus: list[GpuId], at: float) -> list[GpuId]:
        """Give `gpus` to a job, recording any GPU that was not placeable."""
        taken: list[GpuId] = []
        for g in gpus:
            rec = self.gpus.get(g)
            if rec is None:
                self._violate("unknown_gpu", f"grant of unknown GPU {g}", [job_id], [g])
                continue
            if rec.shares or (rec.holder is not None and rec.holder != job_id):
                self._violate("double_booking", f"GPU {g} granted to {job_id} while {self.gpu_blocker(g)}", [job_id, *rec.holders], [g])
                continue
            if g not in self.nodes[rec.node].free:
                self._violate("unplaceable_gpu", f"GPU {g} granted to {job_id} while {self.gpu_blocker(g)}", [job_id], [g])
            rec.holder = job_id
            self._refresh(g)
            taken.append(g)
        return taken

    def _may_run(self, job: Job, gpus: list[GpuId]) -> None:
        """From a grant or resize on, the job's current attempt may have processes on its nodes."""
        for node in dict.fromkeys(g.rpartition("/")[0] for g in gpus):
            self._add_live(job, Live(node, job.attempt, job.generation))

    def _add_live(self, job: Job, live: Live) -> None:
        if live not in job.live:
            job.live = [*job.live, live]
            self.node_live.setdefault(live.node, {})[job.job_id] = None

    def _end_live(self, job: Job, ended) -> None:
        gone = [x for x in job.live if ended(x)]
        if not gone:
            return
        job.live = [x for x in job.live if not ended(x)]
        for x in gone:
            if not any(y.node == x.node for y in job.live):
                jobs = self.node_live.get(x.node, {})
                jobs.pop(job.job_id, None)
                if not jobs:
                    self.node_live.pop(x.node, None)

    def _release_all(self, job: Job, at: float) -> None:
        self._account(job, at)
        if job.idle is not None:
            _end_idle(self, job, at)
        self.idle_jobs.pop(job.job_id, None)
        _give_back_all(self, job)
        self._team_held(job.team, -job.weight, at)
        _pool_held(self, job.team, job.gpus, -job.share)
        job.gpus = []

    def _requeue(self, job: Job, at: float, reason: str) -> None:
        self._release_all(job, at)
        del self.running[job.job_id]
        self.pending[job.job_id] = None
        job.state, job.preemption, job.started_at = "pending", None, None
        job.pending_reason, job.pending_blockers, job.pending_eta_s = reason, [], None
        job.pending_eta_range = None
        job.pending_why = None

    def _account(self, job: Job, at: float) -> None:
        job.service_gpu_s += job.weight * max(0.0, at - job.held_since)
        job.held_since = at
        if job.idle is not None:
            job.idle_gpu_s += job.weight * max(0.0, at - job.idle_at)
            job.idle_at = max(job.idle_at, at)

    def _refresh(self, g: GpuId) -> None:
        """Keep the node's free set and the free count in step with one GPU's record."""
        rec = self.gpus[g]
        node = self.nodes[rec.node]
        _index_shared(self, g)
        placeable = rules.gpu_placeable(self, g)
        if placeable and g not in node.free:
            node.free[g] = None
            self.free_count += 1
        elif not placeable and g in node.free:
            del node.free[g]
            self.free_count -= 1

    def _team_held(self, name: str, delta: float, at: float) -> None:
        t = self.team(name)
        t.held_gpu_s += t.held * max(0.0, at - t.usage_at)
        t.usage_gpu_s = self._decayed_usage(t, at)
        t.usage_at = max(t.usage_at, at)
        t.held = gpu_count(t.held + delta)

    def _decayed_usage(self, t: TeamUsage, at: float) -> float:
        dt = max(0.0, at - t.usage_at)
        if self.half_life_s is None:
            return t.usage_gpu_s + t.held * dt
        decay = math.exp(-math.log(2) * dt / self.half_life_s)
        return t.usage_gpu_s * decay + t.held * self.half_life_s / math.log(2) * (1 - decay)

    def _check_limit(self, team: str, job_id: str, gpus: list[GpuId]) -> None:
        t = self.teams[team]
        if rules.over_limit(t.quota, t.held):
            self._violate("over_limit", f"team {team} holds {t.held} GPUs, limit {t.quota.limit}", [job_id], gpus)

    # --- queries (pure, used by policies, CLI and the simulator) ------------------------

    def violations(self) -> list[Violation]:
        """Every broken invariant of the README (Invariants) seen so far, each with its log sequence."""
        return list(self.broken)

    def team_usage(self, name: str, at: float | None = None) -> float:
        """Decayed GPU-seconds a team has used, as of `at` (default: the latest event)."""
        return self._decayed_usage(self.team(name), self.now if at is None else at)

    def team_gpu_seconds(self, name: str, at: float | None = None) -> tuple[float, float]:
        """(held, busy) GPU-seconds of a team, undecayed, as of `at` (default: the latest event)."""
        t = self.team(name)
        now = self.now if at is None else at
        held = t.held_gpu_s + t.held * max(0.0, now - t.usage_at)
        idle = t.idle_gpu_s + t.idle_gpus * max(0.0, now - t.idle_at)
        return held, max(0.0, held - idle)

    def gpu_blocker(self, g: GpuId) -> str:
        return _gpu_blocker(self, g)

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
                or _array_task_known(self, job_id))

    def summary(self) -> dict:
        """What `gpusched replay --json` prints."""
        return _summary(self)

    def snapshot(self) -> bytes:
        """A compact encoding of the whole state (Redis snapshots: snapshot + tail)."""
        return msgspec.msgpack.encode(self)

    @classmethod
    def restore(cls, data: bytes) -> ClusterState:
        state = msgspec.msgpack.decode(data, type=cls)
        if not state.arrays:  # a snapshot from before the index: rebuild it from the tasks
            state.arrays = _array_index(state)
        return state


def _gpu_blocker(st: ClusterState, g: GpuId) -> str:
    """Why a GPU is not free (or "free"), outside the class for its size."""
    rec = st.gpus[g]
    node = st.nodes[rec.node]
    if rec.occupied:
        return f"held by {rec.holder}" if rec.holder is not None else f"shared by {', '.join(sorted(rec.shares))}"
    if node.lost:
        return f"node {node.name} lost"
    if node.drained:
        return f"node {node.name} drained"
    if rec.quarantined is not None:
        return f"quarantined: {rec.quarantined}"
    if rec.zombie_pids is not None:
        return f"zombie pids {rec.zombie_pids}"
    return "free"


def _pool_held(st: ClusterState, name: str, gpus: list[GpuId], amount: float) -> None:
    """Per-pool holdings of a team (per-model quotas, `teams`), kept beside `held`: `amount`
    per GPU (a fractional job's share); replaced whole, never edited (a forecast's fork shares
    it, `policy/forecast.fork`). Outside the class for its size."""
    if not gpus:
        return
    t = st.team(name)
    per = dict(t.pool_held)
    for g in gpus:
        pool = canonical_model(st.gpus[g].model)
        per[pool] = per.get(pool, 0) + amount
        if abs(per[pool]) < 1e-9:
            del per[pool]
    t.pool_held = per


# --- idle GPUs (JobIdle/JobBusy): held-but-unused accounting, outside the class for its size ---

def _on_idle(st: ClusterState, e: ev.JobIdle) -> None:
    job = st.jobs.get(e.job_id)
    if job is None or not job.holding or job.attempt != e.attempt:
        return  # a late report about an attempt that already ended
    status = IdleStatus(e.since, e.at, e.window_s, e.threshold_pct, e.util_pct, e.util_pct_max, e.memory_mb)
    if job.idle is None:
        # the GPUs were idle since `since` (the evidence window): that time was not busy
        since = min(e.at, max(e.since, job.started_at if job.started_at is not None else e.since))
        back = job.weight * max(0.0, e.at - since)
        job.idle_gpu_s += back
        _team_idle(st, job.team, job.weight, e.at, back)
        job.idle_at = e.at
    job.idle = status
    st.idle_jobs[job.job_id] = None


def _on_busy(st: ClusterState, e: ev.JobBusy) -> None:
    job = st.jobs.get(e.job_id)
    if job is None or not job.holding or job.attempt != e.attempt or job.idle is None:
        return
    _end_idle(st, job, e.at)
    if job.preemption is None or job.preemption.cause != "idle":
        st.idle_jobs.pop(job.job_id, None)


def _end_idle(st: ClusterState, job: Job, at: float) -> None:
    st._account(job, at)
    _team_idle(st, job.team, -job.weight, at)
    job.idle = None


def _team_idle(st: ClusterState, name: str, delta: float, at: float, back: float = 0.0) -> None:
    t = st.team(name)
    t.idle_gpu_s += t.idle_gpus * max(0.0, at - t.idle_at) + back
    t.idle_at = max(t.idle_at, at)
    t.idle_gpus = gpu_count(t.idle_gpus + delta)


def _forget_old(st: ClusterState) -> None:
    """Forget the finished jobs that ended more than `forget_after_s` (log time) before the
    latest event, oldest first; a job whose processes may still run (the fence) waits at the
    back of the queue until they are reported ended."""
    assert st.forget_after_s is not None
    horizon = st.now - st.forget_after_s
    queue = st.finished
    while st.finished_head < len(queue):
        job = st.jobs.get(queue[st.finished_head])
        if job is not None and job.finished_at is not None and job.finished_at > horizon:
            break
        st.finished_head += 1
        if job is None:
            continue
        if job.live:
            queue.append(job.job_id)
            break
        del st.jobs[job.job_id]
        st.forgotten[job.job_id] = Tombstone(job.state, job.finished_at or 0.0, job.request_id, job.team,
                                             job.array_job)
        st.forgotten_counts[job.state] = st.forgotten_counts.get(job.state, 0) + 1
        st.retiring.append(job.job_id)
    if st.finished_head > 1024 and st.finished_head * 2 > len(queue):
        del queue[:st.finished_head]
        st.finished_head = 0
    _retire_old(st, st.now - st.forget_after_s * RETIRE_AFTER_HORIZONS)


def _retire_old(st: ClusterState, horizon: float) -> None:
    """Past the second horizon a tombstone goes and only the id stays (`RetiredIds`); an array's
    tasks need nothing more, `arrays` keeps their range."""
    queue = st.retiring
    while st.retiring_head < len(queue):
        tomb = st.forgotten.get(queue[st.retiring_head])
        if tomb is not None and tomb.finished_at > horizon:
            break
        job_id = queue[st.retiring_head]
        st.retiring_head += 1
        if tomb is None:
            continue
        del st.forgotten[job_id]
        if tomb.request_id and st.requests.get(tomb.request_id) in (job_id, tomb.array_job):
            del st.requests[tomb.request_id]
        if not tomb.array_job:
            st.retired.add(job_id)
    if st.retiring_head > 1024 and st.retiring_head * 2 > len(queue):
        del queue[:st.retiring_head]
        st.retiring_head = 0


def _summary(st: ClusterState) -> dict:
    held = st.held_gpus
    return {
        "last_seq": st.last_seq,
        "events": st.events,
        "time": st.now,
        "jobs": st.job_counts(),
        "gpus": {"total": st.total_gpus, "held": held, "free": st.free_count,
                 "unavailable": st.total_gpus - held - st.free_count},
        "nodes": {"total": len(st.nodes), "lost": sum(n.lost for n in st.nodes.values()),
                  "drained": sum(n.drained for n in st.nodes.values())},
        "teams": {name: {"held": t.held, "guaranteed": t.quota.guaranteed, "limit": t.quota.limit,
                         "usage_gpu_s": round(st.team_usage(name), 3),
                         **dict(zip(("held_gpu_s", "busy_gpu_s"),
                                    (round(x, 3) for x in st.team_gpu_seconds(name))))}
                  for name, t in sorted(st.teams.items())},
        "placement_degraded": st.placement_degraded,
        "violations": [msgspec.to_builtins(v) for v in st.broken],
    }


# --- what a fact may say: who reports it, and when it happened ---

def _clocked(st: ClusterState, event: ev.Event, stored_at: float | None) -> ev.Event:
    """Move the fold's clock to the log's store time of `event` (no writer controls it) and
    return `event` with its `at` no later than `AT_LEAD_S` after it (`clock_ahead`): a writer's
    clock, or a forger's, cannot date a fact into the future. An `at` behind is kept: a report
    is often decided, or buffered by a node through an outage, before it is stored. Without a
    store time (a bare fold of events) the events' `at` is the clock."""
    clock = event.at if stored_at is None else stored_at
    if clock > st.now:
        st.now = clock
    if stored_at is None or event.at <= stored_at + AT_LEAD_S:
        return event
    latest = stored_at + AT_LEAD_S
    st._violate("clock_ahead", f"{event.kind} says it happened at {event.at:.3f}, {event.at - stored_at:.3f} s "
                f"after the log stored it ({stored_at:.3f}): folded as at {latest:.3f}",
                [j] if (j := getattr(event, "job_id", None)) else [])
    return msgspec.structs.replace(event, at=latest)


def _replayed(st: ClusterState, event: ev.Event, position: Position | None) -> bool:
    """A fact at or below its writer chain's highest applied number is a re-published one: a
    writer stores each number of a chain once (one append at a time per chain; after an append
    whose outcome is unknown it starts a new chain, and a duplicate ack stores nothing), so
    only a copy comes back to a number. Recorded as `replayed`, without effect."""
    if position is None:
        return False
    top = st.chains.get(position.chain, 0)
    if position.n > top:
        st.chains[position.chain] = position.n
        return False
    job = getattr(event, "job_id", None)
    st._violate("replayed", f"{event.kind} is fact {position.n} of writer chain {position.chain}, which was applied "
                f"up to fact {top} already: a re-published fact, left without effect", [job] if job else [])
    return True


def _refused(st: ClusterState, event: ev.Event, position: Position | None = None) -> bool:
    """A copy of an applied fact (`_replayed`), and a node's report about a job that is not on
    it (`foreign_node`: a node speaks only for itself), are recorded and have no effect."""
    if _replayed(st, event, position):
        return True
    if type(event) not in NODE_REPORTS or event.node is None:  # type: ignore[attr-defined]
        return False
    problem = node_report_problem(st, event)
    if problem is not None:
        st._violate("foreign_node", problem, [event.job_id])  # type: ignore[attr-defined]
    return problem is not None


def node_report_problem(st: ClusterState, e: ev.Event) -> str | None:
    """Why a node's report about a job (`NODE_REPORTS`, naming its `node`) is not that node's
    to make, or None. While the job holds GPUs in the reported attempt, only the nodes it holds
    them on now speak for it (and, for its processes and saves, the nodes whose ranks of that
    attempt still drain after a resize); a report about an attempt that ended comes only
    from a node that ran it. The node is the one its subject names (permissions: its own)."""
    node, job = e.node, st.jobs.get(e.job_id)  # type: ignore[attr-defined]
    if job is None:
        return None  # nothing to act on: every handler ignores a job it does not know
    attempt = getattr(e, "attempt", job.attempt)  # `GpusReleased` names none: the current one
    ran = any(x.node == node and x.attempt == attempt for x in job.live)
    if job.holding and attempt == job.attempt:
        if node in job_node_order(job) or (ran and not isinstance(e, _ENDINGS)):
            return None
        where = ", ".join(job_node_order(job)) or "no node"
        return f"{e.kind} from node {node} about job {job.job_id} (attempt {attempt}), which runs on {where}"
    if ran or (attempt == job.attempt and node in job.nodes_started) or isinstance(e, ev.ProcessesEnded):
        return None  # late, about its own processes (an end fences only the reporter's): no harm
    return f"{e.kind} from node {node} about attempt {attempt} of job {job.job_id}, which never ran there"


#: Facts a node daemon reports about a job it runs, naming itself (`node`): `apply` refuses one
#: from a node the job is not on (`node_report_problem`).
NODE_REPORTS = frozenset({ev.JobStarted, ev.ProcessesEnded, ev.CheckpointSaved, ev.JobCompleted, ev.JobFailed,
                          ev.GpusReleased})
#: Node reports that end or requeue the attempt: only from a node it holds GPUs on now.
_ENDINGS = (ev.JobCompleted, ev.JobFailed, ev.GpusReleased)


def _on_registered(st: ClusterState, e: ev.NodeRegistered) -> None:
    """A node registers (`_on_node_registered`) with the CPUs and memory it offers: a restarted
    agent may offer other amounts (`--cpus`, `--mem`); one that declares none keeps the last."""
    st._on_node_registered(e)
    node = st.nodes[e.node]
    if e.cpus or e.memory_mb:
        node.cpus, node.memory_mb = e.cpus, e.memory_mb
        # counted afresh from the jobs holding its GPUs (a state restored from before the count)
        holders = [st.jobs[h] for h in dict.fromkeys(st.gpus[g].holder for g in node.gpus) if h in st.jobs]
        node.cpus_used = round(sum(j.spec.cpus or 0.0 for j in holders), 6)
        node.memory_used_mb = sum(j.spec.memory_mb or 0 for j in holders)


def _give_back_all(st: ClusterState, job: Job) -> None:
    """A job's GPUs return; its CPUs and memory stop counting on their nodes."""
    _give_back(st, job.gpus, job.job_id)
    _reserve(st, job.spec, job.gpus, -1)


def _reserve(st: ClusterState, spec: JobSpec, gpus: list[GpuId], sign: int, than: list[GpuId] | None = None) -> None:
    """A job's per-node CPUs and memory count on each node of `gpus` (sign 1) or stop counting
    (-1); with `than` (a resize), only the nodes the job enters (leaves) against `than`."""
    cpus, mem = spec.cpus or 0.0, spec.memory_mb or 0
    if not (cpus or mem):
        return
    now = dict.fromkeys(g.rpartition("/")[0] for g in gpus)
    if than is not None:
        was = dict.fromkeys(g.rpartition("/")[0] for g in than)
        for n in [n for n in was if n not in now]:
            _count_on(st, n, -cpus, -mem)
        now = {n: None for n in now if n not in was}
    for n in now:
        _count_on(st, n, sign * cpus, sign * mem)


def _count_on(st: ClusterState, name: str, cpus: float, mem: int) -> None:
    node = st.nodes.get(name)
    if node is not None:
        node.cpus_used = max(0.0, round(node.cpus_used + cpus, 6))  # no float drift across grants
        node.memory_used_mb = max(0, node.memory_used_mb + mem)


def _nominate(st: ClusterState, victim: Job) -> None:
    """A victim releases for another job: that job's turn to take the freed GPUs first, until
    the next grant (policy/steps/handover.py; a job moved for itself is nobody's beneficiary)."""
    p = victim.preemption
    if p is not None and p.for_job != victim.job_id:
        st.handover[p.for_job] = None


def _take_share(self: ClusterState, job: Job, gpus: list[GpuId]) -> list[GpuId]:
    """Give a fractional job its share of its one GPU (`rules.share_problem`). Applied as far as
    is safe: a share the GPU has room for is taken even where it was not placeable (quarantined,
    drained: recorded), never one beyond its room, beside a whole holder, or of unknown size."""
    taken: list[GpuId] = []
    for g in gpus:
        rec = self.gpus.get(g)
        share = None if rec is None else job.spec.share_on(rec.memory_mb)
        problem = rules.share_problem(self, g, share)
        if problem is not None:
            self._violate("unplaceable_share", f"a share of GPU {g} granted to {job.job_id}: {problem}",
                          [job.job_id], [g])
        if rec is None or share is None or rec.holder is not None or rec.shared_load + share > 1 + rules.SHARE_SLACK:
            continue
        rec.shares = {**rec.shares, job.job_id: share}
        job.share = share
        self._refresh(g)
        taken.append(g)
    return taken


def _give_back(st: ClusterState, gpus: list[GpuId], job_id: str | None = None) -> None:
    for g in gpus:
        _drop_holder(st.gpus[g], job_id)
        st._refresh(g)


def _drop_holder(rec: Gpu, job_id: str | None) -> None:
    """`job_id` no longer holds `rec`: its share of it, or the whole of it."""
    if job_id is not None and job_id in rec.shares:
        rec.shares = {k: v for k, v in rec.shares.items() if k != job_id}
    else:
        rec.holder = None


def _index_shared(st: ClusterState, g: GpuId) -> None:
    """Keep `st.shared` (GPUs with fractional holders) in step with one GPU's record."""
    if st.gpus[g].shares:
        st.shared[g] = None
    elif g in st.shared:
        del st.shared[g]


def _fold_granted(self, e: ev.GpusGranted) -> None:
    job = self.jobs.get(e.job_id)
    if job is None or job.state != "pending":
        state = self.job_status(e.job_id) or "unknown"
        self._violate("grant_to_non_pending", f"grant to {state} job {e.job_id}", [e.job_id], e.gpus)
        return
    spec = job.spec
    if not rules.gang_size_ok(spec, len(e.gpus)):
        self._violate(
            "gang_size",
            f"job {e.job_id} granted {len(e.gpus)} GPUs, gang needs {spec.gang_min}..{spec.gpus}",
            [e.job_id],
            e.gpus,
        )
    job.share = 1.0
    granted = _take_share(self, job, e.gpus) if spec.shared else self._take(e.job_id, e.gpus, e.at)
    _reserve(self, spec, granted, 1)
    if self.handover:
        self.handover.clear()  # the grants after a release are decided: the hand-over had its turn
    del self.pending[e.job_id]
    self.running[e.job_id] = None
    job.state, job.attempt, job.gpus = "starting", e.attempt, granted
    job.placer, job.level, job.backfill = e.placer, e.level, e.backfill
    job.started_at, job.held_since, job.nodes_started = e.at, e.at, []
    job.generation, job.resized_at, job.partial, job.unhealthy, job.unhealthy_reason = 0, None, {}, [], ""
    self._may_run(job, e.gpus)
    job.yielded_idle, job.idle, job.idle_at = False, None, e.at
    if job.first_started_at is None:
        job.first_started_at = e.at
    job.pending_reason, job.pending_blockers, job.pending_eta_s = "", [], None
    job.pending_eta_range = None
    job.pending_why = None
    self._team_held(spec.team, job.weight, e.at)
    _pool_held(self, spec.team, granted, job.share)
    self._check_limit(spec.team, e.job_id, granted)


def _fold_resized(self, e: ev.JobResized) -> None:
    job = self.jobs.get(e.job_id)
    if job is None or not job.holding:
        self._violate("resize_of_idle_job", f"resize of job {e.job_id} that holds nothing", [e.job_id])
        return
    self._account(job, e.at)
    job.prev_nodes = len(job_node_order(job))
    not_held = [g for g in e.removed if g not in job.gpus]
    if not_held:
        self._violate("release_not_held", f"job {e.job_id} releases GPUs it does not hold", [e.job_id], not_held)
    removed = [g for g in e.removed if g in job.gpus]
    _give_back(self, removed)
    added = self._take(e.job_id, e.added, e.at)
    before = job.gpus
    job.gpus = [g for g in job.gpus if g not in removed] + added
    _reserve(self, job.spec, job.gpus, 1, before)
    self._team_held(job.team, len(added) - len(removed), e.at)
    _pool_held(self, job.team, removed, -1)
    _pool_held(self, job.team, added, 1)
    if job.idle is not None:
        _team_idle(self, job.team, len(added) - len(removed), e.at)
    if len(job.gpus) < job.spec.gang_min:
        self._violate(
            "below_gang_min",
            f"job {e.job_id} holds {len(job.gpus)} GPUs, gang minimum is {job.spec.gang_min}",
            [e.job_id],
            job.gpus,
        )
    if added:
        self._check_limit(job.team, e.job_id, added)
    # Every rank restarts with the new world size (checkpoint, stop all, start all).
    job.generation += 1
    job.resized_at, job.partial = e.at, {}
    job.unhealthy = [g for g in job.unhealthy if g in job.gpus]
    self._may_run(job, job.gpus)


def _fold_started(self, e: ev.JobStarted) -> None:
    job = self.jobs.get(e.job_id)
    if job is None:
        return
    others = [x for x in job.live if (x.attempt, x.generation) != (e.attempt, e.generation)]
    if others:
        self._violate("two_live_attempts",
                      f"job {e.job_id} attempt {e.attempt}.{e.generation} started on {e.node} while "
                      + ", ".join(f"attempt {x.attempt}.{x.generation} may run on {x.node}" for x in others),
                      [e.job_id])
    if not any(x.node == e.node and (x.attempt, x.generation) == (e.attempt, e.generation) for x in job.live):
        self._add_live(job, Live(e.node, e.attempt, e.generation))
    if e.log and len(job.logs) < 256:
        job.logs = [*job.logs, LogRef(e.attempt, e.generation, e.rank, e.node, e.log)]
    if not job.holding or job.attempt != e.attempt:
        return  # a late report from an attempt that already ended
    job.state = "running"
    if e.node not in job.nodes_started:
        job.nodes_started = [*job.nodes_started, e.node]


def _fold_preemption(self, e: ev.PreemptionRequested) -> None:
    job = self.jobs.get(e.job_id)
    if job is None or not job.holding:
        return
    if e.cause == "idle":  # the idle timeout serves the queue, not one job, and any class
        job.preemption = Preemption(e.for_job, e.reason, e.deadline, e.at, "idle")
        self.idle_jobs[job.job_id] = None
        return
    beneficiary = self.jobs.get(e.for_job)
    if beneficiary is None:
        self._violate("preemption_without_beneficiary", f"preemption of {e.job_id} serves no known job", [e.job_id])
    elif job.team != beneficiary.team:
        victim_t, for_t = self.team(job.team), self.team(beneficiary.team)
        if not rules.fair_preemption(job.team, victim_t.quota, victim_t.held,
                                     beneficiary.team, for_t.quota, for_t.held):
            self._violate(
                "unfair_preemption",
                f"team {job.team} (holds {victim_t.held} <= guaranteed {victim_t.quota.guaranteed}) "
                f"preempted for team {beneficiary.team} (holds {for_t.held} >= guaranteed "
                f"{for_t.quota.guaranteed})",
                [e.job_id, e.for_job],
            )
    if not job.spec.preemptible:
        self._violate("non_preemptible", f"job {e.job_id} is not preemptible", [e.job_id, e.for_job])
    job.preemption = Preemption(e.for_job, e.reason, e.deadline, e.at)


def _fold_checkpoint(self, e: ev.CheckpointSaved) -> None:
    """A rank's save completes a checkpoint once every rank that must save has saved that
    step in this attempt and generation; earlier or partial saves never replace it."""
    job = self.jobs.get(e.job_id)
    if job is None:
        return
    if not job.holding or job.attempt != e.attempt:
        # A rank-0 save that lands after its attempt ended is complete in rank0 mode.
        newer = job.checkpoint is None or e.step > job.checkpoint.step
        if e.attempt == job.attempt and e.rank == 0 and job.spec.checkpoint == "rank0" and newer:
            _set_checkpoint(job, Checkpoint(e.path, e.step, e.at, e.attempt, [e.path], e.sha256))
        return
    if e.generation == job.generation:
        ranks = checkpoint_ranks(job)
    elif e.generation == job.generation - 1:  # the ranks draining for a resize save for it
        ranks = list(range(max(1, job.prev_nodes))) if job.spec.checkpoint == "all" else [0]
    else:
        return
    ck = job.checkpoint
    if e.rank not in ranks or (ck is not None and ck.attempt == e.attempt and e.step < ck.step):
        return  # not a saving rank, or older than the attempt's complete checkpoint
    saved = dict(job.partial.get(e.step, {}))
    saved[e.rank] = e.path
    if all(r in saved for r in ranks):
        paths = [saved[r] for r in sorted(saved)]
        sha = e.sha256 if e.rank == 0 or len(ranks) == 1 else ""
        _set_checkpoint(job, Checkpoint(saved.get(0, paths[0]), e.step, e.at, e.attempt, paths, sha))
        job.partial = {s: p for s, p in job.partial.items() if s > e.step}
    else:
        partial = {**job.partial, e.step: saved}
        job.partial = dict(sorted(partial.items())[-PARTIAL_CHECKPOINTS:])


def array_task_id(array_job: str, index: int) -> str:
    return f"{array_job}_{index}"


def array_tasks(st: ClusterState, array_id: str) -> list[str]:
    """The ids of a job array's tasks, whole, forgotten or retired ([]: no such array)."""
    first, last = st.arrays.get(array_id, (0, -1))
    return [array_task_id(array_id, i) for i in range(first, last + 1)]


def _array_task_known(st: ClusterState, job_id: str) -> bool:
    """`job_id` is exactly the id of a task of a known array (`array_task_id`: ASCII digits, no
    leading zero; `str.isdigit` alone takes '²', which `int` refuses, and '٣', which it reads as 3)."""
    array_id, _, index = job_id.rpartition("_")
    span = st.arrays.get(array_id)
    if span is None or not (index.isascii() and index.isdigit()):
        return False
    i = int(index)
    return span[0] <= i <= span[1] and array_task_id(array_id, i) == job_id


def _array_index(st: ClusterState) -> dict[str, tuple[int, int]]:
    """`ClusterState.arrays` rebuilt from the tasks' ids (`<array>_<index>`), whole or forgotten."""
    index: dict[str, tuple[int, int]] = {}
    tasks = [(j.job_id, j.array_job) for j in st.jobs.values() if j.array_job]
    tasks += [(jid, t.array_job) for jid, t in st.forgotten.items() if t.array_job]
    for jid, array_id in tasks:
        i = int(jid.rsplit("_", 1)[1])
        first, last = index.get(array_id, (i, i))
        index[array_id] = (min(first, i), max(last, i))
    return index


def _submit_array(st: ClusterState, e: ev.JobSubmitted) -> None:
    """One job per index of the array, each with its index in its environment; the request id
    names the array."""
    arr = e.spec.array
    assert arr is not None
    ids = [array_task_id(e.job_id, i) for i in range(arr.first, arr.last + 1)]
    clash = [j for j in ids if j in st.jobs or j in st.forgotten]
    if clash:
        st._violate("duplicate_job", f"array {e.job_id} submitted over existing jobs", clash[:8])
        return
    st.arrays[e.job_id] = (arr.first, arr.last)
    for i, jid in zip(range(arr.first, arr.last + 1), ids):
        env = {**e.spec.env, "GPUSCHED_ARRAY_JOB_ID": e.job_id, "GPUSCHED_ARRAY_INDEX": str(i),
               "SLURM_ARRAY_JOB_ID": e.job_id, "SLURM_ARRAY_TASK_ID": str(i)}
        spec = msgspec.structs.replace(e.spec, env=env)
        st.jobs[jid] = Job(jid, spec, e.at, held_since=e.at, request_id=e.request_id, user=e.user, array_job=e.job_id)
        st.pending[jid] = None
    if e.request_id:
        st.requests[e.request_id] = e.job_id
    st.team(e.spec.team)


def _on_held(st: ClusterState, e: ev.JobHeld) -> None:
    """Only a pending job is held or released (admission refuses the rest; a late one is a no-op)."""
    job = st.jobs.get(e.job_id)
    if job is not None and job.state == "pending":
        job.hold = (f"{e.user or 'admin'}: {e.reason}" if e.reason else (e.user or "admin")) if e.held else None


def _on_updated(st: ClusterState, e: ev.JobUpdated) -> None:
    """A pending job's spec changes; it moves to the end of `pending` so that the queue index
    (which finds changed jobs there) re-sorts it."""
    job = st.jobs.get(e.job_id)
    if job is None or job.state != "pending":
        return
    changes: dict[str, object] = {}
    if e.priority is not None:
        changes["priority"] = e.priority
    if e.time_limit_s is not None:
        changes["time_limit_s"] = e.time_limit_s
    job.spec = msgspec.structs.replace(job.spec, **changes)
    job.updates += 1
    del st.pending[job.job_id]
    st.pending[job.job_id] = None


def _on_labeled(st: ClusterState, e: ev.NodeLabeled) -> None:
    node = st.nodes.get(e.node)
    if node is not None:
        labels = {**node.labels, **e.labels}
        for k in e.remove:
            labels.pop(k, None)
        node.labels = labels
        st.label_changes += 1


def _on_partition(st: ClusterState, e: ev.PartitionDeclared | ev.PartitionEnded) -> None:
    """Declared: the nodes take no new work, their jobs stay. Ended: usable again, or lost."""
    declared = isinstance(e, ev.PartitionDeclared)
    for name in e.nodes:
        node = st.nodes.get(name)
        if node is None or node.lost or node.partitioned == declared:
            continue
        node.partitioned = declared
        for g in node.gpus:
            st._refresh(g)
        if isinstance(e, ev.PartitionEnded) and e.lost:
            st._on_node_lost(ev.NodeLost(at=e.at, node=name, reason=e.reason))


_HANDLERS: dict[type, Any] = {
    ev.NodeLabeled: _on_labeled,
    ev.JobSubmitted: ClusterState._on_submitted,
    ev.JobHeld: _on_held,
    ev.JobUpdated: _on_updated,
    ev.JobPending: ClusterState._on_pending,
    ev.GpusGranted: _fold_granted,
    ev.JobResized: _fold_resized,
    ev.JobStarted: _fold_started,
    ev.ProcessesEnded: ClusterState._on_processes_ended,
    ev.JobOnUnhealthyGpu: ClusterState._on_unhealthy,
    ev.JobTimedOut: ClusterState._on_terminal,
    ev.PreemptionRequested: _fold_preemption,
    ev.JobIdle: _on_idle,
    ev.JobBusy: _on_busy,
    ev.CheckpointSaved: _fold_checkpoint,
    ev.GpusReleased: ClusterState._on_released,
    ev.JobCompleted: ClusterState._on_terminal,
    ev.JobFailed: ClusterState._on_terminal,
    ev.JobCancelled: ClusterState._on_terminal,
    ev.NodeRegistered: _on_registered,
    ev.NodeLost: ClusterState._on_node_lost,
    ev.PartitionDeclared: _on_partition,
    ev.PartitionEnded: _on_partition,
    ev.NodeDrained: ClusterState._on_node_drained,
    ev.GpuQuarantined: ClusterState._on_quarantined,
    ev.GpuRestored: ClusterState._on_restored,
    ev.ZombieDetected: ClusterState._on_zombie,
    ev.ZombieReclaimed: ClusterState._on_zombie_reclaimed,
    ev.TeamQuotaSet: ClusterState._on_quota,
    ev.FoldSettingsSet: ClusterState._on_fold_settings,
    ev.PlacementDegraded: ClusterState._on_degraded,
    ev.PlacementRecovered: ClusterState._on_recovered,
}


#: The state each terminal fact leaves a job in.
_END_STATE: dict[type, JobStatus] = {ev.JobCompleted: "completed", ev.JobFailed: "failed", ev.JobCancelled: "cancelled",
                                     ev.JobTimedOut: "timeout"}


def job_node_order(job: Job) -> list[str]:
    """The job's nodes in grant order: a node's rank is its position here."""
    return list(dict.fromkeys(g.rpartition("/")[0] for g in job.gpus))


def checkpoint_ranks(job: Job) -> list[int]:
    """The node ranks whose saves make a checkpoint of the job complete."""
    if job.spec.checkpoint == "all":
        return list(range(max(1, len(job_node_order(job)))))
    return [0]


def stale_live(job: Job) -> list[Live]:
    """Fence entries that are not the current attempt and generation of a holding job."""
    if not job.holding:
        return list(job.live)
    return [x for x in job.live if (x.attempt, x.generation) != (job.attempt, job.generation)]


def fold(events, half_life_s: float | None = 7 * 24 * 3600.0) -> ClusterState:
    """Replay a sequence of events (or (seq, event) pairs) into a fresh state."""
    state = ClusterState(half_life_s=half_life_s)
    for item in events:
        if isinstance(item, tuple):
            state.apply(item[1], item[0])
        else:
            state.apply(item)
    return state
