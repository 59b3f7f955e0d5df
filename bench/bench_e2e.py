"""End-to-end control plane throughput and latency through JetStream, against the raw
publish-ack rate measured in the same run. Targets: >= 2,000 grants/s, submit->granted p99 < 50 ms.

    python bench/bench_e2e.py            # 1,000 nodes x 8 GPUs, backlog of 20,000 jobs
    python bench/bench_e2e.py --quick    # 100 nodes x 8 GPUs, backlog of 2,000 jobs (a smoke run)

Real nats-server and redis-server, admission and placement as their own processes (policy
`full`, the live default). Nodes are registered directly in the log (no node daemons: 1,000 of
them would measure the daemons, not the control plane); nothing completes, so grants are counted
while the cluster fills with the backlog still waiting behind.

1. raw: sequential publish-acks/s (one in flight: what a compare-and-set chain can do at best)
   and pipelined publish-acks/s (256 in flight), on a scratch stream of the same server.
2. latency: with free capacity, single-GPU jobs submitted through admission one at a time at a
   modest rate; latency = the grant's arrival at a log subscriber minus the submit's send time.
3. throughput: placement stopped, the backlog submitted through admission (pipelined: that is
   admission's submit rate), placement started; grants/s from its first grant until the cluster
   is full, by the server's store times (its replay of the log at start is reported apart, and
   the rate including the first cycle's decision time too).
4. churn: completions offered open-loop at `--churn-rate`; grants/s sustained from the backlog.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import msgspec
from nats.js.api import StorageType, StreamConfig

from gpusched.bus.client import Client
from gpusched.bus.log import EventLog
from gpusched.bus.servers import start_nats, start_redis
from gpusched.cli.stack import simulated_nodes, spawn_service, stop_processes
from gpusched.core import events as ev
from gpusched.core.commands import SubmitJob
from gpusched.core.model import JobSpec

SIZES = [1, 1, 1, 1, 2, 2, 4, 8]  # mean 2.5 GPUs


async def raw_rates(log: EventLog, n: int) -> tuple[float, float]:
    js = log.js
    await js.add_stream(StreamConfig(name="BENCH_RAW", subjects=["bench.raw.>"], storage=StorageType.FILE))
    payload = msgspec.json.encode(ev.GpusGranted(at=time.time(), job_id="j-00000000", attempt=1,
                                                 gpus=[f"node0000/{i}" for i in range(2)]))
    t = time.perf_counter()
    for i in range(n):
        await js.publish("bench.raw.seq", payload, headers={"Nats-Msg-Id": f"s{i}"})
    seq_rate = n / (time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(0, n, 256):
        await asyncio.gather(*(js.publish("bench.raw.pipe", payload, headers={"Nats-Msg-Id": f"p{j}"})
                               for j in range(i, min(n, i + 256))))
    pipe_rate = n / (time.perf_counter() - t)
    await js.delete_stream("BENCH_RAW")
    return seq_rate, pipe_rate


class GrantWatch:
    """Arrival time of every grant, from a live subscription to the log's grant subjects."""

    def __init__(self, log: EventLog):
        self.log = log
        self.at: dict[str, float] = {}  # job -> arrival here (perf_counter)
        self.stored: dict[str, float] = {}  # job -> the server's store time (unix)
        self.changed = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        sub = await self.log.js.subscribe("gpusched.evt.alloc.GpusGranted.>", ordered_consumer=True,
                                          pending_msgs_limit=0, pending_bytes_limit=0)

        async def run() -> None:
            while True:
                msg = await sub.next_msg(timeout=None)
                e = ev.decode_event(msg.data)
                self.at.setdefault(e.job_id, time.perf_counter())
                self.stored.setdefault(e.job_id, msg.metadata.timestamp.timestamp())
                self.changed.set()

        self.task = asyncio.create_task(run())

    async def wait_count(self, n: int, timeout: float) -> bool:
        deadline = time.perf_counter() + timeout
        while len(self.at) < n:
            self.changed.clear()
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self.changed.wait(), min(left, 1.0))
            except TimeoutError:
                pass
        return True


