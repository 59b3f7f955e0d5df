"""Reconciler: node heartbeats against the allocations of the fold.

It turns what heartbeats show into facts of the log, each only when the fold does not already
reflect it (so a restarted reconciler never reports twice; appends are compare-and-set over
the alloc tree with deterministic message ids):
- a node silent for `node_timeout_s`                          -> `NodeLost` (the fold requeues its jobs)
- more than a share of the nodes (or of one rack) silent within one timeout -> `PartitionDeclared`
  instead: an outage, no requeues; `PartitionEnded` when heartbeats return (services/partition.py)
- a running job with no process on a node for `no_process_grace_s`
                                    -> `GpusReleased(no_process)` or `JobFailed` (per `on_failure`, `max_restarts`)
- a process on a GPU that nothing holds, for `zombie_grace_s` -> `ZombieDetected`, a kill request to the
  node daemon (repeated every `kill_retry_s`), and `ZombieReclaimed` once a heartbeat shows the GPU clean
- an unhealthy GPU (critical XID, uncorrected ECC)            -> `GpuQuarantined`; healthy again -> `GpuRestored`
  (only for quarantines it made: their reason starts with "health: ")
- a running job holding a quarantined GPU                      -> `JobOnUnhealthyGpu` (the policy moves it)
- a running job whose GPUs all stay under `idle_util_pct` for `idle_after_s` -> `JobIdle` (with its
  evidence); a GPU of an idle job seen at or over it                           -> `JobBusy`
- a GPU nothing holds whose memory stays in use (>= `leak_min_mb`) with no process on it for
  `leak_grace_s` -> `GpuQuarantined("leaked memory: ...")`; freed -> `GpuRestored`. With
  `reset_leaked` (an admin's choice, off by default) the node daemon is asked to reset it while
  it is idle. After an admin restores such a GPU it is not quarantined again for the same leak.

It also keeps each running job's mean utilization and memory over the last `usage_window_s`
(the used-versus-held read model, written to Redis when it has one: `gpusched.views.USAGE_KEY`).

`decide` is the pure part (the state, what heartbeats showed, `now`); `Reconciler` is the shell.
Grace periods must exceed a couple of heartbeat intervals, and `zombie_grace_s` the node
daemons' kill grace (a released job's process may take that long to go).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections import deque
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import structlog

from gpusched import metrics
from gpusched.bus import subjects
from gpusched.bus.cas import append_cas
from gpusched.bus.log import EventLog
from gpusched.core import events as ev
from gpusched.core.heartbeat import Heartbeat, KillProcesses, ResetGpu, decode_heartbeat, decode_reply
from gpusched.core.model import gpu_id, split_gpu_id
from gpusched.core.rules import work_since_checkpoint
from gpusched.core.state import ClusterState, Job
from gpusched.services import partition
from gpusched.services.runtime import FoldedLog, cancel_tasks, notify_ready

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from nats.aio.subscription import Subscription
  # imported where the usage view is written (`_write_usage`)

log = structlog.get_logger()

HEALTH_PREFIX = "health: "
LEAK_PREFIX = "leaked memory: "


@dataclass
class ReconcilerConfig:
    node_timeout_s: float = 30.0
    no_process_grace_s: float = 60.0
    zombie_grace_s: float = 30.0
    kill_retry_s: float = 10.0
    tick_s: float = 1.0
    restore_healthy: bool = True
    request_timeout_s: float = 2.0
    idle_util_pct: float = 5.0  # from the policy config (`--policy-set idle_util_pct=...`)
    idle_after_s: float = 600.0  # likewise
    usage_window_s: float = 60.0
    leak_min_mb: int = 1024
    leak_grace_s: float = 30.0
    reset_leaked: bool = False
    usage_every_s: float = 2.0
    partition_share: float = 0.5  # more than this share of all nodes silent at once: a partition
    partition_rack_share: float = 0.5  # likewise of one rack
    partition_min_nodes: int = 3  # fewer silent nodes are never a partition: two nodes lost at once are as likely two failures


#: Heartbeats are bounded per writer at the intake: one larger than this is dropped unread (a
#: 1,024-GPU, 1,024-job heartbeat is well under it), one that follows its node's previous
#: remembered one within the gap is dropped before decoding (nodes beat every second or so; a
#: flood of 654,000 in 60 s grew the reconciler by 200 MB of samples), and what waits unread in
#: the subscription is capped in bytes (NATS drops the excess instead of this process holding it).
MAX_HEARTBEAT_BYTES = 1 << 20
HEARTBEAT_MIN_GAP_S = 0.05
HEARTBEAT_PENDING_BYTES = 16 << 20


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
    window_s: float = 60.0
    samples: dict[str, deque] = field(default_factory=dict)  # GPU -> (time, util %, memory MB)
    peak: dict[str, float] = field(default_factory=dict)  # GPU -> highest util since the last decision
    idle: dict[tuple[str, int], IdleTrack] = field(default_factory=dict)  # (job, attempt) -> evidence
    leak_since: dict[str, float] = field(default_factory=dict)
    leak_reported: set[str] = field(default_factory=set)  # quarantined for this leak: not again

    def observe(self, hb: Heartbeat, now: float) -> None:
        self.heartbeats[hb.node] = hb
        self.received[hb.node] = now
        for s in hb.gpus:
            gid = gpu_id(hb.node, s.index)
            window = self.samples.setdefault(gid, deque())
            window.append((now, s.utilization_pct, s.memory_used_mb))
            while window and window[0][0] < now - self.window_s:
                window.popleft()
            self.peak[gid] = max(self.peak.get(gid, 0.0), s.utilization_pct)


@dataclass
class IdleTrack:
    """Evidence that a job's GPUs are idle, since the first tick that saw them all idle."""

    since: float
    n: int = 0
    util_sum: float = 0.0
    util_max: float = 0.0
    mem_sum: float = 0.0

    def add(self, utils: list[float], mems: list[float]) -> None:
        self.n += 1
        self.util_sum += sum(utils) / len(utils)
        self.util_max = max(self.util_max, *utils)
        self.mem_sum += sum(mems) / len(mems)


