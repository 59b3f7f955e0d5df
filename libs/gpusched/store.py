"""The fold's persistence outside the log: sealed snapshots of the whole fold (tagged with the
sequence they cover) in JetStream's object store `GPUSCHED_SNAPSHOTS` (`SnapshotStore`), a copy
in Redis as a cache for the CLI, and folding the log from a snapshot. The projector writes
snapshots; every service, node agent and the dashboard start from the latest verified one in
JetStream and replay the tail, so start time does not grow with history, and the head of the
stream may be aged out behind a snapshot (docs/operating.md, "Retention").

Why the object store and not a KV bucket: a snapshot is the whole fold (megabytes at scale),
larger than one message may be; the object store chunks it and checks its SHA-256 on read.

A snapshot is sealed: after writing it the projector appends its digest to the log
(`SnapshotTaken`, see `security.snapshots`), and a service adopts one only if the log's latest
seal vouches for it (`untrusted`): anyone who can write Redis could otherwise hand a restarting
service a state in which held GPUs look free."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from nats.js.errors import NotFoundError

from gpusched.bus import subjects
from gpusched.bus.connection import LazyLogger
from gpusched.bus.log import EventLog
from gpusched.core import events as ev
from gpusched.core.model import DEFAULT_HALF_LIFE_S
from gpusched.core.state import FORGET_AFTER_S, ClusterState
from gpusched.security import snapshots

log = LazyLogger()

if TYPE_CHECKING:  # redis is imported where a snapshot is read from or written to it
    import redis.asyncio as aioredis

SNAPSHOT_KEY = "gpusched:snapshot"
#: Snapshots kept in the object store: the newest and older ones to fall back to when the newest
#: fails verification. Names rotate (`fold-0`..), so the bucket stays bounded forever.
KEEP = 3
HORIZON_ENV = "GPUSCHED_FORGET_AFTER_S"


def keeps_whole() -> bool:
    """Whether this process's folds keep every job whole (`GPUSCHED_FORGET_AFTER_S=none`: a
    reader who wants a forgotten job's whole history). The horizon itself is no process's
    option: it is a fact of the log (`FoldSettingsSet`, `gpusched fold-settings`), which every
    fold reads, so a replay can never forget other jobs than the cluster did."""
    text = os.environ.get(HORIZON_ENV, "").strip().lower()
    if not text:
        return False
    if text in ("none", "never", "off"):
        return True
    raise SystemExit(f"{HORIZON_ENV}={text!r}: only 'none' (keep every job whole in this reader's fold); the "
                     "cluster's horizon is a fact of the log: `gpusched fold-settings --forget-after DURATION`")


def fold_horizon() -> float | None:
    """The horizon a fold starts with, before any `FoldSettingsSet`: the default, or None for
    a reader that keeps every job whole."""
    return None if keeps_whole() else FORGET_AFTER_S


def other_fold(snapshot_whole: bool) -> str:
    if snapshot_whole:
        return f"it was folded keeping every job whole ({HORIZON_ENV}=none); this fold forgets as the log says"
    return f"it forgot jobs as the log says; this fold keeps every job whole ({HORIZON_ENV}=none)"


def new_fold() -> ClusterState:
    """An empty fold as the services keep it: the default settings until the log says others."""
    whole = keeps_whole()
    return ClusterState(half_life_s=DEFAULT_HALF_LIFE_S, forget_after_s=None if whole else FORGET_AFTER_S,
                        keep_whole=whole)


@dataclass(frozen=True)
class SnapshotMeta:
    """What an object's description says about it; verified against the log, never trusted."""

    name: str
    seq: int
    half_life_s: str
    digest: str
    seal_seq: int
    forget_after_s: str = "None"  # written since forgetting; older snapshots kept every job


class Refused(Exception):
    """A snapshot that must not be adopted, with why."""


