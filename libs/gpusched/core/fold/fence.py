"""The fence: which attempts of a job may still have processes on which node (`Job.live`,
indexed by node in `ClusterState.node_live`). An attempt may run from its grant (or resize)
until its node reports its processes ended, or the node is declared lost; a node that comes
back kills what the fence no longer lists.

Functions of the state (`st`): grants, resizes and starts (`core/fold/jobs.py`) add to the
fence, node losses (`core/fold/nodes.py`) end it, and both indexes change together here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import events as ev
from ..model import GpuId
from ..records import Job, Live

if TYPE_CHECKING:
    from ..state import ClusterState


def may_run(st: ClusterState, job: Job, gpus: list[GpuId]) -> None:
    """From a grant or resize on, the job's current attempt may have processes on its nodes."""
    for node in dict.fromkeys(g.rpartition("/")[0] for g in gpus):
        add_live(st, job, Live(node, job.attempt, job.generation))


def add_live(st: ClusterState, job: Job, live: Live) -> None:
    if live not in job.live:
        job.live = [*job.live, live]
        st.node_live.setdefault(live.node, {})[job.job_id] = None


def end_live(st: ClusterState, job: Job, ended: Callable[[Live], bool]) -> None:
    gone = [x for x in job.live if ended(x)]
    if not gone:
        return
    job.live = [x for x in job.live if not ended(x)]
    for x in gone:
        if not any(y.node == x.node for y in job.live):
            jobs = st.node_live.get(x.node, {})
            jobs.pop(job.job_id, None)
            if not jobs:
                st.node_live.pop(x.node, None)


def on_processes_ended(st: ClusterState, e: ev.ProcessesEnded) -> None:
    job = st.jobs.get(e.job_id)
    if job is not None:
        end_live(st, job, lambda x: x.node == e.node and (x.attempt, x.generation) == (e.attempt, e.generation))
