"""What confines one run before it starts: the Unix user it runs as (`users.UserMap`) and its
cgroup (`cgroups`: memory, CPU and pids limits from the spec and the node, the allow-list of its
GPUs' device nodes). The launcher then starts the job inside both."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType

import structlog

from gpusched.core.state import Job

from . import cgroups, container
from .devices import GpuDevice
from .launcher import Launch
from .users import UserMap

log = structlog.get_logger()


def cgroups_wanted(setting: bool | None) -> bool:
    """None (auto): a cgroup per run where this daemon may make them (root, a v1 or v2 host)."""
    if setting is not None:
        return setting
    return os.geteuid() == 0 and cgroups.version() is not None


SliceDevices = Mapping[tuple[int, int], tuple[GpuDevice, ...]]  # (GPU, slice) -> its capability devices


def limits_for(job: Job, launch: Launch, devices: dict[int, GpuDevice], control: tuple[str, ...],
               pids_max: int | None, slices: SliceDevices = MappingProxyType({})) -> cgroups.Limits:
    spec = job.spec
    allow = None
    if devices:  # only the granted GPUs' nodes, and the control devices every GPU job needs
        allow = (*(devices[i].allow for i in launch.gpus if i in devices), *control)
        # a MIG job: its own slices' capability devices, never another slice's of the same GPU
        allow += tuple(d.allow for i in launch.gpus for s in launch.mig_slices for d in slices.get((i, s), ()))
        if spec.image:  # runc's own rules for every container: its cgroup is a child of this one
            allow += container.RUNC_DEVICES
    return cgroups.Limits(cpus=spec.cpus, memory_bytes=spec.memory_mb * 2**20 if spec.memory_mb else None,
                          pids_max=pids_max, devices=allow)


def confine(launch: Launch, job: Job, users: UserMap, taken: Callable[[int], str | None], *, cgroup_parent: str | None,
            cgroup_name: str, devices: dict[int, GpuDevice], control: tuple[str, ...],
            pids_max: int | None, slices: SliceDevices = MappingProxyType({})) -> Launch:
    """`launch` with the job's credentials and (when `cgroup_parent`) its new cgroup.
    users.NoJobUser or cgroups.CgroupError when the run cannot be confined as configured."""
    user = users.resolve(job.user, job.spec.team, job.job_id, taken)
    fields: dict = {}
    if user.how != "daemon":
        fields.update(user=user.name, uid=user.uid, gid=user.gid, home=user.home)
    if cgroup_parent is not None and launch.command:
        cg = cgroups.create(cgroup_parent, cgroup_name, limits_for(job, launch, devices, control, pids_max, slices))
        fields["cgroup"] = cg.to_json()
    return dataclasses.replace(launch, **fields) if fields else launch


__all__ = ["cgroups_wanted", "confine", "limits_for"]
