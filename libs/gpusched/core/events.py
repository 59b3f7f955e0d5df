"""The facts of the log, read top to bottom like a glossary.

Every event is a small frozen msgspec Struct tagged by its class name (`"type"` in JSON) and
carries `v` (schema version) and `at` (the unix time its writer decided it: the fold never
reads a clock). Events whose `ALLOC` flag is set change who holds a GPU or whether a GPU may be
held; they live under one subject tree so that grants can compare-and-set over it.

How facts evolve (a log lives for years; eventsourcing's `class_version` and upcasters):

- `v` is the shape of the event's class its writer knew: `Event.VERSION`, raised by a class
  whenever it gains a field (its `HISTORY` says what each version added).
- A writer may only *add* fields, with defaults under which the old meaning holds. A reader
  accepts the fields it does not know from a newer writer (`decode_event` drops them and folds
  the rest), so readers and writers can be upgraded in either order. A change an old reader
  must not ignore is a new event type, which old readers dead-letter: upgrade readers first.
- A shape that changed otherwise (a field renamed, a meaning narrowed) gets an upcaster in
  `UPCASTERS`, (type, stored v) -> a function turning that stored shape into the next; every
  shape ever appended stays readable, and `tests/unit/test_event_versions.py` keeps one of each
  as a fixture.
- Commands stay strict (`forbid_unknown_fields`): a typo in a request is refused precisely.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, Union

import msgspec
from msgspec import Meta, Struct

from . import limits as L
from .model import (
    SCHEMA_VERSION,
    FoldSettings,
    GpuId,
    GpuInfo,
    JobId,
    JobSpec,
    Level,
    NvlinkLayout,
    Priority,
    TeamQuota,
)
from .reasons import Reason


class Event(Struct, frozen=True, kw_only=True, tag_field="type", tag=True, forbid_unknown_fields=True):
    at: float
    v: int = SCHEMA_VERSION
    ALLOC: ClassVar[bool] = False
    #: The class's current shape (see the module docstring); a class that raises it sets `v`'s
    #: default to match (`test_event_versions.py` checks they agree).
    VERSION: ClassVar[int] = SCHEMA_VERSION
    HISTORY: ClassVar[dict[int, str]] = {1: "first shape"}

    @property
    def kind(self) -> str:
        return type(self).__name__


# --- jobs -----------------------------------------------------------------------------------


class JobSubmitted(Event, frozen=True, kw_only=True):
    """Admission accepted a job. `request_id` makes resubmission idempotent past JetStream's
    duplicate window."""

    VERSION: ClassVar[int] = 6
    HISTORY: ClassVar[dict[int, str]] = {1: "first shape", 2: "spec.prefer (soft placement preferences)",
                                         3: "spec.gpu_fraction, spec.gpu_memory_mb (fractional GPUs)",
                                         4: "via (a platform's submit on behalf of a user)",
                                         5: "spec.gpu_type_fallback (ordered GPU types)",
                                         6: "spec.mig, spec.mig_count (MIG slices)"}
    v: int = 6
    job_id: JobId
    spec: JobSpec
    request_id: str = ""
    #: Who submitted it: the user of the command subject the server allowed (never the payload).
    user: str = ""
    #: The platform that submitted it on behalf of `user` (the subject's), or "" (the user itself).
    via: str = ""


class JobRejected(Event, frozen=True, kw_only=True):
    """Admission refused a well-formed submission; kept for audit."""

    request_id: str
    team: str
    reason: str


class JobPending(Event, frozen=True, kw_only=True):
    """Why a job waits, appended only when the reason changes (not once per cycle)."""

    job_id: JobId
    reason: str
    blockers: list[str] = []
    eta_s: float | None = None
    #: The range of the ETA where it rests on predicted run times (`policy/predict.py`).
    eta_low_s: float | None = None
    eta_high_s: float | None = None
    #: The typed reason the deciding step recorded (`core/reasons.py`); `reason` is its text.
    why: Reason | None = None


class JobHeld(Event, frozen=True, kw_only=True):
    """A pending job is held (never placed) or, `held=False`, released again (Slurm's
    hold/release). `user`: who asked, from the command subject."""

    job_id: JobId
    held: bool = True
    reason: str = ""
    user: str = ""


class JobUpdated(Event, frozen=True, kw_only=True):
    """A pending job's priority class and/or time limit changed (None: unchanged)."""

    job_id: JobId
    priority: Priority | None = None
    time_limit_s: float | None = None
    user: str = ""