async def churn(log: EventLog, watch: GrantWatch, exclude: set[str], seconds: float, rate: float,
                placement_log: Path) -> None:
    """Sustained load, open loop: the node daemons' JobCompleted arrive at `rate` per second (in
    atomic batches every 50 ms, oldest grants first, as long as jobs are running), independent of
    placement; placement must keep granting from the backlog to keep up. Reports grants/s
    stored during the window and placement's conflicted rounds."""
    done: set[str] = set(exclude)
    queue: list[str] = []
    t0 = time.time()
    t_end = t0 + seconds
    before = set(watch.stored)
    text0 = placement_log.read_text()
    completed = 0
    tick = 0.05
    next_t = time.perf_counter()
    queued: set[str] = set()
    seen = 0
    order: list[str] = []
    while time.time() < t_end:
        if len(watch.stored) != seen:  # dicts keep arrival order: take the new grants only
            order = list(watch.stored)
            fresh = [j for j in order[seen:] if j not in done and j not in queued]
            seen = len(order)
            queue.extend(fresh)
            queued.update(fresh)
        n = min(len(queue), int(rate * tick))
        if n:
            chunk, queue[:] = queue[:n], queue[n:]
            now = time.time()
            for i in range(0, n, 1000):
                await log.append_batch([ev.JobCompleted(at=now, job_id=j, attempt=1) for j in chunk[i:i + 1000]])
            done.update(chunk)
            completed += n
        next_t += tick
        await asyncio.sleep(max(0.0, next_t - time.perf_counter()))
    new = [t for j, t in watch.stored.items() if j not in before and t0 <= t <= t_end]
    text = placement_log.read_text()[len(text0):]
    rounds = text.count('"placement_round"')
    conflicts = text.count('"conflicted": true')
    print(f"churn {seconds:g} s, completions offered at {rate:g}/s: {completed / seconds:.0f} completions/s appended, "
          f"{len(new) / seconds:.0f} grants/s sustained (placement rounds >= 100 events: {rounds}, "
          f"conflicted after rebasing: {conflicts})")


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


