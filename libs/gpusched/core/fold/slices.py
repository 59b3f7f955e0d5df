"""The fold of MIG slices (docs/gpu-sharing.md#mig-slices): a GPU's geometry (`MigGeometrySet`) and
the slices MIG jobs hold of it. A partitioned GPU is out of its node's free set (`rules.
gpu_placeable`), so no whole-GPU gang and no fractional share ever lands on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import events as ev
from .. import rules
from ..mig import slice_share
from ..model import GpuId
from ..records import Job
from .checks import violate
from .holdings import refresh

if TYPE_CHECKING:
    from ..state import ClusterState


def on_geometry(st: ClusterState, e: ev.MigGeometrySet) -> None:
    """The GPU's slices from now on. Admission appends it only for an idle GPU; one that is
    held anyway (an operator's own append) is recorded as broken and left as it was."""
    rec = st.gpus.get(e.gpu)
    if rec is None:
        violate(st, "unknown_gpu", f"MIG geometry of unknown GPU {e.gpu}", [], [e.gpu])
        return
    if rec.occupied:
        violate(st, "geometry_of_busy_gpu", f"MIG geometry of GPU {e.gpu} while {st.gpu_blocker(e.gpu)}",
                    rec.holders, [e.gpu])
        return
    rec.geometry, rec.slices = list(e.profiles), {}
    refresh(st, e.gpu)


def take_slices(st: ClusterState, job: Job, e: ev.GpusGranted) -> list[GpuId]:
    """Give a MIG job its slices of its one GPU: each a free slice of its profile, else recorded
    as broken and not taken (a slice is a hard partition: never two holders)."""
    spec = job.spec
    assert spec.mig is not None
    if len(e.gpus) != 1 or len(e.slices) != spec.mig_count:
        violate(st, "slice_count", f"job {job.job_id} granted {len(e.slices)} slices of {len(e.gpus)} GPUs, "
                    f"asked {spec.mig_count} of one", [job.job_id], e.gpus)
        return []
    g = e.gpus[0]
    problem = rules.slice_problem(st, g, spec.mig, list(e.slices))
    rec = st.gpus.get(g)
    if problem is not None:
        violate(st, "unplaceable_slice", f"MIG slices {list(e.slices)} of GPU {g} granted to {job.job_id}: {problem}",
                    [job.job_id], [g])
        if rec is None or not rec.geometry or any(i in rec.slices or i >= len(rec.geometry) for i in e.slices):
            return []
    assert rec is not None
    rec.slices = {**rec.slices, **{i: job.job_id for i in e.slices}}
    job.slices, job.share = list(e.slices), slice_share(spec.mig, spec.mig_count)
    refresh(st, g)
    return [g]


__all__ = ["on_geometry", "take_slices"]
