"""The one place that knows NATS subject names and the stream's layout.

Events: `gpusched.evt.info.<Type>.<key>`, where `key` is the job, node, GPU or team the event
is about (so `show JOB` can filter by subject), and `gpusched.evt.alloc.<Type>.<shard>` for every
event that changes who holds a GPU or whether one may be held: the compare-and-set tree. The
alloc tree ends in one of ALLOC_SHARDS shards of the key instead of the key itself, because the
server's expected-last-subject-sequence check over a wildcard costs time in proportion to the
distinct subjects under it (measured: 0.3 ms at 100, 2.1 ms at 50,000); a bounded tree keeps every
grant's check cheap however many jobs the log has seen.

Facts a node daemon reports (kinds in `roles.EVENT_WRITERS` for the node role, when the event
names its node) go to `gpusched.evt.<info|alloc>.<Type>.node.<node>` instead: NATS permissions
can then let a node publish facts about itself only. That adds (node kinds x nodes) subjects to
the alloc tree: bounded by the cluster's size, not by the jobs it has run. The extra `node`
token keeps these subjects out of the services' `gpusched.evt.<tree>.<Type>.*` permissions.

Commands: `gpusched.cmd.<kind>.<team>.<user>` from tenants and platforms (the server allows a
user only its own team(s) and name, so admission takes both from the subject), and
`gpusched.cmd.<kind>[.<user>]` from admin (and the dashboard acting for an admin).
"""

from __future__ import annotations

import re
import zlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only its types: a client that asks the reader never loads the events
    from gpusched.core import events as ev

STREAM = "GPUSCHED"
DEAD_STREAM = "GPUSCHED_DEAD"
#: The JetStream object store of sealed fold snapshots (its stream is OBJ_<bucket>); only the
#: projector writes it, every service, node agent, the dashboard and auditors read it.
SNAPSHOT_BUCKET = "GPUSCHED_SNAPSHOTS"
SNAPSHOT_STREAM = "OBJ_" + SNAPSHOT_BUCKET
#: The JetStream key-value bucket of liveness leases (its stream is KV_<bucket>): placement's and
#: the fallback's. Only those two roles may read or write it (`security/authz.py lease_access`).
LEASE_BUCKET = "GPUSCHED_LEASES"
LEASE_STREAM = "KV_" + LEASE_BUCKET
EVENTS = "gpusched.evt.>"
ALLOC_TREE = "gpusched.evt.alloc.>"
DEAD = "gpusched.dead.>"
HEARTBEATS = "gpusched.hb.>"

#: Request/reply subjects of the commands admission answers.
CMD_SUBMIT = "gpusched.cmd.submit"
CMD_CANCEL = "gpusched.cmd.cancel"
CMD_QUOTA = "gpusched.cmd.quota"
CMD_DRAIN = "gpusched.cmd.drain"
CMD_RESTORE = "gpusched.cmd.restore"
CMD_HOLD = "gpusched.cmd.hold"
CMD_UPDATE = "gpusched.cmd.update"
CMD_LABEL = "gpusched.cmd.label"
CMD_FOLD = "gpusched.cmd.fold"
CMD_MIG = "gpusched.cmd.mig"
CMD_ANY = "gpusched.cmd.>"
#: Command kinds as the subject names them, and those a tenant or platform may send.
COMMAND_KINDS = ("submit", "cancel", "quota", "drain", "restore", "hold", "update", "label", "mig")
TENANT_COMMANDS = ("submit", "cancel", "hold", "update")

#: Request/reply subject of the quota ledger's team standings (read models, not facts).
Q_SHARES = "gpusched.q.shares"

#: Request/reply reads the reader service answers (`services/reader.py`):
#: `gpusched.read.<kind>.<team>.<user>` from tenants and platforms (the server allows a user
#: only its own team(s) and name, so the reader scopes the answer by the subject, never by the
#: payload), `gpusched.read.<kind>` from admin and auditors (every team).
READ_ANY = "gpusched.read.>"
READ_KINDS = ("jobs", "teams", "show", "history", "logs", "events")

_UNSAFE = re.compile(r"[^A-Za-z0-9_\-]")


def token(text: str) -> str:
    """A NATS subject token from any id (dots, slashes and wildcards would split or match)."""
    return _UNSAFE.sub("_", text) or "_"


def event_key(event: ev.Event) -> str:
    for field in ("job_id", "node", "gpu", "team", "request_id"):
        value = getattr(event, field, None)
        if value:
            return token(value)
    return "cluster"


ALLOC_SHARDS = 64


def alloc_shard(key: str) -> str:
    """The alloc-tree shard of a key: stable across processes and versions (crc32, not hash())."""
    return f"s{zlib.crc32(key.encode()) % ALLOC_SHARDS:02d}"


