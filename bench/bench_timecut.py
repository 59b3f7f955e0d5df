"""Time travel on a long log: how fast `--at TIME` finds where to cut, against the old way.

Builds an N-event stream (the realistic mix of bench_log.py), noting the wall time after half of
it, then measures (median of --repeat runs):
- cut: `EventLog.seq_at_time(T)` (one JetStream message get by start time), and
- baseline: scanning the stream from the start until the first event whose `at` is past T (what
  `replay --until TIME` did before; also wrong, since `at` is not monotonic in the log),
- and the whole `gpusched jobs --at T` path: the cut plus the fold of the log up to it.
Prints each time and the ratio baseline / cut.

    python bench/bench_timecut.py [--events 100000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench_log import synthetic_log

from gpusched.bus.log import MAX_BATCH, EventLog
from gpusched.bus.servers import start_nats
from gpusched.core.state import ClusterState
from gpusched.services.projector import fold_log


async def build(url: str, n: int) -> tuple[float, float]:
    """Append n events with wall-clock `at`; returns (a wall time at the half, the `at` then)."""
    log = await EventLog.open(url, name="bench-timecut")
    batch, mark, mark_at, count = [], 0.0, 0.0, 0
    t0 = time.time()
    for e in synthetic_log(n):
        batch.append(e)
        if len(batch) == MAX_BATCH:
            await log.append_batch(batch)
            count += len(batch)
            batch = []
            if not mark and count >= n // 2:
                await asyncio.sleep(0.05)
                mark, mark_at = time.time(), e.at
                await asyncio.sleep(0.05)
    if batch:
        await log.append_batch(batch)
    await log.close()
    print(f"built {n} events in {time.time() - t0:.1f}s")
    return mark, mark_at


async def scan_until_at(log: EventLog, at: float) -> int:
    last = 0
    async for rec in log.records(1):
        if rec.event.at > at:
            break
        last = rec.seq
    return last


async def main(n: int, repeat: int) -> None:
    server = start_nats()
    try:
        mark, mark_at = await build(server.url, n)
        log = await EventLog.open(server.url, name="bench-timecut-read")
        cut_s, scan_s, fold_s = [], [], []
        for _ in range(repeat):
            t = time.perf_counter()
            seq = await log.seq_at_time(mark)
            cut_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            await scan_until_at(log, mark_at)
            scan_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            state = await fold_log(log, ClusterState(), until=await log.seq_at_time(mark))
            fold_s.append(time.perf_counter() - t)
        await log.close()
        cut, scan, fold = (statistics.median(x) for x in (cut_s, scan_s, fold_s))
        print(f"log: {n} events; cut at seq {seq} (half: {n // 2})")
        print(f"cut (seq_at_time, message get by start time): {cut * 1000:.2f} ms")
        print(f"baseline (scan until the first `at` past T):   {scan * 1000:.0f} ms   ratio baseline/cut: {scan / cut:.0f}x")
        print(f"jobs --at T (cut + fold of {state.last_seq} events): {fold * 1000:.0f} ms")
    finally:
        server.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=100_000, help="events in the log")
    ap.add_argument("--repeat", type=int, default=5, help="runs per measurement (median)")
    a = ap.parse_args()
    asyncio.run(main(a.events, a.repeat))
