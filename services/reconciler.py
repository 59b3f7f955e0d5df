"""Reconciler: node heartbeats against the allocations of the fold.

It turns what heartbeats show into facts of the log, each only when the fold does not already
reflect it (so a restarted reconciler never reports twice; appends are compare-and-set over
the alloc tree with deterministic message ids):
- a node silent for `node_timeout_s`                          -> `NodeLost` (the fold requeues its jobs)
- a running job with no process on a node for `no_process_grace_s`
                                    -> `GpusReleased(no_process)` or `JobFailed` (per `on_failure`, `max_restarts`)
- a process on a GPU that nothing holds, for `zombie_grace_s` -> `ZombieDetected`, a kill request to the
  node daemon (repeated every `kill_retry_s`), and `ZombieReclaimed` once a heartbeat shows the GPU clean
- an unhealthy GPU (critical XID, uncorrected ECC)            -> `GpuQuarantined`; healthy again -> `GpuRestored`
  (only for quarantines it made: their reason starts with "health: ")
- a running job holding a quarantined GPU                      -> `JobOnUnhealthyGpu` (the policy moves it)

`decide` is the pure part (the state, what heartbeats showed, `now`); `Reconciler` is the shell.
Grace periods must exceed a couple of heartbeat intervals, and `zombie_grace_s` the node
daemons' kill grace (a released job's process may take that long to go).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from dataclasses import dataclass, field

import msgspec
import structlog

from gpusched.bus import subjects
from gpusched.bus.log import EventLog
from gpusched.core import events as ev
from gpusched.core.model import gpu_id, split_gpu_id
from gpusched.core.state import ClusterState, Job
from gpusched.services.runtime import cancel_tasks
from gpusched.core.heartbeat import Heartbeat, KillProcesses, decode_heartbeat, decode_reply
from gpusched.services.runtime import FoldedLog, append_cas

log = structlog.get_logger()

HEALTH_PREFIX = "health: "


@dataclass
class ReconcilerConfig:
    node_timeout_s: float = 30.0
    no_process_grace_s: float = 60.0
    zombie_grace_s: float = 30.0
    kill_retry_s: float = 10.0
    tick_s: float = 1.0
    restore_healthy: bool = True
    request_timeout_s: float = 2.0


@dataclass
class Observations:
    """What heartbeats showed, and since when: the reconciler's only memory besides the fold.
    Times are this process's wall clock at receipt (heartbeats' own clocks may drift)."""

    started_at: float
    heartbeats: dict[str, Heartbeat] = field(default_factory=dict)
    received: dict[str, float] = field(default_factory=dict)
    missing_since: dict[tuple[str, int, str], float] = field(default_factory=dict)
    stray_since: dict[tuple[str, int], float] = field(default_factory=dict)
    kill_sent: dict[str, float] = field(default_factory=dict)

    def observe(self, hb: Heartbeat, now: float) -> None:
        self.heartbeats[hb.node] = hb
        self.received[hb.node] = now


@dataclass
class Decision:
    events: list[ev.Event] = field(default_factory=list)
    kills: list[tuple[str, str, list[int]]] = field(default_factory=list)  # (node, gpu, pids)


def _nodes_of(job: Job) -> list[str]:
    return list(dict.fromkeys(split_gpu_id(g)[0] for g in job.gpus))


def _alive(hb: Heartbeat, job: Job, node: str) -> bool:
    """The job has a process on this node: the daemon runs it (or its rank finished and waits
    for rank 0), or some process sits on one of the job's GPUs there."""
    for r in hb.jobs:
        if r.job_id == job.job_id and r.attempt == job.attempt and r.state in ("running", "exited"):
            return True
    mine = {i for n, i in map(split_gpu_id, job.gpus) if n == node}
    return any(s.pids for s in hb.gpus if s.index in mine)


def _no_process_outcome(job: Job, node: str, now: float) -> ev.Event:
    if job.spec.on_failure == "requeue" and job.restarts < job.spec.max_restarts:
        since = job.started_at or now
        if job.checkpoint is not None and job.checkpoint.attempt == job.attempt:
            since = max(since, job.checkpoint.at)
        return ev.GpusReleased(at=now, job_id=job.job_id, reason="no_process",
                               lost_gpu_s=round(len(job.gpus) * max(0.0, now - since), 3))
    return ev.JobFailed(at=now, job_id=job.job_id, attempt=job.attempt,
                        reason=f"no process on its GPUs of node {node} (restarts {job.restarts}/{job.spec.max_restarts})")


