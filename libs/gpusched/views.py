"""Reading and naming the read models in Redis: the keys the projector writes and `Views`, the
read access the CLI, the dashboard and the services share (so none of them imports the
projector's internals). The documents themselves are built in `gpusched.readmodel`."""

from __future__ import annotations

from typing import Any

import msgspec

from gpusched.redis_client import aioredis  # first: it imports redis without the OTel metrics SDK

PREFIX = "gpusched:v:"
#: The used-versus-held read model: job id -> mean utilization and memory over the last window.
#: Written by the reconciler (it holds the heartbeats), read by `jobs`, `show` and the dashboard.
USAGE_KEY = "gpusched:usage"
UPDATES_CHANNEL = "gpusched:v:updates"
TAIL_LEN = 200
SHARES_LEN = 900
K = {name: PREFIX + name for name in
     ("meta", "jobs", "jobs:order", "nodes", "teams", "queue", "queue:docs", "health", "tail", "shares")}



def redis_client(url: str | None) -> aioredis.Redis:
    """A Redis client with the control plane's timeouts."""
    from gpusched.redis_client import connect_redis

    return connect_redis(url)


def _text(name: object) -> str:
    """A member or field name as the control plane's bytes client (`connect_redis`) returns it."""
    assert isinstance(name, bytes), f"a bytes client answers bytes, not {type(name).__name__}"
    return name.decode()


def _meta_doc(raw: dict) -> dict[str, Any] | None:
    """The projector's meta hash as a document (None: no projector has written)."""
    if not raw:
        return None
    doc: dict[str, Any] = {"seq": int(raw[b"seq"]), "at": float(raw[b"at"]), "written_at": float(raw[b"written_at"])}
    if b"cluster" in raw:  # the cluster's totals as of `seq` (`readmodel.cluster_totals`)
        doc["cluster"] = msgspec.json.decode(raw[b"cluster"])
    return doc


def _decoded(raw: dict) -> list[dict[str, Any]]:
    """A hash of JSON documents, in the order of its fields."""
    return [msgspec.json.decode(v) for _, v in sorted(raw.items())]


class Views:
    """Read access to the read models. `available()` is False when Redis does not answer or no
    projector has written yet; callers then fold the log instead."""

    def __init__(self, r: aioredis.Redis):
        self.r = r

    @classmethod
    def connect(cls, redis_url: str | None) -> Views:
        return cls(redis_client(redis_url))

    async def close(self) -> None:
        await self.r.aclose()

    async def meta(self) -> dict[str, Any] | None:
        try:
            raw = await self.r.hgetall(K["meta"])
        except (aioredis.RedisError, OSError):
            return None
        return _meta_doc(raw)

    async def listing(self, what: str, with_usage: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any],
                                                                         dict[str, dict[str, Any]] | None] | None:
        """The documents of `what` (`jobs`, `nodes`, `teams`, `queue`, as the methods of those
        names read them), the meta and, `with_usage`, the usage, in two round trips (one for
        `nodes` and `teams`): the meta, the order (or the hash) and the usage in one pipeline,
        then the ordered documents. None: no projector has written. Redis errors are raised."""
        ordered = {"jobs": ("jobs:order", "jobs"), "queue": ("queue", "queue:docs")}.get(what)
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(K["meta"])
        if ordered:
            pipe.zrange(K[ordered[0]], 0, -1)
        else:
            pipe.hgetall(K[what])
        if with_usage:
            pipe.hgetall(USAGE_KEY)
        raw_meta, found, *used = await pipe.execute()
        meta = _meta_doc(raw_meta)
        if meta is None:
            return None
        if not ordered:
            docs = _decoded(found)
        elif found:
            docs = [msgspec.json.decode(v) for v in await self.r.hmget(K[ordered[1]], found) if v is not None]
        else:
            docs = []
        usage = {k.decode(): msgspec.json.decode(v) for k, v in used[0].items()} if with_usage else None
        return docs, meta, usage

    async def _hash_docs(self, key: str) -> list[dict[str, Any]]:
        return _decoded(await self.r.hgetall(key))

    async def jobs(self) -> list[dict[str, Any]]:
        ids = [_text(j) for j in await self.r.zrange(K["jobs:order"], 0, -1)]
        if not ids:
            return []
        raw = await self.r.hmget(K["jobs"], ids)
        return [msgspec.json.decode(v) for v in raw if v is not None]

    async def job(self, job_id: str) -> dict[str, Any] | None:
        raw = await self.r.hget(K["jobs"], job_id)
        return None if raw is None else msgspec.json.decode(raw)

    async def nodes(self) -> list[dict[str, Any]]:
        return await self._hash_docs(K["nodes"])

    async def teams(self) -> list[dict[str, Any]]:
        return await self._hash_docs(K["teams"])

    async def queue(self) -> list[dict[str, Any]]:
        ids = [_text(j) for j in await self.r.zrange(K["queue"], 0, -1)]
        if not ids:
            return []
        raw = await self.r.hmget(K["queue:docs"], ids)
        return [msgspec.json.decode(v) for v in raw if v is not None]

    async def health(self) -> dict[str, Any] | None:
        raw = await self.r.hget(K["health"], "doc")
        return None if raw is None else msgspec.json.decode(raw)

    async def tail(self, n: int = 50) -> list[dict[str, Any]]:
        return [msgspec.json.decode(v) for v in await self.r.lrange(K["tail"], -n, -1)]

    async def shares(self) -> list[dict[str, Any]]:
        return [msgspec.json.decode(v) for v in await self.r.lrange(K["shares"], 0, -1)]

    async def usage(self) -> dict[str, dict[str, Any]]:
        """Running jobs' mean utilization and memory (empty without a reconciler writing it)."""
        try:
            raw = await self.r.hgetall(USAGE_KEY)
        except (aioredis.RedisError, OSError):
            return {}
        return {_text(k): msgspec.json.decode(v) for k, v in raw.items()}


__all__ = ["K", "PREFIX", "SHARES_LEN", "TAIL_LEN", "UPDATES_CHANNEL", "USAGE_KEY", "Views", "redis_client"]
