"""An event log in memory with the JetStream log's semantics (as eventsourcing's POPO recorder
beside its SQL ones): one sequence for every fact, `Nats-Msg-Id` deduplication (a retried
append returns the stored sequence), compare-and-set over the alloc tree, and atomic batches
(all or none, the check on the first). `tests/integration/test_log_contract.py` holds both
implementations to one suite, so retry and conflict paths are tested in milliseconds and the
simulator can run the real services' composition on it.

Each record carries its store time, as JetStream's do: `clock()` when it was stored, never
earlier than the record before (the simulator passes its virtual clock, so a replay of its log
is the same fold on any machine).

Differences, none visible to a writer: the deduplication window is the log's whole life (not
120 s), and nothing is ever undecodable (events are kept as objects, encoded once to check
they would be).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable, Sequence

from gpusched.core.events import Event, encode_event, encode_fact

from . import subjects
from .log import MAX_BATCH, Conflict, Record


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, `>` the rest (one or more tokens)."""
    pat, sub = pattern.split("."), subject.split(".")
    for i, p in enumerate(pat):
        if p == ">":
            return len(sub) > i
        if i >= len(sub) or (p != "*" and p != sub[i]):
            return False
    return len(pat) == len(sub)


class MemoryEventLog:
    """The `EventLog` interface over a list (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.records_: list[Record] = []
        self.msg_ids: dict[str, int] = {}
        self.alloc_seq = 0
        self.dead_letters = 0
        self._appended = asyncio.Condition()

    @classmethod
    async def open(cls, url: str | None = None, name: str = "gpusched", replicas: int | None = None) -> MemoryEventLog:
        return cls()

    async def ensure(self) -> None:
        return None

    async def close(self) -> None:
        return None

    # --- writing ---------------------------------------------------------------------------

    def _msg_id(self, event: Event, msg_id: str | None) -> str:
        return msg_id or hashlib.blake2b(encode_event(event), digest_size=16).hexdigest()

    def _check(self, expect_alloc_seq: int | None) -> None:
        if expect_alloc_seq is not None and expect_alloc_seq != self.alloc_seq:
            raise Conflict(expect_alloc_seq, f"wrong last sequence: {self.alloc_seq}")

    def _store(self, event: Event, msg_id: str, headers: dict[str, str] | None) -> int:
        seq = len(self.records_) + 1
        subject = subjects.event_subject(event)
        stored = self.clock()
        if self.records_:
            stored = max(stored, self.records_[-1].time or stored)  # store times grow with the sequence
        self.records_.append(Record(seq, event, subject, {**(headers or {}), "Nats-Msg-Id": msg_id}, stored))
        self.msg_ids[msg_id] = seq
        if event.ALLOC:
            self.alloc_seq = seq
        return seq

    async def _notify(self) -> None:
        async with self._appended:
            self._appended.notify_all()

    def append_now(self, event: Event, msg_id: str | None = None, headers: dict[str, str] | None = None) -> int:
        """`append` without compare-and-set and without waking readers: for a caller that owns
        the loop and reads `records_` itself (the simulator's world)."""
        mid = self._msg_id(event, msg_id)
        if mid in self.msg_ids:
            return self.msg_ids[mid]
        return self._store(event, mid, headers)

    async def append(self, event: Event, *, msg_id: str | None = None, expect_alloc_seq: int | None = None,
                     headers: dict[str, str] | None = None) -> int:
        """Append one fact; a repeated message id returns the stored sequence. The
        compare-and-set check comes first, as in JetStream: a retried grant from its old view
        conflicts (the writer catches up and finds its grant in the fold)."""
        encode_fact(event)  # refused before anything, as the real log refuses it before publishing
        self._check(expect_alloc_seq)
        mid = self._msg_id(event, msg_id)
        if mid in self.msg_ids:
            return self.msg_ids[mid]
        seq = self._store(event, mid, headers)
        await self._notify()
        return seq

    async def append_batch(self, events: Sequence[Event], *, msg_ids: Sequence[str | None] | None = None,
                           expect_alloc_seq: int | None = None, headers: dict[str, str] | None = None) -> list[int]:
        """Append up to MAX_BATCH facts atomically: all or none; a stored message id in the
        batch fails it (a `Conflict` under compare-and-set, as JetStream's batch error)."""
        if not events:
            return []
        if len(events) == 1:
            return [await self.append(events[0], msg_id=msg_ids[0] if msg_ids else None,
                                      expect_alloc_seq=expect_alloc_seq, headers=headers)]
        if len(events) > MAX_BATCH:
            raise ValueError(f"an atomic batch holds at most {MAX_BATCH} events, got {len(events)}")
        for event in events:
            encode_fact(event)
        mids = [self._msg_id(e, msg_ids[i] if msg_ids else None) for i, e in enumerate(events)]
        if any(m in self.msg_ids for m in mids) or len(set(mids)) != len(mids):
            if expect_alloc_seq is not None:
                raise Conflict(expect_alloc_seq, "batch repeats a stored message id")
            raise ValueError("an atomic batch repeats a stored message id")
        self._check(expect_alloc_seq)
        seqs = [self._store(e, m, headers) for e, m in zip(events, mids)]
        await self._notify()
        return seqs

    # --- reading ---------------------------------------------------------------------------

    async def last_seq(self) -> int:
        return len(self.records_)

    async def records(self, start: int = 1, until: int | None = None, follow: bool = False,
                      subject: str = subjects.EVENTS,
                      on_dead: Callable[[int, str], None] | None = None) -> AsyncIterator[Record]:
        """Records from `start` matching `subject`; stops at `until` (default: the last sequence
        when the call began) unless `follow`, which waits for new appends."""
        stop = None if follow else (until if until is not None else len(self.records_))
        seq = max(1, start)
        while stop is None or seq <= stop:
            if seq > len(self.records_):
                if stop is not None:
                    return
                async with self._appended:
                    await self._appended.wait_for(lambda: seq <= len(self.records_))
                continue
            rec = self.records_[seq - 1]
            if subject_matches(subject, rec.subject):
                yield rec
            seq += 1

    async def replay(self, start: int = 1, until: int | None = None) -> AsyncIterator[tuple[int, Event]]:
        async for rec in self.records(start, until):
            yield rec.seq, rec.event

    async def dead_letter(self, subject: str, seq: int, data: bytes, reason: str) -> None:
        self.dead_letters += 1

    async def dead_letters_list(self, limit: int = 100) -> list[dict]:
        return []


__all__ = ["MemoryEventLog", "subject_matches"]
