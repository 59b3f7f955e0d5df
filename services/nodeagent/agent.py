"""The node daemon: one `NodeAgent` per host, or many simulated ones in one `NodeHost`.

An agent follows the log (one shared `FoldedLog` per host process) and makes the node match
it: a grant that touches its GPUs starts the job's process, a preemption request is passed to
the job (control file + SIGUSR1 to SDK processes), a checkpoint the job acknowledges becomes
`CheckpointSaved`, a release / cancel / node loss stops the process group. It reports what
only it can see: `JobStarted`, exits (`JobCompleted`, a requeue as `GpusReleased(process_failed)`,
or `JobFailed`), and heartbeats with the GPUs' state on core NATS.

Only the current attempt's exit is reported, and never the exit of a process the agent itself
stopped. A multi-node job completes when its rank-0 process exits 0; any rank's non-zero exit
fails (or requeues) the attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog

from gpusched import telemetry
from gpusched.bus import subjects
from gpusched.bus.log import EventLog, EventTooLarge
from gpusched.core import events as ev
from gpusched.core.heartbeat import (
    Heartbeat,
    InjectHealth,
    InjectLeak,
    InjectStray,
    JobReport,
    KillProcesses,
    LogReply,
    NodeReply,
    ResetGpu,
    SimulateCrash,
    decode_request,
)
from gpusched.core.model import gpu_id, split_gpu_id
from gpusched.core.rules import work_since_checkpoint
from gpusched.core.state import ClusterState, Job, job_node_order, stale_live
from gpusched.services.runtime import FoldedLog, append_cas, cancel_tasks, fatal, notify_ready

from . import container, fencing, keeper, launcher
from .acks import AckCoalescer, AckLimits
from .backends import GpuBackend, SimBackend, gpus_with_mig, process_alive
from .cgroups import CgroupError, JobCgroup, remove_parent
from .confine import cgroups_wanted, confine
from .devices import GpuDevice, nvidia_control_allow, nvidia_devices, sim_devices
from .handshake import CheckpointHandshake, _write_json
from .logs import serve_log
from .users import NoJobUser, UserMap

log = structlog.get_logger()

Build = Callable[[ClusterState], "ev.Event | None"]
RunKey = tuple[str, int, int]  # job, attempt, generation


def default_work_dir() -> Path:
    return Path(os.environ.get("GPUSCHED_WORK_DIR") or Path.home() / ".local" / "state" / "gpusched")


@dataclass
class AgentConfig:
    node: str
    rack: str = "rack0"
    block: str | None = None
    address: str = ""
    nvlink: str = "custom"  # the layout name registered (informational)
    work_dir: Path = field(default_factory=default_work_dir)
    log_dir: Path | None = None  # default <work_dir>/logs: <log_dir>/<job>/<attempt>-<node>.log
    checkpoint_root: Path | None = None  # default <work_dir>/checkpoints/<job> (use a shared FS)
    kill_grace_s: float = 10.0
    cwd: str | None = None  # where a job without `spec.workdir` runs (None: the daemon's directory)
    ack_interval_s: float = 5.0  # at most one CheckpointSaved per run per interval (answers excepted)
    max_ack_bytes: int = 4096
    max_control_entries: int = 256
    resize_grace_s: float = 30.0  # a resize waits this long for the collective checkpoint
    timeout_checkpoint_s: float = 30.0  # a time-limited job is asked to checkpoint this long before
    retry_backoff_s: float = 1.0  # a requeued failure restarts after 1, 2, 4 ... s
    retry_backoff_max_s: float = 60.0
    job_user: str | None = None  # run every job without an account or team user as this one (single tenant)
    team_users: dict[str, str] = field(default_factory=dict)  # team -> its service account
    #: Dynamic uids (first, count) for jobs with no account (users.UserMap); None: none.
    uid_range: tuple[int, int] | None = None
    submitter_accounts: bool = True  # run as the submitter's account when this node has it
    #: A cgroup per run (limits, GPU allow-list, kill by cgroup): None = where the host allows (root).
    cgroups: bool | None = None
    cgroup_parent: str = "gpusched"
    pids_max: int | None = 8192  # per job
    #: More directories where jobs may name their checkpoint_dir (besides `checkpoint_root`).
    checkpoint_roots: tuple[str, ...] = ()
    rejoin_heartbeats: int = 3  # after a NodeLost of itself, re-register after this many heartbeats
    labels: dict[str, str] = field(default_factory=dict)  # announced at registration (`--label K=V`)
    #: podman's configuration and image storage for image jobs (`container`); default <work_dir>/containers.
    containers_dir: Path | None = None
    #: CPUs and memory (MiB) offered to jobs, announced at registration (None: not declared,
    #: then placement does not count them here; `main.host_resources` gives the host's).
    cpus: float | None = None
    memory_mb: int | None = None

    def __post_init__(self) -> None:
        self.work_dir = Path(self.work_dir)
        self.log_dir = Path(self.log_dir) if self.log_dir else self.work_dir / "logs"
        self.checkpoint_root = Path(self.checkpoint_root) if self.checkpoint_root else self.work_dir / "checkpoints"
        self.containers_dir = Path(self.containers_dir) if self.containers_dir else self.work_dir / "containers"

    def user_for(self, team: str) -> str | None:
        return self.team_users.get(team, self.job_user)

    def user_map(self) -> UserMap:
        return UserMap(job_user=self.job_user, team_users=dict(self.team_users),
                       submitter_accounts=self.submitter_accounts, uid_range=self.uid_range)

    def all_checkpoint_roots(self) -> tuple[str, ...]:
        return (str(self.checkpoint_root), *self.checkpoint_roots)


_run_ids = itertools.count(1)


@dataclass
class RunningJob:
    job_id: str
    attempt: int
    gpus: tuple[int, ...]
    node_rank: int
    proc: launcher.JobProcess | launcher.VirtualProcess | launcher.AdoptedProcess
    generation: int = 0
    # running | draining (a resize: checkpoint, then stop) | stopping | exited (rank != 0 done)
    state: str = "running"
    stop_at: float | None = None
    sigkilled: bool = False
    exit_code: int | None = None
    sim_checkpoint_at: float | None = None
    request: str | None = None  # the checkpoint request written to the job, by id
    drain_until: float | None = None
    timeout_asked: bool = False
    ended: bool = False  # ProcessesEnded reported
    acks: AckCoalescer | None = None
    id: int = field(default_factory=lambda: next(_run_ids))

    @property
    def key(self) -> RunKey:
        return (self.job_id, self.attempt, self.generation)


def _sharers(job: Job, state: ClusterState) -> set[str]:
    """The other fractional jobs the fold lets a fractional job share its GPU with."""
    if not job.spec.shared:
        return set()
    return {j for g in job.gpus if g in state.gpus for j in state.gpus[g].shares if j != job.job_id}


def job_nodes(job: Job) -> list[str]:
    """The job's nodes in grant order: the rank of a node is its position here."""
    return job_node_order(job)


