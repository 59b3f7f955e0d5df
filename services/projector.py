"""The projector: keeps the read models in Redis in step with the log.

It follows the log into a fold and, a few times a second, writes what changed as JSON documents
(`gpusched.readmodel`): one hash field per job, node and team, the queue in policy order, the
health of the control plane, the event tail, a time series of team shares, and now and then a
whole-state snapshot, sealed in the log and stored in JetStream (`gpusched.store`; a copy in
Redis for the CLI): every process starts from the latest verified one plus the tail. Every document carries `seq`, the
log sequence it covers, and `gpusched:v:meta` says which sequence the whole view covers. Nothing
here is a source of truth: `rebuild_views` wipes it all and derives it again from the log.

Keys (all under `gpusched:v:`):
    meta            hash   seq, at (log time), written_at, rebuilt_at, cluster (the totals `teams` shows)
    jobs            hash   job id -> job document
    jobs:order      zset   job id scored by submission time
    nodes           hash   node -> node document (its GPUs with holders and teams)
    teams           hash   team -> usage vs guarantee and limit
    queue           zset   pending job id scored by its position in policy order
    queue:docs      hash   pending job id -> queue entry (reason, blockers, eta)
    health          hash   placement_degraded, counts, lease holders
    tail            list   the latest event lines, oldest first
    shares          list   samples {at, seq, teams: {team: held}}, oldest first
and `gpusched:snapshot` (hash: seq, half_life_s, forget_after_s, data = msgpack of the ClusterState).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import msgspec
import redis.asyncio as aioredis
import structlog
from redis.typing import EncodableT, FieldT

from gpusched import metrics, readmodel, telemetry
from gpusched.bus.log import EventLog, Record
from gpusched.core import events as ev
from gpusched.core.model import split_gpu_id
from gpusched.core.state import ClusterState
from gpusched.services.runtime import FoldedLog, notify_ready
from gpusched.services.shell import policy_arguments, policy_of
from gpusched.store import SNAPSHOT_KEY, fold_log, load_snapshot, load_snapshot_from, new_fold, save_snapshot  # noqa: F401
from gpusched.views import PREFIX, SHARES_LEN, TAIL_LEN, UPDATES_CHANNEL, USAGE_KEY, K, Views, redis_client  # noqa: F401

log = structlog.get_logger()

_json = msgspec.json.Encoder()


def _enc(doc: Any) -> bytes:
    return _json.encode(doc)


class ShareSeries:
    """Team holdings sampled on the log's clock: at most one sample per `every_s` of log time;
    a change inside a bucket waits in `pending` until the bucket is over (the team documents
    always have the current value)."""

    def __init__(self, every_s: float = 1.0, keep: int = SHARES_LEN):
        self.every_s = every_s
        self.samples: deque[dict[str, Any]] = deque(maxlen=keep)
        self.fresh: list[dict[str, Any]] = []
        self.pending: dict[str, Any] | None = None

    def observe(self, state: ClusterState, seq: int) -> None:
        teams = {t: u.held for t, u in sorted(state.teams.items())}
        if not teams:
            return
        last = self.samples[-1] if self.samples else None
        if last is not None and last["teams"] == teams:
            self.pending = None
            return
        self.pending = {"at": state.now, "seq": seq, "teams": teams}
        self.settle(state.now)

    def settle(self, now: float) -> None:
        """Keep the pending sample once its bucket is over."""
        last = self.samples[-1] if self.samples else None
        if self.pending is not None and (last is None or now - last["at"] >= self.every_s):
            self.samples.append(self.pending)
            self.fresh.append(self.pending)
            self.pending = None


@dataclass
class _Marks:
    """What one flush writes: the dirty marks taken when it started."""

    jobs: set[str]
    nodes: set[str]
    teams: set[str]
    queue: bool
    health: bool
    tail: list[dict[str, Any]]
    shares: list[dict[str, Any]] = field(default_factory=list)


class Projector:
    """Collects what changed from fold records; `flush` writes it to Redis in one transaction."""

    def __init__(self, r: aioredis.Redis, snapshot_every: int = 5000, config=None,
                 seal_log: EventLog | None = None):
        self.r = r
        self.config = config  # the running PolicyConfig: the queue in its order
        self.seal_log = seal_log  # where each snapshot's digest is recorded (unsealed: never adopted)
        self.snapshot_every = snapshot_every
        self.dirty_jobs: set[str] = set()
        self.dirty_nodes: set[str] = set()
        self.dirty_teams: set[str] = set()
        self.queue_dirty = False
        self.health_dirty = False
        self.tail_new: list[dict[str, Any]] = []
        self.shares = ShareSeries()
        self._job_nodes: dict[str, set[str]] = {}  # nodes a job held last time we looked
        self.written_seq = 0
        self.snapshot_seq = 0
        self.writes = 0
        self.forgotten_seen = 0  # `len(state.forgotten)` at the last write

    # --- from the fold -------------------------------------------------------------------

    def seed(self, state: ClusterState) -> None:
        """Where jobs hold GPUs in a fold that started from a snapshot (the listener has not
        seen those grants)."""
        self.forgotten_seen = len(state.forgotten)
        for job_id, job in state.jobs.items():
            if job.gpus:
                self._job_nodes[job_id] = {split_gpu_id(g)[0] for g in job.gpus}

    def listener(self, rec: Record, state: ClusterState) -> None:
        e = rec.event
        job_id = getattr(e, "job_id", None)
        if job_id:
            self.dirty_jobs.add(job_id)
            job = state.jobs.get(job_id)
            if job is not None:
                self.dirty_teams.add(job.spec.team)
                nodes = {split_gpu_id(g)[0] for g in job.gpus}
                before = self._job_nodes.get(job_id, set())
                self.dirty_nodes |= nodes | before
                if nodes:
                    self._job_nodes[job_id] = nodes
                else:
                    self._job_nodes.pop(job_id, None)
            self.queue_dirty = True
        node = getattr(e, "node", None)
        if node and not job_id:
            self.dirty_nodes.add(node)
            for j, nodes in list(self._job_nodes.items()):  # a lost node requeues its jobs
                if node in nodes and isinstance(e, ev.NodeLost):
                    self.dirty_jobs.add(j)
                    self.dirty_nodes |= nodes
                    self.queue_dirty = True
        gpu = getattr(e, "gpu", None)
        if gpu:
            self.dirty_nodes.add(split_gpu_id(gpu)[0])
        team = getattr(e, "team", None)
        if team and isinstance(e, ev.TeamQuotaSet):
            self.dirty_teams.add(team)
            self.queue_dirty = True
        if e.ALLOC or isinstance(e, (ev.PlacementDegraded, ev.PlacementRecovered, ev.JobSubmitted)):
            self.health_dirty = True
        self.tail_new.append(readmodel.event_line(rec.seq, e))
        if len(self.tail_new) > TAIL_LEN:
            del self.tail_new[: len(self.tail_new) - TAIL_LEN]
        self.shares.observe(state, rec.seq)

    @property
    def dirty(self) -> bool:
        return bool(self.dirty_jobs or self.dirty_nodes or self.dirty_teams or self.queue_dirty
                    or self.health_dirty or self.tail_new)

    # --- to Redis ------------------------------------------------------------------------

    def _write_jobs(self, pipe, state: ClusterState, jobs: list[str], seq: int) -> None:
        docs, order = {}, {}
        for j in jobs:
            job = state.jobs.get(j)
            if job is None:
                continue
            doc = readmodel.job_doc(state, job)
            doc["seq"] = seq
            docs[j] = _enc(doc)
            order[j] = job.submitted_at
        if docs:
            pipe.hset(K["jobs"], mapping=docs)
            pipe.zadd(K["jobs:order"], order)

    def _drop_forgotten(self, pipe, state: ClusterState, full: bool) -> None:
        """The documents of jobs the fold forgot since the last write go too (`show` of one then
        says it was forgotten), so the read model stays as bounded as the fold."""
        new = len(state.forgotten) - self.forgotten_seen
        if new > 0 and not full:  # a full write rewrote the whole hash
            gone = list(islice(reversed(state.forgotten), new))
            pipe.hdel(K["jobs"], *gone)
            pipe.zrem(K["jobs:order"], *gone)
        self.forgotten_seen = len(state.forgotten)

    def _write_queue(self, pipe, state: ClusterState, seq: int) -> None:
        """The queue in the running policy's order, with the reasons it recorded."""
        queue = readmodel.queue_docs(state, self.config)
        pipe.delete(K["queue"], K["queue:docs"])
        if queue:
            pipe.zadd(K["queue"], {q["job_id"]: q["position"] for q in queue})
            pipe.hset(K["queue:docs"], mapping={q["job_id"]: _enc({**q, "seq": seq}) for q in queue})

    async def flush(self, state: ClusterState, full: bool = False) -> int:
        """Write what changed (everything when `full`) in one MULTI/EXEC; returns the seq covered."""
        seq = state.last_seq
        marks = self._take_marks()  # what is folded while the write is in flight marks anew
        if full:
            jobs, nodes, teams = list(state.jobs), list(state.nodes), list(state.teams)
        else:
            jobs, nodes, teams = sorted(marks.jobs), sorted(marks.nodes), sorted(marks.teams)
        pipe = self.r.pipeline(transaction=True)
        if full:
            self._delete_views(pipe)
        self._write_jobs(pipe, state, jobs, seq)
        self._drop_forgotten(pipe, state, full)
        for key, names, known, make in (("nodes", nodes, state.nodes, readmodel.node_doc),
                                         ("teams", teams, state.teams, readmodel.team_doc)):
            docs: dict[FieldT, EncodableT] = {name: _enc({**make(state, name), "seq": seq}) for name in names
                                              if name in known}
            if docs:
                pipe.hset(K[key], mapping=docs)
        if full or marks.queue:
            self._write_queue(pipe, state, seq)
        if full or marks.health or jobs:
            health = readmodel.health_doc(state)
            pipe.hset(K["health"], mapping={"doc": _enc(health), "seq": seq,
                                            "placement_degraded": int(state.placement_degraded)})
        if marks.tail:
            pipe.rpush(K["tail"], *[_enc(x) for x in marks.tail])
            pipe.ltrim(K["tail"], -TAIL_LEN, -1)
        self.shares.settle(state.now)
        marks.shares, self.shares.fresh = self.shares.fresh, []
        fresh = list(self.shares.samples) if full else marks.shares
        if full:
            pipe.delete(K["shares"])
        if fresh:
            pipe.rpush(K["shares"], *[_enc(x) for x in fresh])
            pipe.ltrim(K["shares"], -SHARES_LEN, -1)
        meta: dict[FieldT, EncodableT] = {"seq": seq, "at": state.now, "written_at": time.time(),
                                          "cluster": _enc(readmodel.cluster_totals(state))}
        if full:
            meta["rebuilt_at"] = time.time()
        pipe.hset(K["meta"], mapping=meta)
        pipe.publish(UPDATES_CHANNEL, str(seq))
        try:
            await pipe.execute()
        except BaseException:
            self._give_back(marks)  # not written: the next flush writes it
            raise
        self.written_seq = seq
        self.writes += 1
        if self.snapshot_every and seq - self.snapshot_seq >= self.snapshot_every:
            self.snapshot_seq = seq  # a failed snapshot is tried again after as many events
            try:
                await save_snapshot(self.r, state, seal_log=self.seal_log)
            except (aioredis.RedisError, OSError):
                raise
            except Exception as err:  # noqa: BLE001 - NATS trouble: the views are written, processes replay more
                log.warning("snapshot_failed", seq=seq, error=f"{type(err).__name__}: {err}"[:300])
        return seq

    def _take_marks(self) -> _Marks:
        """What changed so far, taken out of the projector: the listener runs while a flush
        awaits Redis, and what it marks then must survive for the next flush (clearing the
        sets after the write dropped those updates: stale read models for good)."""
        marks = _Marks(self.dirty_jobs, self.dirty_nodes, self.dirty_teams, self.queue_dirty,
                       self.health_dirty, self.tail_new)
        self.dirty_jobs, self.dirty_nodes, self.dirty_teams = set(), set(), set()
        self.queue_dirty = self.health_dirty = False
        self.tail_new = []
        return marks

    def _give_back(self, marks: _Marks) -> None:
        """A write that failed: its marks join what was marked meanwhile (older lines first)."""
        self.dirty_jobs |= marks.jobs
        self.dirty_nodes |= marks.nodes
        self.dirty_teams |= marks.teams
        self.queue_dirty |= marks.queue
        self.health_dirty |= marks.health
        self.tail_new = (marks.tail + self.tail_new)[-TAIL_LEN:]
        self.shares.fresh = marks.shares + self.shares.fresh

    def _delete_views(self, pipe) -> None:
        pipe.delete(*K.values())


