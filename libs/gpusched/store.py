"""The fold's persistence outside the log: the snapshot store in Redis (the whole fold, tagged
with the sequence it covers) and folding the log from a snapshot. The projector writes
snapshots; every service, the CLI and the dashboard start from one and replay the tail.

A snapshot is sealed: after writing it the projector appends its digest to the log
(`SnapshotTaken`, see `security.snapshots`), and a service adopts one only if the log's latest
seal vouches for it (`untrusted`): anyone who can write Redis could otherwise hand a restarting
service a state in which held GPUs look free."""

from __future__ import annotations

import redis.asyncio as aioredis

from gpusched.bus.log import EventLog
from gpusched.core.state import ClusterState
from gpusched.security import snapshots

SNAPSHOT_KEY = "gpusched:snapshot"


async def save_snapshot(r: aioredis.Redis, state: ClusterState, seal_log: EventLog | None = None) -> None:
    """The whole fold, tagged with the log sequence it covers; with `seal_log`, its seal is
    appended there (an unsealed snapshot is never adopted by a service)."""
    await r.hset(SNAPSHOT_KEY, mapping={"seq": state.last_seq, "half_life_s": str(state.half_life_s),
                                         "data": state.snapshot()})
    if seal_log is not None:
        await snapshots.append_seal(seal_log, state)


async def untrusted(event_log: EventLog, state: ClusterState) -> str | None:
    """Why the snapshot `state` must not be adopted (None: the log's latest seal records it)."""
    return await snapshots.untrusted(event_log, state)


async def load_snapshot(r: aioredis.Redis, half_life_s: float | None = 7 * 24 * 3600.0) -> ClusterState | None:
    """The latest snapshot if its half-life matches (a fold with other parameters is another fold)."""
    try:
        raw = await r.hgetall(SNAPSHOT_KEY)
    except (aioredis.RedisError, OSError):
        return None
    if not raw or b"data" not in raw:
        return None
    if raw.get(b"half_life_s", b"").decode() != str(half_life_s):
        return None
    state = ClusterState.restore(raw[b"data"])
    state.last_seq = int(raw[b"seq"])
    return state


async def load_snapshot_from(redis_url: str | None,
                             half_life_s: float | None = 7 * 24 * 3600.0) -> ClusterState | None:
    """The latest snapshot from the Redis at `redis_url`, or None (no Redis, no snapshot)."""
    from gpusched.services.lease import connect_redis

    r = connect_redis(redis_url)
    try:
        return await load_snapshot(r, half_life_s)
    finally:
        await r.aclose()


async def fold_log(event_log: EventLog, state: ClusterState | None = None, until: int | None = None,
                   half_life_s: float | None = 7 * 24 * 3600.0) -> ClusterState:
    """Fold the log (from a snapshot's sequence when given one) up to `until` (default: now)."""
    state = state or ClusterState(half_life_s=half_life_s)
    last = await event_log.last_seq() if until is None else until
    if last > state.last_seq:
        async for rec in event_log.records(state.last_seq + 1, last):
            state.apply(rec.event, rec.seq)
    return state


__all__ = ["SNAPSHOT_KEY", "fold_log", "load_snapshot", "load_snapshot_from", "save_snapshot", "untrusted"]