class GpusGranted(Event, frozen=True, kw_only=True):
    """A gang starts: every GPU of the job in one append, or none. `level` is the widest
    topology level the set spans; `placer` tells topology-aware placement from the fallback;
    `handover`: it starts ahead of its team's queue on GPUs a preemption freed for it; `slices`:
    a MIG job's slices of its one GPU (indices into that GPU's `MigGeometrySet` geometry)."""

    ALLOC: ClassVar[bool] = True
    VERSION: ClassVar[int] = 3
    HISTORY: ClassVar[dict[int, str]] = {1: "first shape", 2: "handover", 3: "slices (MIG slices)"}
    v: int = 3
    job_id: JobId
    attempt: int
    gpus: list[GpuId]
    placer: Literal["topo", "naive", "sim"] = "topo"
    level: Level = "cluster"
    backfill: bool = False
    handover: bool = False
    slices: Annotated[list[Annotated[int, Meta(ge=0, lt=L.MAX_MIG_SLICES)]], Meta(max_length=L.MAX_MIG_SLICES)] = []


class JobResized(Event, frozen=True, kw_only=True):
    """An elastic job grows into idle GPUs (`added`) or shrinks on demand (`removed`)."""

    ALLOC: ClassVar[bool] = True
    job_id: JobId
    added: list[GpuId] = []
    removed: list[GpuId] = []
    reason: str = ""


class JobStarted(Event, frozen=True, kw_only=True):
    """A node daemon started the job's processes for this attempt on one node, as node rank
    `rank`. `generation` counts the restarts of all ranks within the attempt (an elastic
    resize restarts every rank); `log` is where the rank's stdout/stderr are kept on the node."""

    job_id: JobId
    attempt: int
    node: str
    pids: list[int] = []
    rank: int = 0
    generation: int = 0
    log: str = ""


class ProcessesEnded(Event, frozen=True, kw_only=True):
    """Every process of this attempt (and generation) on this node is dead: the fence that lets
    the next attempt start. Reported by the node daemon that ran them, also when it finds
    them gone after a restart; a `NodeLost` fences a node's processes too."""

    job_id: JobId
    attempt: int
    node: str
    generation: int = 0
    exit_code: int | None = None
    reason: str = ""


class PreemptionRequested(Event, frozen=True, kw_only=True):
    """Ask a running job to checkpoint and yield by `deadline`, naming the job it serves.
    `cause` "idle": the idle timeout of its priority class reclaims an idle job (`for_job` is
    the job itself; it serves the queue, and waits behind it once requeued)."""

    job_id: JobId
    for_job: JobId
    reason: str
    deadline: float
    cause: Literal["preempt", "idle"] = "preempt"


class JobIdle(Event, frozen=True, kw_only=True):
    """The reconciler saw every GPU of the job under `threshold_pct` utilization for `window_s`
    (idle since `since`). Appended when the conclusion changes, never per heartbeat. Evidence:
    the window's mean and highest utilization and mean memory used per GPU."""

    job_id: JobId
    attempt: int
    since: float
    window_s: float
    threshold_pct: float
    util_pct: float = 0.0
    util_pct_max: float = 0.0
    memory_mb: float = 0.0


class JobBusy(Event, frozen=True, kw_only=True):
    """A job the reconciler had reported idle uses its GPUs again (`util_pct`: the GPU seen busy)."""

    job_id: JobId
    attempt: int
    util_pct: float = 0.0
    gpu: GpuId = ""