# --- entry points ---------------------------------------------------------------------------


async def rebuild_views(nats_url: str | None, redis_url: str | None, creds: str | None = None) -> dict[str, Any]:
    """Wipe the read models and derive them again from the whole log (`gpusched replay
    --rebuild-views`, as its `--creds`). Returns what was written."""
    event_log = await EventLog.open(nats_url, name="projector-rebuild", creds=creds)
    r = redis_client(redis_url)
    try:
        projector = Projector(r, snapshot_every=1)
        state = new_fold()
        last = await event_log.last_seq()
        if last:
            async for rec in event_log.records(1, last):
                state.apply(rec.event, rec.seq, rec.time, rec.position)
                projector.tail_new.append(readmodel.event_line(rec.seq, rec.event))
                if len(projector.tail_new) > 4 * TAIL_LEN:
                    del projector.tail_new[: -TAIL_LEN]
                projector.shares.observe(state, rec.seq)
        projector.tail_new = projector.tail_new[-TAIL_LEN:]
        tail = len(projector.tail_new)
        seq = await projector.flush(state, full=True)
        return {"seq": seq, "jobs": len(state.jobs), "nodes": len(state.nodes), "teams": len(state.teams),
                "queue": len(state.pending), "tail": tail, "snapshot": True}
    finally:
        await r.aclose()
        await event_log.close()


