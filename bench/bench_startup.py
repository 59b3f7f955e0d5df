"""Start time of a process against the length of history: the fold from scratch (baseline, what
every service did before snapshots) vs the latest verified snapshot in JetStream plus the tail,
with and without the fold forgetting finished jobs past its horizon; and what the log and the
snapshot cost per job.

For each --events N: writes an N-event stream of realistic churn (1,000 nodes of 8 GPUs; jobs
submitted, granted, started, completed and their processes reported ended, --jobs-per-day of
log time; signed atomic batches of 1,000 as placement appends, --inflight batches pipelined,
each batch holding the whole life of its 200 jobs so that batches may land in any order), then:
- fold (in memory): the same events folded without a horizon (every job kept whole) and with
  the services' horizon (`GPUSCHED_FORGET_AFTER_S`, default 90 days): fold time, jobs kept,
  snapshot bytes (per job, and per job of the whole history);
- scratch: `FoldedLog.start()` (what every service, node agent and the dashboard run at start)
  with no snapshot: the whole stream read and folded (skipped above --scratch-max events: then
  extrapolated from the largest measured rate, and labelled so);
- snapshot + tail: after `SnapshotStore.save` of both folds (sealed in the log) and --tail more
  events (the projector snapshots every 5,000: the worst case), `FoldedLog.start()` once per
  horizon: verified, adopted, tail folded.
Then memory per job in the fold (tracemalloc over --memory-jobs jobs): a finished job kept whole
vs its tombstone.

    python bench/bench_startup.py [--events 200000 2000000] [--tail 5000] [--jobs-per-day 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import tracemalloc

import nats.errors
from nats.js.errors import APIError, NotFoundError

from gpusched.bus import subjects
from gpusched.bus.log import MAX_BATCH, EventLog
from gpusched.bus.servers import start_nats
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.core.state import FORGET_AFTER_S, ClusterState
from gpusched.security.signing import Signer
from gpusched.services.runtime import FoldedLog
from gpusched.store import HORIZON_ENV, SnapshotStore

NODES, GPUS = 1000, 8
JOBS_PER_BATCH = MAX_BATCH // 5


def nodes_batch() -> list[ev.Event]:
    return [ev.NodeRegistered(at=0.0, node=f"n{i:04d}", rack=f"r{i // 32}",
                              gpus=[GpuInfo(index=k, uuid=f"GPU-{i}-{k}") for k in range(GPUS)]) for i in range(NODES)]


def churn_batch(b: int, jobs_per_day: float) -> list[ev.Event]:
    """The whole life of jobs b*200 .. b*200+199, interleaved (all submitted, then granted, ...):
    200 jobs hold GPUs at once, and every GPU is free again at the batch's end."""
    dt = 86400.0 / jobs_per_day
    first = b * JOBS_PER_BATCH
    lives = []
    for job in range(first, first + JOBS_PER_BATCH):
        size = (1, 1, 2, 4, 8)[job % 5]
        slot = (job - first) * 40  # 200 jobs x 40 slots = the 8,000 GPUs, no two jobs share one
        gpus = [f"n{(slot + k) // GPUS:04d}/{(slot + k) % GPUS}" for k in range(size)]
        # ids shaped as admission makes them (`j-` + 8 hex; an odd multiplier keeps them distinct)
        node, jid, t = gpus[0].split("/")[0], f"j-{job * 2654435761 % 2**32:08x}", job * dt
        lives.append((ev.JobSubmitted(at=t, job_id=jid, spec=JobSpec(team=f"t{job % 7}", gpus=size),
                                      request_id=f"r{job}", user="bench"),
                      ev.GpusGranted(at=t, job_id=jid, attempt=1, gpus=gpus),
                      ev.JobStarted(at=t, job_id=jid, attempt=1, node=node, pids=[job]),
                      ev.JobCompleted(at=t + 3600, job_id=jid, attempt=1, node=node),
                      ev.ProcessesEnded(at=t + 3600, job_id=jid, attempt=1, node=node)))
    return [life[i] for i in range(5) for life in lives]