class CheckpointSaved(Event, frozen=True, kw_only=True):
    """One node rank saved `step` durably. The checkpoint is complete (usable to resume, and
    enough to release a preempted job) once every rank its spec's `checkpoint` mode names has
    saved the same step. `sha256`: the file's (or tree's)
    checksum as the job's SDK computed it; a resume verifies it and falls back to the checkpoint before."""

    job_id: JobId
    attempt: int
    path: str
    step: int
    rank: int = 0
    generation: int = 0
    #: The node daemon that reports it (its subject carries the node, so permissions can say so).
    node: str | None = None
    sha256: Annotated[str, Meta(pattern="^([0-9a-f]{64})?$")] = ""


class GpusReleased(Event, frozen=True, kw_only=True):
    """A running job gives back all its GPUs and goes back to the queue, to resume from its
    last checkpoint. `forced`: it did not checkpoint in time; `lost_gpu_s` is the work lost;
    `for_job`: the blocked job a preemption freed them for, the hand-off the preemptor's
    `PreemptionRequested.for_job` began and a `GpusGranted` (`handover`) ends."""

    ALLOC: ClassVar[bool] = True
    VERSION: ClassVar[int] = 2
    HISTORY: ClassVar[dict[int, str]] = {1: "first shape", 2: "for_job"}
    v: int = 2
    job_id: JobId
    reason: Literal["preempted", "no_process", "node_lost", "drained", "process_failed"]
    forced: bool = False
    lost_gpu_s: float = 0.0
    node: str | None = None  # the reporting node daemon, when a node reports it (process_failed)
    for_job: JobId | None = None


class JobCompleted(Event, frozen=True, kw_only=True):
    ALLOC: ClassVar[bool] = True
    job_id: JobId
    attempt: int
    exit_code: int = 0
    node: str | None = None  # the reporting node daemon, when a node reports it


class JobFailed(Event, frozen=True, kw_only=True):
    ALLOC: ClassVar[bool] = True
    job_id: JobId
    attempt: int
    reason: str
    exit_code: int | None = None
    node: str | None = None  # the reporting node daemon, when a node reports it


class JobTimedOut(Event, frozen=True, kw_only=True):
    """The job ran past its time limit and ends (Slurm's TIMEOUT); its node daemons asked it to
    checkpoint a grace period before."""

    ALLOC: ClassVar[bool] = True
    job_id: JobId
    attempt: int
    limit_s: float


class JobOnUnhealthyGpu(Event, frozen=True, kw_only=True):
    """A running job holds a GPU that was quarantined: the job is told (and, per policy, moved)."""

    job_id: JobId
    attempt: int
    gpus: list[GpuId]
    reason: str


class JobCancelled(Event, frozen=True, kw_only=True):
    ALLOC: ClassVar[bool] = True
    job_id: JobId
    reason: str = "cancelled by user"


# --- nodes and GPUs -------------------------------------------------------------------------


class NodeRegistered(Event, frozen=True, kw_only=True):
    """A node daemon announced its GPUs and where it sits: rack, optional block. `cpus` and
    `memory_mb`: what it offers jobs (0: not declared, then placement does not count them there)."""

    ALLOC: ClassVar[bool] = True
    VERSION: ClassVar[int] = 3
    HISTORY: ClassVar[dict[int, str]] = {1: "first shape", 2: "cpus and memory_mb (CPUs and memory as resources)",
                                         3: "gpus[].mig (MIG mode and profiles)"}
    v: int = 3
    node: str
    rack: str
    gpus: list[GpuInfo]
    block: str | None = None
    nvlink: NvlinkLayout | Literal["custom"] = "custom"
    address: str = ""
    #: key=value labels the node announces (agent `--label`); an admin's `NodeLabeled` wins.
    labels: dict[str, str] = {}
    cpus: Annotated[float, Meta(ge=0, le=1_000_000)] = 0.0
    memory_mb: Annotated[int, Meta(ge=0, le=2**40)] = 0


class NodeLabeled(Event, frozen=True, kw_only=True):
    """An admin sets (`labels`) or removes (`remove`) labels of a node, matched against jobs'
    `constraints`."""

    node: str
    labels: dict[str, str] = {}
    remove: list[str] = []


class NodeLost(Event, frozen=True, kw_only=True):
    """Heartbeats stopped. Jobs on the node go back to the queue from their checkpoints."""

    ALLOC: ClassVar[bool] = True
    node: str
    reason: str


