"""Who holds each GPU: a job takes GPUs whole or a share of one, and gives them back; the
node's CPUs and memory count for the jobs holding its GPUs; each node's `free` set, the free
count and `shared` follow every GPU record that changes (`refresh`).

Functions of the state (`st`): the reducers of jobs and nodes (`core/fold/jobs.py`,
`core/fold/nodes.py`) change holdings through these, so that the indexes cannot drift.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import rules
from ..model import GpuId, JobSpec
from ..records import Job
from ..topology import Gpu
from .checks import violate

if TYPE_CHECKING:
    from ..state import ClusterState


def refresh(st: ClusterState, g: GpuId) -> None:
    """Keep the node's free set and the free count in step with one GPU's record."""
    rec = st.gpus[g]
    node = st.nodes[rec.node]
    _index_shared(st, g)
    placeable = rules.gpu_placeable(st, g)
    if placeable and g not in node.free:
        node.free[g] = None
        st.free_count += 1
    elif not placeable and g in node.free:
        del node.free[g]
        st.free_count -= 1


def _index_shared(st: ClusterState, g: GpuId) -> None:
    """Keep `st.shared` (GPUs with fractional holders) in step with one GPU's record."""
    if st.gpus[g].shares:
        st.shared[g] = None
    elif g in st.shared:
        del st.shared[g]


def take(st: ClusterState, job_id: str, gpus: list[GpuId], at: float) -> list[GpuId]:
    """Give `gpus` to a job, recording any GPU that was not placeable."""
    taken: list[GpuId] = []
    for g in gpus:
        rec = st.gpus.get(g)
        if rec is None:
            violate(st, "unknown_gpu", f"grant of unknown GPU {g}", [job_id], [g])
            continue
        if rec.shares or (rec.holder is not None and rec.holder != job_id):
            violate(st, "double_booking", f"GPU {g} granted to {job_id} while {st.gpu_blocker(g)}", [job_id, *rec.holders], [g])
            continue
        if g not in st.nodes[rec.node].free:
            violate(st, "unplaceable_gpu", f"GPU {g} granted to {job_id} while {st.gpu_blocker(g)}", [job_id], [g])
        rec.holder = job_id
        refresh(st, g)
        taken.append(g)
    return taken


def take_share(st: ClusterState, job: Job, gpus: list[GpuId]) -> list[GpuId]:
    """Give a fractional job its share of its one GPU (`rules.share_problem`). Applied as far as
    is safe: a share the GPU has room for is taken even where it was not placeable (quarantined,
    drained: recorded), never one beyond its room, beside a whole holder, or of unknown size."""
    taken: list[GpuId] = []
    for g in gpus:
        rec = st.gpus.get(g)
        share = None if rec is None else job.spec.share_on(rec.memory_mb)
        problem = rules.share_problem(st, g, share)
        if problem is not None:
            violate(st, "unplaceable_share", f"a share of GPU {g} granted to {job.job_id}: {problem}",
                    [job.job_id], [g])
        if rec is None or share is None or rec.holder is not None or rec.shared_load + share > 1 + rules.SHARE_SLACK:
            continue
        rec.shares = {**rec.shares, job.job_id: share}
        job.share = share
        refresh(st, g)
        taken.append(g)
    return taken


def give_back(st: ClusterState, gpus: list[GpuId], job_id: str | None = None) -> None:
    for g in gpus:
        _drop_holder(st.gpus[g], job_id)
        refresh(st, g)


def give_back_all(st: ClusterState, job: Job) -> None:
    """A job's GPUs return; its CPUs and memory stop counting on their nodes."""
    give_back(st, job.gpus, job.job_id)
    reserve(st, job.spec, job.gpus, -1)


def _drop_holder(rec: Gpu, job_id: str | None) -> None:
    """`job_id` no longer holds `rec`: its share of it, or the whole of it."""
    if job_id is not None and job_id in rec.shares:
        rec.shares = {k: v for k, v in rec.shares.items() if k != job_id}
    else:
        rec.holder = None


def reserve(st: ClusterState, spec: JobSpec, gpus: list[GpuId], sign: int, than: list[GpuId] | None = None) -> None:
    """A job's per-node CPUs and memory count on each node of `gpus` (sign 1) or stop counting
    (-1); with `than` (a resize), only the nodes the job enters (leaves) against `than`."""
    cpus, mem = spec.cpus or 0.0, spec.memory_mb or 0
    if not (cpus or mem):
        return
    now = dict.fromkeys(g.rpartition("/")[0] for g in gpus)
    if than is not None:
        was = dict.fromkeys(g.rpartition("/")[0] for g in than)
        for n in [n for n in was if n not in now]:
            _count_on(st, n, -cpus, -mem)
        now = {n: None for n in now if n not in was}
    for n in now:
        _count_on(st, n, sign * cpus, sign * mem)


def _count_on(st: ClusterState, name: str, cpus: float, mem: int) -> None:
    node = st.nodes.get(name)
    if node is not None:
        node.cpus_used = max(0.0, round(node.cpus_used + cpus, 6))  # no float drift across grants
        node.memory_used_mb = max(0, node.memory_used_mb + mem)