def _tell_holder(state: ClusterState, gid: str, reason: str, now: float, out: Decision) -> None:
    """A running job on a quarantined GPU gets the fact (once: the fold remembers it)."""
    holder = state.gpus[gid].holder
    job = state.jobs.get(holder) if holder is not None else None
    if job is None or not job.holding or gid in job.unhealthy:
        return
    for i, e in enumerate(out.events):  # one fact per job and decision, naming all its GPUs
        if isinstance(e, ev.JobOnUnhealthyGpu) and e.job_id == job.job_id:
            out.events[i] = ev.JobOnUnhealthyGpu(at=now, job_id=job.job_id, attempt=job.attempt,
                                                 gpus=[*e.gpus, gid], reason=e.reason)
            return
    out.events.append(ev.JobOnUnhealthyGpu(at=now, job_id=job.job_id, attempt=job.attempt, gpus=[gid],
                                           reason=reason))


def decide(state: ClusterState, obs: Observations, now: float, cfg: ReconcilerConfig) -> Decision:
    out = Decision()
    lost = _lost_nodes(state, obs, now, cfg, out)
    _missing_processes(state, obs, now, cfg, lost, out)
    _gpu_facts(state, obs, now, cfg, lost, out)
    return out


def _lost_nodes(state: ClusterState, obs: Observations, now: float, cfg: ReconcilerConfig, out: Decision) -> set[str]:
    lost: set[str] = set()
    for name, node in state.nodes.items():
        if node.lost:
            continue
        # A (re-)registration counts as a sign of life: a node that just came back is not
        # declared lost again for heartbeats it missed while it was away.
        silent = now - max(obs.received.get(name, obs.started_at), node.registered_at)
        if silent >= cfg.node_timeout_s:
            out.events.append(ev.NodeLost(at=now, node=name, reason=f"no heartbeat for {silent:.1f}s"))
            lost.add(name)
    return lost


def _missing_processes(state: ClusterState, obs: Observations, now: float, cfg: ReconcilerConfig, lost: set[str],
                       out: Decision) -> None:
    missing_keys: set[tuple[str, int, str]] = set()
    for job_id in state.running:
        job = state.jobs[job_id]
        nodes = _nodes_of(job)
        if any(n in lost or n not in state.nodes or state.nodes[n].lost for n in nodes):
            continue  # the node loss requeues it
        for node in nodes:
            hb = obs.heartbeats.get(node)
            if hb is None or obs.received[node] < (job.started_at or 0.0):
                continue  # no evidence since the grant
            key = (job_id, job.attempt, node)
            if _alive(hb, job, node):
                continue
            missing_keys.add(key)
            # Only heartbeats count as evidence: a daemon that went silent (restarting) proves
            # nothing, and its node's silence is the node timeout's business.
            seen = obs.received[node]
            since = obs.missing_since.setdefault(key, seen)
            if seen - since >= cfg.no_process_grace_s:
                out.events.append(_no_process_outcome(job, node, now))
                break
    for key in [k for k in obs.missing_since if k not in missing_keys]:
        del obs.missing_since[key]


def _gpu_facts(state: ClusterState, obs: Observations, now: float, cfg: ReconcilerConfig, lost: set[str],
               out: Decision) -> None:
    strays: set[tuple[str, int]] = set()
    for name, hb in obs.heartbeats.items():
        node = state.nodes.get(name)
        if node is None or node.lost or name in lost:
            continue
        for s in hb.gpus:
            gid = gpu_id(name, s.index)
            g = state.gpus.get(gid)
            if g is None:
                continue
            _health(state, s, gid, now, cfg, out)
            if g.zombie_pids is not None:
                if not s.pids:
                    out.events.append(ev.ZombieReclaimed(at=now, gpu=gid, pids=list(g.zombie_pids)))
                elif now - obs.kill_sent.get(gid, -math.inf) >= cfg.kill_retry_s:
                    out.kills.append((name, gid, list(s.pids)))
            elif g.holder is None and s.pids:
                first = min(obs.stray_since.setdefault((gid, p), now) for p in s.pids)
                strays.update((gid, p) for p in s.pids)
                if now - first >= cfg.zombie_grace_s:
                    out.events.append(ev.ZombieDetected(at=now, gpu=gid, pids=list(s.pids)))
                    out.kills.append((name, gid, list(s.pids)))
    for key in [k for k in obs.stray_since if k not in strays]:
        del obs.stray_since[key]


def _health(state: ClusterState, s, gid: str, now: float, cfg: ReconcilerConfig, out: Decision) -> None:
    g = state.gpus[gid]
    if not s.healthy and g.quarantined is None:
        reason = HEALTH_PREFIX + (s.health or "unhealthy")
        out.events.append(ev.GpuQuarantined(at=now, gpu=gid, reason=reason))
        _tell_holder(state, gid, reason, now, out)
    elif s.healthy and cfg.restore_healthy and g.quarantined and g.quarantined.startswith(HEALTH_PREFIX):
        out.events.append(ev.GpuRestored(at=now, gpu=gid, reason="healthy again"))
    elif g.quarantined is not None:  # an operator's quarantine, or one the job was not told of
        _tell_holder(state, gid, g.quarantined, now, out)