class PartitionDeclared(Event, frozen=True, kw_only=True):
    """Many nodes went silent within one node timeout (more than the reconciler's share of all
    nodes, or of one rack): an outage between them and the control plane, not that many dead
    nodes. Their jobs are not requeued and no new work goes to them, until `PartitionEnded`."""

    ALLOC: ClassVar[bool] = True
    nodes: list[str]
    reason: str


class PartitionEnded(Event, frozen=True, kw_only=True):
    """Nodes of a declared partition are back (their heartbeats returned), or an admin
    confirmed them gone (`lost=True`: each is then lost as by `NodeLost`, its jobs requeued)."""

    ALLOC: ClassVar[bool] = True
    nodes: list[str]
    reason: str
    lost: bool = False


class NodeDrained(Event, frozen=True, kw_only=True):
    """An operator keeps new work off a node (`drain=False` undoes it, and its windows). Running
    jobs finish. With `until`: a maintenance window [`start`, `until`) instead, which bars the
    node only for jobs whose time limit reaches into it, and ends by itself."""

    ALLOC: ClassVar[bool] = True
    node: str
    drain: bool = True
    reason: str = ""
    start: float | None = None
    until: float | None = None


class GpuQuarantined(Event, frozen=True, kw_only=True):
    """An unhealthy GPU (XID, ECC), or one whose memory stays in use with no process on it
    after its job ended ("leaked memory: ..."), is kept out of placement."""

    ALLOC: ClassVar[bool] = True
    gpu: GpuId
    reason: str


class MigGeometrySet(Event, frozen=True, kw_only=True):
    """The admin lays out a MIG GPU's slices, one profile each (`gpusched mig set`; [] makes it
    whole again). Admission appends it only while nobody holds the GPU, as a compare-and-set on
    the alloc tree, so no grant can slip in between; the node creates the GPU instances."""

    ALLOC: ClassVar[bool] = True
    gpu: GpuId
    profiles: L.MigGeometry = []
    reason: str = ""
    user: str = ""


class GpuRestored(Event, frozen=True, kw_only=True):
    ALLOC: ClassVar[bool] = True
    gpu: GpuId
    reason: str = ""


class ZombieDetected(Event, frozen=True, kw_only=True):
    """A process runs on a GPU that nothing holds: keep the GPU out until it is clean."""

    ALLOC: ClassVar[bool] = True
    gpu: GpuId
    pids: list[int]


class ZombieReclaimed(Event, frozen=True, kw_only=True):
    """The zombie is gone; the GPU is placeable again."""

    ALLOC: ClassVar[bool] = True
    gpu: GpuId
    pids: list[int] = []


# --- teams and the control plane ------------------------------------------------------------


class TeamQuotaSet(Event, frozen=True, kw_only=True):
    VERSION: ClassVar[int] = 3
    HISTORY: ClassVar[dict[int, str]] = {1: "first shape", 2: "quota.default_cpus, quota.default_memory_mb",
                                         3: "quota.models (per GPU pool terms)"}
    v: int = 3
    team: str
    quota: TeamQuota


class FoldSettingsSet(Event, frozen=True, kw_only=True):
    """From this fact on, every fold (services, `replay`, the audit) decays usage and forgets
    finished jobs with these settings: admin's decision, through admission (`gpusched
    fold-settings`). Usage up to it decays with the settings before it."""

    settings: FoldSettings
    reason: str = ""


class PlacementDegraded(Event, frozen=True, kw_only=True):
    """The placement lease lapsed: naive first-free placement has taken over."""

    reason: str


class PlacementRecovered(Event, frozen=True, kw_only=True):
    reason: str = ""


class SnapshotTaken(Event, frozen=True, kw_only=True):
    """The projector wrote a snapshot of the fold as of `seq` (to Redis); `digest` is the
    SHA-256 of its bytes. A restarting service uses a snapshot only if it matches the latest
    seal in the log (`security.snapshots`). `at` is the fold's time at `seq`, not a clock's."""

    seq: int
    digest: str


