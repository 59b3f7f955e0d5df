"""Commands are requests, not facts: clients send them to `gpusched.cmd.*` (request/reply) and
admission answers with a `CommandReply`. Only services append events."""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta, Struct

from . import limits as L
from .model import SCHEMA_VERSION, FoldSettings, JobId, JobSpec, Priority, Team, TeamQuota

RequestId = Annotated[str, Meta(min_length=1, max_length=L.MAX_REQUEST_ID_CHARS, pattern=L.NO_NUL_PATTERN)]
JobRef = Annotated[str, Meta(min_length=1, max_length=L.NAME_MAX + 2, pattern=L.NO_NUL_PATTERN)]


class Command(Struct, frozen=True, kw_only=True, tag_field="type", tag=True, forbid_unknown_fields=True):
    request_id: RequestId
    v: int = SCHEMA_VERSION


class SubmitJob(Command, frozen=True, kw_only=True):
    spec: JobSpec


class CancelJob(Command, frozen=True, kw_only=True):
    job_id: JobRef
    reason: L.Reason = "cancelled by user"


class SetTeamQuota(Command, frozen=True, kw_only=True):
    """Set a team's terms. `only` (non-empty): change just these fields of its current quota,
    taking their values from `quota` (admission merges against the fold, so two partial
    updates never undo each other); empty: replace the whole quota."""

    team: Team
    quota: TeamQuota
    #: "models" merges per pool: the entries given replace those pools' (one of guaranteed 0 and
    #: no limit removes its pool), the others stay.
    only: list[Literal["guaranteed", "weight", "limit", "default_time_limit_s", "max_time_limit_s",
                       "default_cpus", "default_memory_mb", "models"]] = []


class DrainNode(Command, frozen=True, kw_only=True):
    """Drain a node now, or (with `until`, optionally `at`: epoch seconds) a maintenance window
    [at or now, until): placement keeps off the node every job whose time limit would reach into
    it; after `until` the node returns with no further command. `drain=False` undoes both."""

    node: L.NodeName
    drain: bool = True
    reason: L.Reason = ""
    at: Annotated[float, Meta(ge=0)] | None = None
    until: Annotated[float, Meta(ge=0)] | None = None


class RestoreGpu(Command, frozen=True, kw_only=True):
    """An operator puts a quarantined GPU back into service (an XID that was cleared, leaked
    memory that was checked): admission appends `GpuRestored`."""

    gpu: str
    reason: str = ""


class HoldJob(Command, frozen=True, kw_only=True):
    """Keep a pending job from being placed (`hold=False`: release it). A tenant may hold its
    own team's jobs only; admin any."""

    job_id: JobRef
    hold: bool = True
    reason: L.Reason = ""


class UpdateJob(Command, frozen=True, kw_only=True):
    """Change a pending job: its priority class and/or its time limit (None: unchanged). The
    team's maximum time limit applies as at submit."""

    job_id: JobRef
    priority: Priority | None = None
    time_limit_s: L.TimeLimit | None = None


class LabelNode(Command, frozen=True, kw_only=True):
    """Set (`labels`) or remove (`remove`) key=value labels of a node (admin)."""

    node: L.NodeName
    labels: L.Labels = {}
    remove: Annotated[list[L.LabelKey], Meta(max_length=32)] = []


class SetFoldSettings(Command, frozen=True, kw_only=True):
    """Admin: the fold's settings from now on (`gpusched fold-settings`): one fact every fold reads."""

    settings: FoldSettings
    reason: L.Reason = ""


class SetMigGeometry(Command, frozen=True, kw_only=True):
    """Admin: lay out a MIG GPU's slices (`gpusched mig set NODE GPU PROFILES`), one profile per
    slice; [] makes it whole again. Refused while anybody holds the GPU."""

    node: L.NodeName
    gpu: Annotated[int, Meta(ge=0, le=1023)]
    profiles: L.MigGeometry = []
    reason: L.Reason = ""


AnyCommand = Union[SubmitJob, CancelJob, SetTeamQuota, DrainNode, RestoreGpu, HoldJob, UpdateJob, LabelNode,
                   SetFoldSettings, SetMigGeometry]
COMMAND_TYPES: dict[str, type[Command]] = {c.__name__: c for c in AnyCommand.__args__}  # type: ignore[attr-defined]


class CommandReply(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`ok=False` carries a precise `error`; `job_id` names the job a submit created (or found,
    for a repeated request id); `seq` is the log sequence of the appended fact."""

    ok: bool
    error: str = ""
    job_id: JobId | None = None
    seq: int | None = None
    duplicate: bool = False
    #: Accepted, but worth a look (e.g. guarantees that add up to more than the cluster).
    warning: str = ""


_decoder = msgspec.json.Decoder(AnyCommand)


def decode_command(data: bytes) -> Command:
    return _decoder.decode(data)
