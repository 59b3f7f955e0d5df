"""Liveness leases in Redis: how a standby (or the naive fallback) knows an active service is gone.

`SET key owner NX PX ttl` takes the lease; the holder renews it well inside the TTL (a Lua
compare-and-renew, so a holder that lost it cannot renew someone else's). A lease is only a
liveness signal, never a lock on the data: two writers that both believe they hold it are still
kept safe by the log's compare-and-set.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid

import redis.asyncio as aioredis
import structlog

from gpusched.redis_client import DEFAULT_REDIS_URL, connect_redis, redis_url  # noqa: F401 (the services' names)

log = structlog.get_logger()

PLACEMENT_LEASE_KEY = "gpusched:lease:placement"
FALLBACK_LEASE_KEY = "gpusched:lease:fallback"

_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""


def owner_id(role: str) -> str:
    return f"{role}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Lease:
    """One named lease. `held` is this process's belief, refreshed on every `tick`."""

    def __init__(self, r: aioredis.Redis, key: str, owner: str, ttl_ms: int = 3000):
        self.r, self.key, self.owner, self.ttl_ms = r, key, owner, ttl_ms
        self.held = False
        self._renew = r.register_script(_RENEW)
        self._release = r.register_script(_RELEASE)

    async def tick(self) -> bool:
        """Renew if held, else try to take it. Redis errors count as not held (fail safe)."""
        try:
            if self.held and await self._renew(keys=[self.key], args=[self.owner, self.ttl_ms]):
                return True
            self.held = bool(await self.r.set(self.key, self.owner, nx=True, px=self.ttl_ms))
        except (aioredis.RedisError, OSError) as err:
            log.warning("lease_error", key=self.key, error=str(err))
            self.held = False
        return self.held

    async def holder(self) -> str | None:
        return await lease_holder(self.r, self.key)

    async def release(self) -> None:
        try:
            await self._release(keys=[self.key], args=[self.owner])
        except (aioredis.RedisError, OSError):
            pass
        self.held = False

    async def keep(self, stop: asyncio.Event, on_change=None) -> None:
        """Renew (or try to take) the lease every third of its TTL until `stop` is set."""
        was = self.held
        while not stop.is_set():
            now_held = await self.tick()
            if now_held != was:
                log.info("lease_acquired" if now_held else "lease_lost", key=self.key, owner=self.owner)
                if on_change is not None:
                    on_change(now_held)
                was = now_held
            try:
                await asyncio.wait_for(stop.wait(), self.ttl_ms / 3000.0)
            except TimeoutError:
                pass
        await self.release()


async def lease_holder(r: aioredis.Redis, key: str) -> str | None:
    """Who holds a lease; `""` when Redis cannot be asked."""
    try:
        value = await r.get(key)
    except (aioredis.RedisError, OSError):
        return ""
    return value.decode() if value is not None else None
