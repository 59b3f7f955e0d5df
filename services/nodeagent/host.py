"""The node daemon's host: one NATS connection and one fold of the log for one `NodeAgent`
per host, or for many simulated ones. It hands each agent the log's facts about its node, calls
its `poll` and `heartbeat`, routes its node-control subjects, and appends what it reports
through one writer (`appends.AppendQueue`) behind a read barrier (`readbarrier.ReadBarrier`)."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import msgspec
import structlog

from gpusched import telemetry
from gpusched.bus import subjects
from gpusched.bus.cas import append_cas
from gpusched.bus.log import EventLog
from gpusched.core import events as ev
from gpusched.core.heartbeat import KillProcesses, LogReply, ResetGpu
from gpusched.core.model import split_gpu_id
from gpusched.core.state import ClusterState
from gpusched.services.runtime import FoldedLog, cancel_tasks, fatal, notify_ready

from . import fencing, keeper
from .agent import NodeAgent
from .agent_config import AgentConfig
from .appends import AppendQueue, Build
from .backends import GpuBackend
from .launch import job_nodes
from .readbarrier import VIEW_MAX_AGE_S, ReadBarrier

log = structlog.get_logger()

JOB_EVENTS = (ev.PreemptionRequested, ev.GpusReleased, ev.JobCompleted, ev.JobFailed, ev.JobCancelled,
              ev.JobTimedOut)


class NodeHost:
    """Runs one or many node agents over one NATS connection and one fold of the log.
    Appends go through one writer task, in order; decisions that change GPU ownership are
    built against the fold at append time and compare-and-set."""

    def __init__(self, event_log: EventLog, *, heartbeat_s: float = 5.0, poll_s: float = 0.2, own_log: bool = True,
                 max_view_age_s: float = VIEW_MAX_AGE_S):
        self.log = event_log
        self.nc = event_log.nc
        self.folded = FoldedLog(event_log)
        self.appends = AppendQueue(event_log, self.folded)
        self.barrier = ReadBarrier(event_log, self.folded, max_view_age_s, retry_s=max(poll_s, 1.0))
        self.agents: dict[str, NodeAgent] = {}
        self.heartbeat_s = heartbeat_s
        self.poll_s = poll_s
        self.own_log = own_log
        self._history = 0
        self._tasks: list[asyncio.Task] = []
        self._job_nodes: dict[str, set[str]] = {}
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
        self.appends.submit(item, msg_id)

    def fresh_view(self) -> bool:
        """Whether launches may trust the fold (`ReadBarrier`)."""
        return self.barrier.fresh()

    async def start(self) -> None:
        asked = time.monotonic()
        self._history = await self.log.last_seq()
        keeper.start(self)  # the fence keeper's side, before adoption (its lease renewed once running: keeper.tasks)
        self.folded.listeners.append(self._on_record)
        await self.folded.start()
        self.barrier.confirmed_at = asked  # folded at least up to the head as it was then
        self.started = True
        self._take_back(self.folded.state)
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
            asyncio.create_task(self.appends.run(), name="nodeagent-writer"),
            asyncio.create_task(self._monitor(), name="nodeagent-monitor"),
            asyncio.create_task(self._heartbeats(), name="nodeagent-heartbeats"),
            asyncio.create_task(self.barrier.run(), name="nodeagent-view"),
            *fencing.tasks(self),  # the log out of reach for long: stop the jobs (fencing.py)
            *keeper.tasks(self),  # this daemon dead for long: its keeper stops them (keeper.py)
        ]
        log.info("nodeagent_ready", nodes=len(self.agents), seq=self.folded.seen_seq)
        notify_ready()

    def _take_back(self, state: ClusterState) -> None:
        """First take back (or end) what earlier daemons started, then launch what was granted
        here while no daemon ran."""
        for agent in self.agents.values():
            agent.adopt_geometry(state)
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

    async def _register_all(self) -> None:
        """Register the nodes the log does not know or holds lost, except those whose adopted
        leftovers are still being stopped: they register from `heartbeat` once those are dead.
        A registration changes what may be granted, so it is a compare-and-set like every fact
        of the alloc tree (`bus.cas.append_cas`), in atomic batches; after a conflict the nodes
        still to register are decided again on the fresher fold."""
        for _ in range(50):
            todo = [a.registration() for a in self.agents.values()
                    if a.needs_registration(self.folded.state) and not a.defer_registration()]
            _, conflicted = await append_cas(self.folded, todo)
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
        elif isinstance(e, ev.MigGeometrySet):
            nodes = {split_gpu_id(e.gpu)[0]: False}
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
            reply = await agent.logs(msg.data, self.folded) if not agent.crashed else \
                LogReply(ok=False, node=agent.node, error="node is down (simulated crash)")
            if msg.reply:
                await msg.respond(msgspec.json.encode(reply))
        return cb

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
        await self.appends.flush(timeout)

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
                log.warning("nodeagent_flush_incomplete", queued=self.appends.pending())
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
            agent.starter.close(jobs_stopped=kill_jobs)
        if self.own_log:
            try:
                await self.log.close()
            except Exception:
                pass
