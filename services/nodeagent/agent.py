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
import itertools
import json
import os
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog
from gpusched import telemetry
from gpusched.bus import subjects
from gpusched.bus.log import EventLog
from gpusched.core import events as ev
from gpusched.core.heartbeat import (
    Heartbeat,
    InjectHealth,
    InjectLeak,
    InjectStray,
    JobReport,
    KillProcesses,
    NodeReply,
    ResetGpu,
    SimulateCrash,
    decode_request,
)
from gpusched.core.model import gpu_id, split_gpu_id
from gpusched.core.state import ClusterState, Job
from gpusched.job import env as E
from gpusched.services.runtime import FoldedLog, append_cas, cancel_tasks

from . import launcher
from .backends import GpuBackend, SimBackend, process_alive

log = structlog.get_logger()

Build = Callable[[ClusterState], "ev.Event | None"]


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
    cwd: str | None = None

    def __post_init__(self) -> None:
        self.work_dir = Path(self.work_dir)
        self.log_dir = Path(self.log_dir) if self.log_dir else self.work_dir / "logs"
        self.checkpoint_root = Path(self.checkpoint_root) if self.checkpoint_root else self.work_dir / "checkpoints"


_run_ids = itertools.count(1)


@dataclass
class RunningJob:
    job_id: str
    attempt: int
    gpus: tuple[int, ...]
    node_rank: int
    proc: launcher.JobProcess | launcher.VirtualProcess
    state: str = "running"  # running | stopping | exited (a non-zero rank done, waiting for rank 0)
    stop_at: float | None = None
    sigkilled: bool = False
    exit_code: int | None = None
    sim_checkpoint_at: float | None = None
    seen_acks: set[str] = field(default_factory=set)
    id: int = field(default_factory=lambda: next(_run_ids))


def job_nodes(job: Job) -> list[str]:
    """The job's nodes in grant order: the rank of a node is its position here."""
    return list(dict.fromkeys(split_gpu_id(g)[0] for g in job.gpus))


