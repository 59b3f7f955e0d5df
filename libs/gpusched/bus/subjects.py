"""The one place that knows NATS subject names and the stream's layout.

Events: `gpusched.evt.info.<Type>.<key>`, where `key` is the job, node, GPU or team the event
is about (so `show JOB` can filter by subject), and `gpusched.evt.alloc.<Type>.<shard>` for every
event that changes who holds a GPU or whether one may be held: the compare-and-set tree. The
alloc tree ends in one of ALLOC_SHARDS shards of the key instead of the key itself, because the
server's expected-last-subject-sequence check over a wildcard costs time in proportion to the
distinct subjects under it (measured: 0.3 ms at 100, 2.1 ms at 50,000); a bounded tree keeps every
grant's check cheap however many jobs the log has seen.
"""

from __future__ import annotations

import re
import zlib

from gpusched.core import events as ev

STREAM = "GPUSCHED"
DEAD_STREAM = "GPUSCHED_DEAD"
EVENTS = "gpusched.evt.>"
ALLOC_TREE = "gpusched.evt.alloc.>"
DEAD = "gpusched.dead.>"
HEARTBEATS = "gpusched.hb.>"

#: Request/reply subjects of the commands admission answers.
CMD_SUBMIT = "gpusched.cmd.submit"
CMD_CANCEL = "gpusched.cmd.cancel"
CMD_QUOTA = "gpusched.cmd.quota"
CMD_DRAIN = "gpusched.cmd.drain"
CMD_ANY = "gpusched.cmd.*"

#: Request/reply subject of the quota ledger's team standings (read models, not facts).
Q_SHARES = "gpusched.q.shares"

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


def event_subject(event: ev.Event) -> str:
    key = event_key(event)
    if event.ALLOC:
        return f"gpusched.evt.alloc.{type(event).__name__}.{alloc_shard(key)}"
    return f"gpusched.evt.info.{type(event).__name__}.{key}"


def job_subjects(job_id: str) -> list[str]:
    """Subjects that hold every event about a job: its own info subjects, and the alloc shard it
    shares with other jobs (readers keep the records whose `job_id` is this job)."""
    key = token(job_id)
    return [f"gpusched.evt.info.*.{key}", f"gpusched.evt.alloc.*.{alloc_shard(key)}"]


def dead_subject(original: str) -> str:
    return "gpusched.dead." + original


def heartbeat_subject(node: str) -> str:
    return f"gpusched.hb.{token(node)}"


def node_control_subject(node: str) -> str:
    """Node daemons listen here for kill requests of zombies (request/reply)."""
    return f"gpusched.node.{token(node)}.ctl"


def node_logs_subject(node: str) -> str:
    """Request/reply: a node daemon serves its jobs' stdout/stderr (`LogRequest`)."""
    return f"gpusched.node.{token(node)}.logs"