@dataclass
class Decision:
    events: list[ev.Event] = field(default_factory=list)
    kills: list[tuple[str, str, list[int]]] = field(default_factory=list)  # (node, gpu, pids)
    resets: list[tuple[str, str]] = field(default_factory=list)  # (node, gpu): leaked memory


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
        return ev.GpusReleased(at=now, job_id=job.job_id, reason="no_process",
                               lost_gpu_s=round(work_since_checkpoint(job, now), 3))
    return ev.JobFailed(at=now, job_id=job.job_id, attempt=job.attempt,
                        reason=f"no process on its GPUs of node {node} (restarts {job.restarts}/{job.spec.max_restarts})")


def _tell_holder(state: ClusterState, gid: str, reason: str, now: float, out: Decision) -> None:
    """A running job on a quarantined GPU gets the fact (once: the fold remembers it)."""
    for holder in state.gpus[gid].holders:  # its whole holder, or every fractional or MIG job on it
        _tell_job(state.jobs.get(holder), gid, reason, now, out)


def _tell_job(job: Job | None, gid: str, reason: str, now: float, out: Decision) -> None:
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
    """What the observations mean against the fold: silent nodes are lost, jobs without a
    process are requeued or fail, unhealthy GPUs are quarantined, stray processes are zombies,
    idle jobs are reported, leaked GPU memory is quarantined."""
    out = Decision()
    held = partition.decide(state, obs, now, cfg, out)  # an outage: neither lost nor requeued
    lost = _lost_nodes(state, obs, now, cfg, out, skip=held) | held
    _missing_processes(state, obs, now, cfg, lost, out)
    _gpu_facts(state, obs, now, cfg, lost, out)
    out.events += decide_idle(state, obs, now, cfg, lost)
    decide_leaks(state, obs, now, cfg, lost, out)
    obs.peak.clear()
    _forget_reclaimed(state, obs)
    return out


