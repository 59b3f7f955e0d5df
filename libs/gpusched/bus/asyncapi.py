"""`schemas/asyncapi.json`: every subject an integrator can use, generated from the code.

The subjects come from `bus.subjects` itself (its functions are called with placeholder ids and
the placeholders turned back into AsyncAPI channel parameters), so the document follows whatever
subjects the code has; the payloads are `$ref`s into the JSON Schemas beside it (`gpusched
schemas` writes both, and the drift test covers both). AsyncAPI 3.0: channels (addresses with
`{parameters}`), operations (`send` for requests integrators make, `receive` for what they read)
and messages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpusched.core import schemas
from gpusched.core.events import EVENT_TYPES
from gpusched.core.model import SCHEMA_VERSION
from gpusched.security.roles import EVENT_WRITERS

from . import subjects

FILE = "asyncapi.json"
#: Placeholder ids: `token()` leaves them as they are, so they can be found again in a subject.
_PLACEHOLDER = {name: f"PARAM_{name}_" for name in ("job_id", "node", "gpu", "team", "request_id", "user")}
_PARAM_TEXT = {
    "job_id": "the job the event is about", "node": "the node (host) name", "gpu": "a GPU id `node/index`",
    "team": "the team", "request_id": "the client's request id", "user": "the submitting user",
    "shard": f"`s00`..`s{subjects.ALLOC_SHARDS - 1:02d}`: crc32 of the event's key modulo {subjects.ALLOC_SHARDS}",
}


def _parametrize(subject: str) -> str:
    for name, placeholder in _PLACEHOLDER.items():
        subject = subject.replace(subjects.alloc_shard(placeholder), "{shard}").replace(placeholder, "{" + name + "}")
    return subject


def _event_address(cls: type) -> str:
    """The subject pattern of an event kind: `event_subject` of a stand-in with placeholder ids."""
    fields = set(getattr(cls, "__struct_fields__", ()))
    stand_in = type(cls.__name__, (), {"ALLOC": cls.ALLOC,  # type: ignore[attr-defined]
                                       **{f: p for f, p in _PLACEHOLDER.items() if f in fields}})
    return _parametrize(subjects.event_subject(stand_in()))  # type: ignore[arg-type]


def _command_addresses() -> dict[str, list[str]]:
    """Command type name -> its request subjects (admin form first, tenant form when the code has one)."""
    from .control_client import COMMAND_SUBJECTS

    out: dict[str, list[str]] = {}
    for cmd_type, admin_subject in COMMAND_SUBJECTS.items():
        addresses = [admin_subject]
        subject_of = getattr(subjects, "command_subject", None)
        kind = admin_subject.rsplit(".", 1)[-1]
        # tenant form only for the kinds tenants may send (quotas, drains, restores: admin's form only)
        if subject_of is not None and kind in getattr(subjects, "TENANT_COMMANDS", (kind,)):
            addresses = [subject_of(kind), _parametrize(subject_of(kind, _PLACEHOLDER["team"], _PLACEHOLDER["user"]))]
        out[cmd_type.__name__] = addresses
    return out


def _params(address: str) -> dict[str, Any]:
    names = [part[1:-1] for part in address.split(".") if part.startswith("{")]
    return {n: {"description": _PARAM_TEXT.get(n, n)} for n in names}


def _channel(address: str, message: str, description: str) -> dict[str, Any]:
    channel: dict[str, Any] = {"address": address, "description": description,
                               "messages": {message: {"$ref": f"#/components/messages/{message}"}}}
    if _params(address):
        channel["parameters"] = _params(address)
    return channel


def _message(name: str, schema_ref: str, summary: str) -> dict[str, Any]:
    return {"name": name, "title": name, "summary": summary, "contentType": "application/json",
            "payload": {"schemaFormat": "application/schema+json;version=draft-07", "schema": {"$ref": schema_ref}}}


def _key(address: str) -> str:
    return address.replace(".", "_").replace("{", "").replace("}", "").replace(">", "all").replace("*", "any")


def document() -> dict[str, Any]:
    """The AsyncAPI 3.0 document of the bus."""
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}

    messages["CommandReply"] = _message("CommandReply", "command-reply.schema.json", "admission's answer to a command")
    for name, addresses in _command_addresses().items():
        messages[name] = _message(name, f"commands.schema.json#/$defs/{name}", f"the {name} command (request/reply)")
        for i, address in enumerate(addresses):
            form = "admin" if i == 0 else "tenant (team and user from the subject, as permitted)"
            key = _key(address)
            channels[key] = _channel(address, name, f"{name} requests, {form} form; admission replies")
            channels[key + "_reply"] = {"address": None, "description": "the request's reply inbox",
                                        "messages": {"CommandReply": {"$ref": "#/components/messages/CommandReply"}}}
            operations[f"send{name}{'' if i == 0 else 'AsTenant'}"] = {
                "action": "send", "channel": {"$ref": f"#/channels/{key}"}, "summary": f"request {name}",
                "messages": [{"$ref": f"#/channels/{key}/messages/{name}"}],
                "reply": {"channel": {"$ref": f"#/channels/{key}_reply"},
                          "messages": [{"$ref": f"#/channels/{key}_reply/messages/CommandReply"}]}}

    for name in sorted(EVENT_TYPES):
        cls = EVENT_TYPES[name]
        address = _event_address(cls)
        writers = ", ".join(sorted(EVENT_WRITERS.get(name, ())))
        summary = (cls.__doc__ or name).strip().splitlines()[0]
        messages[name] = _message(name, f"events.schema.json#/$defs/{name}", summary)
        tree = "compare-and-set alloc tree" if cls.ALLOC else "info tree"  # type: ignore[attr-defined]
        channels[name] = _channel(address, name, f"{name} facts in the `{subjects.STREAM}` stream ({tree}); "
                                                 f"appended by: {writers or 'nobody'}")
        operations[f"read{name}"] = {"action": "receive", "channel": {"$ref": f"#/channels/{name}"},
                                     "summary": f"read {name} facts from the stream",
                                     "messages": [{"$ref": f"#/channels/{name}/messages/{name}"}]}

    _bus_channels(channels, operations, messages)
    return {
        "asyncapi": "3.0.0",
        "info": {"title": "gpusched bus", "version": f"{SCHEMA_VERSION}",
                 "description": f"Commands (NATS request/reply to admission) and facts (JetStream stream "
                                f"`{subjects.STREAM}`, subjects `{subjects.EVENTS}`) of gpusched, plus what node "
                                "daemons say outside the log. Generated by `gpusched schemas`; payload schemas "
                                "are the JSON Schemas beside this file."},
        "defaultContentType": "application/json",
        "servers": {"local": {"host": "127.0.0.1:4222", "protocol": "nats",
                              "description": "`gpusched up`; elsewhere $GPUSCHED_NATS_URL"}},
        "channels": channels, "operations": operations, "components": {"messages": messages},
    }


def _bus_channels(channels: dict[str, Any], operations: dict[str, Any], messages: dict[str, Any]) -> None:
    """Heartbeats, node control and the quota ledger's standings: subjects outside the stream."""
    hb = _parametrize(subjects.heartbeat_subject(_PLACEHOLDER["node"]))
    ctl = _parametrize(subjects.node_control_subject(_PLACEHOLDER["node"]))
    messages["Heartbeat"] = _message("Heartbeat", "heartbeat.schema.json", "a node daemon's telemetry (core NATS)")
    messages["NodeRequest"] = _message("NodeRequest", "node-control.schema.json", "a node-control request")
    messages["NodeReply"] = _message("NodeReply", "node-control-reply.schema.json", "a node daemon's answer")
    messages["Shares"] = {"name": "Shares", "contentType": "application/json",
                          "summary": "the quota ledger's team standings: {seq, at, teams: {team: {...}}}",
                          "payload": {"type": "object"}}
    channels["heartbeat"] = _channel(hb, "Heartbeat", "heartbeats, not in the log")
    channels["node_control"] = _channel(ctl, "NodeRequest", "node-control requests (request/reply)")
    kill_of = getattr(subjects, "node_kill_subject", None)
    if kill_of is not None:
        kill = _parametrize(kill_of(_PLACEHOLDER["node"]))
        channels["node_kill"] = _channel(kill, "NodeRequest", "KillProcesses requests only (the reconciler's "
                                                               "node-control subject; request/reply)")
        operations["sendKillProcesses"] = {
            "action": "send", "channel": {"$ref": "#/channels/node_kill"},
            "messages": [{"$ref": "#/channels/node_kill/messages/NodeRequest"}],
            "reply": {"channel": {"$ref": "#/channels/node_control_reply"},
                      "messages": [{"$ref": "#/channels/node_control_reply/messages/NodeReply"}]}}
    reset = _parametrize(subjects.node_reset_subject(_PLACEHOLDER["node"]))
    channels["node_reset"] = _channel(reset, "NodeRequest", "ResetGpu requests only (the reconciler's "
                                                            "--reset-leaked; request/reply)")
    operations["sendResetGpu"] = {
        "action": "send", "channel": {"$ref": "#/channels/node_reset"},
        "messages": [{"$ref": "#/channels/node_reset/messages/NodeRequest"}],
        "reply": {"channel": {"$ref": "#/channels/node_control_reply"},
                  "messages": [{"$ref": "#/channels/node_control_reply/messages/NodeReply"}]}}
    channels["node_control_reply"] = {"address": None, "messages": {"NodeReply": {"$ref": "#/components/messages/NodeReply"}}}
    channels["shares"] = _channel(subjects.Q_SHARES, "Shares", "request (empty body) the quota ledger's standings")
    _reads(messages, channels, operations)
    operations["readHeartbeat"] = {"action": "receive", "channel": {"$ref": "#/channels/heartbeat"},
                                   "messages": [{"$ref": "#/channels/heartbeat/messages/Heartbeat"}]}
    operations["sendNodeRequest"] = {
        "action": "send", "channel": {"$ref": "#/channels/node_control"},
        "messages": [{"$ref": "#/channels/node_control/messages/NodeRequest"}],
        "reply": {"channel": {"$ref": "#/channels/node_control_reply"},
                  "messages": [{"$ref": "#/channels/node_control_reply/messages/NodeReply"}]}}
    operations["requestShares"] = {"action": "send", "channel": {"$ref": "#/channels/shares"},
                                   "messages": [{"$ref": "#/channels/shares/messages/Shares"}]}


