"""The one place that knows NATS subject names and the stream's layout.

Events: `gpusched.evt.<tree>.<Type>.<key>` where `tree` is `alloc` for every event that changes
who holds a GPU or whether one may be held (the compare-and-set tree) and `info` otherwise, and
`key` is the job, node, GPU or team the event is about (so `show JOB` can filter by subject).
"""

from __future__ import annotations

import re

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


def event_subject(event: ev.Event) -> str:
    tree = "alloc" if event.ALLOC else "info"
    return f"gpusched.evt.{tree}.{type(event).__name__}.{event_key(event)}"


def job_filter(job_id: str) -> str:
    return f"gpusched.evt.*.*.{token(job_id)}"


def dead_subject(original: str) -> str:
    return "gpusched.dead." + original


def heartbeat_subject(node: str) -> str:
    return f"gpusched.hb.{token(node)}"


def node_control_subject(node: str) -> str:
    """Node daemons listen here for kill requests of zombies (request/reply)."""
    return f"gpusched.node.{token(node)}.ctl"