def _lost_nodes(state: ClusterState, obs: Observations, now: float, cfg: ReconcilerConfig, out: Decision,
                skip: AbstractSet[str] = frozenset()) -> set[str]:
    lost: set[str] = set()
    for name, node in state.nodes.items():
        if node.lost or name in skip:
            continue
        silent = partition.silent_s(state, obs, name, now)
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



def _live_samples(state: ClusterState, obs: Observations, lost: set[str]):
    """(node, sample, GPU id, GPU) of every GPU a live, registered node last reported."""
    for name, hb in obs.heartbeats.items():
        node = state.nodes.get(name)
        if node is None or node.lost or name in lost:
            continue
        for s in hb.gpus:
            gid = gpu_id(name, s.index)
            g = state.gpus.get(gid)
            if g is not None:
                yield name, s, gid, g

def _gpu_facts(state: ClusterState, obs: Observations, now: float, cfg: ReconcilerConfig, lost: set[str],
               out: Decision) -> None:
    strays: set[tuple[str, int]] = set()
    for name, s, gid, g in _live_samples(state, obs, lost):
        _health(state, s, gid, now, cfg, out)
        if g.zombie_pids is not None:
            if not s.pids:
                out.events.append(ev.ZombieReclaimed(at=now, gpu=gid, pids=list(g.zombie_pids)))
            elif now - obs.kill_sent.get(gid, -math.inf) >= cfg.kill_retry_s:
                out.kills.append((name, gid, list(s.pids)))
        elif not g.occupied and s.pids:  # a shared GPU's processes are its fractional jobs
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


def _job_sample(state: ClusterState, obs: Observations, job: Job) -> tuple[list[float], list[float], str] | None:
    """(utilization, memory) of each of the job's GPUs as heartbeats since its start show them,
    and its busiest GPU; None while some node of the job has not reported since."""
    utils, mems, busiest, top = [], [], "", -1.0
    for g in job.gpus:
        node, index = split_gpu_id(g)
        hb = obs.heartbeats.get(node)
        if hb is None or obs.received[node] < (job.started_at or 0.0):
            return None
        sample = next((s for s in hb.gpus if s.index == index), None)
        if sample is None:
            return None
        util = max(obs.peak.get(g, 0.0), sample.utilization_pct)
        utils.append(util)
        mems.append(float(sample.memory_used_mb))
        if util > top:
            busiest, top = g, util
    return (utils, mems, busiest) if utils else None


def decide_idle(state: ClusterState, obs: Observations, now: float, cfg: ReconcilerConfig,
                lost: AbstractSet[str] = frozenset()) -> list[ev.Event]:
    """JobIdle when every GPU of a running job stayed under the threshold for `idle_after_s`;
    JobBusy when a job the fold holds idle shows a GPU at or over it. Only on a change."""
    out: list[ev.Event] = []
    live: set[tuple[str, int]] = set()
    for job_id in state.running:
        job = state.jobs[job_id]
        if job.state != "running" or any(n in lost for n in _nodes_of(job)):
            continue
        seen = _job_sample(state, obs, job)
        if seen is None:
            continue
        utils, mems, busiest = seen
        key = (job_id, job.attempt)
        live.add(key)
        if max(utils) >= cfg.idle_util_pct:
            obs.idle.pop(key, None)
            if job.idle is not None:
                out.append(ev.JobBusy(at=now, job_id=job_id, attempt=job.attempt, util_pct=round(max(utils), 2),
                                      gpu=busiest))
            continue
        track = obs.idle.setdefault(key, IdleTrack(since=now))
        track.add(utils, mems)
        if job.idle is None and now - track.since >= cfg.idle_after_s:
            out.append(ev.JobIdle(at=now, job_id=job_id, attempt=job.attempt, since=track.since,
                                  window_s=round(now - track.since, 3), threshold_pct=cfg.idle_util_pct,
                                  util_pct=round(track.util_sum / track.n, 2), util_pct_max=round(track.util_max, 2),
                                  memory_mb=round(track.mem_sum / track.n, 1)))
    for key in [k for k in obs.idle if k not in live]:
        del obs.idle[key]
    return out