def _reads(messages: dict, channels: dict, operations: dict) -> None:
    """The reader service's request/reply reads, one channel per kind (`services/reader.py`)."""
    messages["Read"] = {"name": "Read", "contentType": "application/json",
                        "summary": "a read request ({job_id, at, rank, offset, ...} as the kind takes); the "
                                   "reply is {ok, data} or {ok: false, error}", "payload": {"type": "object"}}
    for kind in subjects.READ_KINDS:
        address = _parametrize(subjects.read_subject(kind, _PLACEHOLDER["team"], _PLACEHOLDER["user"]))
        channels[f"read_{kind}"] = _channel(address, "Read", f"`{kind}` of the team's jobs only (a tenant's or "
                                                             "platform's read; admin and auditors: gpusched.read."
                                                             f"{kind}, every team)")
        operations[f"read{kind.title()}"] = {"action": "send", "channel": {"$ref": f"#/channels/read_{kind}"},
                                              "messages": [{"$ref": f"#/channels/read_{kind}/messages/Read"}]}


def render() -> str:
    return json.dumps(document(), indent=2, sort_keys=True) + "\n"


def write(directory: Path) -> Path:
    return schemas.write_file(directory, FILE, render())


def drift(directory: Path) -> list[str]:
    return [FILE] if schemas.drifted(directory, FILE, render()) else []


__all__ = ["document", "render", "write", "drift", "FILE"]
