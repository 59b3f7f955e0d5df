"""Forgetting old jobs: a finished job stays whole for `forget_after_s` of log time, then only
its tombstone (`Tombstone`: enough for `afterok`, request-id dedupe and `show`), and after
`RETIRE_AFTER_HORIZONS` horizons only its id (`RetiredIds`), so that no id is handed out twice.

Functions of the state (`st`): `ClusterState.apply` runs `forget_old` after any fact while
finished jobs wait; measured in log time, every replica and every audit forgets the same jobs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..records import Tombstone

if TYPE_CHECKING:
    from ..state import ClusterState

#: A tombstone lives this many horizons after the job ended (a year at the default 90 days); then
#: only the job's id is kept (`RetiredIds`, 4 bytes), so that no id is ever handed out twice:
#: request-id dedupe, `afterok` on the job and `show` end there (docs/operating.md, "Retention").
RETIRE_AFTER_HORIZONS = 4


def forget_old(st: ClusterState) -> None:
    """Forget the finished jobs that ended more than `forget_after_s` (log time) before the
    latest event, oldest first; a job whose processes may still run (the fence) waits at the
    back of the queue until they are reported ended."""
    assert st.forget_after_s is not None
    horizon = st.now - st.forget_after_s
    queue = st.finished
    while st.finished_head < len(queue):
        job = st.jobs.get(queue[st.finished_head])
        if job is not None and job.finished_at is not None and job.finished_at > horizon:
            break
        st.finished_head += 1
        if job is None:
            continue
        if job.live:
            queue.append(job.job_id)
            break
        del st.jobs[job.job_id]
        st.forgotten[job.job_id] = Tombstone(job.state, job.finished_at or 0.0, job.request_id, job.team,
                                             job.array_job)
        st.forgotten_counts[job.state] = st.forgotten_counts.get(job.state, 0) + 1
        st.retiring.append(job.job_id)
    if st.finished_head > 1024 and st.finished_head * 2 > len(queue):
        del queue[:st.finished_head]
        st.finished_head = 0
    retire_old(st, st.now - st.forget_after_s * RETIRE_AFTER_HORIZONS)


def retire_old(st: ClusterState, horizon: float) -> None:
    """Past the second horizon a tombstone goes and only the id stays (`RetiredIds`); an array's
    tasks need nothing more, `arrays` keeps their range."""
    queue = st.retiring
    while st.retiring_head < len(queue):
        tomb = st.forgotten.get(queue[st.retiring_head])
        if tomb is not None and tomb.finished_at > horizon:
            break
        job_id = queue[st.retiring_head]
        st.retiring_head += 1
        if tomb is None:
            continue
        del st.forgotten[job_id]
        if tomb.request_id and st.requests.get(tomb.request_id) in (job_id, tomb.array_job):
            del st.requests[tomb.request_id]
        if not tomb.array_job:
            st.retired.add(job_id)
    if st.retiring_head > 1024 and st.retiring_head * 2 > len(queue):
        del queue[:st.retiring_head]
        st.retiring_head = 0