def _launch_spec_for(self, job: Job, mine: tuple[int, ...], state: ClusterState) -> launcher.Launch:
    nodes = job_nodes(job)
    first = state.nodes.get(nodes[0])
    ck = job.checkpoint
    rank = nodes.index(self.node)
    job_token = subjects.token(job.job_id)
    gen = f".{job.generation}" if job.generation else ""
    run_name = f"{job.attempt}{gen}-{subjects.token(self.node)}"
    prev_attempt, prev_n = self.launches.get(job.job_id, (job.attempt, -1))
    n = prev_n + 1 if prev_attempt == job.attempt else 0
    self.launches[job.job_id] = (job.attempt, n)
    control = self.cfg.work_dir / "control" / job_token / (run_name if n == 0 else f"{run_name}.{n}")
    if job.spec.command:
        shutil.rmtree(control, ignore_errors=True)
    resume = None
    if ck is not None:
        resume = ck.paths[rank] if rank < len(ck.paths) else ck.path
    return launcher.Launch(
        job_id=job.job_id, attempt=job.attempt, node=self.node, node_rank=rank,
        num_nodes=len(nodes), gpus=mine, gpu_ids=tuple(gpu_id(self.node, i) for i in mine),
        gpu_uuids=tuple(self.uuids.get(i, "") for i in mine),
        master_addr=(first.address if first is not None and first.address else "127.0.0.1"),
        command=tuple(job.spec.command), env=dict(job.spec.env),
        checkpoint_dir=Path(job.spec.checkpoint_dir) if job.spec.checkpoint_dir else self.cfg.checkpoint_root / job_token,
        control_dir=control, log_path=self.cfg.log_dir / job_token / f"{run_name}.log",
        resume_from=resume, resume_step=ck.step if ck is not None else None,
        cwd=job.spec.workdir or (None if job.spec.image else self.cfg.cwd), generation=job.generation, checkpoint_mode=job.spec.checkpoint,
        **launcher.resume_and_secrets(job), checkpoint_roots=self.cfg.all_checkpoint_roots(),
        devices=tuple(self.devices[i].path for i in mine if i in self.devices),
        image=job.spec.image, containers_dir=str(self.cfg.containers_dir) if job.spec.image else None,
        **launcher.share_of(job, [state.gpus[g].memory_mb for g in job.gpus if g in state.gpus]),
    )


def _watch_run(self, run: RunningJob, state: ClusterState, now: float) -> None:
    """A live run: SIGKILL after the grace; a draining one stops once its checkpoint is
    complete; a time-limited one is asked to checkpoint before its limit."""
    if run.state == "stopping":
        if not run.sigkilled and now - run.stop_at >= self.cfg.kill_grace_s:
            log.warning("job_sigkill", job=run.job_id, attempt=run.attempt, node=self.node)
            run.proc.signal_group(signal.SIGKILL)
            run.sigkilled = True
        return
    job = state.jobs.get(run.job_id)
    if run.state == "draining":
        ck = job.checkpoint if job is not None else None
        done = (job is None or not job.holding or job.attempt != run.attempt
                or (ck is not None and ck.attempt == run.attempt and job.resized_at is not None
                    and ck.at >= job.resized_at))
        if done or now >= (run.drain_until or 0.0):
            self.stop(run, "resize: every rank restarts")
        return
    limit = job.spec.time_limit_s if job is not None else None
    if (limit is not None and not run.timeout_asked and job.started_at is not None
            and time.time() >= job.started_at + limit - self.cfg.timeout_checkpoint_s):
        run.timeout_asked = True
        self._request_checkpoint(run, f"timeout-{run.attempt}", f"time limit of {limit:g} s",
                                 job.started_at + limit, "")


def _adopt_running(self, state: ClusterState) -> None:
    """A restarted daemon takes back the runs its state files record, each only if the OS
    proves the process is the one it started; a run of a job the fold no longer runs here
    is stopped; one that ended meanwhile is reported as ended (its exit too)."""
    try:
        files = sorted(self.runs_dir.glob("*.json"))
    except OSError:
        files = []
    for path in files:
        try:
            rec = json.loads(path.read_text())
            proc = launcher.adopt(rec)
            key = (rec["launch"]["job_id"], int(rec["launch"]["attempt"]), int(rec.get("generation", 0)))
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("run_record_unreadable", file=path.name, error=str(err))
            path.unlink(missing_ok=True)
            continue
        job = state.jobs.get(key[0])
        current = job is not None and job.holding and (job.attempt, job.generation) == key[1:]
        if proc is None:
            path.unlink(missing_ok=True)
            self._adopt_dead(rec, key, current)
            continue
        run = RunningJob(key[0], key[1], tuple(rec.get("gpus", ())), int(rec.get("node_rank", 0)), proc,
                         generation=key[2], acks=AckCoalescer(self.limits))
        self._add_run(run)
        log.info("job_adopted", job=key[0], attempt=key[1], generation=key[2], node=self.node, pid=proc.pid)
        if current:
            self.launched[key[0]] = key[1:]
            if job.preemption is not None:
                self._request_checkpoint(run, f"pre-{job.attempt}", job.preemption.reason,
                                         job.preemption.deadline, job.preemption.for_job)
        else:
            self.converge(key[0], state, False)