class SnapshotStore:
    """Sealed snapshots of the fold in JetStream. The writer appends the seal (`SnapshotTaken`:
    seq, SHA-256) to the log first, then stores the snapshot naming its seal's sequence; a reader
    adopts a snapshot only if that log message is a seal for exactly its sequence and digest:
    the bucket alone (anyone who could write it) cannot make a process adopt a forged state."""

    def __init__(self, event_log: EventLog):
        self.log = event_log

    async def _bucket(self):
        return await self.log.js.object_store(subjects.SNAPSHOT_BUCKET)

    async def metas(self) -> list[SnapshotMeta]:
        """The stored snapshots, newest first (empty: no bucket, none stored, or not readable)."""
        try:
            infos = await (await self._bucket()).list(ignore_deletes=True)
        except NotFoundError:
            return []
        out = []
        for info in infos:
            try:
                d = json.loads(info.description or "")
                out.append(SnapshotMeta(info.name, int(d["seq"]), str(d["half_life_s"]), str(d["digest"]),
                                        int(d["seal_seq"]), str(d.get("forget_after_s", "None"))))
            except (ValueError, KeyError, TypeError):
                log.warning("snapshot_unreadable", name=info.name, reason="its description is not snapshot metadata")
        return sorted(out, key=lambda m: m.seq, reverse=True)

    async def save(self, state: ClusterState) -> SnapshotMeta:
        """Seal `state` in the log, then store it in the slot of the oldest snapshot."""
        seq = state.last_seq  # read once, with the encoding: the fold moves on during the awaits below
        data = state.snapshot()
        digest = hashlib.sha256(data).hexdigest()
        sealed = ev.SnapshotTaken(at=state.now, seq=seq, digest=digest)
        seal_seq = await self.log.append(sealed, msg_id=f"snapshot-{sealed.seq}-{digest[:32]}")
        stored = await self.metas()
        used = {m.name for m in stored}
        free = [f"fold-{i}" for i in range(KEEP) if f"fold-{i}" not in used]
        name = free[0] if free else stored[-1].name
        meta = SnapshotMeta(name, seq, str(state.half_life_s), digest, seal_seq,
                            str(state.forget_after_s))
        await self.put(meta, data)
        return meta

    async def put(self, meta: SnapshotMeta, data: bytes) -> None:
        """Store `data` as the object `meta` names, described by `meta` (what `metas` reads
        back). Nothing here is checked: `load` verifies against the log."""
        from nats.js.api import ObjectMeta

        description = json.dumps({"seq": meta.seq, "half_life_s": meta.half_life_s, "digest": meta.digest,
                                  "seal_seq": meta.seal_seq, "forget_after_s": meta.forget_after_s})
        await (await self._bucket()).put(meta.name, data, meta=ObjectMeta(name=meta.name, description=description))

    async def load(self, meta: SnapshotMeta, first_seq: int, last_seq: int) -> ClusterState:
        """The snapshot `meta` names, verified; raises `Refused` saying why not."""
        if meta.seq > last_seq:
            raise Refused(f"it covers seq {meta.seq}, beyond the stream's last {last_seq} (a stream created anew?)")
        if meta.seq < first_seq - 1:
            raise Refused(f"it covers seq {meta.seq}, but the stream now starts at {first_seq}: the events "
                          "between are gone")
        await self._check_seal(meta)
        try:
            data = await self._read(meta.name)
        except Refused:
            raise
        except Exception as err:  # noqa: BLE001 - missing, unreadable
            raise Refused(f"it could not be read ({type(err).__name__}: {err})") from None
        try:
            state = ClusterState.restore(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            raise Refused(f"it does not decode as a fold ({err})") from None
        state.last_seq = meta.seq
        if str(state.forget_after_s) != meta.forget_after_s:
            raise Refused(f"it folds with horizon {state.forget_after_s}, its description says {meta.forget_after_s}")
        if snapshots.digest(state) != meta.digest:  # re-encoded: vouches for the object in hand
            raise Refused(f"its digest does not match the log's seal at seq {meta.seal_seq} (altered)")
        return state

    async def _read(self, name: str) -> bytes:
        """The object's bytes, checked as nats-py's `ObjectStore.get` checks them (the SHA-256
        its info records) and also against its chunk count and size. Read here with `next_msg`
        on an ordered consumer of its chunk subject: `get` iterates the subscription, so the
        server's flow-control requests are answered only by nats-py's 0.25 s poll, and stalled
        each read (260 ms of a 2.7 MB fold, bench_cli's 1,000 nodes; 13-27 ms so)."""
        info = await (await self._bucket()).get_info(name)
        if not info.nuid or info.is_link():
            raise Refused("its object info names no chunks of its own")
        size, chunks = info.size or 0, info.chunks or 0
        h = hashlib.sha256()
        parts: list[bytes] = []
        if size:
            sub = await self.log.js.subscribe(f"$O.{subjects.SNAPSHOT_BUCKET}.C.{info.nuid}",
                                              stream=subjects.SNAPSHOT_STREAM, ordered_consumer=True)
            try:
                pending = 1
                while pending and len(parts) < chunks:
                    msg = await sub.next_msg(timeout=5)
                    pending = msg.metadata.num_pending
                    parts.append(msg.data)
                    h.update(msg.data)
            finally:
                await sub.unsubscribe()
            if pending:
                raise Refused(f"it has more than the {chunks} chunks its info records (altered)")
        data = b"".join(parts)
        if len(parts) != chunks or len(data) != size:
            raise Refused(f"its chunks hold {len(parts)} chunks, {len(data)} bytes; its info records {chunks}, "
                          f"{size} (altered)")
        kind, _, recorded = (info.digest or "").partition("=")
        try:
            matches = kind.upper() == "SHA-256" and base64.urlsafe_b64decode(recorded + "==") == h.digest()
        except ValueError:
            matches = False
        if not matches:
            raise Refused("its chunks do not match the SHA-256 its info records (altered)")
        return data

    async def _check_seal(self, meta: SnapshotMeta) -> None:
        try:
            msg = await self.log.js.get_msg(subjects.STREAM, meta.seal_seq)
        except NotFoundError:
            raise Refused(f"its seal (seq {meta.seal_seq}) is not in the log") from None
        except Exception as err:  # noqa: BLE001 - cannot check: do not trust
            raise Refused(f"its seal (seq {meta.seal_seq}) could not be read ({type(err).__name__})") from None
        try:
            sealed = ev.decode_event(msg.data or b"")  # a message without data does not decode: refused
        except (msgspec.DecodeError, msgspec.ValidationError):
            sealed = None
        if msg.subject != snapshots.SEAL_SUBJECT or not isinstance(sealed, ev.SnapshotTaken):
            raise Refused(f"log seq {meta.seal_seq} is not a snapshot seal")
        if sealed.seq != meta.seq or sealed.digest != meta.digest:
            raise Refused(f"the log's seal at seq {meta.seal_seq} is for seq {sealed.seq} with another digest")

    async def latest(self, first_seq: int, last_seq: int,
                     keep_whole: bool | None = None) -> tuple[ClusterState | None, list[str]]:
        """The newest snapshot that passes verification, and the reasons each newer one was
        refused (each is also logged). Its fold settings are the log's as of its seq, as any
        fold's; only a fold that keeps every job whole (`keep_whole`, default: this process's)
        refuses one that forgot."""
        whole = keeps_whole() if keep_whole is None else keep_whole
        refused: list[str] = []
        try:
            metas = await self.metas()
        except Exception as err:  # noqa: BLE001 - no store, no snapshot: replay
            metas = []
            refused.append(f"the snapshot store could not be listed ({type(err).__name__}: {err})")
        for meta in metas:
            try:
                state = await self.load(meta, first_seq, last_seq)
                if state.keep_whole != whole:
                    raise Refused(other_fold(state.keep_whole))
                return state, refused
            except Refused as why:
                refused.append(f"{meta.name} (seq {meta.seq}): {why}")
                log.warning("snapshot_rejected", name=meta.name, seq=meta.seq, reason=str(why))
        return None, refused


async def save_snapshot(r: aioredis.Redis | None, state: ClusterState, seal_log: EventLog | None = None) -> None:
    """The whole fold, tagged with the log sequence it covers: with `seal_log`, sealed in its log
    and stored in JetStream (where processes start from); with `r`, cached in Redis (the CLI's)."""
    if seal_log is not None:
        await SnapshotStore(seal_log).save(state)
    if r is not None:
        await r.hset(SNAPSHOT_KEY, mapping={"seq": state.last_seq, "half_life_s": str(state.half_life_s),
                                             "forget_after_s": str(state.forget_after_s),
                                             "data": state.snapshot()})


async def untrusted(event_log: EventLog, state: ClusterState) -> str | None:
    """Why the snapshot `state` must not be adopted (None: the log's latest seal records it)."""
    return await snapshots.untrusted(event_log, state)


async def load_snapshot(r: aioredis.Redis) -> ClusterState | None:
    """The latest snapshot (None for a fold that keeps every job whole, if it forgot some)."""
    from redis.exceptions import RedisError

    try:
        raw = await r.hgetall(SNAPSHOT_KEY)
    except (RedisError, OSError):
        return None
    if not raw or b"data" not in raw:
        return None
    data = raw[b"data"]
    assert isinstance(data, bytes), "a bytes client (redis_client.connect_redis): the snapshot is msgpack"
    state = ClusterState.restore(data)
    if state.keep_whole != keeps_whole():
        return None  # another fold: it forgets other jobs
    state.last_seq = int(raw[b"seq"])
    return state


async def load_snapshot_from(redis_url: str | None) -> ClusterState | None:
    """The latest snapshot from the Redis at `redis_url`, or None (no Redis, no snapshot)."""
    from gpusched.redis_client import connect_redis

    r = connect_redis(redis_url)
    try:
        return await load_snapshot(r)
    finally:
        await r.aclose()


async def fold_log(event_log: EventLog, state: ClusterState | None = None, until: int | None = None) -> ClusterState:
    """Fold the log (from a snapshot's sequence when given one) up to `until` (default: now)."""
    state = state or new_fold()
    info = (await event_log.js.stream_info(subjects.STREAM)).state
    last = info.last_seq if until is None else until
    if info.first_seq > state.last_seq + 1 and last > state.last_seq:
        raise RuntimeError(f"the stream starts at seq {info.first_seq} (older facts aged out): folding from "
                           f"seq {state.last_seq + 1} needs a snapshot or the exported segments")
    if last > state.last_seq:
        async for rec in event_log.records(state.last_seq + 1, last):
            state.apply(rec.event, rec.seq, rec.time, rec.position)
    return state


__all__ = ["HORIZON_ENV", "KEEP", "fold_horizon", "keeps_whole", "new_fold", "Refused", "SnapshotMeta", "SnapshotStore", "SNAPSHOT_KEY", "fold_log", "load_snapshot", "load_snapshot_from", "save_snapshot", "untrusted"]