def decide_leaks(state: ClusterState, obs: Observations, now: float, cfg: ReconcilerConfig,
                 lost: set[str], out: Decision) -> None:
    """GPU memory in use with no process on a GPU that nothing holds: quarantine after the
    grace period, restore once freed; optionally ask the daemon to reset an idle leaked GPU."""
    leaking: set[str] = set()
    for name, s, gid, g in _live_samples(state, obs, lost):
        ours = g.quarantined is not None and g.quarantined.startswith(LEAK_PREFIX)
        if s.memory_used_mb < cfg.leak_min_mb or s.pids or g.occupied or g.zombie_pids is not None:
            if ours and s.memory_used_mb < cfg.leak_min_mb and not s.pids:
                out.events.append(ev.GpuRestored(at=now, gpu=gid, reason="leaked memory freed"))
            continue
        leaking.add(gid)
        since = obs.leak_since.setdefault(gid, now)
        if ours:
            obs.leak_reported.add(gid)
            if (cfg.reset_leaked and s.utilization_pct < cfg.idle_util_pct
                    and now - obs.kill_sent.get(gid, -math.inf) >= cfg.kill_retry_s):
                out.resets.append((name, gid))
        elif g.quarantined is None and gid not in obs.leak_reported and now - since >= cfg.leak_grace_s:
            out.events.append(ev.GpuQuarantined(
                at=now, gpu=gid, reason=f"{LEAK_PREFIX}{s.memory_used_mb} MB in use with no process "
                                        f"for {now - since:.0f} s"))
            obs.leak_reported.add(gid)
    for gid in [k for k in obs.leak_since if k not in leaking]:
        del obs.leak_since[gid]
        obs.leak_reported.discard(gid)


def usage_docs(state: ClusterState, obs: Observations, now: float) -> dict[str, dict]:
    """Each running job's mean utilization and memory per GPU over the last window (read model)."""
    docs: dict[str, dict] = {}
    for job_id in state.running:
        job = state.jobs[job_id]
        utils, mems, n = 0.0, 0.0, 0
        for g in job.gpus:
            for t, util, mem in obs.samples.get(g, ()):
                if t >= (job.started_at or 0.0):
                    utils, mems, n = utils + util, mems + mem, n + 1
        if n:
            docs[job_id] = {"job_id": job_id, "attempt": job.attempt, "util_pct": round(utils / n, 1),
                            "memory_mb": round(mems / n, 1), "window_s": obs.window_s, "samples": n, "at": now}
    return docs


def _forget_reclaimed(state: ClusterState, obs: Observations) -> None:
    """Per-GPU memory ends with the zombie (bounded by the GPUs that have one)."""
    for gid in [g for g in obs.kill_sent if g not in state.gpus or state.gpus[g].zombie_pids is None]:
        del obs.kill_sent[gid]