async def run(nats_url: str | None = None, redis_url: str | None = None, stop: asyncio.Event | None = None,
              flush_s: float = 0.1, snapshot_every: int = 5000, config=None) -> None:
    """Follow the log and keep the read models until `stop` is set. `config`: the running
    PolicyConfig (its usage half-life folds, its order lists the queue; default: `full`)."""
    from gpusched.policy.config import DEFAULT

    config = config or DEFAULT
    telemetry.set_service("projector")
    stop = stop or asyncio.Event()
    event_log = await EventLog.open(nats_url, name="projector")
    r = redis_client(redis_url)
    projector = Projector(r, snapshot_every=snapshot_every, config=config, seal_log=event_log)
    folded = FoldedLog(event_log)
    folded.listeners.append(projector.listener)
    metrics.export_cluster()  # the one process that serves the cluster-wide metrics
    metrics.attach(folded)
    try:
        await folded.start()  # from the latest verified snapshot in JetStream, then the tail
        projector.seed(folded.state)
        await _write_retrying(projector, folded.state, full=True, stop=stop)
        log.info("projector_ready", seq=folded.state.last_seq)
        notify_ready()
        while not stop.is_set():
            await _wait(folded, stop, flush_s)
            lost = await _views_lost(r)  # Redis restarted empty (it holds only derived data)
            if (projector.dirty or lost) and not stop.is_set():
                await _write_retrying(projector, folded.state, full=lost, stop=stop)
    finally:
        await folded.stop()
        await r.aclose()
        await event_log.close()


