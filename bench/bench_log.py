"""Benchmarks of the log, each printed as a ratio against a baseline measured in the same run.

1. Replay: events/s of a `ClusterState` rebuild from an N-event stream (fetch + decode + fold)
   ÷ the raw JetStream fetch rate of the same stream (fetch only). Target >= 0.5.
2. Grants: compare-and-set grant appends/s by 4 concurrent writers (each with its own live fold,
   catching up on conflict) ÷ plain publish-ack appends/s by 4 concurrent writers; once with one
   grant per cycle (the worst case) and once with 64 (a placement cycle's atomic batch).

    python bench/bench_log.py [--events 200000] [--grants 4000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from nats.js.api import ConsumerConfig, DeliverPolicy

from gpusched.bus import subjects
from gpusched.bus.cas import append_cas
from gpusched.bus.log import EventLog
from gpusched.bus.servers import start_nats
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.core.state import ClusterState
from gpusched.services.runtime import FoldedLog


def synthetic_log(n_events: int, nodes: int = 1000, gpus_per_node: int = 8):
    """A realistic mix: node registrations, then jobs cycling submit -> grant -> start -> complete."""
    for i in range(nodes):
        yield ev.NodeRegistered(at=0.0, node=f"n{i:04d}", rack=f"r{i // 32}",
                                gpus=[GpuInfo(index=k, uuid=f"GPU-{i}-{k}") for k in range(gpus_per_node)])
    emitted, job, t = nodes, 0, 1.0
    slots = [f"n{i:04d}/{k}" for i in range(nodes) for k in range(gpus_per_node)]
    while emitted < n_events:
        size = (1, 1, 2, 4, 8)[job % 5]
        gpus = [slots[(job * 8 + k) % len(slots)] for k in range(size)]
        jid = f"j{job}"
        for e in (ev.JobSubmitted(at=t, job_id=jid, spec=JobSpec(team=f"t{job % 7}", gpus=size)),
                  ev.GpusGranted(at=t, job_id=jid, attempt=1, gpus=gpus),
                  ev.JobStarted(at=t, job_id=jid, attempt=1, node=gpus[0].split("/")[0], pids=[job]),
                  ev.JobCompleted(at=t + 1, job_id=jid, attempt=1, node=gpus[0].split("/")[0])):
            yield e
            emitted += 1
        job, t = job + 1, t + 1


async def fill(log: EventLog, n_events: int) -> None:
    batch: list = []
    for e in synthetic_log(n_events):
        batch.append(log.js.publish(subjects.event_subject(e), ev.encode_event(e)))
        if len(batch) == 2000:
            await asyncio.gather(*batch)
            batch = []
    if batch:
        await asyncio.gather(*batch)


async def raw_fetch(log: EventLog, last: int) -> float:
    config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=1)
    sub = await log.js.subscribe(subjects.EVENTS, stream=subjects.STREAM, ordered_consumer=True, config=config,
                                 pending_msgs_limit=0, pending_bytes_limit=0)
    t0 = time.perf_counter()
    while True:
        msg = await sub.next_msg(timeout=None)
        if msg.metadata.sequence.stream >= last:
            break
    elapsed = time.perf_counter() - t0
    await sub.unsubscribe()
    return elapsed


async def fold_replay(log: EventLog) -> tuple[float, ClusterState]:
    state = ClusterState()
    t0 = time.perf_counter()
    async for seq, e in log.replay():
        state.apply(e, seq)
    return time.perf_counter() - t0, state


async def bench_replay(url: str, n_events: int) -> dict:
    log = await EventLog.open(url)
    await fill(log, n_events)
    last = await log.last_seq()
    raw = min([await raw_fetch(log, last) for _ in range(2)])
    fold_runs = [await fold_replay(log) for _ in range(2)]
    folded, state = min(fold_runs, key=lambda r: r[0])
    assert state.violations() == [] and state.last_seq == last
    await log.close()
    return {"events": last, "raw_per_s": last / raw, "fold_per_s": last / folded, "ratio": raw / folded}


async def bench_grants(url: str, n_grants: int, writers: int = 4, per_cycle: int = 1) -> dict:
    setup = await EventLog.open(url)
    nodes = max(1, n_grants // 8 + 1)
    for i in range(nodes):
        await setup.append(ev.NodeRegistered(at=0.0, node=f"c{per_cycle}g{i:04d}", rack="r0",
                                             gpus=[GpuInfo(index=k, uuid=f"G-{i}-{k}") for k in range(8)]))
    per_writer = n_grants // writers
    await asyncio.gather(*(setup.append(ev.JobSubmitted(at=1, job_id=f"c{per_cycle}w{w}j{k}", spec=JobSpec(team="a", gpus=1)))
                           for w in range(writers) for k in range(per_writer)))
    folds = [FoldedLog(await EventLog.open(url, name=f"writer-{w}")) for w in range(writers)]
    for f in folds:
        await f.start()
    conflicts = [0] * writers

    async def writer(w: int) -> None:
        """One placement writer: each cycle grants up to `per_cycle` of its jobs in one batch."""
        folded = folds[w]
        for first in range(0, per_writer, per_cycle):
            jobs = [f"c{per_cycle}w{w}j{k}" for k in range(first, min(first + per_cycle, per_writer))]
            while True:
                free = [g for n in folded.state.nodes.values() for g in n.free][: len(jobs)]
                grants = [ev.GpusGranted(at=2, job_id=j, attempt=1, gpus=[g]) for j, g in zip(jobs, free)]
                appended, conflicted = await append_cas(folded, grants)
                if appended:
                    break
                conflicts[w] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(writer(w) for w in range(writers)))
    cas_s = time.perf_counter() - t0

    async def plain(w: int) -> None:
        e = ev.JobPending(at=3, job_id=f"c{per_cycle}w{w}", reason="benchmark baseline")
        for k in range(per_writer):
            await setup.append(e, msg_id=f"plain-{per_cycle}-{w}-{k}")

    t0 = time.perf_counter()
    await asyncio.gather(*(plain(w) for w in range(writers)))
    plain_s = time.perf_counter() - t0
    for f in folds:
        await f.catch_up()
        assert f.state.violations() == []
        await f.stop()
        await f.log.close()
    await setup.close()
    total = per_writer * writers
    return {"grants": total, "cas_per_s": total / cas_s, "plain_per_s": total / plain_s,
            "ratio": plain_s / cas_s, "conflicts": sum(conflicts)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--grants", type=int, default=4000)
    parser.add_argument("--quick", action="store_true", help="20k events, 1k grants")
    args = parser.parse_args()
    if args.quick:
        args.events, args.grants = 20_000, 1000
    # as deployed: authentication on, the streams made by admin, the writers as admin
    import os
    import tempfile

    from gpusched.security.bootstrap import create_streams_sync
    from gpusched.security.trust import TrustStore

    trust = TrustStore(tempfile.mkdtemp(prefix="bench-trust-"))
    trust.ensure_stack()
    os.environ["GPUSCHED_CREDS"] = str(trust.creds("admin"))
    server = start_nats(trust=trust)
    create_streams_sync(server.url, trust.creds("admin"))
    try:
        r = await bench_replay(server.url, args.events)
        print(f"replay  {r['events']:>8} events  raw fetch {r['raw_per_s']:>9,.0f}/s  "
              f"fold {r['fold_per_s']:>9,.0f}/s  ratio {r['ratio']:.2f}  (target >= 0.5)")
        for per_cycle in (1, 64):
            g = await bench_grants(server.url, args.grants, per_cycle=per_cycle)
            print(f"grants  {g['grants']:>8} grants  plain publish-ack {g['plain_per_s']:>8,.0f}/s  "
                  f"CAS {g['cas_per_s']:>8,.0f}/s  ratio {g['ratio']:.2f}  conflicts {g['conflicts']:>5}  "
                  f"(4 writers, {per_cycle} grants per cycle)")
    finally:
        server.stop()
        import shutil

        shutil.rmtree(trust.dir, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