AnyEvent = Union[
    JobSubmitted,
    JobRejected,
    JobPending,
    JobHeld,
    JobUpdated,
    GpusGranted,
    JobResized,
    JobStarted,
    ProcessesEnded,
    PreemptionRequested,
    JobIdle,
    JobBusy,
    CheckpointSaved,
    GpusReleased,
    JobCompleted,
    JobFailed,
    JobCancelled,
    JobTimedOut,
    JobOnUnhealthyGpu,
    NodeRegistered,
    NodeLabeled,
    NodeLost,
    PartitionDeclared,
    PartitionEnded,
    NodeDrained,
    GpuQuarantined,
    GpuRestored,
    MigGeometrySet,
    ZombieDetected,
    ZombieReclaimed,
    TeamQuotaSet,
    FoldSettingsSet,
    PlacementDegraded,
    PlacementRecovered,
    SnapshotTaken,
]

EVENT_TYPES: dict[str, type[Event]] = {cls.__name__: cls for cls in AnyEvent.__args__}  # type: ignore[attr-defined]

_decoder = msgspec.json.Decoder(AnyEvent)
_encoder = msgspec.json.Encoder()


#: (event type, stored v) -> the stored shape turned into the next version's. Empty so far:
#: every change has been an added field with a default (see the module docstring).
UPCASTERS: dict[tuple[str, int], Callable[[dict[str, Any]], dict[str, Any]]] = {}


def decode_event(data: bytes) -> Event:
    """Decode any event; raises msgspec.ValidationError / DecodeError with a precise reason.
    The current shape decodes in one call; an older one goes through its upcasters, and the
    fields of a newer writer this reader does not know are dropped (`_known`)."""
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError:
        raw = msgspec.json.decode(data)
        cls = EVENT_TYPES.get(str(raw.get("type"))) if isinstance(raw, dict) else None
        if cls is None:
            raise
        return msgspec.convert(_known(upcast(raw), msgspec.inspect.type_info(cls)), AnyEvent)


def upcast(raw: dict[str, Any]) -> dict[str, Any]:
    """A stored event's fields in its class's current shape (`UPCASTERS`, oldest first)."""
    kind, v = raw.get("type"), raw.get("v", SCHEMA_VERSION)
    while isinstance(v, int) and (step := UPCASTERS.get((kind, v))) is not None:  # type: ignore[arg-type]
        raw, v = step(raw), v + 1
        raw["v"] = v
    return raw


def _known(obj: Any, info: msgspec.inspect.Type) -> Any:
    """`obj` less the object fields its type does not declare, at every depth."""
    if isinstance(info, msgspec.inspect.UnionType):
        for t in info.types:
            if isinstance(t, msgspec.inspect.StructType) and isinstance(obj, dict):
                return _known(obj, t)
        return obj
    if isinstance(info, msgspec.inspect.StructType) and isinstance(obj, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        tag = info.tag_field
        return {k: _known(v, fields[k]) if k in fields else v for k, v in obj.items() if k in fields or k == tag}
    if isinstance(info, (msgspec.inspect.ListType, msgspec.inspect.SetType, msgspec.inspect.FrozenSetType,
                         msgspec.inspect.VarTupleType)) and isinstance(obj, list):
        return [_known(x, info.item_type) for x in obj]
    if isinstance(info, msgspec.inspect.DictType) and isinstance(obj, dict):
        return {k: _known(v, info.value_type) for k, v in obj.items()}
    if isinstance(info, msgspec.inspect.Metadata):
        return _known(obj, info.type)
    return obj


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


class InvalidFact(ValueError):
    """A fact its readers would dead-letter: refused before it is stored, never after."""


def encode_fact(event: Event) -> bytes:
    """Encode a fact for the log, checking it decodes: msgspec does not validate a struct built
    in code (a literal outside its set, a bound broken), and a stored fact no reader can fold
    would be lost to every replay."""
    payload = _encoder.encode(event)
    try:
        _decoder.decode(payload)
    except msgspec.ValidationError as e:
        raise InvalidFact(f"{type(event).__name__}: {e}") from None
    return payload