async def _views_lost(r: aioredis.Redis) -> bool:
    """True when the views are gone (a Redis restarted without its data): write them whole."""
    try:
        return not await r.exists(K["meta"])
    except (aioredis.RedisError, OSError):
        return False  # unreachable: the next write retries, and writes everything


async def _wait(folded: FoldedLog, stop: asyncio.Event, flush_s: float) -> None:
    changed = asyncio.ensure_future(folded.changed.wait())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({changed, stopped}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
    finally:
        changed.cancel()
        stopped.cancel()
    folded.changed.clear()
    await asyncio.sleep(flush_s)  # one write covers a burst of events


async def _write_retrying(projector: Projector, state: ClusterState, full: bool, stop: asyncio.Event) -> None:
    """Redis down is not fatal: keep the dirty marks and write everything once it is back."""
    delay = 0.2
    while not stop.is_set():
        try:
            with metrics.decision_timer("projector"):
                await projector.flush(state, full=full)
            return
        except (aioredis.RedisError, OSError) as err:
            log.warning("projector_redis_error", error=str(err))
            full = True
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except TimeoutError:
                pass
            delay = min(delay * 2, 5.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--flush-s", type=float, default=0.1, help="how often changed views are written")
    parser.add_argument("--snapshot-every", type=int, default=5000, help="events between state snapshots")
    policy_arguments(parser)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    """The service-shell entry point (`gpusched service run projector`)."""
    await run(getattr(args, "nats", None), getattr(args, "redis", None), stop,
              flush_s=getattr(args, "flush_s", 0.1), snapshot_every=getattr(args, "snapshot_every", 5000),
              config=policy_of(args))


__all__ = ["Projector", "Views", "rebuild_views", "run", "serve", "add_arguments", "load_snapshot",
           "save_snapshot", "fold_log", "PREFIX", "SNAPSHOT_KEY", "UPDATES_CHANNEL", "USAGE_KEY"]