async def build(log: EventLog, first_batch: int, batches: int, jobs_per_day: float, inflight: int) -> list[tuple[int, list]]:
    """Append `batches` churn batches, `inflight` at a time; returns (first seq, events) per batch."""
    landed: list[tuple[int, list]] = []

    async def one(b: int) -> None:
        events = churn_batch(b, jobs_per_day)
        for _ in range(5):
            try:
                landed.append(((await log.append_batch(events))[0], events))
                return
            except (nats.errors.TimeoutError, APIError):  # a loaded server: did it land after all?
                await asyncio.sleep(2)
                try:  # the batch is atomic, and its first fact's subject names its job
                    stored = await log.js.get_last_msg(subjects.STREAM, subjects.event_subject(events[0]))
                except NotFoundError:
                    continue
                landed.append((stored.seq, events))
                return
        raise RuntimeError(f"batch {b} could not be appended")

    for start in range(first_batch, first_batch + batches, inflight):
        await asyncio.gather(*(one(b) for b in range(start, min(first_batch + batches, start + inflight))))
    return landed


def fold_landed(state: ClusterState, landed: list[tuple[int, list]]) -> float:
    """Fold batches in stream order (as a reader of the stream would); returns seconds."""
    t = time.perf_counter()
    for first, events in sorted(landed, key=lambda x: x[0]):
        for i, e in enumerate(events):
            state.apply(e, first + i)
    return time.perf_counter() - t


async def start_once(url: str) -> None:
    """In a fresh process, as a service starts: connect, adopt the snapshot (or not), fold the tail."""
    t = time.perf_counter()
    folded = FoldedLog(await EventLog.open(url, name="bench-startup"))
    await folded.start()
    took = time.perf_counter() - t
    print(json.dumps({"took": took, "seen": folded.seen_seq, "jobs": len(folded.state.jobs)}))
    await folded.close()