class Reconciler:
    def __init__(self, event_log: EventLog, config: ReconcilerConfig | None = None, own_log: bool = True,
                 redis_url: str | None = None):
        self.log = event_log
        self.cfg = config or ReconcilerConfig()
        self.folded = FoldedLog(event_log)
        self.gpu_metrics = metrics.GpuMetrics()
        self.obs = Observations(started_at=time.time(), window_s=self.cfg.usage_window_s)
        self.redis_url = redis_url
        self._redis: aioredis.Redis | None = None  # connected at the first usage write
        self._usage_at = 0.0
        self.own_log = own_log
        self.appended: list[ev.Event] = []
        self._sub: Subscription | None = None
        self._task: asyncio.Task | None = None
        self._kills: set[asyncio.Task] = set()
        self.ignored: dict[str, int] = {}  # heartbeats not remembered, by why
        self._said: dict[str, float] = {}
        self._heard: dict[str, float] = {}  # heartbeat subject -> when one was last remembered

    @classmethod
    async def open(cls, nats_url: str | None = None, config: ReconcilerConfig | None = None,
                   redis_url: str | None = None) -> Reconciler:
        return cls(await EventLog.open(nats_url, name="gpusched-reconciler"), config, redis_url=redis_url)

    async def start(self) -> None:
        await self.folded.start()
        self.obs.started_at = time.time()
        self._sub = await self.log.nc.subscribe(subjects.HEARTBEATS, cb=self._on_heartbeat,  # a flood is
                                                pending_bytes_limit=HEARTBEAT_PENDING_BYTES)  # dropped, not buffered
        await self.log.nc.flush()
        self._task = asyncio.create_task(self._loop(), name="reconciler")
        log.info("reconciler_ready", seq=self.folded.seen_seq, config=self.cfg.__dict__)
        notify_ready()

    async def _on_heartbeat(self, msg) -> None:
        if len(msg.data) > MAX_HEARTBEAT_BYTES:
            self._quietly("heartbeat_too_large", subject=msg.subject[:200], size=len(msg.data))
            return
        now = time.monotonic()  # one writer, one rate: checked before any decoding work
        if now - self._heard.get(msg.subject, -1e18) < HEARTBEAT_MIN_GAP_S:
            self._quietly("heartbeat_too_frequent", subject=msg.subject[:200])
            return
        try:
            hb = decode_heartbeat(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            self._quietly("bad_heartbeat", subject=msg.subject[:200], error=str(err)[:300])
            return
        if hb.node not in self.folded.state.nodes:  # only registered nodes are remembered
            self._quietly("heartbeat_from_unregistered_node", node=hb.node)
            return
        if msg.subject != subjects.heartbeat_subject(hb.node):  # permissions say who may publish
            log.warning("heartbeat_for_another_node", subject=msg.subject, node=hb.node)  # the subject,
            return  # so a node speaks only for itself: the payload must name the subject's node
        self._heard[msg.subject] = now  # registered nodes' subjects only: bounded by the fold
        self.obs.observe(hb, time.time())
        if metrics.ENABLED:  # per-GPU metrics: this is the one process that reads heartbeats
            self.gpu_metrics.observe(hb, self.folded.state)

    def _quietly(self, event: str, **fields) -> None:
        """At most one line per kind per minute, with how many were not logged (a flood of
        bad heartbeats must not flood the log)."""
        now = time.monotonic()
        self.ignored[event] = self.ignored.get(event, 0) + 1
        if now - self._said.get(event, -1e18) >= 60.0:
            self._said[event] = now
            log.warning(event, count=self.ignored[event], **fields)

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
            self._spawn(self._request(node, gid, KillProcesses(
                pids=pids, gpu=gid, reason="zombie: a process on a GPU that nothing holds")))
        for node, gid in decision.resets:
            self.obs.kill_sent[gid] = now
            self._spawn(self._request(node, gid, ResetGpu(index=split_gpu_id(gid)[1], reason="leaked memory")))
        if self.redis_url and now - self._usage_at >= self.cfg.usage_every_s:
            self._usage_at = now
            await self._write_usage(usage_docs(self.folded.state, self.obs, now))
        return decision

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    async def _write_usage(self, docs: dict[str, dict]) -> None:
        """Replace the used-versus-held read model (best effort: it is telemetry, not a fact)."""
        from gpusched.views import USAGE_KEY, redis_client

        try:
            if self._redis is None:
                self._redis = redis_client(self.redis_url)
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(USAGE_KEY)
            if docs:
                pipe.hset(USAGE_KEY, mapping={k: msgspec.json.encode(v) for k, v in docs.items()})
            await pipe.execute()
        except Exception as err:  # noqa: BLE001 - Redis down: the view goes stale, the reconciler goes on
            log.warning("usage_view_failed", error=repr(err))

    async def _request(self, node: str, gid: str, request) -> None:
        what = type(request).__name__
        try:
            subject = (subjects.node_reset_subject if isinstance(request, ResetGpu) else subjects.node_kill_subject)(node)
            msg = await self.log.nc.request(subject, msgspec.json.encode(request),
                                            timeout=self.cfg.request_timeout_s)
            reply = decode_reply(msg.data)
            log.warning("node_request_reply", request=what, node=node, gpu=gid, ok=reply.ok, killed=reply.killed,
                        missing=reply.missing, refused=reply.refused, error=reply.error)
        except Exception as err:  # no responder, timeout: retried after kill_retry_s
            log.warning("node_request_failed", request=what, node=node, gpu=gid, error=repr(err))

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *self._kills] if t is not None]
        await cancel_tasks(tasks)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
        await self.folded.stop()
        if self._redis is not None:
            try:
                await self._redis.aclose()
            except Exception:
                pass
        if self.own_log:
            try:
                await self.log.close()
            except Exception:
                pass


