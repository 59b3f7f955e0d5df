"""The log: one JetStream stream that holds every fact, and the only code that touches it.

- `append` publishes with `Nats-Msg-Id` (a retried append is stored once) and, for grants,
  with the expected-last-subject-sequence check over the alloc tree: the append is accepted
  only if the writer saw every ownership change before it, otherwise `Conflict` is raised and
  the writer catches up and decides again.
- `replay` reads a range; `follow` reads from a sequence and keeps following live.
- A message that does not decode goes to the dead-letter stream with the reason, and reading
  goes on.
- With a signer (the writer's nkey; by default `security.signing.signer_from_env()`), every
  append carries a `Gpusched-Sig` header: see `gpusched.security.signing` for what is signed.
  Each chain is used by one append at a time (sign, publish, ack), so a chain is in stream order;
  concurrent appends (admission's pipelined submits) each take a chain of their own from a pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    DeliverPolicy,
    StreamConfig,
)
from nats.js.errors import APIError, NotFoundError

from gpusched.core import limits
from gpusched.core.events import Event, decode_event, encode_fact
from gpusched.security import signing
from gpusched.security.identity import Identity
from gpusched.security.identity import load as load_identity  # noqa: F401 (callers import it here)

from . import connection, fastpath, streams, subjects
from .dial import (  # noqa: F401 (their names here, where callers import them)
    DEFAULT_NATS_URL,
    NATS_HINT,
    ServerUnsuitable,
    Unreachable,
    _client_options,
    _last_error,
    connect,
    creds_file,
    fail_fast,
    identity_of,
    nats_url,
    seed_list,
    tls_context,
)
from .streams import (  # noqa: F401 (their names here, where callers import them)
    DEAD_MAX_MSG_BYTES,
    REPLICA_ERRORS,
    ReplicasUnavailable,
    cluster_size,
    create_lease_bucket,
)

_log = connection.LazyLogger()

WRONG_LAST_SEQUENCE = 10071  # JetStream's error code for a failed expected-sequence check
#: A clustered stream's leader refuses an expected-sequence check while another one over the same
#: subject (here: the alloc tree) is proposed and not yet applied; it names no sequence. Stored
#: nothing, like 10071: a conflict, and the writer catches up and decides again.
CHECK_IN_FLIGHT = 10164
CAS_REFUSALS = (WRONG_LAST_SEQUENCE, CHECK_IN_FLIGHT)
BATCH_DUPLICATE_MSG_ID = 10201  # an atomic batch repeats a stored Nats-Msg-Id
MAX_BATCH = 1000  # JetStream's limit on one atomic batch
DEAD_ALREADY_STORED = 10077  # "maximum messages per subject exceeded" (discard new per subject)
DEAD_STREAM_FULL = 10027  # "maximum messages exceeded"
#: Dead letters one reader files per writer (subjects.writer_of) in a window: a writer that
#: floods the log with undecodable facts gets its first ones filed and the rest only counted,
#: so the bounded dead-letter stream keeps room for everyone else's.
DEAD_PER_WRITER = 50
DEAD_WINDOW_S = 60.0
#: Idle heartbeat of the log's ordered consumers, in seconds. A restarted server has lost them
#: (they live in its memory), and nats-py re-creates one only once two heartbeats went missing,
#: checked every two intervals: at its default of 5 s every service was deaf for 10-20 s after
#: a NATS restart (a job submitted then waited 17.5 s to be placed). At 1 s they resume within
#: 2-4 s. A needless re-creation (the event loop busy for over 2 s) resumes from the next
#: sequence, so nothing is lost or read twice; the cost is one heartbeat a second per reader.
READ_HEARTBEAT_S = 1.0


def _telemetry():
    """gpusched.telemetry (OpenTelemetry), imported when first needed: a CLI that only reads
    never loads it."""
    from gpusched import telemetry

    return telemetry


def _observe(record: Record) -> None:
    """Remember a record's job trace context, in a process that traces (one that imported
    telemetry: every service does at start); a reading CLI has no trace to continue."""
    telemetry = sys.modules.get("gpusched.telemetry")
    if telemetry is not None:
        telemetry.observe(record)


class EventTooLarge(ValueError):
    """An event (with its headers) exceeds `limits.MAX_EVENT_BYTES`: refused before publishing,
    because a message over the server's max_payload makes the server close the connection."""


