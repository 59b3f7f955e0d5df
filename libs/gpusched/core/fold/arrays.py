"""Job arrays: one submit makes a job per index (`<array>_<index>`), and `ClusterState.arrays`
keeps each array's index range, so that a command naming an array finds its tasks by id, not
by scanning every job and tombstone, long after the tasks were forgotten.

Functions of the state (`st`): the submit reducer (`core/fold/jobs.py`) hands an array here,
and the state's queries (`knows`, `restore`) ask these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from .. import events as ev
from ..records import Job
from .checks import violate

if TYPE_CHECKING:
    from ..state import ClusterState


def array_task_id(array_job: str, index: int) -> str:
    return f"{array_job}_{index}"


def array_tasks(st: ClusterState, array_id: str) -> list[str]:
    """The ids of a job array's tasks, whole, forgotten or retired ([]: no such array)."""
    first, last = st.arrays.get(array_id, (0, -1))
    return [array_task_id(array_id, i) for i in range(first, last + 1)]


def array_task_known(st: ClusterState, job_id: str) -> bool:
    """`job_id` is exactly the id of a task of a known array (`array_task_id`: ASCII digits, no
    leading zero; `str.isdigit` alone takes '²', which `int` refuses, and '٣', which it reads as 3)."""
    array_id, _, index = job_id.rpartition("_")
    span = st.arrays.get(array_id)
    if span is None or not (index.isascii() and index.isdigit()):
        return False
    i = int(index)
    return span[0] <= i <= span[1] and array_task_id(array_id, i) == job_id


def array_index(st: ClusterState) -> dict[str, tuple[int, int]]:
    """`ClusterState.arrays` rebuilt from the tasks' ids (`<array>_<index>`), whole or forgotten."""
    index: dict[str, tuple[int, int]] = {}
    tasks = [(j.job_id, j.array_job) for j in st.jobs.values() if j.array_job]
    tasks += [(jid, t.array_job) for jid, t in st.forgotten.items() if t.array_job]
    for jid, array_id in tasks:
        i = int(jid.rsplit("_", 1)[1])
        first, last = index.get(array_id, (i, i))
        index[array_id] = (min(first, i), max(last, i))
    return index


def submit_array(st: ClusterState, e: ev.JobSubmitted) -> None:
    """One job per index of the array, each with its index in its environment; the request id
    names the array."""
    arr = e.spec.array
    assert arr is not None
    ids = [array_task_id(e.job_id, i) for i in range(arr.first, arr.last + 1)]
    clash = [j for j in ids if j in st.jobs or j in st.forgotten]
    if clash:
        violate(st, "duplicate_job", f"array {e.job_id} submitted over existing jobs", clash[:8])
        return
    st.arrays[e.job_id] = (arr.first, arr.last)
    for i, jid in zip(range(arr.first, arr.last + 1), ids):
        env = {**e.spec.env, "GPUSCHED_ARRAY_JOB_ID": e.job_id, "GPUSCHED_ARRAY_INDEX": str(i),
               "SLURM_ARRAY_JOB_ID": e.job_id, "SLURM_ARRAY_TASK_ID": str(i)}
        spec = msgspec.structs.replace(e.spec, env=env)
        st.jobs[jid] = Job(jid, spec, e.at, held_since=e.at, request_id=e.request_id, user=e.user,
                           via=e.via, array_job=e.job_id)
        st.pending[jid] = None
    if e.request_id:
        st.requests[e.request_id] = e.job_id
    st.team(e.spec.team)