async def timed_start(url: str, horizon: str) -> tuple[float, dict]:
    """`FoldedLog.start()` timed inside a fresh process (not this one, which holds the generated
    history and its folds: its garbage collector would slow the start several times)."""
    env = {**os.environ, HORIZON_ENV: horizon}
    proc = await asyncio.create_subprocess_exec(sys.executable, __file__, "--start-only", url, env=env,
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out
    doc = json.loads(out.decode().strip().splitlines()[-1])
    return doc["took"], doc


async def one_size(n: int, tail: int, jobs_per_day: float, inflight: int, scratch_max: int,
                   rate: dict) -> None:
    server = start_nats()
    horizon = os.environ.get(HORIZON_ENV) or str(FORGET_AFTER_S)
    try:
        log = await EventLog.open(server.url, name="bench-startup-build", signer=Signer.generate())
        t = time.perf_counter()
        await log.append_batch(nodes_batch())
        batches = max(1, (n - NODES) // MAX_BATCH)
        landed = await build(log, 0, batches, jobs_per_day, inflight)
        built = time.perf_counter() - t
        last = await log.last_seq()
        jobs = batches * JOBS_PER_BATCH
        days = jobs / jobs_per_day
        print(f"\n== {last} events, {jobs} jobs over {days:.0f} days of log time: written in {built:.0f} s "
              f"({last / built:,.0f} events/s, {inflight} signed batches of {MAX_BATCH} in flight)")
        folds = {}
        for name, h in (("keep every job", None), (f"forget after {float(horizon) / 86400:g} days", float(horizon))):
            state = ClusterState(forget_after_s=h)
            for i, e in enumerate(nodes_batch()):
                state.apply(e, i + 1)
            took = fold_landed(state, landed)
            assert state.last_seq == last and not state.violations(), state.violations()[:3]
            size = len(state.snapshot())
            folds[h] = state
            print(f"fold in memory, {name:24s}: {took:6.1f} s; {len(state.jobs):7d} jobs whole, "
                  f"{len(state.forgotten):7d} tombstones; snapshot {size / 1e6:6.1f} MB = {size / jobs:5.0f} B per job "
                  f"of history")
        if last <= scratch_max:
            scratch, _ = await timed_start(server.url, horizon)
            rate["scratch"] = last / scratch
            scratch_text = f"{scratch:7.1f} s (measured)"
        else:
            scratch = last / rate["scratch"] if rate.get("scratch") else float("nan")
            scratch_text = f"{scratch:7.1f} s (NOT measured: extrapolated at {rate.get('scratch', 0):,.0f} events/s)"
        store = SnapshotStore(log)
        for h in (None, float(horizon)):
            await store.save(folds[h])
        del folds, landed
        tail_batches = max(1, tail // MAX_BATCH)
        await build(log, batches, tail_batches, jobs_per_day, inflight)
        size = (await log.js.stream_info(subjects.STREAM)).state
        print(f"stream: {size.bytes / 1e6:.0f} MB, {size.bytes / size.messages:.0f} B per event, "
              f"{size.bytes / (jobs + tail_batches * JOBS_PER_BATCH):.0f} B per job (5 facts, signed batches)")
        print(f"scratch start (fold {last} events, horizon {horizon} s): {scratch_text}")
        for label, h in (("keep every job", "none"), ("forget past the horizon", horizon)):
            warm, doc = await timed_start(server.url, h)
            assert doc["seen"] == await log.last_seq()
            print(f"snapshot + {tail_batches * MAX_BATCH}-event tail, {label:24s}: {warm:6.1f} s  "
                  f"(scratch / this: {scratch / warm:5.1f}x; {doc['jobs']} jobs whole)")
        await log.close()
    finally:
        os.environ.pop(HORIZON_ENV, None)
        server.stop()


def memory_per_job(jobs: int) -> None:
    """Bytes of Python heap per finished job: kept whole, forgotten (its tombstone), retired (its
    id only, past the second horizon: `RETIRE_AFTER_HORIZONS` horizons after it ended)."""
    landed = [(1 + NODES + b * MAX_BATCH, churn_batch(b, 1000.0)) for b in range(jobs // JOBS_PER_BATCH)]
    # forgotten: a horizon far longer than the jobs' spread (days), then a clock past one horizon and
    # not past the second, so every job is a tombstone; retired: a 1 s horizon, so jobs retire as
    # the log goes on (as in a long-lived fold: the dicts never hold every tombstone at once)
    horizon = 1e9
    heap = {}
    for name, h, later in (("kept whole", None, 1e12), ("forgotten", horizon, 2 * horizon), ("retired", 1.0, 1e12)):
        state = ClusterState(forget_after_s=h)
        for i, e in enumerate(nodes_batch()):
            state.apply(e, i + 1)
        empty = len(state.snapshot())  # the nodes and GPUs: not a per-job cost
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        fold_landed(state, landed)
        at = later if name != "forgotten" else state.now + later  # past one horizon, not past the second
        state.apply(ev.PlacementRecovered(at=at), landed[-1][0] + MAX_BATCH)
        heap[name] = (tracemalloc.get_traced_memory()[0] - before) / jobs
        tracemalloc.stop()
        print(f"memory per finished job, {name:10s}: {heap[name]:5.0f} B ({len(state.jobs)} whole, "
              f"{len(state.forgotten)} tombstones, {len(state.retired)} retired ids); "
              f"snapshot {(len(state.snapshot()) - empty) / jobs:5.0f} B per job")
    print(f"forgetting saves {heap['kept whole'] - heap['forgotten']:.0f} B per job "
          f"({heap['kept whole'] / heap['forgotten']:.1f}x less); retiring leaves {heap['retired']:.0f} B per job")


async def main(a) -> None:
    rate: dict = {}
    for n in a.events:
        await one_size(n, a.tail, a.jobs_per_day, a.inflight, a.scratch_max, rate)
    if a.memory_jobs:
        memory_per_job(a.memory_jobs)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, nargs="+", default=[200_000], help="log lengths to measure")
    ap.add_argument("--tail", type=int, default=5000, help="events after the snapshot")
    ap.add_argument("--jobs-per-day", type=float, default=1000.0, help="log time: jobs submitted per day")
    ap.add_argument("--inflight", type=int, default=4, help="signed atomic batches appended at once")
    ap.add_argument("--scratch-max", type=int, default=10**9, help="measure the scratch start only up to this")
    ap.add_argument("--memory-jobs", type=int, default=20000, help="jobs for the memory-per-job figure (0: skip)")
    ap.add_argument("--start-only", metavar="URL", help=argparse.SUPPRESS)
    a = ap.parse_args()
    asyncio.run(start_once(a.start_only) if a.start_only else main(a))