def check_size(event: Event, payload: bytes, headers: dict[str, str]) -> None:
    size = len(payload) + sum(len(k) + len(v) + 4 for k, v in headers.items())
    if size > limits.MAX_EVENT_BYTES:
        raise EventTooLarge(f"{event.kind} is {size} bytes with headers; at most {limits.MAX_EVENT_BYTES}")


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



class DeadLetterBudget:
    """At most DEAD_PER_WRITER dead letters per writer per DEAD_WINDOW_S (the rest counted and
    said once per window in the log)."""

    def __init__(self, per_writer: int = DEAD_PER_WRITER, window_s: float = DEAD_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        self.per_writer, self.window_s, self.clock = per_writer, window_s, clock
        self.windows: dict[str, tuple[float, int]] = {}
        self.dropped = 0

    def take(self, writer: str) -> bool:
        now = self.clock()
        start, used = self.windows.get(writer, (now, 0))
        if now - start >= self.window_s:
            start, used = now, 0
        if len(self.windows) > 10_000:  # bounded: the writers of one window, at most
            self.windows = {w: v for w, v in self.windows.items() if now - v[0] < self.window_s}
        self.windows[writer] = (start, used + 1)
        if used < self.per_writer:
            return True
        self.dropped += 1
        if used == self.per_writer:
            _log.warning("dead_letters_over_budget", writer=writer, per_window=self.per_writer,
                         window_s=self.window_s)
        return False

@dataclass(frozen=True)
class Record:
    seq: int
    event: Event
    subject: str
    headers: dict[str, str] | None
    time: float | None = None  # the server's store time (epoch seconds): the fold's clock

    @property
    def position(self):
        """Its place in its writer's signed chain (`ClusterState.apply` refuses a copy)."""
        return signing.position(self.subject, self.headers)


@dataclass(frozen=True)
class RawMessage:
    """A stored message as it is, for audits and exports: `time` is the server's store time."""

    seq: int
    subject: str
    headers: dict[str, str] | None
    data: bytes
    time: float


FROM_ENV = object()  # EventLog.open's default signer: whatever `signer_from_env()` finds


class EventLog:
    def __init__(self, nc: NATS, replicas: int | None = None, signer: signing.Signer | None = None):
        self.nc = nc
        #: This writer's key, or None: appends go unsigned.
        self.signer = signer
        self._idle_chains: list[signing.Chain] = []  # a sequential writer keeps reusing one
        self.js: JetStreamContext = nc.jetstream()
        # R3 in a NATS cluster. Given (`up --replicas`, `stream create --replicas`): the streams
        # are created or scaled to it; not given: created at $GPUSCHED_STREAM_REPLICAS (or 1), and
        # an existing stream keeps its count (an admin's CLI must never scale an R3 log down).
        self.replicas_given = replicas is not None
        self.replicas = replicas if replicas is not None else int(os.environ.get("GPUSCHED_STREAM_REPLICAS", "1"))
        self.dead_letters = 0
        self.dead_budget = DeadLetterBudget()

    @classmethod
    async def open(cls, url: str | None = None, name: str = "gpusched", replicas: int | None = None,
                   signer: signing.Signer | None | object = FROM_ENV,
                   creds: str | os.PathLike | None = None) -> EventLog:
        """Connect as `creds` and check the streams exist (an admin connection creates them when
        missing: no other role may change the stream). `signer`: the writer's key (None: unsigned;
        default: `signing.signer_from_env()`, else the seed of the credentials it connects with:
        one identity both authenticates the connection and signs the facts)."""
        if signer is FROM_ENV:
            signer = signing.signer_from_env({k: v for k, v in os.environ.items() if k != "GPUSCHED_CREDS"})
            path = creds_file(creds)
            if signer is None and path:
                signer = signing.Signer.from_seed(signing.seed_from_file(path))
        log = cls(await connect(url, name=name, creds=creds), replicas, signer)  # type: ignore[arg-type]
        try:
            await log.ensure()
        except BaseException:
            await log.nc.close()
            raise
        return log

    async def close(self) -> None:
        await connection.close(self.nc)

    @property
    def identity(self) -> Identity | None:
        return identity_of(self.nc)

    async def ensure(self) -> None:
        """Admin creates or updates the streams; every other role only checks they exist."""
        await streams.ensure(self)

    async def create_streams(self) -> None:
        """Admin: create or update the streams, the snapshot store and the lease bucket (`streams.py`)."""
        await streams.create(self)

    async def set_retention(self, max_age_s: float | None = None, max_msgs: int | None = None,
                            max_bytes: int | None = None) -> StreamConfig:
        """Admin: bound the log by age, count or size (`streams.set_retention`)."""
        return await streams.set_retention(self.js, max_age_s, max_msgs, max_bytes)

    async def first_seq(self) -> int:
        """The oldest sequence still in the stream (> 1 once its head has aged out)."""
        return (await self.js.stream_info(subjects.STREAM)).state.first_seq

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
        payload = encode_fact(event)
        subject = subjects.event_subject(event)
        hdrs = dict(headers or {})
        _telemetry().append_headers(event, hdrs)  # traceparent: the job's trace crosses services here
        hdrs["Nats-Msg-Id"] = msg_id or hashlib.blake2b(payload, digest_size=16).hexdigest()
        if expect_alloc_seq is not None:
            hdrs["Nats-Expected-Last-Subject-Sequence"] = str(expect_alloc_seq)
            hdrs["Nats-Expected-Last-Subject-Sequence-Subject"] = subjects.ALLOC_TREE
        check_size(event, payload, hdrs)
        if self.signer is None:
            return await self._publish(subject, payload, hdrs, expect_alloc_seq)
        chain = self._take_chain()
        try:
            (hdrs[signing.SIG_HEADER],), end = chain.sign([(subject, payload)], expect_alloc_seq)
            ack = await self._signed(chain, lambda: self._publish(subject, payload, hdrs, expect_alloc_seq, raw=True))
            if not ack.duplicate:  # a duplicate stored nothing: the chain did not move
                chain.advance(1, end)
            return ack.seq
        finally:
            self._idle_chains.append(chain)

    def _take_chain(self) -> signing.Chain:
        """A chain no other append is using (the most recently used: one for a sequential writer)."""
        return self._idle_chains.pop() if self._idle_chains else signing.Chain(self.signer)  # type: ignore[arg-type]

    async def _publish(self, subject: str, payload: bytes, hdrs: dict[str, str], expect_alloc_seq: int | None,
                       raw: bool = False):
        try:
            ack = await self.js.publish(subject, payload, headers=hdrs)
        except APIError as err:
            if err.err_code in CAS_REFUSALS and expect_alloc_seq is not None:
                raise Conflict(expect_alloc_seq, err.description or "") from err
            raise
        return ack if raw else ack.seq

    async def _signed(self, chain: signing.Chain, publish):
        """Run a signed publish: a refusal (Conflict, APIError) stored nothing and leaves the
        chain as it was; any other failure leaves it unknown whether the fact is stored, so the
        writer starts a new chain rather than link to it or skip it."""
        try:
            return await publish()
        except (Conflict, APIError):
            raise
        except BaseException:
            chain.rotate()
            raise

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
        if self.signer is None:
            return await self._publish_batch(events, msg_ids, expect_alloc_seq, headers, None)
        chain = self._take_chain()
        try:
            return await self._signed(chain, lambda: self._publish_batch(events, msg_ids, expect_alloc_seq, headers, chain))
        finally:
            self._idle_chains.append(chain)

    async def _publish_batch(self, events: Sequence[Event], msg_ids: Sequence[str | None] | None,
                             expect_alloc_seq: int | None, headers: dict[str, str] | None,
                             chain: signing.Chain | None) -> list[int]:
        batch_id = uuid.uuid4().hex
        last = len(events) - 1
        facts = [(subjects.event_subject(e), encode_fact(e)) for e in events]
        sigs, end = chain.sign(facts, expect_alloc_seq) if chain is not None else ([], "")
        reply = None
        for i, (event, (subject, payload)) in enumerate(zip(events, facts)):
            hdrs = dict(headers or {})
            _telemetry().append_headers(event, hdrs)  # each fact continues its own job's trace
            hdrs["Nats-Batch-Id"], hdrs["Nats-Batch-Sequence"] = batch_id, str(i + 1)
            msg_id = msg_ids[i] if msg_ids else None
            hdrs["Nats-Msg-Id"] = msg_id or hashlib.blake2b(payload, digest_size=16).hexdigest()
            if sigs:
                hdrs[signing.SIG_HEADER] = sigs[i]
            if i == 0 and expect_alloc_seq is not None:
                hdrs["Nats-Expected-Last-Subject-Sequence"] = str(expect_alloc_seq)
                hdrs["Nats-Expected-Last-Subject-Sequence-Subject"] = subjects.ALLOC_TREE
            check_size(event, payload, hdrs)  # before the first publish: a batch is all or nothing
            if i < last:
                await self.nc.publish(subject, payload, headers=hdrs)
            else:
                hdrs["Nats-Batch-Commit"] = "1"
                reply = await self.nc.request(subject, payload, headers=hdrs, timeout=10)
        assert reply is not None, "the last of the two or more facts (append_batch) is sent as a request"
        answer = json.loads(reply.data)
        error = answer.get("error")
        if error:
            if error.get("err_code") in (*CAS_REFUSALS, BATCH_DUPLICATE_MSG_ID) and expect_alloc_seq is not None:
                raise Conflict(expect_alloc_seq or 0, error.get("description", ""))
            raise APIError(**error)
        if chain is not None:
            chain.advance(len(events), end)
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
        async with contextlib.aclosing(self._messages(start, until, follow, subject)) as messages:
            async for msg, seq in messages:
                try:
                    event = decode_event(msg.data)
                    problem = subjects.subject_problem(msg.subject, event)
                except (msgspec.DecodeError, msgspec.ValidationError) as err:
                    problem = str(err)
                if problem is not None:
                    await self.dead_letter(msg.subject, seq, msg.data, problem)
                    if on_dead is not None:
                        on_dead(seq, msg.subject)
                else:
                    record = Record(seq, event, msg.subject, msg.headers, fastpath.stored_at(msg))
                    _observe(record)  # remember the job's trace context
                    yield record

    async def raw(self, start: int = 1, until: int | None = None) -> AsyncIterator[RawMessage]:
        """Stored messages as they are (audit, export): nothing decoded, nothing dead-lettered.
        A deleted message is simply absent: its sequence is skipped."""
        async with contextlib.aclosing(self._messages(start, until, False, subjects.EVENTS)) as messages:
            async for msg, seq in messages:
                yield RawMessage(seq, msg.subject, msg.headers, msg.data, msg.metadata.timestamp.timestamp())

    async def _messages(self, start: int, until: int | None, follow: bool, subject: str):
        """(msg, stream seq) in stream order from `start`, through `until` or the last sequence
        when the call began, or on forever when `follow`. A bounded read that the stream already
        holds ends when nothing matching is left (a filtered `subject`, or a deleted message,
        may have no message at its bound: waiting for one would hang)."""
        tail = None if follow else await self.last_seq()
        stop = None if tail is None else (until if until is not None else tail)
        if stop is not None and stop < start:
            return
        held = stop is not None and tail is not None and stop <= tail  # every message up to `stop` is stored already
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(1, start))
        sub = await self.js.subscribe(
            subject, stream=subjects.STREAM, ordered_consumer=True, config=config, idle_heartbeat=READ_HEARTBEAT_S,
            pending_msgs_limit=0, pending_bytes_limit=0,
        )
        try:
            if held:
                info = await sub.consumer_info()
                if not info.num_pending and not (info.delivered and info.delivered.consumer_seq):
                    return  # nothing matches from `start` on
            reader = fastpath.Reader(sub)
            while True:
                msg = await reader.next()
                seq, pending = fastpath.position(msg)
                if stop is not None and seq > stop:
                    return
                yield msg, seq
                if stop is not None and (seq >= stop or (held and not pending)):
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
        """Keep the bad message, with why, where an operator can read it; once per sequence:
        every reader meets the same bad message, and the dead-letter stream stores only the
        first publish of its subject (the others are refused, quietly). Readers without write
        permissions (auditors) only count it: the writers' readers file it."""
        self.dead_letters += 1
        ident = self.identity
        if ident is not None and ident.role in ("auditor", "tenant", "platform", "node"):
            return  # only the control plane's services file them (nodes may not: a node could flood)
        if not self.dead_budget.take(subjects.writer_of(subject)):
            return
        headers = {"Gpusched-Reason": reason[:1000], "Gpusched-Seq": str(seq), "Nats-Msg-Id": f"dead-{seq}",
                   "Gpusched-Size": str(len(data))}
        try:
            await self.js.publish(subjects.dead_subject(subject, seq), data[:DEAD_MAX_MSG_BYTES - 2048],
                                  headers=headers)
        except APIError as err:  # already dead-lettered (or the stream is full): nothing to add
            if err.err_code not in (DEAD_ALREADY_STORED, DEAD_STREAM_FULL):
                raise

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
                seq = hdrs.get("Gpusched-Seq", "0")
                original = msg.subject.removeprefix(f"gpusched.dead.{seq}.")
                out.append({"seq": int(seq), "subject": "gpusched.dead." + original,
                            "reason": hdrs.get("Gpusched-Reason", ""), "data": msg.data.decode(errors="replace")})
                if msg.metadata.sequence.stream >= last:
                    break
        finally:
            await sub.unsubscribe()
        return out