async def wait_ready(path: Path, service: str, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while f'"{service}_ready"' not in path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"{service} did not start:\n{path.read_text()[-2000:]}")
        await asyncio.sleep(0.05)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100 nodes, 2,000 jobs")
    ap.add_argument("--nodes", type=int, default=None)
    ap.add_argument("--backlog", type=int, default=None)
    ap.add_argument("--latency-jobs", type=int, default=300)
    ap.add_argument("--latency-rate", type=float, default=100.0, help="submits/s during the latency phase")
    ap.add_argument("--churn-s", type=float, default=10.0, help="sustained phase with completions (0: skip)")
    ap.add_argument("--churn-rate", type=float, default=2500.0, help="completions/s offered in the churn phase")
    ap.add_argument("--placement-log-level", default="info", help="debug: one line per decision round")
    ap.add_argument("--raw", type=int, default=5000, help="messages for the raw publish-ack rates")
    ap.add_argument("--signed", action="store_true",
                    help="admission and placement sign their appends (compare a run without: bench_sign.py)")
    args = ap.parse_args()
    from gpusched.security.signing import new_seed

    env = {name: ({"GPUSCHED_SIGNING_SEED": new_seed().decode()} if args.signed else {})
           for name in ("admission", "placement")}
    nodes = args.nodes or (100 if args.quick else 1000)
    backlog = args.backlog or (2000 if args.quick else 20000)
    gpus = nodes * 8
    work = Path(tempfile.mkdtemp(prefix="gpusched-bench-"))
    # as deployed: authentication on, each service as its own identity, this process as admin
    import os

    from gpusched.security.bootstrap import create_streams_sync
    from gpusched.security.trust import TrustStore

    trust = TrustStore(tempfile.mkdtemp(prefix="bench-trust-"))
    trust.ensure_stack()
    os.environ["GPUSCHED_CREDS"] = str(trust.creds("admin"))
    os.environ["GPUSCHED_IDENTITY_DIR"] = str(trust.ids)
    nats, redis = start_nats(trust=trust), start_redis()
    create_streams_sync(nats.url, trust.creds("admin"))
    procs = []
    try:
        log = await EventLog.open(nats.url, name="bench")
        seq_rate, pipe_rate = await raw_rates(log, args.raw)
        print(f"cluster {nodes} nodes x 8 GPUs = {gpus} GPUs; backlog {backlog} jobs; policy full; "
              f"{'signed' if args.signed else 'unsigned'} appends")
        print(f"raw publish-ack: sequential {seq_rate:8.0f}/s   pipelined(256) {pipe_rate:8.0f}/s")

        regs = simulated_nodes(nodes, 8, 16, "all")
        for i in range(0, len(regs), 256):
            await asyncio.gather(*(log.append(e, msg_id=f"register-{e.node}") for e in regs[i:i + 256]))

        adm = spawn_service("admission", nats.url, redis.url, ["--placeholders", "any"], log_path=work / "admission.log", env=env["admission"])
        plc = spawn_service("placement", nats.url, redis.url, [], log_path=work / "placement.log", env=env["placement"])
        procs += [adm, plc]
        await wait_ready(work / "admission.log", "admission", adm)
        await wait_ready(work / "placement.log", "placement", plc)
        client = await Client.connect(nats.url, timeout=30)
        watch = GrantWatch(log)
        await watch.start()

        # --- latency with free capacity ------------------------------------------------------
        await asyncio.sleep(1.0)  # the lease is taken, the first cycle ran
        sent: dict[str, float] = {}
        interval = 1.0 / args.latency_rate
        t_next = time.perf_counter()
        for i in range(args.latency_jobs):
            t_next += interval
            t0 = time.perf_counter()
            reply = await client.submit(JobSpec(team=f"t{i % 4}", gpus=1), request_id=f"lat-{i}")
            assert reply.ok, reply.error
            sent[reply.job_id] = t0
            await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
        await watch.wait_count(len(sent), 30)
        lat = [(watch.at[j] - t) * 1000 for j, t in sent.items() if j in watch.at]
        print(f"submit->granted ({len(lat)} jobs at {args.latency_rate:g}/s, free capacity): "
              f"p50 {pct(lat, 50):.1f} ms  p99 {pct(lat, 99):.1f} ms  max {max(lat):.1f} ms   (target p99 < 50 ms)")

        # --- throughput with a backlog -------------------------------------------------------
        stop_processes([plc])
        procs.remove(plc)
        rng = random.Random(1)
        specs = [JobSpec(team=f"t{i % 8}", gpus=rng.choice(SIZES)) for i in range(backlog)]
        t0 = time.perf_counter()
        for i in range(0, backlog, 256):
            replies = await asyncio.gather(*(client.send(SubmitJob(request_id=f"bl-{j}", spec=specs[j]))
                                             for j in range(i, min(backlog, i + 256))))
            assert all(r.ok for r in replies), [r.error for r in replies if not r.ok][:3]
        submit_s = time.perf_counter() - t0
        print(f"admission: {backlog} submits in {submit_s:.2f} s = {backlog / submit_s:.0f} submits/s (256 in flight)")

        base = len(watch.at)
        free = gpus - args.latency_jobs
        fits, used = 0, 0
        for s in specs:  # what first-fit in order would grant; topology may pack differently
            if used + s.gpus <= free:
                used += s.gpus
                fits += 1
        t_start = time.perf_counter()
        plc = spawn_service("placement", nats.url, redis.url, ["--log-level", args.placement_log_level],
                            log_path=work / "placement2.log", env=env["placement"])
        procs.append(plc)
        await wait_ready(work / "placement2.log", "placement", plc)
        ready_s = time.perf_counter() - t_start
        ready_unix = time.time()
        await watch.wait_count(base + 1, 120)
        # until the grants stop coming (the cluster is full or nothing else fits)
        last_n, stable_since = len(watch.at), time.perf_counter()
        while time.perf_counter() - stable_since < 3.0:
            await asyncio.sleep(0.25)
            if len(watch.at) != last_n:
                last_n, stable_since = len(watch.at), time.perf_counter()
        backlog_jobs = [j for j in watch.stored if j not in sent]
        granted = len(backlog_jobs)
        stored = sorted(watch.stored[j] for j in backlog_jobs)
        span = max(1e-9, stored[-1] - stored[0])
        rate = granted / span
        first = min(watch.at[j] for j in backlog_jobs)
        print(f"placement start (process + replay of {await log.last_seq()} events): {ready_s:.2f} s; "
              f"first grant {first - t_start:.2f} s after start")
        print(f"grants: {granted} (first-fit estimate {fits}) stored in {span:.3f} s = {rate:.0f} grants/s   "
              f"(target >= 2,000/s; server store times)")
        whole = granted / max(1e-9, stored[-1] - ready_unix)
        print(f"  with the first cycle's decision time ({backlog}-job order, reasons): {granted} grants in "
              f"{stored[-1] - ready_unix:.2f} s after ready = {whole:.0f} grants/s")
        print(f"ratio to raw sequential publish-ack: {rate / seq_rate:.2f}   to pipelined: {rate / pipe_rate:.2f}")
        for line in (work / "placement2.log").read_text().splitlines():
            if '"placement_round"' in line:
                r = msgspec.json.decode(line)
                print(f"  placement round: {r['appended']} events in {r['seconds']} s ({r['per_s']}/s), "
                      f"conflicted={r['conflicted']}")
        if args.churn_s > 0:
            await churn(log, watch, set(sent), args.churn_s, args.churn_rate, work / "placement2.log")
        watch.task.cancel()
        await client.close()
        await log.close()
    finally:
        print(f"logs: {work}")
        stop_processes(procs)
        redis.stop()
        nats.stop()
        import shutil

        shutil.rmtree(trust.dir, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
