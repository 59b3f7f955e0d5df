"""The log: one JetStream stream that holds every fact, and the only code that touches it.

- `append` publishes with `Nats-Msg-Id` (a retried append is stored once) and, for grants,
  with the expected-last-subject-sequence check over the alloc tree: the append is accepted
  only if the writer saw every ownership change before it, otherwise `Conflict` is raised and
  the writer catches up and decides again.
- `replay` reads a range; `follow` reads from a sequence and keeps following live.
- A message that does not decode goes to the dead-letter stream with the reason, and reading
  goes on.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from gpusched import telemetry
from gpusched.core.events import Event, decode_event, encode_event

from . import subjects

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code for a failed expected-sequence check
BATCH_DUPLICATE_MSG_ID = 10201  # an atomic batch repeats a stored Nats-Msg-Id
MAX_BATCH = 1000  # JetStream's limit on one atomic batch


def nats_url(url: str | None = None) -> str:
    return url or os.environ.get("GPUSCHED_NATS_URL") or DEFAULT_NATS_URL


class Unreachable(ConnectionError):
    """A client could not reach a server: says which, at what address, and what to do."""

    def __init__(self, what: str, url: str, cause: BaseException | str, hint: str):
        detail = cause if isinstance(cause, str) else (str(cause) or type(cause).__name__)
        super().__init__(f"cannot reach {what} at {url} ({detail}); {hint}")


NATS_HINT = "is `gpusched up` running? (or set --nats / GPUSCHED_NATS_URL)"
#: Connection options of this process. Services keep the default (reconnect forever: they must
#: outlive blips); a command-line client calls `fail_fast()` so an unreachable server is one
#: clear error within seconds instead of a retry loop.
_client_options: dict = {}


def fail_fast(connect_timeout: float = 1.5) -> None:
    """Make every later `connect` of this process try once, quietly, and raise `Unreachable`."""

    async def remember(err: Exception) -> None:  # no log line: the caller says it once
        _last_error[:] = [err]

    # one try (nats-py counts the first as a reconnect: 1 is the smallest value that stops)
    _client_options.update(allow_reconnect=False, max_reconnect_attempts=1, reconnect_time_wait=0.1,
                           connect_timeout=connect_timeout, error_cb=remember)


_last_error: list[Exception] = []


async def connect(url: str | None = None, name: str = "gpusched", **kwargs) -> NATS:
    """The one way to connect to NATS (reconnects forever; services must outlive blips)."""
    options = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.5, **_client_options, **kwargs}
    if not _client_options:
        return await nats.connect(nats_url(url), name=name, **options)
    try:
        return await asyncio.wait_for(nats.connect(nats_url(url), name=name, **options),
                                      options["connect_timeout"] + 1)
    except (OSError, TimeoutError, NatsError) as err:
        cause = _last_error[0] if _last_error else err  # what the socket said, not "no servers"
        raise Unreachable("NATS", nats_url(url), cause, NATS_HINT) from err


def _stored_at(text: str) -> float:
    """A JetStream RFC 3339 time (nanoseconds, `Z`) as epoch seconds."""
    head, _, frac = text.rstrip("Z").partition(".")
    base = datetime.fromisoformat(head).replace(tzinfo=timezone.utc).timestamp()
    return base + (float("0." + frac) if frac else 0.0)


class Conflict(Exception):
    """A compare-and-set append lost: someone changed GPU ownership since the writer's view."""

    def __init__(self, expected: int, detail: str):
        super().__init__(f"expected alloc sequence {expected}: {detail}")
        self.expected = expected
        found = re.search(r"wrong last sequence: (\d+)", detail)
        #: The alloc tree's real last sequence, as the server reported it (None if it did not).
        self.actual = int(found.group(1)) if found else None


@dataclass(frozen=True)
class Record:
    seq: int
    event: Event
    subject: str
    headers: dict[str, str] | None


