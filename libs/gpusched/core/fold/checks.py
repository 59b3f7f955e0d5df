"""What a fact may say before the fold applies it: who reports it (a node speaks only for
itself), when it happened (no later than the log stored it, give or take `AT_LEAD_S`), and
whether it was applied already (its writer chain's number); and `violate`, which records
every broken rule the fold meets, in log order.

Functions of the state (`st`), as every reducer of the fold: `ClusterState.apply` calls them
before its dispatch table, and the other reducers record what they find with `violate`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from .. import events as ev
from ..records import Position, Violation, job_node_order

if TYPE_CHECKING:
    from ..state import ClusterState

#: How far a fact's `at` may run ahead of the log's store time of it (writers' clock skew and
#: the append's latency are far less); later, the fold bounds it (`clocked`).
AT_LEAD_S = 60.0


def violate(st: ClusterState, rule: str, detail: str, jobs: list[str] = (), gpus: list[str] = ()) -> None:  # type: ignore[assignment]
    st.broken.append(Violation(st.last_seq, rule, detail, list(jobs), list(gpus)))


def clocked(st: ClusterState, event: ev.Event, stored_at: float | None) -> ev.Event:
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
    violate(st, "clock_ahead", f"{event.kind} says it happened at {event.at:.3f}, {event.at - stored_at:.3f} s "
            f"after the log stored it ({stored_at:.3f}): folded as at {latest:.3f}",
            [j] if (j := getattr(event, "job_id", None)) else [])
    return msgspec.structs.replace(event, at=latest)


def replayed(st: ClusterState, event: ev.Event, position: Position | None) -> bool:
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
    violate(st, "replayed", f"{event.kind} is fact {position.n} of writer chain {position.chain}, which was applied "
            f"up to fact {top} already: a re-published fact, left without effect", [job] if job else [])
    return True


def refused(st: ClusterState, event: ev.Event, position: Position | None = None) -> bool:
    """A copy of an applied fact (`replayed`), and a node's report about a job that is not on
    it (`foreign_node`: a node speaks only for itself), are recorded and have no effect."""
    if replayed(st, event, position):
        return True
    if type(event) not in NODE_REPORTS or event.node is None:  # type: ignore[attr-defined]
        return False
    problem = node_report_problem(st, event)
    if problem is not None:
        violate(st, "foreign_node", problem, [event.job_id])  # type: ignore[attr-defined]
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
