"""Starting a job's rank on this node: its launch spec (from the grant, the job's checkpoint
and the node's GPUs), its confinement (user, cgroup, device allow-list, CDI spec for image
jobs), and the process; and removing the confinement again once the run is over."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from pathlib import Path

import structlog

from gpusched.bus import subjects
from gpusched.core.model import gpu_id
from gpusched.core.state import ClusterState, Job, job_node_order

from . import container, launcher
from .agent_config import AgentConfig
from .backends import GpuBackend, SimBackend
from .cgroups import CgroupError, JobCgroup, remove_parent
from .confine import cgroups_wanted, confine
from .devices import GpuDevice, nvidia_control_allow, nvidia_devices, sim_devices, sim_slice_devices
from .users import NoJobUser

log = structlog.get_logger()


class LaunchError(Exception):
    """The job cannot start here (no such command, not executable, no user, bad working dir):
    no retry would help."""


def job_nodes(job: Job) -> list[str]:
    """The job's nodes in grant order: the rank of a node is its position here."""
    return job_node_order(job)


def sharers(job: Job, state: ClusterState) -> set[str]:
    """The other fractional (MIG) jobs the fold lets a fractional (MIG) job share its GPU with."""
    if not job.spec.partial:
        return set()
    return {j for g in job.gpus if g in state.gpus for j in state.gpus[g].holders if j != job.job_id}