class EventLog:
    def __init__(self, nc: NATS, replicas: int | None = None):
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        # R3 in a NATS cluster: every service must agree, so it comes from one variable
        self.replicas = replicas if replicas is not None else int(os.environ.get("GPUSCHED_STREAM_REPLICAS", "1"))
        self.dead_letters = 0

    @classmethod
    async def open(cls, url: str | None = None, name: str = "gpusched", replicas: int | None = None) -> EventLog:
        log = cls(await connect(url, name=name), replicas)
        await log.ensure()
        return log

    async def close(self) -> None:
        await self.nc.drain()

    async def ensure(self) -> None:
        """Create or update the streams; safe to call from every service at every start."""
        configs = [
            StreamConfig(
                name=subjects.STREAM, subjects=[subjects.EVENTS], storage=StorageType.FILE,
                retention=RetentionPolicy.LIMITS, discard=DiscardPolicy.OLD, num_replicas=self.replicas,
                duplicate_window=120.0, allow_atomic=True, description="gpusched: every fact, the source of truth",
            ),
            StreamConfig(
                name=subjects.DEAD_STREAM, subjects=[subjects.DEAD], storage=StorageType.FILE,
                num_replicas=self.replicas, description="gpusched: messages that did not decode, with why",
            ),
        ]
        for config in configs:
            try:
                await self.js.add_stream(config)
            except APIError as err:
                if err.err_code != 10058:  # stream name already in use with a different config
                    raise
                await self.js.update_stream(config)

    # --- writing ---------------------------------------------------------------------------

    async def append(
        self,
        event: Event,
        *,
        msg_id: str | None = None,
        expect_alloc_seq: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> int:
        """Append one fact and return its sequence. With `expect_alloc_seq` the append is a
        compare-and-set over the alloc tree and raises `Conflict` when the writer is behind."""
        payload = encode_event(event)
        hdrs = dict(headers or {})
        telemetry.append_headers(event, hdrs)  # traceparent: the job's trace crosses services here
        hdrs["Nats-Msg-Id"] = msg_id or hashlib.blake2b(payload, digest_size=16).hexdigest()
        if expect_alloc_seq is not None:
            hdrs["Nats-Expected-Last-Subject-Sequence"] = str(expect_alloc_seq)
            hdrs["Nats-Expected-Last-Subject-Sequence-Subject"] = subjects.ALLOC_TREE
        try:
            ack = await self.js.publish(subjects.event_subject(event), payload, headers=hdrs)
        except APIError as err:
            if err.err_code == WRONG_LAST_SEQUENCE and expect_alloc_seq is not None:
                raise Conflict(expect_alloc_seq, err.description or "") from err
            raise
        return ack.seq

    async def append_batch(
        self,
        events: Sequence[Event],
        *,
        msg_ids: Sequence[str | None] | None = None,
        expect_alloc_seq: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> list[int]:
        """Append up to MAX_BATCH facts atomically (JetStream atomic batch: all or none), in one
        round trip. With `expect_alloc_seq` the whole batch is a compare-and-set over the alloc
        tree: a scheduling cycle's grants land together or not at all. Returns their sequences."""
        if not events:
            return []
        if len(events) == 1:  # a plain publish-ack is the cheaper round trip
            msg_id = msg_ids[0] if msg_ids else None
            return [await self.append(events[0], msg_id=msg_id, expect_alloc_seq=expect_alloc_seq, headers=headers)]
        if len(events) > MAX_BATCH:
            raise ValueError(f"an atomic batch holds at most {MAX_BATCH} events, got {len(events)}")
        batch_id = uuid.uuid4().hex
        last = len(events) - 1
        reply = None
        for i, event in enumerate(events):
            payload = encode_event(event)
            hdrs = dict(headers or {})
            telemetry.append_headers(event, hdrs)  # each fact continues its own job's trace
            hdrs["Nats-Batch-Id"], hdrs["Nats-Batch-Sequence"] = batch_id, str(i + 1)
            msg_id = msg_ids[i] if msg_ids else None
            hdrs["Nats-Msg-Id"] = msg_id or hashlib.blake2b(payload, digest_size=16).hexdigest()
            if i == 0 and expect_alloc_seq is not None:
                hdrs["Nats-Expected-Last-Subject-Sequence"] = str(expect_alloc_seq)
                hdrs["Nats-Expected-Last-Subject-Sequence-Subject"] = subjects.ALLOC_TREE
            if i < last:
                await self.nc.publish(subjects.event_subject(event), payload, headers=hdrs)
            else:
                hdrs["Nats-Batch-Commit"] = "1"
                reply = await self.nc.request(subjects.event_subject(event), payload, headers=hdrs, timeout=10)
        answer = json.loads(reply.data)
        error = answer.get("error")
        if error:
            if error.get("err_code") in (WRONG_LAST_SEQUENCE, BATCH_DUPLICATE_MSG_ID) and expect_alloc_seq is not None:
                raise Conflict(expect_alloc_seq or 0, error.get("description", ""))
            raise APIError(**error)
        commit = answer["seq"]
        return list(range(commit - len(events) + 1, commit + 1))

    # --- reading ---------------------------------------------------------------------------

    async def last_seq(self) -> int:
        info = await self.js.stream_info(subjects.STREAM)
        return info.state.last_seq

    async def seq_at_time(self, when: float) -> int:
        """The last sequence the server stored at or before `when` (epoch seconds): the log as it
        stood then. The server's store timestamps, not the events' `at`: they grow with the
        sequence (the writers' clocks do not), so the answer is a prefix of the log. One
        round trip: JetStream's message get by start time (the first message stored at or after
        `when`) answers in the same time at any log length."""
        stamp = datetime.fromtimestamp(when, timezone.utc).isoformat().replace("+00:00", "Z")
        reply = await self.nc.request(f"$JS.API.STREAM.MSG.GET.{subjects.STREAM}",
                                      json.dumps({"start_time": stamp}).encode(), timeout=5)
        answer = json.loads(reply.data)
        if "error" in answer:
            if answer["error"].get("code") == 404:  # nothing stored at or after `when`
                return await self.last_seq()
            raise APIError(**answer["error"])
        first_after = answer["message"]["seq"]
        if _stored_at(answer["message"]["time"]) <= when:  # stored exactly at `when`: it belongs
            return first_after
        return first_after - 1

    async def records(
        self, start: int = 1, until: int | None = None, follow: bool = False, subject: str = subjects.EVENTS,
        on_dead: Callable[[int, str], None] | None = None,
    ) -> AsyncIterator[Record]:
        """Decoded records from `start`; stops at `until` (default: the last sequence when the
        call began) unless `follow`. Undecodable messages are dead-lettered and skipped
        (`on_dead(seq, subject)` still hears of them: they occupy a sequence)."""
        stop = None if follow else (until if until is not None else await self.last_seq())
        if stop is not None and stop < start:
            return
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(1, start))
        sub = await self.js.subscribe(
            subject, stream=subjects.STREAM, ordered_consumer=True, config=config,
            pending_msgs_limit=0, pending_bytes_limit=0,
        )
        try:
            while True:
                msg = await sub.next_msg(timeout=None)
                seq = msg.metadata.sequence.stream
                try:
                    event = decode_event(msg.data)
                except (msgspec.DecodeError, msgspec.ValidationError) as err:
                    await self.dead_letter(msg.subject, seq, msg.data, str(err))
                    if on_dead is not None:
                        on_dead(seq, msg.subject)
                else:
                    record = Record(seq, event, msg.subject, msg.headers)
                    telemetry.observe(record)  # remember the job's trace context
                    yield record
                if stop is not None and seq >= stop:
                    return
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may already be closing
                pass

    async def replay(self, start: int = 1, until: int | None = None) -> AsyncIterator[tuple[int, Event]]:
        async for rec in self.records(start, until):
            yield rec.seq, rec.event

    async def dead_letter(self, subject: str, seq: int, data: bytes, reason: str) -> None:
        """Keep the bad message, with why, where an operator can read it; once per sequence."""
        self.dead_letters += 1
        headers = {"Gpusched-Reason": reason[:1000], "Gpusched-Seq": str(seq), "Nats-Msg-Id": f"dead-{seq}"}
        await self.js.publish(subjects.dead_subject(subject), data, headers=headers)

    async def dead_letters_list(self, limit: int = 100) -> list[dict]:
        """The dead-letter stream's messages, oldest first."""
        try:
            info = await self.js.stream_info(subjects.DEAD_STREAM)
        except NotFoundError:
            return []
        out: list[dict] = []
        last = info.state.last_seq
        if info.state.messages == 0:
            return out
        sub = await self.js.subscribe(subjects.DEAD, stream=subjects.DEAD_STREAM, ordered_consumer=True,
                                     deliver_policy=DeliverPolicy.ALL)
        try:
            while len(out) < limit:
                msg = await asyncio.wait_for(sub.next_msg(timeout=None), 5)
                hdrs = msg.headers or {}
                out.append({"seq": int(hdrs.get("Gpusched-Seq", 0)), "subject": msg.subject,
                            "reason": hdrs.get("Gpusched-Reason", ""), "data": msg.data.decode(errors="replace")})
                if msg.metadata.sequence.stream >= last:
                    break
        finally:
            await sub.unsubscribe()
        return out