def _handle_control(self, data: bytes, only: type | None = None) -> NodeReply:
    """One node-control request. `only`: it came on the subject of that one request kind
    (the kill or reset subject: what the reconciler may send), where every other is refused."""
    try:
        req = decode_request(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        return NodeReply(ok=False, node=self.node, error=str(err))
    if only is not None and not isinstance(req, only):
        return NodeReply(ok=False, node=self.node,
                         error=f"{type(req).__name__} is not accepted on the {only.__name__} subject")
    if self.crashed:
        return NodeReply(ok=False, node=self.node, error="node is down (simulated crash)")
    try:
        if isinstance(req, KillProcesses):
            return self._kill(req)
        if isinstance(req, ResetGpu):
            error = self.backend.reset(req.index)
            log.warning("gpu_reset", node=self.node, index=req.index, reason=req.reason, error=error)
            return NodeReply(ok=not error, node=self.node, error=error)
        if not isinstance(self.backend, SimBackend):
            return NodeReply(ok=False, node=self.node, error=f"{req.__class__.__name__} needs the simulated backend")
        if isinstance(req, InjectStray):
            self.backend.inject_stray(req.index, req.pid)
        elif isinstance(req, InjectHealth):
            self.backend.inject_health(req.index, req.healthy, req.xid, req.reason)
        elif isinstance(req, InjectLeak):
            self.backend.inject_leak(req.index, req.memory_mb)
        elif isinstance(req, SimulateCrash):
            self.host.crash(self.node, req.revive_after_s)
    except ValueError as err:
        return NodeReply(ok=False, node=self.node, error=str(err))
    return NodeReply(ok=True, node=self.node)


def _defer_registration(agent: NodeAgent) -> bool:
    """True while a leftover run of this node still lives: its registration waits for the next
    heartbeat, so the node is never announced usable with an earlier attempt on its GPUs."""
    stopping = agent.leftovers()
    if stopping:
        agent.rejoin_at = agent.heartbeats + 1
        log.info("registration_deferred", node=agent.node, stopping=[r.job_id for r in stopping])
    return bool(stopping)


def _register_node(self: NodeAgent) -> bool:
    """(Re-)register, e.g. after a `NodeLost` of this node: the fold makes it usable again.
    Not while a leftover run still lives: then retried at the next heartbeat."""
    if _defer_registration(self):
        return False
    self.rejoin_at = None
    event = self.registration()

    def build(state: ClusterState) -> ev.Event | None:
        if not self.needs_registration(state):
            return None
        if self.leftovers():  # a stop began meanwhile: try again at the next heartbeat
            self.rejoin_at = self.heartbeats + 1
            return None
        return event

    self.host.submit(build)
    return True


class NodeAgent(CheckpointHandshake):
    def __init__(self, host: NodeHost, config: AgentConfig, backend: GpuBackend):
        self.host = host
        self.cfg = config
        self.node = config.node
        self.backend = backend
        self.agent_id = uuid.uuid4().hex[:12]
        self.gpu_info = gpus_with_mig(backend)
        self.uuids = {g.index: g.uuid for g in self.gpu_info}
        self.jobs: dict[int, RunningJob] = {}  # by run id: a stopping run and its successor can coexist
        self.launched: dict[str, tuple[int, int]] = {}  # job -> (attempt, generation) started here
        self.launches: dict[str, tuple[int, int]] = {}  # job -> (attempt, launches of it here)
        self.deferred: dict[RunKey, float] = {}  # launches waiting for the fence, not before
        self.ended_sent: dict[RunKey, None] = {}
        self.limits = AckLimits(max_bytes=config.max_ack_bytes, max_entries=config.max_control_entries,
                                interval_s=config.ack_interval_s)
        self.runs_dir = config.work_dir / "runs" / subjects.token(self.node)
        self.heartbeats = 0
        self.rejoin_at: int | None = None  # heartbeat count at which to register again
        self.crashed = False  # a simulated crash: silent, deaf, its processes gone
        self._subs: list = []
        self._swept = 0.0
        self.users = config.user_map()
        if not config.work_dir.exists():  # traversable for its jobs' directories, never listable
            config.work_dir.mkdir(parents=True, mode=0o711)
        self.cgroup_parent = config.cgroup_parent if cgroups_wanted(config.cgroups) else None
        self.devices, self.control_devices = gpu_devices(config, backend) if self.cgroup_parent else ({}, ())
        #: The simulated GPUs' CDI spec to write at the first image job (NVML GPUs: NVIDIA's own spec).
        self.cdi_pending: str | None = f"{config.work_dir.resolve()}/{config.node}" \
            if self.devices and isinstance(backend, SimBackend) else None
        #: Removed when the daemon stops its jobs (an earlier daemon's, for the runs adopted from it, too).
        self.cdi_spec: Path | None = container.cdi_path(self.cdi_pending) if self.cdi_pending else None
        
    # --- registration ---------------------------------------------------------------------

    def registration(self) -> ev.NodeRegistered:
        return ev.NodeRegistered(at=time.time(), node=self.node, rack=self.cfg.rack, gpus=self.gpu_info,
                                 block=self.cfg.block, nvlink=self.cfg.nvlink, address=self.cfg.address,
                                 labels=dict(self.cfg.labels), cpus=self.cfg.cpus or 0.0,
                                 memory_mb=self.cfg.memory_mb or 0)

    def needs_registration(self, state: ClusterState) -> bool:
        """Unknown, lost, or offering other CPUs or memory than the log says (a restart with other
        `--cpus`/`--mem`, or the first start of a daemon that declares them)."""
        node = state.nodes.get(self.node)
        offers = (self.cfg.cpus or 0.0, self.cfg.memory_mb or 0)
        return node is None or node.lost or (any(offers) and offers != (node.cpus, node.memory_mb))

    def leftovers(self) -> list[RunningJob]:
        """Runs being stopped (SIGTERM sent, SIGKILL after the grace, see `poll`): while any
        is alive, its GPUs are not usable and the node must not register."""
        return [r for r in self.jobs.values() if r.state == "stopping"]

    register = _register_node

    # --- following the log ------------------------------------------------------------------

    def on_event(self, e: ev.Event, state: ClusterState, seq: int, launch: bool) -> None:
        if self.crashed:
            return
        if isinstance(e, ev.NodeLost) and e.node == self.node:
            log.warning("node_declared_lost", node=self.node, reason=e.reason,
                        rejoin_after_heartbeats=self.cfg.rejoin_heartbeats)
            self.rejoin_at = self.heartbeats + max(1, self.cfg.rejoin_heartbeats)  # damped: no flapping
        if isinstance(e, ev.PreemptionRequested):
            job = state.jobs.get(e.job_id)
            for run in self.runs_of(e.job_id):
                if job is not None and job.attempt == run.attempt and run.state in ("running", "draining"):
                    self._request_checkpoint(run, str(seq), e.reason, e.deadline, e.for_job)
        job_id = getattr(e, "job_id", None)
        if job_id is not None:
            self.converge(job_id, state, launch)
        elif isinstance(e, ev.NodeLost):
            for jid in {r.job_id for r in self.jobs.values()}:
                self.converge(jid, state, False)

    def runs_of(self, job_id: str) -> list[RunningJob]:
        return [r for r in self.jobs.values() if r.job_id == job_id]

    def my_gpus(self, job: Job | None) -> tuple[int, ...]:
        if job is None or not job.holding:
            return ()
        return tuple(sorted(i for n, i in map(split_gpu_id, job.gpus) if n == self.node))

    def converge(self, job_id: str, state: ClusterState, launch: bool) -> None:
        """Make this node's processes of `job_id` match the fold. A resize restarts every rank:
        checkpoint (collective), stop, and start again with the new world size."""
        job = state.jobs.get(job_id)
        mine = self.my_gpus(job)
        current = (job.attempt, job.generation) if job is not None and job.holding else None
        for run in self.runs_of(job_id):
            if run.state in ("stopping", "draining"):
                continue
            if current is not None and (run.attempt, run.generation) == current and mine == run.gpus:
                continue
            if current is not None and run.attempt == current[0] and run.generation < current[1]:
                self._drain(run, job)
            else:
                self.stop(run, "released" if current is None else "attempt replaced")
        if current is None:
            self.launched.pop(job_id, None)
            self.launches.pop(job_id, None)
        elif launch and mine and self.launched.get(job_id) != current:
            self.launched[job_id] = current
            self.deferred[(job_id, *current)] = time.monotonic() + self._backoff(job)
            self._try_launch((job_id, *current), state)

    def _backoff(self, job: Job) -> float:
        """A job requeued after failures restarts later each time (1, 2, 4 ... s, capped)."""
        if job.restarts <= 0 or self.cfg.retry_backoff_s <= 0:
            return 0.0
        return min(self.cfg.retry_backoff_max_s, self.cfg.retry_backoff_s * 2 ** (job.restarts - 1))

    def _try_launch(self, key: RunKey, state: ClusterState) -> None:
        """Launch a deferred run once it is due and fenced: no process of an earlier attempt or
        generation of the job may still run anywhere, nor any other run on these GPUs here."""
        job = state.jobs.get(key[0])
        mine = self.my_gpus(job)
        if job is None or (job.attempt, job.generation) != key[1:] or not mine:
            self.deferred.pop(key, None)
            return
        if time.monotonic() < self.deferred[key] or stale_live(job) or self._gpus_busy(mine, key, _sharers(job, state)) \
                or not self.host.fresh_view():
            return
        del self.deferred[key]
        self._launch(job, mine, state)

    def current(self, job_id: str) -> RunningJob | None:
        """The run of `job_id` on this node that is not being stopped."""
        return next((r for r in self.jobs.values() if r.job_id == job_id and r.state not in ("stopping", "draining")),
                    None)

    def _gpus_busy(self, gpus: Iterable[int], key: RunKey | None = None, beside: Collection[str] = ()) -> bool:
        """Another run is on these GPUs (`beside`: the fractional jobs the fold lets share them)."""
        wanted = set(gpus)
        return any(r.key != key and r.state != "exited" and wanted & set(r.gpus) and r.job_id not in beside
                   for r in self.jobs.values())

    _launch_spec = _launch_spec_for

    def _launch(self, job: Job, mine: tuple[int, ...], state: ClusterState) -> None:
        spec = self._launch_spec(job, mine, state)
        if spec.image and self.cdi_pending:
            self.cdi_spec = _publish_cdi(self.cdi_pending, self.devices, self.uuids)
            self.cdi_pending = None
        key = (job.job_id, job.attempt, job.generation)
        try:
            spec = confine(spec, job, self.users, self.host.uid_holder, cgroup_parent=self.cgroup_parent,
                           cgroup_name=f"{subjects.token(job.job_id)}.{spec.control_dir.name}-{self.agent_id}",
                           devices=self.devices, control=self.control_devices, pids_max=self.cfg.pids_max)
        except (NoJobUser, CgroupError) as err:
            self._launch_failed(key, spec, f"cannot confine the job: {err}")
            return
        try:
            proc = launcher.start(spec)
        except OSError as err:  # its directories or log cannot be made safe
            self._launch_failed(key, spec, f"cannot prepare the job's directories: {err}")
            _remove_cgroup(spec)
            return
        if proc.spawn_error:
            self._launch_failed(key, spec, proc.spawn_error)
            _remove_cgroup(spec)
            return
        run = RunningJob(job.job_id, job.attempt, mine, spec.node_rank, proc, generation=job.generation,
                         acks=AckCoalescer(self.limits))
        self._add_run(run)
        log.info("job_started", job=job.job_id, attempt=job.attempt, generation=job.generation, node=self.node,
                 pid=proc.pid, gpus=list(mine), rank=spec.node_rank, resume_from=spec.resume_from)
        started = ev.JobStarted(at=time.time(), job_id=job.job_id, attempt=job.attempt, node=self.node,
                                pids=[proc.pid], rank=spec.node_rank, generation=job.generation,
                                log="" if proc.virtual else str(spec.log_path))
        self.host.submit(started, msg_id=f"started:{job.job_id}:{job.attempt}.{job.generation}:{self.node}")
        if job.preemption is not None:  # asked while the run was waiting for its fence
            self._request_checkpoint(run, f"pre-{job.attempt}", job.preemption.reason, job.preemption.deadline,
                                     job.preemption.for_job)

    def _launch_failed(self, key: RunKey, spec: launcher.Launch, error: str) -> None:
        """A launch error (no such command, not executable, bad working dir) fails the job at
        once: no retry would help."""
        log.error("job_launch_error", job=key[0], attempt=key[1], node=self.node, error=error)
        job_id, attempt = key[0], key[1]

        def failed(state: ClusterState) -> ev.Event | None:
            job = state.jobs.get(job_id)
            if job is None or not job.holding or job.attempt != attempt:
                return None
            return ev.JobFailed(at=time.time(), job_id=job_id, attempt=attempt,
                                reason=f"launch error on node {self.node}: {error}", node=self.node)

        self.host.submit(failed, msg_id=f"launch-error:{job_id}:{attempt}")
        self._report_ended(key, None, "launch error")

    def _add_run(self, run: RunningJob) -> None:
        self.jobs[run.id] = run
        self.host.track(run.job_id, self.node, True)
        if run.proc.pid:
            launch = run.proc.launch  # the spec's env and its MPS limits (the sim backend caps its memory by them)
            self.backend.attach(run.gpus, run.proc.pid, env={**launch.env, **launcher.share_env(launch)})
        self._save_record(run)

    def _record_path(self, key: RunKey) -> Path:
        return self.runs_dir / f"{subjects.token(key[0])}.{key[1]}.{key[2]}.json"

    def _save_record(self, run: RunningJob) -> None:
        """The state file a restarted daemon adopts this run from."""
        rec = launcher.record(run.proc)
        rec.update(gpus=list(run.gpus), node_rank=run.node_rank, generation=run.generation)
        if not self.runs_dir.exists():
            self.runs_dir.mkdir(parents=True, mode=0o700)  # the daemon's alone: jobs never read them
            os.chmod(self.runs_dir.parent, 0o700)
        _write_json(self._record_path(run.key), rec)
        if not run.proc.virtual:
            keeper.guard(self)  # a process that outlives this daemon: its fence keeper runs

    def _drain(self, run: RunningJob, job: Job) -> None:
        """Resize: ask this rank for the collective checkpoint; `poll` stops it once the
        checkpoint is complete or `resize_grace_s` is over."""
        run.state, run.drain_until = "draining", time.monotonic() + self.cfg.resize_grace_s
        nodes = len(job_nodes(job))
        log.info("job_resize_restart", job=run.job_id, attempt=run.attempt, node=self.node, nodes=nodes)
        self._request_checkpoint(run, f"resize-{job.attempt}.{job.generation}", f"resize to {nodes} node(s)",
                                 time.time() + self.cfg.resize_grace_s, "")

    def stop(self, run: RunningJob, why: str) -> None:
        """SIGTERM the job's process group now, SIGKILL after the grace period (see `poll`)."""
        if run.state == "exited":
            self._forget(run)
            return
        log.info("job_stopping", job=run.job_id, attempt=run.attempt, node=self.node, why=why)
        run.state, run.stop_at = "stopping", time.monotonic()
        run.proc.signal_group(signal.SIGTERM)

    def _forget(self, run: RunningJob) -> None:
        self.jobs.pop(run.id, None)
        self.backend.detach(run.proc.pid)
        self._report_ended(run.key, run.exit_code, "stopped" if run.state == "stopping" else "exited", run)
        try:
            self._record_path(run.key).unlink()
        except OSError:
            pass
        if not run.proc.virtual:
            shutil.rmtree(run.proc.launch.control_dir, ignore_errors=True)
            _remove_cgroup(run.proc.launch)
        if not any(r.job_id == run.job_id for r in self.jobs.values()):
            self.host.track(run.job_id, self.node, False)

    def _report_ended(self, key: RunKey, exit_code: int | None, reason: str, run: RunningJob | None = None) -> None:
        """Every process of this run is gone: the fact that lets the next attempt start."""
        if run is not None:
            if run.ended:
                return
            run.ended = True
        if key in self.ended_sent:
            return
        self.ended_sent[key] = None
        e = ev.ProcessesEnded(at=time.time(), job_id=key[0], attempt=key[1], generation=key[2], node=self.node,
                              exit_code=exit_code, reason=reason)
        self.host.submit(e, msg_id=f"ended:{key[0]}:{key[1]}.{key[2]}:{self.node}")

    # --- processes --------------------------------------------------------------------------

    def poll(self, state: ClusterState) -> None:
        """Called every `poll_s`: acks, exits, resizes, time limits, SIGKILL after the grace,
        deferred launches, and ProcessesEnded for what the fold still thinks may run here."""
        if self.crashed:
            return
        now = time.monotonic()
        for run in list(self.jobs.values()):
            if run.state == "exited":
                continue
            if run.state != "stopping":
                self._collect_acks(run, state)
            rc = run.proc.poll()
            if rc is None:
                self._watch(run, state, now)
                continue
            self._exited(run, rc, state)
        for key in list(self.deferred):
            self._try_launch(key, state)
        if now - self._swept >= 1.0:
            self._swept = now
            self._sweep(state)

    _watch = _watch_run

    def _sweep(self, state: ClusterState) -> None:
        """Report as ended what the fold says may run here but this daemon does not run (a
        release before the launch, a run lost across a restart): the fence must not wait."""
        mine = {r.key for r in self.jobs.values()}
        for job_id in list(state.node_live.get(self.node, {})):
            job = state.jobs[job_id]
            for x in job.live:
                key = (job_id, x.attempt, x.generation)
                if x.node != self.node or key in mine or key in self.ended_sent:
                    continue
                if job.holding and (x.attempt, x.generation) == (job.attempt, job.generation):
                    if key in self.deferred or self.my_gpus(job) and self.launched.get(job_id) != key[1:]:
                        continue  # about to start here
                self._report_ended(key, None, "not running here")
        live = {(j, x.attempt, x.generation) for j in state.node_live.get(self.node, {})
                for x in state.jobs[j].live if x.node == self.node}
        for key in [k for k in self.ended_sent if k not in live]:
            del self.ended_sent[key]

    def _exited(self, run: RunningJob, rc: int, state: ClusterState) -> None:
        if run.state != "stopping":
            self._collect_acks(run, state)  # an ack written just before the exit still counts
        run.proc.kill_stragglers()
        run.exit_code = rc
        if run.state != "stopping" and keeper.fenced(self._record_path(run.key)):
            run.state = "stopping"  # the fence keeper stopped it (this daemon was silent too long)
        if run.state in ("stopping",):
            self._forget(run)  # stopped by us: never reported
            return
        detail = _oom_detail(run.proc.launch) or container.exit_detail(run.proc.launch, rc)
        log.info("job_exited", job=run.job_id, attempt=run.attempt, node=self.node, exit_code=rc, detail=detail)
        if rc == 0 and run.node_rank != 0:
            run.state = "exited"  # its GPUs stay held until rank 0 finishes
            self.backend.detach(run.proc.pid)
            self._report_ended(run.key, rc, "exited", run)
            return
        self._forget(run)
        self._report_exit(run.job_id, run.attempt, rc, detail)

    def _report_exit(self, job_id: str, attempt: int, rc: int, detail: str = "") -> None:
        node = self.node

        def outcome(state: ClusterState) -> ev.Event | None:
            return exit_event(state, job_id, attempt, node, rc, time.time(), detail)

        self.host.submit(outcome, msg_id=f"exit:{job_id}:{attempt}:{node}")

    def stop_all(self, why: str) -> None:
        for run in list(self.jobs.values()):
            if run.state != "stopping":
                self.stop(run, why)

    # --- adoption after a restart -------------------------------------------------------------

    adopt = _adopt_running

    def _adopt_dead(self, rec: dict, key: RunKey, current: bool) -> None:
        """A recorded run whose process is gone: its exit status (from the wrapper) is reported
        like any exit, and its processes as ended."""
        rc = launcher.UNKNOWN_EXIT
        if not rec.get("virtual"):
            status = launcher.exit_status_file(launcher.Launch.from_json(rec["launch"]))
            try:
                rc = launcher.read_exit_status(status.parent, status.name)
            except (OSError, ValueError):
                pass
            for rest in ("control_dir",):
                shutil.rmtree(rec["launch"][rest], ignore_errors=True)
            _remove_cgroup(launcher.Launch.from_json(rec["launch"]))  # whatever the dead leader left, then the cgroup
        fenced = str(rec.get("fenced") or "")  # stopped by the fence keeper: like the daemon's own fence
        log.warning("job_ended_while_down", job=key[0], attempt=key[1], node=self.node, exit_code=rc, fenced=fenced)
        self._report_ended(key, rc, fenced or "ended while the daemon was down")
        if current:
            self.launched[key[0]] = key[1:]
            if not fenced and not (rc == 0 and int(rec.get("node_rank", 0)) != 0):
                self._report_exit(key[0], key[1], rc)

    # --- heartbeats and control -------------------------------------------------------------

    def heartbeat(self) -> Heartbeat:
        self.heartbeats += 1
        if self.rejoin_at is not None and self.heartbeats >= self.rejoin_at:
            self.register()
        jobs = [JobReport(job_id=r.job_id, attempt=r.attempt, gpus=list(r.gpus), pids=[r.proc.pid] if r.proc.pid else [],
                          state="running" if r.state == "draining" else r.state, exit_code=r.exit_code)
                for r in self.jobs.values()]
        return Heartbeat(node=self.node, at=time.time(), agent_id=self.agent_id, seq=self.heartbeats,
                         backend=self.backend.name, gpus=self.backend.sample(), jobs=jobs)

    control = _handle_control

    def logs(self, data: bytes, state: ClusterState) -> LogReply:
        """Serve part of one rank's log of one attempt (`gpusched logs`)."""
        return serve_log(self.node, self.cfg.log_dir, data, state)

    def _kill(self, req: KillProcesses) -> NodeReply:
        """Kill pids seen on this node's GPUs; never one of a job this agent runs, never a
        process that is on none of its GPUs."""
        on_gpus = {pid for s in self.backend.sample() for pid in s.pids}
        own = {r.proc.pid for r in self.jobs.values() if r.state in ("running", "draining")}
        killed, missing, refused = [], [], []
        for pid in req.pids:
            if pid in own:
                refused.append(pid)
            elif pid not in on_gpus:
                (refused if process_alive(pid) else missing).append(pid)
            elif self.backend.kill(pid) == "killed":
                killed.append(pid)
            else:
                missing.append(pid)
        log.warning("zombie_kill", node=self.node, gpu=req.gpu, killed=killed, missing=missing, refused=refused,
                    reason=req.reason)
        return NodeReply(ok=True, node=self.node, killed=killed, missing=missing, refused=refused)


def exit_event(state: ClusterState, job_id: str, attempt: int, node: str, rc: int, now: float,
               detail: str = "") -> ev.Event | None:
    """What a process exit means, decided against the fold at the moment of appending: nothing
    if the attempt already ended; completion on exit 0; else requeue while restarts remain."""
    job = state.jobs.get(job_id)
    if job is None or not job.holding or job.attempt != attempt:
        return None
    if rc == 0:
        return ev.JobCompleted(at=now, job_id=job_id, attempt=attempt, exit_code=0, node=node)
    if job.spec.on_failure == "requeue" and job.restarts < job.spec.max_restarts:
        return ev.GpusReleased(at=now, job_id=job_id, reason="process_failed",
                               lost_gpu_s=round(work_since_checkpoint(job, now), 3), node=node)
    reason = f"exit code {rc} on node {node}" + (f" ({detail})" if detail else "")
    return ev.JobFailed(at=now, job_id=job_id, attempt=attempt, reason=reason, exit_code=rc,
                        node=node)


def gpu_devices(cfg: AgentConfig, backend: GpuBackend) -> tuple[dict[int, GpuDevice], tuple[str, ...]]:
    """The device node of each GPU, and the control devices every GPU job may open: simulated
    GPUs get device nodes of their own under the work dir; NVML ones are /dev/nvidiaN."""
    if isinstance(backend, SimBackend):
        return sim_devices(cfg.work_dir / "dev" / subjects.token(cfg.node), cfg.node, len(backend.gpus())), ()
    minors = getattr(backend, "minor_numbers", None)
    return (nvidia_devices(minors()), nvidia_control_allow()) if minors is not None else ({}, ())


def _oom_detail(launch: launcher.Launch) -> str:
    """"out of memory" when the kernel killed a process of the job for its memory limit."""
    if launch.cgroup is None or not JobCgroup.from_json(launch.cgroup).oom_kills():
        return ""
    return "out of memory: the job exceeded its memory limit (--mem) and the kernel killed it"


def _publish_cdi(key: str, devices: dict[int, GpuDevice], uuids: dict[int, str]) -> Path | None:
    """Write the simulated GPUs' CDI spec; a failure shows as the image job's unresolvable
    device, with podman's message in its log."""
    try:
        return container.write_cdi_spec(key, devices, uuids)
    except OSError as err:
        log.warning("cdi_spec_not_written", dir=str(container.CDI_DIR), error=str(err))
        return None


def _remove_cgroup(launch: launcher.Launch) -> None:
    if launch.cgroup is not None:
        cg = JobCgroup.from_json(launch.cgroup)
        cg.kill()
        if not cg.remove(0.5):
            log.warning("cgroup_not_removed", job=launch.job_id, dirs=list(cg.dirs.values()))
    if launch.image and launch.containers_dir:  # what its killed podman left behind
        container.remove_run_cgroups(launch)
        container.remove(container.configure(Path(launch.containers_dir)), container.name_of(launch))


# --- the host: one connection, one fold, many agents -----------------------------------------


JOB_EVENTS = (ev.PreemptionRequested, ev.GpusReleased, ev.JobCompleted, ev.JobFailed, ev.JobCancelled,
              ev.JobTimedOut)


#: A node daemon starts a job only while its fold held the whole log as of at most this long
#: ago (`NodeHost.fresh_view`); well under the reconciler's node timeout (30 s).
VIEW_MAX_AGE_S = 2.0


class NodeHost:
    """Runs one or many node agents over one NATS connection and one fold of the log.
    Appends go through one writer task, in order; decisions that change GPU ownership are
    built against the fold at append time and compare-and-set."""

    def __init__(self, event_log: EventLog, *, heartbeat_s: float = 5.0, poll_s: float = 0.2, own_log: bool = True,
                 max_view_age_s: float = VIEW_MAX_AGE_S):
        self.log = event_log
        self.max_view_age_s = max_view_age_s
        self.view_confirmed_at = -math.inf  # when the log's head last fetched was found folded
        self._view_wanted = asyncio.Event()  # set by a launch that found the view stale
        self.nc = event_log.nc
        self.folded = FoldedLog(event_log)
        self.agents: dict[str, NodeAgent] = {}
        self.heartbeat_s = heartbeat_s
        self.poll_s = poll_s
        self.own_log = own_log
        self._history = 0
        self._queue: asyncio.Queue[tuple[Build | ev.Event, str | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._job_nodes: dict[str, set[str]] = {}
        self.appended = 0
        self.started = False

    @classmethod
    async def open(cls, nats_url: str | None = None, **kwargs) -> NodeHost:
        return cls(await EventLog.open(nats_url, name="gpusched-nodeagent"), **kwargs)

    def add(self, config: AgentConfig, backend: GpuBackend) -> NodeAgent:
        if self.started:
            raise RuntimeError("add agents before start()")
        agent = NodeAgent(self, config, backend)
        self.agents[config.node] = agent
        return agent

    def uid_holder(self, uid: int) -> str | None:
        """The job whose live run on this host holds `uid` (dynamic uids are per job), if any."""
        for agent in self.agents.values():
            for run in agent.jobs.values():
                if run.proc.launch.uid == uid:
                    return run.job_id
        return None

    def track(self, job_id: str, node: str, running: bool) -> None:
        nodes = self._job_nodes.setdefault(job_id, set())
        if running:
            nodes.add(node)
        else:
            nodes.discard(node)
            if not nodes:
                del self._job_nodes[job_id]

    def submit(self, item: Build | ev.Event, msg_id: str | None = None) -> None:
        self._queue.put_nowait((item, msg_id))

    async def start(self) -> None:
        asked = time.monotonic()
        self._history = await self.log.last_seq()
        keeper.start(self)  # the fence keeper's side, before adoption (its lease renewed once running: keeper.tasks)
        self.folded.listeners.append(self._on_record)
        await self.folded.start()
        self.view_confirmed_at = asked  # folded at least up to the head as it was then
        self.started = True
        state = self.folded.state
        for agent in self.agents.values():  # first take back (or end) what earlier daemons started
            agent.adopt(state)
        running_here: dict[str, list[str]] = {}
        for job_id in list(state.running):
            for node in job_nodes(state.jobs[job_id]):
                if node in self.agents:
                    running_here.setdefault(node, []).append(job_id)
        for node, job_ids in running_here.items():
            agent = self.agents[node]
            for job_id in job_ids:
                job = state.jobs[job_id]
                if agent.current(job_id) is not None or job_id in agent.launched:
                    continue  # adopted, or ended while the daemon was down
                if node not in job.nodes_started:  # granted while this daemon was down
                    agent.converge(job_id, state, launch=True)
                else:  # started by an earlier daemon, and nothing proves it still runs
                    agent.launched[job_id] = (job.attempt, job.generation)
                    log.warning("job_not_adopted", job=job_id, node=node,
                                hint="no provable process: reported ended; the reconciler requeues it")
        for agent in self.agents.values():
            agent._subs = [
                await self.nc.subscribe(subjects.node_control_subject(agent.node), cb=self._control_cb(agent)),
                await self.nc.subscribe(subjects.node_kill_subject(agent.node), cb=self._control_cb(agent, KillProcesses)),
                await self.nc.subscribe(subjects.node_reset_subject(agent.node), cb=self._control_cb(agent, ResetGpu)),
                await self.nc.subscribe(subjects.node_logs_subject(agent.node), cb=self._logs_cb(agent)),
            ]
        await self.nc.flush()  # control subjects are heard before the node is announced as usable
        await self._register_all()
        self._tasks = [
            asyncio.create_task(self._writer(), name="nodeagent-writer"),
            asyncio.create_task(self._monitor(), name="nodeagent-monitor"),
            asyncio.create_task(self._heartbeats(), name="nodeagent-heartbeats"),
            asyncio.create_task(self._confirm_view(), name="nodeagent-view"),
            *fencing.tasks(self),  # the log out of reach for long: stop the jobs (fencing.py)
            *keeper.tasks(self),  # this daemon dead for long: its keeper stops them (keeper.py)
        ]
        log.info("nodeagent_ready", nodes=len(self.agents), seq=self.folded.seen_seq)
        notify_ready()

    async def _register_all(self) -> None:
        """Register the nodes the log does not know or holds lost, except those whose adopted
        leftovers are still being stopped: they register from `heartbeat` once those are dead.
        A registration changes what may be granted, so it is a compare-and-set like every fact
        of the alloc tree (`runtime.append_cas`), in atomic batches; after a conflict the nodes
        still to register are decided again on the fresher fold."""
        for _ in range(50):
            todo = [a.registration() for a in self.agents.values()
                    if a.needs_registration(self.folded.state) and not _defer_registration(a)]
            appended, conflicted = await append_cas(self.folded, todo)
            self.appended += appended
            if not conflicted:
                return
        fatal("registering the nodes lost 50 compare-and-sets in a row")

    def _on_record(self, rec, state: ClusterState) -> None:
        if rec.seq <= self._history:
            return  # history: what was running before this daemon started is handled in start()
        e = rec.event
        nodes: dict[str, bool] = {}
        if isinstance(e, ev.GpusGranted):
            nodes = dict.fromkeys((split_gpu_id(g)[0] for g in e.gpus), True)
        elif isinstance(e, ev.JobResized):
            nodes = dict.fromkeys((split_gpu_id(g)[0] for g in [*e.added, *e.removed]), True)
            nodes.update(dict.fromkeys(self._job_nodes.get(e.job_id, ()), True))
        elif isinstance(e, JOB_EVENTS):
            nodes = dict.fromkeys(self._job_nodes.get(e.job_id, ()), False)
        elif isinstance(e, ev.NodeLost):
            nodes = dict.fromkeys({e.node} | {n for ns in self._job_nodes.values() for n in ns}, False)
        mine = [(self.agents[n], launch) for n, launch in nodes.items() if n in self.agents]
        if not mine:
            return
        with telemetry.record_span(f"nodeagent.{e.kind}", rec, nodes=len(mine)):
            for agent, launch in mine:
                agent.on_event(e, state, rec.seq, launch)

    def _control_cb(self, agent: NodeAgent, only: type | None = None):
        async def cb(msg) -> None:
            reply = agent.control(msg.data, only)
            if msg.reply:
                await msg.respond(msgspec.json.encode(reply))
        return cb

    def _logs_cb(self, agent: NodeAgent):
        async def cb(msg) -> None:
            reply = agent.logs(msg.data, self.folded.state) if not agent.crashed else \
                LogReply(ok=False, node=agent.node, error="node is down (simulated crash)")
            if msg.reply:
                await msg.respond(msgspec.json.encode(reply))
        return cb

    async def _writer(self) -> None:
        while True:
            item, msg_id = await self._queue.get()
            for _ in range(50):
                try:
                    event = item(self.folded.state) if callable(item) else item
                    if event is None:
                        break
                    if event.ALLOC:  # every fact of the alloc tree (see `runtime.append_cas`)
                        _, conflicted = await append_cas(self.folded, [event], msg_id=lambda e: msg_id)
                        if conflicted:
                            continue
                    else:
                        await self.log.append(event, msg_id=msg_id)
                    self.appended += 1
                    break
                except asyncio.CancelledError:
                    raise
                except EventTooLarge as err:  # permanent: retrying cannot help
                    log.error("append_refused", msg_id=msg_id, error=str(err))
                    break
                except Exception:
                    log.exception("append_failed", msg_id=msg_id)
                    await asyncio.sleep(0.5)
            else:  # retries exhausted: end, so that a restarted daemon converges from the log
                fatal(f"append {msg_id} failed 50 times")
            self._queue.task_done()

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            for agent in list(self.agents.values()):
                try:
                    agent.poll(self.folded.state)
                except Exception:
                    log.exception("agent_poll_failed", node=agent.node)

    def fresh_view(self) -> bool:
        """Whether launches may trust the fold: it held the whole log as of at most
        `max_view_age_s` ago. A daemon that lags (starved of CPU, restarting a thousand nodes,
        cut off from NATS) would otherwise start an attempt the log already superseded: its node
        declared lost and the job granted elsewhere, in facts it has not folded yet."""
        if time.monotonic() - self.view_confirmed_at <= self.max_view_age_s:
            return True
        self._view_wanted.set()  # a launch waits for it: confirm now
        return False

    async def _confirm_view(self) -> None:
        """The read barrier behind `fresh_view`: when a launch asks, fetch the log's head, wait
        until the fold holds it, record when it was fetched. On demand, not on a timer: an idle
        host asks the stream nothing, a busy one at most once per `max_view_age_s`."""
        warned = False
        while True:
            await self._view_wanted.wait()
            self._view_wanted.clear()
            asked = time.monotonic()
            try:
                head = await self.log.last_seq()
            except Exception as err:  # noqa: BLE001 - cannot confirm: launches wait
                if not warned:
                    log.warning("nodeagent_view_unconfirmed", error=f"{type(err).__name__}: {err}"[:200],
                                hint="no job starts on these nodes until the log answers")
                warned = True
                self._view_wanted.set()
                await asyncio.sleep(max(self.poll_s, 1.0))
                continue
            warned = False
            while self.folded.seen_seq < head:
                await asyncio.sleep(0.02)
            self.view_confirmed_at = asked

    async def _heartbeats(self) -> None:
        """Every agent once per `heartbeat_s`, spread over the period in slices so that a host
        of a thousand simulated nodes sends a steady stream rather than bursts."""
        while True:
            agents = [a for a in self.agents.values() if not a.crashed]
            slices = max(1, min(len(agents), 10))
            for k in range(slices):
                for agent in agents[k::slices]:
                    try:
                        await self.nc.publish(subjects.heartbeat_subject(agent.node), msgspec.json.encode(agent.heartbeat()))
                    except Exception:
                        log.exception("heartbeat_failed", node=agent.node)
                await asyncio.sleep(self.heartbeat_s / slices)

    async def flush(self, timeout: float = 10.0) -> None:
        """Wait until every queued append is written (tests, clean shutdown)."""
        await asyncio.wait_for(self._queue.join(), timeout)

    def crash(self, node: str, revive_after_s: float | None = None) -> None:
        """Simulate a dead machine: its processes die, it goes silent and deaf."""
        agent = self.agents[node]
        for run in list(agent.jobs.values()):
            run.proc.signal_group(signal.SIGKILL)
            run.ended = True  # a dead machine reports nothing; after it revives, its sweep does
            agent._forget(run)
        agent.crashed = True
        log.warning("node_crashed", node=node, revive_after_s=revive_after_s)
        if revive_after_s is not None:
            asyncio.get_running_loop().call_later(revive_after_s, self.revive, node)

    def revive(self, node: str) -> None:
        agent = self.agents[node]
        agent.crashed = False
        agent.agent_id = uuid.uuid4().hex[:12]
        agent.register()

    async def stop(self, kill_jobs: bool = True) -> None:
        """Stop every job process (SIGTERM, SIGKILL after the grace), then the tasks."""
        if kill_jobs:
            for agent in self.agents.values():
                agent.stop_all("node daemon stopping")
            deadline = time.monotonic() + max((a.cfg.kill_grace_s for a in self.agents.values()), default=0) + 2
            while any(a.jobs for a in self.agents.values()) and time.monotonic() < deadline:
                for agent in self.agents.values():
                    agent.poll(self.folded.state)
                await asyncio.sleep(0.05)
            try:
                await self.flush(timeout=3.0)  # the ProcessesEnded of what it stopped
            except Exception:
                log.warning("nodeagent_flush_incomplete", queued=self._queue.qsize())
        await cancel_tasks(self._tasks)
        keeper.stop(self)
        for agent in self.agents.values():
            for sub in agent._subs:
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass
        await self.folded.stop()
        for agent in self.agents.values():
            agent.backend.close()
            if agent.cgroup_parent:
                remove_parent(agent.cgroup_parent)  # empty once no run is left under it
            if agent.cdi_spec is not None and kill_jobs:  # a kept run's podman may still be resolving it
                with contextlib.suppress(OSError):
                    agent.cdi_spec.unlink(missing_ok=True)
        if self.own_log:
            try:
                await self.log.close()
            except Exception:
                pass