class Reconciler:
    def __init__(self, event_log: EventLog, config: ReconcilerConfig | None = None, own_log: bool = True):
        self.log = event_log
        self.cfg = config or ReconcilerConfig()
        self.folded = FoldedLog(event_log)
        self.obs = Observations(started_at=time.time())
        self.own_log = own_log
        self.appended: list[ev.Event] = []
        self._sub = None
        self._task: asyncio.Task | None = None
        self._kills: set[asyncio.Task] = set()

    @classmethod
    async def open(cls, nats_url: str | None = None, config: ReconcilerConfig | None = None) -> Reconciler:
        return cls(await EventLog.open(nats_url, name="gpusched-reconciler"), config)

    async def start(self) -> None:
        await self.folded.start()
        self.obs.started_at = time.time()
        self._sub = await self.log.nc.subscribe(subjects.HEARTBEATS, cb=self._on_heartbeat)
        await self.log.nc.flush()
        self._task = asyncio.create_task(self._loop(), name="reconciler")
        log.info("reconciler_ready", seq=self.folded.seen_seq, config=self.cfg.__dict__)

    async def _on_heartbeat(self, msg) -> None:
        try:
            hb = decode_heartbeat(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            log.warning("bad_heartbeat", subject=msg.subject, error=str(err))
            return
        self.obs.observe(hb, time.time())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.tick_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconciler_tick_failed")

    async def tick(self) -> Decision:
        now = time.time()
        decision = decide(self.folded.state, self.obs, now, self.cfg)
        if decision.events:
            base = self.folded.alloc_seq
            appended, conflicted = await append_cas(
                self.folded, decision.events,
                msg_id=lambda e: f"reconciler:{e.kind}:{subjects.event_key(e)}:{base}",
            )
            for e in decision.events[:appended]:
                log.warning("reconciled", kind=e.kind, detail=msgspec.to_builtins(e))
            self.appended += decision.events[:appended]
            if not conflicted:
                await self.folded.catch_up()
        for node, gid, pids in decision.kills:
            self.obs.kill_sent[gid] = now
            task = asyncio.create_task(self._kill(node, gid, pids))
            self._kills.add(task)
            task.add_done_callback(self._kills.discard)
        return decision

    async def _kill(self, node: str, gid: str, pids: list[int]) -> None:
        request = KillProcesses(pids=pids, gpu=gid, reason="zombie: a process on a GPU that nothing holds")
        try:
            msg = await self.log.nc.request(subjects.node_control_subject(node), msgspec.json.encode(request),
                                            timeout=self.cfg.request_timeout_s)
            reply = decode_reply(msg.data)
            log.warning("zombie_kill_reply", node=node, gpu=gid, killed=reply.killed, missing=reply.missing,
                        refused=reply.refused, error=reply.error)
        except Exception as err:  # no responder, timeout: retried after kill_retry_s
            log.warning("zombie_kill_failed", node=node, gpu=gid, pids=pids, error=repr(err))

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *self._kills] if t is not None]
        await cancel_tasks(tasks)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
        await self.folded.stop()
        if self.own_log:
            try:
                await self.log.close()
            except Exception:
                pass


async def run(nats_url: str | None = None, config: ReconcilerConfig | None = None,
              stop: asyncio.Event | None = None, ready: asyncio.Event | None = None) -> None:
    """The reconciler until `stop` is set."""
    rec = await Reconciler.open(nats_url, config)
    await rec.start()
    if ready is not None:
        ready.set()
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await rec.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The reconciler's options (`--nats`, `--log-level` come from `shell.common_arguments`)."""
    d = ReconcilerConfig()
    parser.add_argument("--node-timeout-s", type=float, default=d.node_timeout_s)
    parser.add_argument("--no-process-grace-s", type=float, default=d.no_process_grace_s)
    parser.add_argument("--zombie-grace-s", type=float, default=d.zombie_grace_s)
    parser.add_argument("--kill-retry-s", type=float, default=d.kill_retry_s)
    parser.add_argument("--tick-s", type=float, default=d.tick_s)
    parser.add_argument("--no-restore", action="store_true", help="keep quarantined GPUs out even once healthy")


def config_from_args(args: argparse.Namespace) -> ReconcilerConfig:
    return ReconcilerConfig(node_timeout_s=args.node_timeout_s, no_process_grace_s=args.no_process_grace_s,
                            zombie_grace_s=args.zombie_grace_s, kill_retry_s=args.kill_retry_s, tick_s=args.tick_s,
                            restore_healthy=not args.no_restore)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    await run(args.nats, config_from_args(args), stop)


def main(argv: list[str] | None = None) -> int:
    from gpusched.services.shell import common_arguments, run as run_service

    parser = argparse.ArgumentParser(prog="gpusched-reconciler", description="gpusched reconciler")
    common_arguments(parser)
    add_arguments(parser)
    return run_service(serve, parser.parse_args(argv), "reconciler")


if __name__ == "__main__":
    raise SystemExit(main())
