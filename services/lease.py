"""Liveness leases in a JetStream key-value bucket: how a standby (or the naive fallback) knows
an active service is gone.

The bucket (`subjects.LEASE_BUCKET`, created by admin with the streams) is writable only by the
placement and fallback roles, each only at its own keys (`security/authz.py lease_access`): a
tenant, a node or any other service cannot write, delete or purge a lease, so a holder is a
placement process because the server let it write. Redis plays no part.

A lease is a key whose value names its holder and TTL. The holder takes it with `create` (the key
absent) and renews it every third of its TTL with `update(last=its revision)`, a compare-and-set
on the revision: a holder that lost it cannot renew someone else's. No clock of any host decides
expiry: an observer counts a lease as lapsed when the key's revision has not moved for the TTL,
timed on the observer's own monotonic clock from when it saw that revision (so a forged or skewed
wall clock changes nothing); a contender then takes it with `update(last=that revision)`. The
holder counts itself as holding only until TTL after it *sent* its last successful renewal, which
is before any observer saw it: two processes never both believe they hold one lease (clock rates
being equal). A lease is only a liveness signal, never a lock on the data: two writers that
both decide are still kept safe by the log's compare-and-set.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass

import structlog
from nats.errors import Error as NatsError
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from gpusched.bus import subjects

log = structlog.get_logger()

PLACEMENT_LEASE_KEY = "placement"
FALLBACK_LEASE_KEY = "fallback"
#: A role's lease keys: its name, or `ROLE.NAME` (two placements racing on purpose, in tests).
LEASE_KEY = re.compile(r"(placement|fallback)(\.[A-Za-z0-9_-]{1,64})?")
#: NATS request timeout of one lease call: a renewal that hangs is a renewal that failed.
CALL_TIMEOUT_S = 2.0


def owner_id(role: str) -> str:
    return f"{role}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def lease_key(value: str) -> str:
    """argparse type of `--lease-key`: a key the role's permissions let it write."""
    import argparse

    if not LEASE_KEY.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a lease key: 'placement', 'fallback', or ROLE.NAME "
                                         "(letters, digits, '-', '_'), the keys their roles may write")
    return value


async def open_bucket(nc) -> KeyValue:
    """The lease bucket, which an admin created (`gpusched up`, `gpusched stream create`)."""
    from nats.js.errors import BucketNotFoundError

    try:
        return await nc.jetstream(timeout=CALL_TIMEOUT_S).key_value(subjects.LEASE_BUCKET)
    except BucketNotFoundError:
        raise RuntimeError(f"lease bucket {subjects.LEASE_BUCKET} does not exist: an admin creates it "
                           "(`gpusched up`, or `gpusched stream create` with admin credentials)") from None


@dataclass(frozen=True)
class Holder:
    owner: str
    ttl_ms: int
    revision: int


def decode(value: bytes | None, revision: int, default_ttl_ms: int) -> Holder:
    """A lease value; one that is not ours reads as an unnamed holder with the observer's TTL."""
    try:
        doc = json.loads(value or b"")
        return Holder(str(doc["owner"]), max(1, int(doc["ttl_ms"])), revision)
    except (ValueError, KeyError, TypeError):
        return Holder("", default_ttl_ms, revision)


class Watch:
    """One observer's view of a lease key: who holds it while its revision keeps moving."""

    def __init__(self, kv: KeyValue, key: str, ttl_ms: int):
        self.kv, self.key, self.ttl_ms = kv, key, ttl_ms
        self._seen: tuple[int, float] | None = None  # (revision, when this process first saw it)

    async def look(self) -> Holder | None:
        """The current holder's entry (fresh or not), None when the key is absent. Raises
        NatsError / TimeoutError when the bucket cannot be asked."""
        try:
            entry = await self.kv.get(self.key)
        except KeyNotFoundError:
            self._seen = None
            return None
        holder = decode(entry.value, entry.revision or 0, self.ttl_ms)
        if self._seen is None or self._seen[0] != holder.revision:
            self._seen = (holder.revision, time.monotonic())
        return holder

    def lapsed(self, holder: Holder) -> bool:
        """Its revision has stood still for its TTL, on this process's clock."""
        return self._seen is not None and time.monotonic() - self._seen[1] >= holder.ttl_ms / 1000.0

    async def holder(self) -> str | None:
        """Who holds the lease now; None when nobody does (absent or lapsed); `""` when the
        bucket cannot be asked."""
        try:
            holder = await self.look()
        except (NatsError, TimeoutError, OSError):
            return ""
        if holder is None or self.lapsed(holder):
            return None
        return holder.owner


class Lease:
    """One named lease. `held` is this process's belief, true until TTL after the last renewal
    it sent that the server accepted."""

    def __init__(self, kv: KeyValue, key: str, owner: str, ttl_ms: int = 3000):
        self.kv, self.key, self.owner, self.ttl_ms = kv, key, owner, ttl_ms
        self.watch = Watch(kv, key, ttl_ms)
        self.revision: int | None = None  # of our last write, while we think we hold it
        self._valid_until = 0.0
        self._value = json.dumps({"owner": owner, "ttl_ms": ttl_ms}).encode()

    @property
    def held(self) -> bool:
        return self.revision is not None and time.monotonic() < self._valid_until

    async def tick(self) -> bool:
        """Renew if held, else take it when absent or lapsed. Bucket errors keep it unrenewed
        (fail safe: the belief runs out at its TTL)."""
        sent = time.monotonic()
        try:
            if self.revision is not None:
                self.revision = await self.kv.update(self.key, self._value, last=self.revision)
            else:
                current = await self.watch.look()
                if current is None:
                    self.revision = await self.kv.create(self.key, self._value)
                elif self.watch.lapsed(current):
                    self.revision = await self.kv.update(self.key, self._value, last=current.revision)
                else:
                    return False
            self._valid_until = sent + self.ttl_ms / 1000.0
        except KeyWrongLastSequenceError:
            self.revision = await self._ours_after_all()
        except (NatsError, TimeoutError, OSError) as err:
            log.warning("lease_error", key=self.key, error=str(err) or type(err).__name__)
        return self.held

    async def _ours_after_all(self) -> int | None:
        """After a refused write: a renewal that timed out after it was stored left the key
        ours at a newer revision (renewed next tick); anything else is someone else's."""
        try:
            current = await self.watch.look()
        except (NatsError, TimeoutError, OSError):
            return None
        return current.revision if current is not None and current.owner == self.owner else None

    async def holder(self) -> str | None:
        return await self.watch.holder()

    async def release(self) -> None:
        """Delete the key if it is still ours, so a standby takes over at once."""
        if self.revision is not None:
            try:
                await self.kv.delete(self.key, last=self.revision)
            except (NatsError, TimeoutError, OSError):
                pass
        self.revision = None

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
