"""What a node daemon says on the bus outside the log: heartbeats and node-control messages.

Heartbeats are telemetry (core NATS on `subjects.heartbeat_subject(node)`), not facts: the
reconciler turns what they show into facts (node lost, zombie, quarantine). The node-control
messages are the request/reply protocol on `subjects.node_control_subject(node)`.
Both are part of the public contract: `SCHEMAS` lists their JSON Schemas.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta, Struct

from gpusched.core import limits as L
from gpusched.core.model import SCHEMA_VERSION

#: Bounds on what a node daemon says (a heartbeat is read by the reconciler at every beat).
Text = Annotated[str, Meta(max_length=256)]
Detail = Annotated[str, Meta(max_length=L.MAX_REASON_CHARS)]
Pids = Annotated[list[Annotated[int, Meta(ge=0, le=2**32)]], Meta(max_length=4096)]
GpuIndex = Annotated[int, Meta(ge=0, le=1023)]


class GpuSample(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One GPU at one instant. `pids`: every process the backend sees on the GPU (NVML compute
    processes; the simulated backend: what the agent started there plus injected strays).
    `healthy` is False after a critical XID or an uncorrected ECC error; `health` says why."""

    index: GpuIndex
    uuid: Text
    memory_used_mb: Annotated[int, Meta(ge=0, le=2**40)] = 0
    memory_total_mb: Annotated[int, Meta(ge=0, le=2**40)] = 0
    utilization_pct: Annotated[float, Meta(ge=0, le=100)] = 0.0
    temperature_c: Annotated[float, Meta(ge=-100, le=300)] | None = None  # None: the backend cannot read it
    pids: Pids = []
    healthy: bool = True
    health: Detail = ""
    xid: Annotated[int, Meta(ge=0, le=2**32)] | None = None
    ecc_errors: Annotated[int, Meta(ge=0, le=2**62)] = 0


JobProcessState = Literal["running", "stopping", "exited"]


class JobReport(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A job process the agent runs for one attempt on this node. `exited` with `exit_code` 0
    is a non-zero rank that finished first and waits for rank 0 (its GPUs are still held)."""

    job_id: Text
    attempt: Annotated[int, Meta(ge=0, le=2**31)]
    gpus: Annotated[list[GpuIndex], Meta(max_length=1024)]
    pids: Pids = []
    state: JobProcessState = "running"
    exit_code: Annotated[int, Meta(ge=-256, le=256)] | None = None


class Heartbeat(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Published every `heartbeat_s` by each node daemon. `agent_id` changes when the daemon
    restarts; `seq` counts heartbeats since then."""

    node: L.NodeName
    at: float
    agent_id: Text
    seq: Annotated[int, Meta(ge=0)]
    backend: Text
    gpus: Annotated[list[GpuSample], Meta(max_length=1024)]
    jobs: Annotated[list[JobReport], Meta(max_length=1024)] = []
    v: int = SCHEMA_VERSION


# --- node control (request/reply) -------------------------------------------------------------


class NodeRequest(Struct, frozen=True, kw_only=True, tag_field="type", tag=True, forbid_unknown_fields=True):
    v: int = SCHEMA_VERSION


class KillProcesses(NodeRequest, frozen=True, kw_only=True):
    """Kill processes that run on this node's GPUs (zombies). Pids not seen on one of the
    node's GPUs are refused: the daemon never kills an arbitrary process."""

    pids: list[int]
    gpu: str | None = None
    reason: str = ""


class InjectStray(NodeRequest, frozen=True, kw_only=True):
    """Simulated backend only: report `pid` as a process on GPU `index` (chaos, tests)."""

    index: int
    pid: int


class InjectHealth(NodeRequest, frozen=True, kw_only=True):
    """Simulated backend only: mark GPU `index` unhealthy with an XID (or healthy again)."""

    index: int
    healthy: bool = False
    xid: int | None = 79
    reason: str = ""


class InjectLeak(NodeRequest, frozen=True, kw_only=True):
    """Simulated backend only: GPU `index` shows `memory_mb` in use by no process (a driver
    leak after a crash); 0 frees it. Admin-only, like every node-control message but kills."""

    index: int
    memory_mb: int = 4096


class ResetGpu(NodeRequest, frozen=True, kw_only=True):
    """Reset GPU `index` (leaked memory). Refused while any process is on it; the reconciler
    sends it only with `--reset-leaked`, for a GPU that nothing holds and that is idle."""

    index: int
    reason: str = ""


class SimulateCrash(NodeRequest, frozen=True, kw_only=True):
    """Simulated backend only: the machine dies (its job processes too) and the daemon goes
    silent; with `revive_after_s` it comes back and registers again."""

    revive_after_s: float | None = None


AnyNodeRequest = Union[KillProcesses, InjectStray, InjectHealth, InjectLeak, ResetGpu, SimulateCrash]


class NodeReply(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    ok: bool
    node: str
    error: str = ""
    killed: list[int] = []
    missing: list[int] = []
    refused: list[int] = []


# --- job logs (request/reply on `subjects.node_logs_subject(node)`) ------------------------------

#: The most bytes one `LogReply` carries (well under NATS's max payload).
MAX_LOG_CHUNK = 256 * 1024


class LogRequest(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Part of one rank's stdout/stderr of one attempt: `max_bytes` from byte `offset` (a
    negative offset counts from the end). `generation` None: the latest of the attempt."""

    job_id: str
    attempt: int
    rank: int = 0
    generation: int | None = None
    offset: int = 0
    max_bytes: Annotated[int, Meta(ge=1, le=MAX_LOG_CHUNK)] = 64 * 1024
    v: int = SCHEMA_VERSION


class LogReply(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`data` (UTF-8, undecodable bytes replaced) ends at byte `offset` of a file of `size` bytes."""

    ok: bool
    node: str
    error: str = ""
    path: str = ""
    data: str = ""
    offset: int = 0
    size: int = 0


_heartbeat_decoder = msgspec.json.Decoder(Heartbeat)
_request_decoder = msgspec.json.Decoder(AnyNodeRequest)
_reply_decoder = msgspec.json.Decoder(NodeReply)


def decode_heartbeat(data: bytes) -> Heartbeat:
    return _heartbeat_decoder.decode(data)


def decode_request(data: bytes) -> NodeRequest:
    return _request_decoder.decode(data)


def decode_reply(data: bytes) -> NodeReply:
    return _reply_decoder.decode(data)


#: Schema file name -> type, written to `schemas/` by `gpusched schemas`.
SCHEMAS: dict[str, object] = {
    "heartbeat.schema.json": Heartbeat,
    "node-control.schema.json": AnyNodeRequest,
    "node-control-reply.schema.json": NodeReply,
    "node-logs.schema.json": LogRequest,
    "node-logs-reply.schema.json": LogReply,
}
