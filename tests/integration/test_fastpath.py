"""The log's read path through `bus.fastpath` (cheaper header parse, queued messages taken
without nats-py's per-call task) reads what nats-py's own path reads, in order, live too."""

from __future__ import annotations

import asyncio

from gpusched.bus import fastpath, subjects
from gpusched.bus.log import EventLog, connect
from gpusched.core import events as ev
from gpusched.security import signing


def _completions(n: int, start: int = 0) -> list[ev.Event]:
    return [ev.JobCompleted(at=1.0, job_id=f"j-{i:06d}", attempt=1) for i in range(start, start + n)]


async def test_a_long_read_is_whole_in_order_with_the_headers_nats_py_parses(nats_url):
    log = await EventLog.open(nats_url, signer=signing.Signer.from_seed(signing.new_seed()))
    try:
        assert log.nc._parse_header_lines is fastpath.parse_header_lines
        events = _completions(3000)
        for i in range(0, len(events), 1000):  # more than one flow-control window of the consumer
            await log.append_batch(events[i:i + 1000], headers={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})
        records = [r async for r in log.records()]
        assert [r.seq for r in records] == list(range(1, 3001))
        assert [r.event for r in records] == events
        # each record's headers are what nats-py's own parser makes of the stored header block
        plain = await connect(nats_url, name="plain")
        del plain._parse_header_lines  # back to nats-py's own
        try:
            sub = await plain.jetstream().subscribe(subjects.EVENTS, stream=subjects.STREAM, ordered_consumer=True)
            for rec in records[:50]:
                raw = await sub.next_msg(timeout=5)
                assert rec.headers == raw.headers and rec.seq == raw.metadata.sequence.stream
        finally:
            await plain.close()
        assert signing.SIG_HEADER in records[0].headers and "Nats-Msg-Id" in records[0].headers
        assert records[0].headers["traceparent"].startswith("00-aaaa")
    finally:
        await log.close()


async def test_following_reads_live_appends_in_order(nats_url):
    reader = await EventLog.open(nats_url, name="reader")
    writer = await EventLog.open(nats_url, name="writer")
    seen: list[int] = []
    done = asyncio.Event()

    async def follow() -> None:
        async for rec in reader.records(1, follow=True):
            seen.append(rec.seq)
            if len(seen) == 1500:
                done.set()
                return

    task = asyncio.create_task(follow())
    try:
        for i in range(0, 1500, 500):
            await writer.append_batch(_completions(500, i))
            await asyncio.sleep(0.05)
        await asyncio.wait_for(done.wait(), 20)
        assert seen == list(range(1, 1501))
    finally:
        task.cancel()
        await reader.close()
        await writer.close()
