"""The fold's records: what `ClusterState` keeps of each job, team, GPU holder and broken
rule, and small pure helpers on them (no state, no event): the policies, the CLI and the
node daemon read these, the fold's reducers (`core/fold/`) write them.
"""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

from .model import GpuId, JobSpec, TeamQuota
from .reasons import Reason

JobStatus = Literal["pending", "starting", "running", "completed", "failed", "cancelled", "timeout"]
HOLDING = ("starting", "running")
TERMINAL = ("completed", "failed", "cancelled", "timeout")
JOB_STATES: tuple[str, ...] = ("pending", "starting", "running", "completed", "failed", "cancelled", "timeout")


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
    via: str = ""  # the platform that submitted it on behalf of `user` ("": the user itself)
    hold: str | None = None  # held (`gpusched hold`): who held it and why; None: not held
    updates: int = 0  # `JobUpdated` applied (the queue index re-sorts a job whose count moved)
    array_job: str = ""  # a task of a job array: the array's id (the task's id is `<array>_<index>`)
    share: float = 1.0  # the share of each of its GPUs it holds: below 1 for a fractional or MIG job (its grant)
    slices: list[int] = []  # a MIG job's slices of its one GPU (indices into its geometry), while it holds them

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
    and stored before shares), a fractional one is rounded so that sums of shares do not drift.
    A sum within a millionth of a whole count is that count: shares are whole millionths, and
    MIG slices are sevenths (seven 1/7 slices sum to one GPU, not 1.000000001)."""
    r = round(float(value), 9)
    whole = round(r)
    return int(whole) if abs(r - whole) < 1e-6 else r


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


def account(job: Job, at: float) -> None:
    """Settle the job's attained (and idle) GPU-seconds up to `at`: its held GPUs or share
    change from here on."""
    job.service_gpu_s += job.weight * max(0.0, at - job.held_since)
    job.held_since = at
    if job.idle is not None:
        job.idle_gpu_s += job.weight * max(0.0, at - job.idle_at)
        job.idle_at = max(job.idle_at, at)


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