class NodeAgent:
    def __init__(self, host: NodeHost, config: AgentConfig, backend: GpuBackend):
        self.host = host
        self.cfg = config
        self.node = config.node
        self.backend = backend
        self.agent_id = uuid.uuid4().hex[:12]
        self.gpu_info = backend.gpus()
        self.uuids = {g.index: g.uuid for g in self.gpu_info}
        self.jobs: dict[int, RunningJob] = {}  # by run id: a stopping run and its successor can coexist
        self.launched: dict[str, int] = {}  # job -> the attempt started here (never twice)
        self.launches: dict[str, tuple[int, int]] = {}  # job -> (attempt, launches of it here)
        self.deferred: dict[tuple[str, int], None] = {}
        self.heartbeats = 0
        self.crashed = False  # a simulated crash: silent, deaf, its processes gone
        self._subs: list = []

    # --- registration ---------------------------------------------------------------------

    def registration(self) -> ev.NodeRegistered:
        return ev.NodeRegistered(at=time.time(), node=self.node, rack=self.cfg.rack, gpus=self.gpu_info,
                                 block=self.cfg.block, nvlink=self.cfg.nvlink, address=self.cfg.address)

    def needs_registration(self, state: ClusterState) -> bool:
        node = state.nodes.get(self.node)
        return node is None or node.lost

    def register(self) -> None:
        """Re-register after a `NodeLost` of this node: the fold makes it usable again."""
        event = self.registration()
        self.host.submit(lambda s: event if self.needs_registration(s) else None, cas=False)

    # --- following the log ------------------------------------------------------------------

    def on_event(self, e: ev.Event, state: ClusterState, seq: int, launch: bool) -> None:
        if self.crashed:
            return
        if isinstance(e, ev.NodeLost) and e.node == self.node:
            log.warning("node_declared_lost", node=self.node, reason=e.reason)
            self.register()
        if isinstance(e, ev.PreemptionRequested):
            self._request_checkpoint(e, state, seq)
        job_id = getattr(e, "job_id", None)
        if job_id is not None:
            self.converge(job_id, state, launch)
        elif isinstance(e, ev.NodeLost):
            for jid in {r.job_id for r in self.jobs.values()}:
                self.converge(jid, state, False)

    def my_gpus(self, job: Job | None) -> tuple[int, ...]:
        if job is None or not job.holding:
            return ()
        return tuple(sorted(i for n, i in map(split_gpu_id, job.gpus) if n == self.node))

    def converge(self, job_id: str, state: ClusterState, launch: bool) -> None:
        """Make this node's processes of `job_id` match the fold."""
        job = state.jobs.get(job_id)
        mine = self.my_gpus(job)
        for run in [r for r in self.jobs.values() if r.job_id == job_id]:
            if run.state == "stopping":
                continue
            if not mine or job is None or run.attempt != job.attempt:
                why = "released" if job is None or not job.holding else "attempt replaced" if run.attempt != job.attempt else "moved"
                self.stop(run, why)
                if why == "moved":  # an elastic shrink off this node: a later grow starts it again
                    self.launched.pop(job_id, None)
            elif mine != run.gpus:
                self._resized(run, mine)
        if job is None or not job.holding:
            self.launched.pop(job_id, None)
            self.launches.pop(job_id, None)
        if launch and mine and job is not None and self.launched.get(job_id) != job.attempt:
            self.launched[job_id] = job.attempt
            if self._gpus_busy(mine):
                self.deferred[(job_id, job.attempt)] = None  # wait for the previous holder to exit
            else:
                self._launch(job, mine, state)

    def current(self, job_id: str) -> RunningJob | None:
        """The run of `job_id` on this node that is not being stopped."""
        return next((r for r in self.jobs.values() if r.job_id == job_id and r.state != "stopping"), None)

    def _gpus_busy(self, gpus: Iterable[int]) -> bool:
        wanted = set(gpus)
        return any(r.state == "stopping" and wanted & set(r.gpus) for r in self.jobs.values())

    def _launch(self, job: Job, mine: tuple[int, ...], state: ClusterState) -> None:
        nodes = job_nodes(job)
        first = state.nodes.get(nodes[0])
        ck = job.checkpoint
        job_token = subjects.token(job.job_id)
        run_name = f"{job.attempt}-{subjects.token(self.node)}"
        prev_attempt, prev_n = self.launches.get(job.job_id, (job.attempt, -1))
        n = prev_n + 1 if prev_attempt == job.attempt else 0
        self.launches[job.job_id] = (job.attempt, n)
        control = self.cfg.work_dir / "control" / job_token / (run_name if n == 0 else f"{run_name}.{n}")
        if job.spec.command:
            shutil.rmtree(control, ignore_errors=True)
        spec = launcher.Launch(
            job_id=job.job_id, attempt=job.attempt, node=self.node, node_rank=nodes.index(self.node),
            num_nodes=len(nodes), gpus=mine, gpu_ids=tuple(gpu_id(self.node, i) for i in mine),
            gpu_uuids=tuple(self.uuids.get(i, "") for i in mine),
            master_addr=(first.address if first is not None and first.address else "127.0.0.1"),
            command=tuple(job.spec.command), env=dict(job.spec.env),
            checkpoint_dir=Path(job.spec.checkpoint_dir) if job.spec.checkpoint_dir else self.cfg.checkpoint_root / job_token,
            control_dir=control, log_path=self.cfg.log_dir / job_token / f"{run_name}.log",
            resume_from=ck.path if ck is not None else None, resume_step=ck.step if ck is not None else None,
            cwd=self.cfg.cwd,
        )
        proc = launcher.start(spec)
        run = RunningJob(job.job_id, job.attempt, mine, spec.node_rank, proc)
        self.jobs[run.id] = run
        self.host.track(run.job_id, self.node, True)
        if proc.spawn_error:
            log.error("job_spawn_failed", job=job.job_id, attempt=job.attempt, node=self.node, error=proc.spawn_error)
            return  # the next poll reports exit code 127
        self.backend.attach(mine, proc.pid, env=spec.env)
        log.info("job_started", job=job.job_id, attempt=job.attempt, node=self.node, pid=proc.pid, gpus=list(mine),
                 rank=spec.node_rank, resume_from=spec.resume_from)
        started = ev.JobStarted(at=time.time(), job_id=job.job_id, attempt=job.attempt, node=self.node, pids=[proc.pid])
        self.host.submit(started, msg_id=f"started:{job.job_id}:{job.attempt}:{self.node}", cas=False)

    def _resized(self, run: RunningJob, mine: tuple[int, ...]) -> None:
        """An elastic job's GPUs on this node changed: the process keeps running (its
        CUDA_VISIBLE_DEVICES cannot change) and finds the new set in its control dir."""
        run.gpus = mine
        self.backend.detach(run.proc.pid)
        self.backend.attach(mine, run.proc.pid)
        if not run.proc.virtual:
            _write_json(run.proc.launch.control_dir / E.RESIZE, {"gpus": [gpu_id(self.node, i) for i in mine]})

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
        if not run.proc.virtual:
            shutil.rmtree(run.proc.launch.control_dir, ignore_errors=True)
        if not any(r.job_id == run.job_id for r in self.jobs.values()):
            self.host.track(run.job_id, self.node, False)

    # --- checkpoints ------------------------------------------------------------------------

    def _request_checkpoint(self, e: ev.PreemptionRequested, state: ClusterState, seq: int) -> None:
        job = state.jobs.get(e.job_id)
        for run in [r for r in self.jobs.values() if r.job_id == e.job_id and r.state == "running"]:
            if job is None or job.attempt != run.attempt:
                continue
            if run.proc.virtual:
                if run.proc.checkpoint_after is not None:
                    run.sim_checkpoint_at = time.monotonic() + run.proc.checkpoint_after
                continue
            control = run.proc.launch.control_dir
            _write_json(control / E.REQUEST, {"id": str(seq), "reason": e.reason, "deadline": e.deadline,
                                              "for_job": e.for_job})
            pids = [int(p.name[len(E.SDK_PREFIX):]) for p in control.glob(f"{E.SDK_PREFIX}*")
                    if p.name[len(E.SDK_PREFIX):].isdigit()]
            run.proc.signal_pids([p for p in pids if process_alive(p)], signal.SIGUSR1)
            log.info("checkpoint_requested", job=run.job_id, attempt=run.attempt, node=self.node, signalled=pids)

    def _collect_acks(self, run: RunningJob) -> None:
        if run.proc.virtual:
            if run.sim_checkpoint_at is not None and time.monotonic() >= run.sim_checkpoint_at:
                run.sim_checkpoint_at = None
                step = int(time.monotonic() - run.proc.started) + (run.proc.launch.resume_step or 0)
                path = f"sim://{run.job_id}/{run.attempt}/{step}"
                self._report_checkpoint(run, path, step, f"sim-{step}")
            return
        control = run.proc.launch.control_dir
        try:
            names = sorted(n for n in os.listdir(control) if n.startswith(E.ACK_PREFIX) and n.endswith(".json"))
        except FileNotFoundError:
            return
        for name in names:
            if name in run.seen_acks:
                continue
            run.seen_acks.add(name)
            try:
                ack = json.loads((control / name).read_text())
                path, step = str(ack["path"]), int(ack["step"])
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("bad_checkpoint_ack", job=run.job_id, file=name, error=str(err))
                continue
            self._report_checkpoint(run, path, step, name)

    def _report_checkpoint(self, run: RunningJob, path: str, step: int, ack: str) -> None:
        log.info("checkpoint_saved", job=run.job_id, attempt=run.attempt, node=self.node, path=path, step=step)
        event = ev.CheckpointSaved(at=time.time(), job_id=run.job_id, attempt=run.attempt, path=path, step=step,
                                   node=self.node)
        self.host.submit(event, msg_id=f"ckpt:{run.job_id}:{run.attempt}:{self.node}:{ack}", cas=False)

    # --- processes --------------------------------------------------------------------------

    def poll(self, state: ClusterState) -> None:
        """Called every `poll_s`: acks, exits, SIGKILL after the grace, deferred launches."""
        if self.crashed:
            return
        now = time.monotonic()
        for run in list(self.jobs.values()):
            if run.state == "exited":
                continue
            self._collect_acks(run)
            rc = run.proc.poll()
            if rc is None:
                if run.state == "stopping" and not run.sigkilled and now - run.stop_at >= self.cfg.kill_grace_s:
                    log.warning("job_sigkill", job=run.job_id, attempt=run.attempt, node=self.node)
                    run.proc.signal_group(signal.SIGKILL)
                    run.sigkilled = True
                continue
            self._exited(run, rc)
        for key in list(self.deferred):
            job = state.jobs.get(key[0])
            mine = self.my_gpus(job)
            if job is None or job.attempt != key[1] or not mine:
                del self.deferred[key]
            elif not self._gpus_busy(mine):
                del self.deferred[key]
                self._launch(job, mine, state)

    def _exited(self, run: RunningJob, rc: int) -> None:
        self._collect_acks(run)  # an ack written just before the exit still counts
        run.proc.kill_stragglers()
        run.exit_code = rc
        if run.state == "stopping":
            self._forget(run)  # stopped by us: never reported
            return
        log.info("job_exited", job=run.job_id, attempt=run.attempt, node=self.node, exit_code=rc)
        if rc == 0 and run.node_rank != 0:
            run.state = "exited"  # its GPUs stay held until rank 0 finishes
            self.backend.detach(run.proc.pid)
            return
        self._forget(run)
        job_id, attempt, node = run.job_id, run.attempt, self.node

        def outcome(state: ClusterState) -> ev.Event | None:
            return exit_event(state, job_id, attempt, node, rc, time.time())

        self.host.submit(outcome, msg_id=f"exit:{job_id}:{attempt}:{node}")

    def stop_all(self, why: str) -> None:
        for run in list(self.jobs.values()):
            if run.state != "stopping":
                self.stop(run, why)

    # --- heartbeats and control -------------------------------------------------------------

    def heartbeat(self) -> Heartbeat:
        self.heartbeats += 1
        jobs = [JobReport(job_id=r.job_id, attempt=r.attempt, gpus=list(r.gpus), pids=[r.proc.pid] if r.proc.pid else [],
                          state=r.state, exit_code=r.exit_code) for r in self.jobs.values()]
        return Heartbeat(node=self.node, at=time.time(), agent_id=self.agent_id, seq=self.heartbeats,
                         backend=self.backend.name, gpus=self.backend.sample(), jobs=jobs)

    def control(self, data: bytes, kill_only: bool = False) -> NodeReply:
        """One node-control request. `kill_only`: it came on the kill subject (what the
        reconciler may send), where every other request is refused."""
        try:
            req = decode_request(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            return NodeReply(ok=False, node=self.node, error=str(err))
        if kill_only and not isinstance(req, KillProcesses):
            return NodeReply(ok=False, node=self.node, error=f"{type(req).__name__} is not accepted on the kill subject")
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

    def _kill(self, req: KillProcesses) -> NodeReply:
        """Kill pids seen on this node's GPUs; never one of a job this agent runs, never a
        process that is on none of its GPUs."""
        on_gpus = {pid for s in self.backend.sample() for pid in s.pids}
        own = {r.proc.pid for r in self.jobs.values() if r.state == "running"}
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


def exit_event(state: ClusterState, job_id: str, attempt: int, node: str, rc: int, now: float) -> ev.Event | None:
    """What a process exit means, decided against the fold at the moment of appending: nothing
    if the attempt already ended; completion on exit 0; else requeue while restarts remain."""
    job = state.jobs.get(job_id)
    if job is None or not job.holding or job.attempt != attempt:
        return None
    if rc == 0:
        return ev.JobCompleted(at=now, job_id=job_id, attempt=attempt, exit_code=0, node=node)
    if job.spec.on_failure == "requeue" and job.restarts < job.spec.max_restarts:
        since = job.started_at or now
        if job.checkpoint is not None and job.checkpoint.attempt == attempt:
            since = max(since, job.checkpoint.at)
        return ev.GpusReleased(at=now, job_id=job_id, reason="process_failed",
                               lost_gpu_s=round(len(job.gpus) * max(0.0, now - since), 3), node=node)
    return ev.JobFailed(at=now, job_id=job_id, attempt=attempt, reason=f"exit code {rc} on node {node}", exit_code=rc,
                        node=node)


def _write_json(path: Path, obj: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


# --- the host: one connection, one fold, many agents -----------------------------------------


JOB_EVENTS = (ev.PreemptionRequested, ev.GpusReleased, ev.JobCompleted, ev.JobFailed, ev.JobCancelled)


class NodeHost:
    """Runs one or many node agents over one NATS connection and one fold of the log.
    Appends go through one writer task, in order; decisions that change GPU ownership are
    built against the fold at append time and compare-and-set."""

    def __init__(self, event_log: EventLog, *, heartbeat_s: float = 5.0, poll_s: float = 0.2, own_log: bool = True):
        self.log = event_log
        self.nc = event_log.nc
        self.folded = FoldedLog(event_log)
        self.agents: dict[str, NodeAgent] = {}
        self.heartbeat_s = heartbeat_s
        self.poll_s = poll_s
        self.own_log = own_log
        self._history = 0
        self._queue: asyncio.Queue[tuple[Build | ev.Event, str | None, bool]] = asyncio.Queue()
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

    def track(self, job_id: str, node: str, running: bool) -> None:
        nodes = self._job_nodes.setdefault(job_id, set())
        if running:
            nodes.add(node)
        else:
            nodes.discard(node)
            if not nodes:
                del self._job_nodes[job_id]

    def submit(self, item: Build | ev.Event, msg_id: str | None = None, cas: bool = True) -> None:
        self._queue.put_nowait((item, msg_id, cas))

    async def start(self) -> None:
        self._history = await self.log.last_seq()
        self.folded.listeners.append(self._on_record)
        await self.folded.start()
        self.started = True
        state = self.folded.state
        await self._register_all(state)
        running_here: dict[str, list[str]] = {}
        for job_id in list(state.running):
            for node in job_nodes(state.jobs[job_id]):
                if node in self.agents:
                    running_here.setdefault(node, []).append(job_id)
        for node, job_ids in running_here.items():
            agent = self.agents[node]
            for job_id in job_ids:
                job = state.jobs[job_id]
                if node not in job.nodes_started:  # granted while this daemon was down
                    agent.converge(job_id, state, launch=True)
                else:
                    log.warning("job_not_adopted", job=job_id, node=node,
                                hint="started by an earlier daemon; the reconciler requeues it if no process remains")
        for agent in self.agents.values():
            agent._subs = [
                await self.nc.subscribe(subjects.node_control_subject(agent.node), cb=self._control_cb(agent)),
                await self.nc.subscribe(subjects.node_kill_subject(agent.node), cb=self._control_cb(agent, kill_only=True)),
            ]
        await self.nc.flush()
        self._tasks = [
            asyncio.create_task(self._writer(), name="nodeagent-writer"),
            asyncio.create_task(self._monitor(), name="nodeagent-monitor"),
            asyncio.create_task(self._heartbeats(), name="nodeagent-heartbeats"),
        ]
        log.info("nodeagent_ready", nodes=len(self.agents), seq=self.folded.seen_seq)

    async def _register_all(self, state: ClusterState) -> None:
        todo = [a.registration() for a in self.agents.values() if a.needs_registration(state)]
        for i in range(0, len(todo), 64):  # registration needs no compare-and-set: pipeline it
            await asyncio.gather(*(self.log.append(e) for e in todo[i:i + 64]))
        self.appended += len(todo)

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

    def _control_cb(self, agent: NodeAgent, kill_only: bool = False):
        async def cb(msg) -> None:
            reply = agent.control(msg.data, kill_only)
            if msg.reply:
                await msg.respond(msgspec.json.encode(reply))
        return cb

    async def _writer(self) -> None:
        while True:
            item, msg_id, cas = await self._queue.get()
            for _ in range(50):
                try:
                    event = item(self.folded.state) if callable(item) else item
                    if event is None:
                        break
                    if cas and event.ALLOC:
                        _, conflicted = await append_cas(self.folded, [event], msg_id=lambda e: msg_id)
                        if conflicted:
                            continue
                    else:
                        await self.log.append(event, msg_id=msg_id)
                    self.appended += 1
                    break
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("append_failed", msg_id=msg_id)
                    await asyncio.sleep(0.5)
            self._queue.task_done()

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            for agent in list(self.agents.values()):
                try:
                    agent.poll(self.folded.state)
                except Exception:
                    log.exception("agent_poll_failed", node=agent.node)

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
        await cancel_tasks(self._tasks)
        for agent in self.agents.values():
            for sub in agent._subs:
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass
        await self.folded.stop()
        for agent in self.agents.values():
            agent.backend.close()
        if self.own_log:
            try:
                await self.log.close()
            except Exception:
                pass
