"""Start time of a process against the length of history: the fold from scratch (baseline, what
every service did before) vs the latest verified snapshot in JetStream plus the tail, and what
the log costs in bytes per job.

For each --events N: builds an N-event stream (the realistic mix of bench_log.py, appended in
signed atomic batches of 1000 as placement appends), then measures `FoldedLog.start()` (what
every service, node agent and the dashboard run at start):
- scratch: no snapshot, the whole log folded;
- snapshot+tail: after `SnapshotStore.save` at seq N and --tail more events (the projector
  snapshots every 5000 events, so 5000 is the worst case), verified and adopted, tail folded.
Prints each time, the ratio scratch / snapshot+tail, the snapshot's size and the stream's bytes
per job. Then --single-jobs jobs appended one fact per append (each signed, as admission and the
node agents append): the upper bound of bytes per job.

    python bench/bench_startup.py [--events 200000] [--tail 5000] [--single-jobs 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench_log import synthetic_log

from gpusched.bus import subjects
from gpusched.bus.log import MAX_BATCH, EventLog
from gpusched.bus.servers import start_nats
from gpusched.core import events as ev
from gpusched.security.signing import Signer
from gpusched.services.runtime import FoldedLog
from gpusched.store import SnapshotStore, fold_log


async def append_all(log: EventLog, events, batched: bool = True) -> None:
    batch: list = []
    for e in events:
        if not batched:
            await log.append(e)
            continue
        batch.append(e)
        if len(batch) == MAX_BATCH:
            await log.append_batch(batch)
            batch = []
    if batch:
        await log.append_batch(batch)


async def timed_start(url: str) -> tuple[float, int]:
    t = time.perf_counter()
    folded = FoldedLog(await EventLog.open(url, name="bench-startup"))
    await folded.start()
    took = time.perf_counter() - t
    seen = folded.seen_seq
    await folded.close()
    return took, seen


async def stream_bytes(log: EventLog) -> tuple[int, int]:
    info = await log.js.stream_info(subjects.STREAM)
    return info.state.bytes, info.state.messages


async def one_size(n: int, tail: int) -> None:
    server = start_nats()
    try:
        log = await EventLog.open(server.url, name="bench-startup-build", signer=Signer.generate())
        t = time.perf_counter()
        events = list(synthetic_log(n + tail))
        await append_all(log, events[:n])
        print(f"\n== {n} events (built in {time.perf_counter() - t:.0f}s)")
        scratch, _ = await timed_start(server.url)
        state = await fold_log(log)
        meta = await SnapshotStore(log).save(state)
        snap_bytes = len(state.snapshot())
        await append_all(log, events[n:])
        warm, seen = await timed_start(server.url)
        assert seen == await log.last_seq()
        size, msgs = await stream_bytes(log)
        jobs = sum(1 for e in events if isinstance(e, ev.JobSubmitted))
        print(f"scratch (fold {n} events):            {scratch:7.2f} s")
        print(f"snapshot (seq {meta.seq}) + tail of {tail}: {warm:7.2f} s   ratio scratch/snapshot+tail: "
              f"{scratch / warm:.1f}x")
        print(f"snapshot: {snap_bytes / 1e6:.1f} MB for {len(state.jobs)} jobs, {len(state.nodes)} nodes")
        print(f"stream: {size / 1e6:.1f} MB for {msgs} messages, {jobs} jobs: {size / msgs:.0f} B/event, "
              f"{size / jobs:.0f} B/job (batched appends)")
        await log.close()
    finally:
        server.stop()


async def single_appends(jobs: int) -> None:
    server = start_nats()
    try:
        log = await EventLog.open(server.url, name="bench-startup-single", signer=Signer.generate())
        before, _ = await stream_bytes(log)
        events = [e for e in synthetic_log(1000 + 4 * jobs) if not isinstance(e, ev.NodeRegistered)]
        await append_all(log, events, batched=False)
        size, msgs = await stream_bytes(log)
        print(f"\n== {jobs} jobs, one signed append per fact: {(size - before) / msgs:.0f} B/event, "
              f"{(size - before) / jobs:.0f} B/job")
        await log.close()
    finally:
        server.stop()


async def main(sizes: list[int], tail: int, single_jobs: int) -> None:
    for n in sizes:
        await one_size(n, tail)
    if single_jobs:
        await single_appends(single_jobs)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, nargs="+", default=[200_000], help="log lengths to measure")
    ap.add_argument("--tail", type=int, default=5000, help="events after the snapshot")
    ap.add_argument("--single-jobs", type=int, default=2000, help="jobs for the one-append-per-fact bytes figure")
    a = ap.parse_args()
    asyncio.run(main(a.events, a.tail, a.single_jobs))
