"""The one way anything connects to Redis (services, the CLI's read models, snapshots): below
the services, so that `libs/` never imports `services/`.

Redis holds only what can be rebuilt from the log, so losing it loses nothing; a site that wants
it to stay up through a server's loss runs Redis Sentinel and gives a sentinel URL:

    redis+sentinel://:PASSWORD@sentinel-0:26379,sentinel-1:26379,sentinel-2:26379/MASTER/DB

Every client then asks the sentinels for the current master on each new connection, so after a
failover the next command reconnects to the promoted replica. The one password is the data
servers' and the sentinels' (`requirepass` on both; the chart configures them so).
"""

from __future__ import annotations

from typing import NamedTuple

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SENTINEL_SCHEME = "redis+sentinel://"
TIMEOUTS = {"socket_timeout": 2.0, "socket_connect_timeout": 2.0}


class SentinelUrl(NamedTuple):
    sentinels: list[tuple[str, int]]
    master: str
    db: int
    password: str | None


def parse_sentinel_url(url: str) -> SentinelUrl:
    """`redis+sentinel://[:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB]`, refused precisely."""
    rest = url[len(SENTINEL_SCHEME):]
    netloc, _, path = rest.partition("/")
    auth, _, hosts = netloc.rpartition("@")
    password = (auth.partition(":")[2] or None) if auth else None
    sentinels: list[tuple[str, int]] = []
    for item in filter(None, hosts.split(",")):
        host, _, port = item.rpartition(":") if item.count(":") == 1 else (item, "", "26379")
        if not host or not port.isdigit():
            raise ValueError(f"{url!r}: {item!r} is not HOST[:PORT] (a sentinel)")
        sentinels.append((host, int(port)))
    parts = [p for p in path.split("/") if p]
    if not sentinels or not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(f"{url!r}: expected redis+sentinel://[:PASSWORD@]HOST[:PORT][,...]/MASTER[/DB]")
    return SentinelUrl(sentinels, parts[0], int(parts[1]) if len(parts) == 2 else 0, password)


def redis_url(url: str | None = None) -> str:
    """Explicit > $GPUSCHED_REDIS_URL > the client config's (which carries the password)."""
    from gpusched.security import clientconfig

    return clientconfig.resolve("redis", url, "GPUSCHED_REDIS_URL") or DEFAULT_REDIS_URL


def connect_redis(url: str | None = None) -> aioredis.Redis:
    """A client with the control plane's timeouts: of one server, or of the master the sentinels name."""
    url = redis_url(url)
    if not url.startswith(SENTINEL_SCHEME):
        return aioredis.Redis.from_url(url, **TIMEOUTS)
    s = parse_sentinel_url(url)
    sentinel = Sentinel(s.sentinels, sentinel_kwargs={"password": s.password, **TIMEOUTS}, **TIMEOUTS)
    return sentinel.master_for(s.master, password=s.password, db=s.db, **TIMEOUTS)