class JobStarter:
    """One node's launches: what it needs to confine them (the job users, its cgroup parent,
    its GPUs' device nodes), and how often each attempt was launched here (each launch its own
    control dir)."""

    def __init__(self, cfg: AgentConfig, backend: GpuBackend, uuids: dict[int, str],
                 uid_holder: Callable[[int], str | None]):
        self.cfg = cfg
        self.node = cfg.node
        self.uuids = uuids
        self.uid_holder = uid_holder
        self.backend = backend
        self.launches: dict[str, tuple[int, int]] = {}  # job -> (attempt, launches of it here)
        self.users = cfg.user_map()
        self.cgroup_parent = cfg.cgroup_parent if cgroups_wanted(cfg.cgroups) else None
        self.devices, self.control_devices = gpu_devices(cfg, backend) if self.cgroup_parent else ({}, ())
        #: (GPU, slice) -> the capability device of each possible MIG slice of a simulated MIG GPU.
        self.slice_devices = slice_devices(cfg, backend) if self.devices else {}
        #: The simulated GPUs' CDI spec to write at the first image job (NVML GPUs: NVIDIA's own spec).
        self.cdi_pending: str | None = f"{cfg.work_dir.resolve()}/{cfg.node}" \
            if self.devices and isinstance(backend, SimBackend) else None
        #: Removed when the daemon stops its jobs (an earlier daemon's, for the runs adopted from it, too).
        self.cdi_spec: Path | None = container.cdi_path(self.cdi_pending) if self.cdi_pending else None

    def spec(self, job: Job, mine: tuple[int, ...], state: ClusterState) -> launcher.Launch:
        """The launch of this node's rank of `job` on its GPUs `mine` (a fresh control dir)."""
        cfg, node = self.cfg, self.node
        assert cfg.checkpoint_root is not None and cfg.log_dir is not None, "AgentConfig.__post_init__ defaults them"
        nodes = job_nodes(job)
        first = state.nodes.get(nodes[0])
        ck = job.checkpoint
        rank = nodes.index(node)
        job_token = subjects.token(job.job_id)
        gen = f".{job.generation}" if job.generation else ""
        run_name = f"{job.attempt}{gen}-{subjects.token(node)}"
        prev_attempt, prev_n = self.launches.get(job.job_id, (job.attempt, -1))
        n = prev_n + 1 if prev_attempt == job.attempt else 0
        self.launches[job.job_id] = (job.attempt, n)
        control = cfg.work_dir / "control" / job_token / (run_name if n == 0 else f"{run_name}.{n}")
        if job.spec.command:
            shutil.rmtree(control, ignore_errors=True)
        resume = None
        if ck is not None:
            resume = ck.paths[rank] if rank < len(ck.paths) else ck.path
        mig, slice_nodes = self.slices_of(job, mine, state)
        return launcher.Launch(
            job_id=job.job_id, attempt=job.attempt, node=node, node_rank=rank,
            num_nodes=len(nodes), gpus=mine, gpu_ids=tuple(gpu_id(node, i) for i in mine),
            gpu_uuids=tuple(self.uuids.get(i, "") for i in mine),
            master_addr=(first.address if first is not None and first.address else "127.0.0.1"),
            command=tuple(job.spec.command), env=dict(job.spec.env),
            checkpoint_dir=Path(job.spec.checkpoint_dir) if job.spec.checkpoint_dir else cfg.checkpoint_root / job_token,
            control_dir=control, log_path=cfg.log_dir / job_token / f"{run_name}.log",
            resume_from=resume, resume_step=ck.step if ck is not None else None,
            cwd=job.spec.workdir or (None if job.spec.image else cfg.cwd), generation=job.generation,
            checkpoint_mode=job.spec.checkpoint,
            **launcher.resume_and_secrets(job), checkpoint_roots=cfg.all_checkpoint_roots(),
            devices=tuple(self.devices[i].path for i in mine if i in self.devices)
            + tuple(d.path for ds in slice_nodes.values() for d in ds),
            image=job.spec.image, containers_dir=str(cfg.containers_dir) if job.spec.image else None,
            **launcher.share_of(job, [state.gpus[g].memory_mb for g in job.gpus if g in state.gpus]),
            **mig,
        )

    def slices_of(self, job: Job, mine: tuple[int, ...], state: ClusterState) \
            -> tuple[dict, dict[tuple[int, int], tuple[GpuDevice, ...]]]:
        """A MIG job's Launch fields (slices, MIG UUIDs) and its slices' capability devices: on
        an NVML node as the backend made them (`LaunchError` where it has not or failed), on a
        simulated one derived from the GPU's. Nothing for other jobs."""
        made = getattr(self.backend, "mig_slices", None)
        if made is None or not job.spec.sliced or not mine:
            wanted = [(i, s) for i in mine for s in job.slices]
            return launcher.slices_of(job, state), {k: (self.slice_devices[k],) for k in wanted if k in self.slice_devices}
        gpu = mine[0]
        found = made(gpu) or []
        bad = [s for s in job.slices if s >= len(found) or found[s].profile != job.spec.mig]
        if bad:
            why = getattr(self.backend, "mig_error", lambda _: "")(gpu) or "its geometry is not applied here"
            raise LaunchError(f"MIG slice(s) {bad} of GPU {gpu_id(self.node, gpu)} are not usable: {why}")
        fields = {"mig_slices": tuple(job.slices), "mig_uuids": tuple(found[s].uuid for s in job.slices)}
        return fields, {(gpu, s): found[s].devices for s in job.slices}

    def forget(self, job_id: str) -> None:
        """The job no longer runs here: a later attempt counts its launches afresh."""
        self.launches.pop(job_id, None)

    def start(self, job: Job, mine: tuple[int, ...], state: ClusterState, agent_id: str) \
            -> tuple[launcher.Launch, launcher.JobProcess | launcher.VirtualProcess]:
        """Confine and start this node's rank of `job` (`agent_id` names its cgroup);
        `LaunchError` when it cannot start."""
        spec = self.spec(job, mine, state)
        slice_nodes = self.slices_of(job, mine, state)[1]
        if spec.image and self.cdi_pending:
            self.cdi_spec = _publish_cdi(self.cdi_pending, self.devices, self.uuids, self.slice_devices)
            self.cdi_pending = None
        try:
            spec = confine(spec, job, self.users, self.uid_holder, cgroup_parent=self.cgroup_parent,
                           cgroup_name=f"{subjects.token(job.job_id)}.{spec.control_dir.name}-{agent_id}",
                           devices=self.devices, control=self.control_devices, pids_max=self.cfg.pids_max,
                           slices=slice_nodes)
        except (NoJobUser, CgroupError) as err:
            raise LaunchError(f"cannot confine the job: {err}") from err
        try:
            proc = launcher.start(spec)
        except OSError as err:  # its directories or log cannot be made safe
            remove_confinement(spec)
            raise LaunchError(f"cannot prepare the job's directories: {err}") from err
        if proc.spawn_error:
            remove_confinement(spec)
            raise LaunchError(proc.spawn_error)
        return spec, proc

    def close(self, jobs_stopped: bool) -> None:
        """The daemon stops: its cgroup parent goes (empty once no run is left under it), and its
        CDI spec once its jobs are stopped (a kept run's podman may still be resolving it)."""
        if self.cgroup_parent:
            remove_parent(self.cgroup_parent)
        if self.cdi_spec is not None and jobs_stopped:
            with contextlib.suppress(OSError):
                self.cdi_spec.unlink(missing_ok=True)