async def run(nats_url: str | None = None, config: ReconcilerConfig | None = None,
              stop: asyncio.Event | None = None, ready: asyncio.Event | None = None,
              redis_url: str | None = None) -> None:
    """The reconciler until `stop` is set."""
    rec = await Reconciler.open(nats_url, config, redis_url)
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
    parser.add_argument("--usage-window-s", type=float, default=d.usage_window_s,
                        help="window of the mean utilization and memory that `jobs` and `show` give")
    parser.add_argument("--leak-min-mb", type=int, default=d.leak_min_mb,
                        help="memory in use with no process that counts as leaked")
    parser.add_argument("--leak-grace-s", type=float, default=d.leak_grace_s)
    parser.add_argument("--reset-leaked", action="store_true",
                        help="ask the node daemon to reset an idle GPU whose memory leaked (admin's choice)")
    parser.add_argument("--partition-share", type=float, default=d.partition_share,
                        help="more than this share of the nodes silent within one timeout is a partition, not lost nodes")
    parser.add_argument("--partition-rack-share", type=float, default=d.partition_rack_share,
                        help="likewise, of one rack's nodes")
    parser.add_argument("--policy", default="full", help="policy preset: its idle_util_pct and idle_after_s")
    parser.add_argument("--policy-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of the preset (idle_util_pct, idle_after_s are read here)")


def config_from_args(args: argparse.Namespace) -> ReconcilerConfig:
    from gpusched.services.placement import policy_config

    policy = policy_config(getattr(args, "policy", "full"), getattr(args, "policy_set", []))
    return ReconcilerConfig(node_timeout_s=args.node_timeout_s, no_process_grace_s=args.no_process_grace_s,
                            zombie_grace_s=args.zombie_grace_s, kill_retry_s=args.kill_retry_s, tick_s=args.tick_s,
                            restore_healthy=not args.no_restore, idle_util_pct=policy.idle_util_pct,
                            idle_after_s=policy.idle_after_s, usage_window_s=args.usage_window_s,
                            leak_min_mb=args.leak_min_mb, leak_grace_s=args.leak_grace_s,
                            reset_leaked=args.reset_leaked, partition_share=args.partition_share,
                            partition_rack_share=args.partition_rack_share)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    import os

    redis_url = getattr(args, "redis", None) or os.environ.get("GPUSCHED_REDIS_URL") or None
    await run(args.nats, config_from_args(args), stop, redis_url=redis_url)


def main(argv: list[str] | None = None) -> int:
    from gpusched.services.shell import common_arguments
    from gpusched.services.shell import run as run_service

    parser = argparse.ArgumentParser(prog="gpusched-reconciler", description="gpusched reconciler")
    common_arguments(parser)
    add_arguments(parser)
    return run_service(serve, parser.parse_args(argv), "reconciler")


if __name__ == "__main__":
    raise SystemExit(main())