#: Event kinds a node daemon reports about itself (their subject carries the node when they name one).
NODE_KINDS = frozenset({"NodeRegistered", "JobStarted", "CheckpointSaved", "JobCompleted", "JobFailed",
                        "GpusReleased", "ProcessesEnded"})


def event_subject(event: ev.Event) -> str:
    kind = type(event).__name__
    tree = "alloc" if event.ALLOC else "info"
    if kind in NODE_KINDS:
        node = getattr(event, "node", None)
        if node:
            return f"gpusched.evt.{tree}.{kind}.node.{token(node)}"
    key = event_key(event)
    if event.ALLOC:
        return f"gpusched.evt.alloc.{kind}.{alloc_shard(key)}"
    return f"gpusched.evt.info.{kind}.{key}"


def node_event_subjects(node: str) -> list[str]:
    """Every subject a node's own reports go to (what its NATS permissions allow)."""
    return [f"gpusched.evt.{tree}.{kind}.node.{token(node)}" for kind in sorted(NODE_KINDS)
            for tree in ("info", "alloc")]


def subject_problem(subject: str, event: ev.Event) -> str | None:
    """Why a stored message's subject does not fit its payload, or None. Permissions say who
    may publish a subject; this says the payload is the fact that subject is for (a writer
    permitted one kind, or one node, cannot slip in another)."""
    parts = subject.split(".")
    kind = type(event).__name__
    if len(parts) < 5 or parts[3] != kind:
        return f"subject {subject} does not carry a {kind}"
    if len(parts) == 6 and parts[4] == "node" and subject != event_subject(event):
        return f"subject {subject} is not the node subject of this {kind} ({event_subject(event)})"
    return None


def job_subjects(job_id: str) -> list[str]:
    """Subjects that hold every event about a job: its own info subjects, and the alloc shard it
    shares with other jobs (readers keep the records whose `job_id` is this job). Node reports
    are on their node's subjects (`node_subjects`)."""
    key = token(job_id)
    return [f"gpusched.evt.info.*.{key}", f"gpusched.evt.alloc.*.{alloc_shard(key)}"]


def node_subjects(node: str) -> str:
    """Every report of one node daemon (both trees)."""
    return f"gpusched.evt.*.*.node.{token(node)}"


def command_subject(kind: str, team: str | None = None, user: str | None = None) -> str:
    """A command's subject: with a team, the tenant form (team and user); without, admin's."""
    if team is not None:
        return f"gpusched.cmd.{kind}.{token(team)}.{token(user or '_')}"
    return f"gpusched.cmd.{kind}" + (f".{token(user)}" if user else "")


def on_behalf_subject(team: str, platform: str, user: str) -> str:
    """A platform's submit for one of `team`'s users: the job is `user`'s, sent `via` the platform."""
    return f"{command_subject('submit', team, platform)}.{token(user)}"


def read_subject(kind: str, team: str | None = None, user: str | None = None) -> str:
    """A read request's subject: with a team, the scoped form (team and user); without, the
    unscoped form of admin and auditors."""
    if team is not None:
        return f"gpusched.read.{kind}.{token(team)}.{token(user or '_')}"
    return f"gpusched.read.{kind}"


def writer_of(subject: str) -> str:
    """The part of an event subject that names who may publish it (`node.<name>` for a node's
    reports): dead letters are budgeted per writer, so one writer's garbage cannot crowd out
    another's."""
    parts = subject.split(".")
    return ".".join(parts[4:]) or subject


def dead_subject(original: str, seq: int) -> str:
    """One subject per dead-lettered stream sequence: the dead-letter stream keeps one message
    per subject, so each bad message is stored once whoever reads it first."""
    return f"gpusched.dead.{seq}.{original}"


def heartbeat_subject(node: str) -> str:
    return f"gpusched.hb.{token(node)}"


def node_control_subject(node: str) -> str:
    """Node daemons answer every node-control request here (admin only: it includes the
    simulated crash and stray-process hooks)."""
    return f"gpusched.node.{token(node)}.ctl"


def node_logs_subject(node: str) -> str:
    """Request/reply: a node daemon serves its jobs' stdout/stderr (`LogRequest`)."""
    return f"gpusched.node.{token(node)}.logs"


def node_kill_subject(node: str) -> str:
    """Node daemons answer only `KillProcesses` here: what the reconciler may send."""
    return f"gpusched.node.{token(node)}.ctl.KillProcesses"


def node_reset_subject(node: str) -> str:
    """Node daemons answer only `ResetGpu` here: the reconciler's `--reset-leaked`."""
    return f"gpusched.node.{token(node)}.ctl.ResetGpu"