def gpu_devices(cfg: AgentConfig, backend: GpuBackend) -> tuple[dict[int, GpuDevice], tuple[str, ...]]:
    """The device node of each GPU, and the control devices every GPU job may open: simulated
    GPUs get device nodes of their own under the work dir; NVML ones are /dev/nvidiaN."""
    if isinstance(backend, SimBackend):
        return sim_devices(cfg.work_dir / "dev" / subjects.token(cfg.node), cfg.node, len(backend.gpus())), ()
    minors = getattr(backend, "minor_numbers", None)
    return (nvidia_devices(minors()), nvidia_control_allow()) if minors is not None else ({}, ())


def slice_devices(cfg: AgentConfig, backend: GpuBackend) -> dict[tuple[int, int], GpuDevice]:
    """The capability devices of the possible MIG slices of a simulated node's GPUs in MIG mode
    (an NVML node's are NVIDIA's /dev/nvidia-caps: not read yet, docs/gpu-sharing.md)."""
    if not isinstance(backend, SimBackend):
        return {}
    mig = [i for i, m in backend.mig().items() if "enabled" in (m.mode, m.pending)]
    return sim_slice_devices(cfg.work_dir / "dev" / subjects.token(cfg.node), cfg.node, mig) if mig else {}


def _publish_cdi(key: str, devices: dict[int, GpuDevice], uuids: dict[int, str],
                 slices: dict[tuple[int, int], GpuDevice]) -> Path | None:
    """Write the simulated GPUs' CDI spec; a failure shows as the image job's unresolvable
    device, with podman's message in its log."""
    try:
        return container.write_cdi_spec(key, devices, uuids, slices=slices)
    except OSError as err:
        log.warning("cdi_spec_not_written", dir=str(container.CDI_DIR), error=str(err))
        return None


def oom_detail(launch: launcher.Launch) -> str:
    """"out of memory" when the kernel killed a process of the job for its memory limit."""
    if launch.cgroup is None or not JobCgroup.from_json(launch.cgroup).oom_kills():
        return ""
    return "out of memory: the job exceeded its memory limit (--mem) and the kernel killed it"


def remove_confinement(launch: launcher.Launch) -> None:
    """Kill what is left in the run's cgroup and remove it; for an image job, what its killed
    podman left behind."""
    if launch.cgroup is not None:
        cg = JobCgroup.from_json(launch.cgroup)
        cg.kill()
        if not cg.remove(0.5):
            log.warning("cgroup_not_removed", job=launch.job_id, dirs=list(cg.dirs.values()))
    if launch.image and launch.containers_dir:
        container.remove_run_cgroups(launch)
        container.remove(container.configure(Path(launch.containers_dir)), container.name_of(launch))
