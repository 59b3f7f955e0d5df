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
import os
import random
import sys
import tempfile
import time
import zlib
from collections import deque
from pathlib import Path

import msgspec
from nats.js.api import StorageType, StreamConfig

from gpusched.bus.control_client import Client
from gpusched.bus.log import MAX_BATCH, EventLog
from gpusched.bus.servers import start_nats, start_redis
from gpusched.cli.stack import simulated_nodes, spawn_service, stop_processes
from gpusched.core import events as ev
from gpusched.core.commands import SubmitJob
from gpusched.core.model import JobSpec

SIZES = [1, 1, 1, 1, 2, 2, 4, 8]  # mean 2.5 GPUs


async def raw_rates(log: EventLog, n: int, replicas: int = 1) -> tuple[float, float]:
    """The server's publish-ack rates on a scratch stream at the log's replica count: one in flight
    (what a compare-and-set chain can do at best) and 256 in flight."""
    js = log.js
    await js.add_stream(StreamConfig(name="BENCH_RAW", subjects=["bench.raw.>"], storage=StorageType.FILE,
                                     num_replicas=replicas))
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
        self.sub = None

    async def start(self) -> None:
        sub = self.sub = await self.log.js.subscribe("gpusched.evt.alloc.GpusGranted.>", ordered_consumer=True,
                                                     pending_msgs_limit=0, pending_bytes_limit=0)

        async def run() -> None:
            while True:
                msg = await sub.next_msg(timeout=None)
                e = ev.decode_event(msg.data)
                self.at.setdefault(e.job_id, time.perf_counter())
                self.stored.setdefault(e.job_id, msg.metadata.timestamp.timestamp())
                self.changed.set()

        self.task = asyncio.create_task(run())

    async def stop(self) -> None:
        """Stop reading and unsubscribe: a subscription left with messages queued makes the
        connection's drain wait for a reader that is gone (a 30 s timeout at every run's end)."""
        if self.task is not None:
            self.task.cancel()
        if self.sub is not None:
            await self.sub.unsubscribe()

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


class _Grant(msgspec.Struct):
    """The fields of a grant the load generator needs (decoding the whole event costs more)."""

    job_id: str
    attempt: int = 1


async def _churn_worker(url: str, index: int, workers: int, rate: float, seconds: float,
                        exclude: set[str], tick: float, ready, go) -> dict:
    """One process of the load generator: completes the running jobs it owns (crc32 of the job
    id modulo `workers`), oldest grant first, at `rate` per second in atomic batches every
    `tick`, on its own connection. Open loop: a completion that falls due while none of its jobs
    runs is not owed later (`missed`); `lag` counts the ones it was too slow to append."""
    log = await EventLog.open(url, name=f"bench-churn-{index}")
    sub = await log.js.subscribe("gpusched.evt.alloc.GpusGranted.>", ordered_consumer=True,
                                 pending_msgs_limit=0, pending_bytes_limit=0)
    running: deque[tuple[str, int]] = deque()

    async def read() -> None:
        while True:
            msg = await sub.next_msg(timeout=None)
            g = msgspec.json.decode(msg.data, type=_Grant)
            if g.job_id not in exclude and zlib.crc32(g.job_id.encode()) % workers == index:
                running.append((g.job_id, g.attempt))

    reader = asyncio.create_task(read())
    offered = appended = missed = 0
    batch_s: list[float] = []
    ready.put(index)  # connected and reading: the window starts when every worker is
    t0 = await asyncio.to_thread(go.get, True, 300)
    await asyncio.sleep(max(0.0, t0 - time.time()))
    while (now := time.time()) < t0 + seconds:
        due = int(rate * (now - t0)) - offered  # completions this tick is to offer
        n = min(due, len(running), MAX_BATCH)
        offered += due
        missed += max(0, due - len(running))
        if n > 0:
            chunk = [running.popleft() for _ in range(n)]
            started = time.perf_counter()
            await log.append_batch([ev.JobCompleted(at=now, job_id=j, attempt=a) for j, a in chunk])
            batch_s.append(time.perf_counter() - started)
            appended += n
        await asyncio.sleep(max(0.0, tick - (time.time() - now)))
    reader.cancel()
    await sub.unsubscribe()  # else the drain waits for the reader that is gone (see GrantWatch.stop)
    await log.close()
    return {"offered": offered, "appended": appended, "missed": missed, "batches": len(batch_s),
            "batch_ms_p50": 1000 * pct(batch_s, 50) if batch_s else 0.0,
            "batch_ms_p99": 1000 * pct(batch_s, 99) if batch_s else 0.0}


def churn_worker_main(args: tuple, ready, go, out) -> None:
    out.put(asyncio.run(_churn_worker(*args, ready, go)))


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process has used so far (Linux /proc; None elsewhere): its
    CPU per grant does not depend on how many other processes share the machine."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def churn(url: str, watch: GrantWatch, exclude: set[str], seconds: float, rate: float, workers: int,
                placement_log: Path, placement_pid: int, log: EventLog) -> dict:
    """Sustained load, open loop: the node daemons' JobCompleted offered at `rate` per second by
    `workers` processes (each its own connection and share of the jobs, atomic batches every
    50 ms), independent of placement, which must keep granting from the backlog to keep up.
    Reports what the generator appended (and why it appended less than it offered: no running
    job to complete, or too slow itself), grants/s stored during the window, and placement's
    conflicted rounds."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    ready, go, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=churn_worker_main, daemon=True,
                         args=((url, i, workers, rate / workers, seconds, exclude, 0.05), ready, go, out))
             for i in range(workers)]
    for proc in procs:
        proc.start()
    for _ in procs:  # each has started, connected and subscribed (slow on a busy machine)
        await asyncio.to_thread(ready.get, True, 300)
    t0 = time.time() + 1.0  # and read the grants so far
    for _ in procs:
        go.put(t0)
    before = set(watch.stored)
    text0 = placement_log.read_text()
    await asyncio.sleep(max(0.0, t0 - time.time()))
    cpu0, seq0, load0 = cpu_seconds(placement_pid), await log.last_seq(), os.getloadavg()[0]
    await asyncio.sleep(seconds)
    cpu1, seq1 = cpu_seconds(placement_pid), await log.last_seq()
    results = [await asyncio.to_thread(out.get, True, 60) for _ in procs]
    for proc in procs:
        proc.join(10)
    load = os.getloadavg()
    total = {k: sum(r[k] for r in results) for k in ("offered", "appended", "missed")}
    lag = total["offered"] - total["appended"] - total["missed"]
    new = [t for j, t in watch.stored.items() if j not in before and t0 <= t <= t0 + seconds]
    text = placement_log.read_text()[len(text0):]
    rounds = text.count('"placement_round"')
    conflicts = text.count('"conflicted": true')
    grants = len(new) / seconds
    print(f"churn {seconds:g} s, completions offered at {rate:g}/s by {workers} generator processes: "
          f"{total['appended'] / seconds:.0f}/s appended; not appended: {total['missed'] / seconds:.0f}/s "
          f"(no running job to complete: placement behind), {lag / seconds:.0f}/s (generator too slow); "
          f"batch append p50 {max(r['batch_ms_p50'] for r in results):.1f} ms p99 "
          f"{max(r['batch_ms_p99'] for r in results):.1f} ms")
    print(f"  {grants:.0f} grants/s sustained (placement rounds >= 100 events: {rounds}, conflicted after "
          f"rebasing: {conflicts}); load average {load0:.1f} at the start, {load[0]:.1f} {load[1]:.1f} "
          f"{load[2]:.1f} at the end")
    facts = seq1 - seq0
    print(f"  facts stored in the window: {facts / seconds:.0f}/s, of which grants {grants:.0f}/s, completions "
          f"{total['appended'] / seconds:.0f}/s, other (reasons, releases) {(facts - len(new)) / seconds - total['appended'] / seconds:.0f}/s")
    per_cpu = None
    if cpu0 is not None and cpu1 is not None and cpu1 > cpu0:
        per_cpu = len(new) / (cpu1 - cpu0)
        print(f"  placement process: {cpu1 - cpu0:.2f} CPU-s in the {seconds:g} s window "
              f"({100 * (cpu1 - cpu0) / seconds:.0f}% of one core) = {per_cpu:.0f} grants per placement CPU-second")
    decided = decision_rounds(text, t0, t0 + seconds)
    if decided:
        print(f"  placement's decision rounds in the window: {decided['rounds']}, {decided['events_p50']:.0f} events "
              f"each (p50; {decided['events_mean']:.0f} mean), deciding {decided['decide_s']:.2f} s of the "
              f"{seconds:g} s ({decided['decide_ms_p50']:.1f} ms per round p50)")
    return {"grants_per_s": grants, "completions_per_s": total["appended"] / seconds,
            "generator_lag_per_s": lag / seconds, "missed_per_s": total["missed"] / seconds,
            "grants_per_cpu_s": per_cpu, "load_start": load0, "load_end": load[0]}


def decision_rounds(text: str, t0: float, t1: float) -> dict | None:
    """Placement's rounds between unix times t0 and t1, from its `decided` lines (logged at
    `--placement-log-level debug`): how many, how big, and the time spent deciding. On an idle
    machine fewer, bigger rounds mean the per-cycle cost (the queue's order, its tail) is
    shared by more grants."""
    from datetime import datetime

    rounds = []
    for line in text.splitlines():
        if '"decided"' not in line:
            continue
        try:
            rec = msgspec.json.decode(line)
            at = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
        except (msgspec.DecodeError, KeyError, ValueError):
            continue
        if t0 <= at <= t1:
            rounds.append((rec["events"], rec["seconds"]))
    if not rounds:
        return None
    events = [float(e) for e, _ in rounds]
    return {"rounds": len(rounds), "events_p50": pct(events, 50), "events_mean": sum(events) / len(events),
            "decide_s": sum(s for _, s in rounds), "decide_ms_p50": 1000 * pct([s for _, s in rounds], 50)}


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


async def wait_ready(path: Path, service: str, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while f'"{service}_ready"' not in path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"{service} did not start:\n{path.read_text()[-2000:]}")
        await asyncio.sleep(0.05)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100 nodes, 2,000 jobs")
    ap.add_argument("--nodes", type=int, default=None)
    ap.add_argument("--backlog", type=int, default=None)
    ap.add_argument("--latency-jobs", type=int, default=300)
    ap.add_argument("--latency-rate", type=float, default=100.0, help="submits/s during the latency phase")
    ap.add_argument("--churn-s", type=float, default=10.0, help="sustained phase with completions (0: skip)")
    ap.add_argument("--churn-rate", type=float, default=3000.0, help="completions/s offered in the churn phase")
    ap.add_argument("--churn-workers", type=int, default=2, help="load generator processes in the churn phase")
    ap.add_argument("--placement-log-level", default="info",
                    help="debug: one line per decision round (and the churn window's rounds summed up)")
    ap.add_argument("--raw", type=int, default=5000, help="messages for the raw publish-ack rates")
    ap.add_argument("--signed", action="store_true",
                    help="admission and placement sign with a signing seed of their own (GPUSCHED_SIGNING_SEED) "
                         "instead of their identity's key (every append is signed either way)")
    ap.add_argument("--nats-cluster", type=int, default=1, help="JetStream servers clustered on this machine")
    ap.add_argument("--replicas", type=int, default=None, help="the log's replicas (default: the cluster size)")
    ap.add_argument("--profile-placement", metavar="FILE", default=None,
                    help="run the placement that serves the backlog and churn under cProfile, stats to FILE")
    return ap.parse_args()


def profiled(path: str):
    """Wrap `service_command` so the next service runs under cProfile (stats to `path` at exit)."""
    from gpusched.cli import stack

    plain = stack.service_command

    def command(name: str, *rest: str) -> list[str]:
        cmd = plain(name, *rest)
        return [cmd[0], "-m", "cProfile", "-o", path, *cmd[1:]] if name == "placement" else cmd

    return plain, command


async def latency_phase(client: Client, watch: GrantWatch, jobs: int, rate: float) -> dict[str, float]:
    """Single-GPU jobs submitted one at a time with free capacity: submit -> grant arrival."""
    sent: dict[str, float] = {}
    interval = 1.0 / rate
    t_next = time.perf_counter()
    for i in range(jobs):
        t_next += interval
        t0 = time.perf_counter()
        reply = await client.submit(JobSpec(team=f"t{i % 4}", gpus=1), request_id=f"lat-{i}")
        assert reply.ok, reply.error
        sent[reply.job_id] = t0
        await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
    await watch.wait_count(len(sent), 30)
    lat = [(watch.at[j] - t) * 1000 for j, t in sent.items() if j in watch.at]
    print(f"submit->granted ({len(lat)} jobs at {rate:g}/s, free capacity): "
          f"p50 {pct(lat, 50):.1f} ms  p99 {pct(lat, 99):.1f} ms  max {max(lat):.1f} ms   (target p99 < 50 ms)")
    return sent


async def submit_backlog(client: Client, backlog: int) -> list[JobSpec]:
    rng = random.Random(1)
    specs = [JobSpec(team=f"t{i % 8}", gpus=rng.choice(SIZES)) for i in range(backlog)]
    t0 = time.perf_counter()
    for i in range(0, backlog, 256):
        replies = await asyncio.gather(*(client.send(SubmitJob(request_id=f"bl-{j}", spec=specs[j]))
                                         for j in range(i, min(backlog, i + 256))))
        assert all(r.ok for r in replies), [r.error for r in replies if not r.ok][:3]
    submit_s = time.perf_counter() - t0
    print(f"admission: {backlog} submits in {submit_s:.2f} s = {backlog / submit_s:.0f} submits/s (256 in flight)")
    return specs


async def wait_quiet(watch: GrantWatch, quiet_s: float = 3.0) -> None:
    """Until the grants stop coming (the cluster is full or nothing else fits)."""
    last_n, stable_since = len(watch.at), time.perf_counter()
    while time.perf_counter() - stable_since < quiet_s:
        await asyncio.sleep(0.25)
        if len(watch.at) != last_n:
            last_n, stable_since = len(watch.at), time.perf_counter()


def report_fill(watch: GrantWatch, sent: dict, t_start: float, ready_unix: float, backlog: int,
                raw: tuple[float, float]) -> None:
    backlog_jobs = [j for j in watch.stored if j not in sent]
    granted = len(backlog_jobs)
    stored = sorted(watch.stored[j] for j in backlog_jobs)
    span = max(1e-9, stored[-1] - stored[0])
    rate = granted / span
    first = min(watch.at[j] for j in backlog_jobs)
    print(f"first grant {first - t_start:.2f} s after the placement process started")
    print(f"grants: {granted} stored in {span:.3f} s = {rate:.0f} grants/s   (target >= 2,000/s; server store times)")
    whole = granted / max(1e-9, stored[-1] - ready_unix)
    print(f"  with the first cycle's decision time ({backlog}-job order, reasons): {granted} grants in "
          f"{stored[-1] - ready_unix:.2f} s after ready = {whole:.0f} grants/s")
    print(f"ratio to raw sequential publish-ack: {rate / raw[0]:.2f}   to pipelined: {rate / raw[1]:.2f}")


def start_servers(args: argparse.Namespace, trust) -> tuple[list, str]:
    """One nats-server, or a local JetStream cluster; the log's streams at the asked replicas."""
    from gpusched.bus.servers import seed_urls, start_nats_cluster
    from gpusched.security.bootstrap import create_streams_sync

    if args.nats_cluster > 1:
        servers = start_nats_cluster(args.nats_cluster, trust=trust)
        url = seed_urls(servers)
    else:
        servers = [start_nats(trust=trust)]
        url = servers[0].url
    create_streams_sync(url, trust.creds("admin"), replicas=args.replicas or args.nats_cluster)
    return servers, url


async def run(args: argparse.Namespace, url: str, redis_url: str, work: Path, procs: list) -> None:
    from gpusched.security.signing import new_seed

    env = {name: ({"GPUSCHED_SIGNING_SEED": new_seed().decode()} if args.signed else {})
           for name in ("admission", "placement")}
    nodes = args.nodes or (100 if args.quick else 1000)
    backlog = args.backlog or (2000 if args.quick else 60000)  # enough that churn does not run it out
    replicas = args.replicas or args.nats_cluster
    log = await EventLog.open(url, name="bench")
    raw = await raw_rates(log, args.raw, replicas)
    print(f"cluster {nodes} nodes x 8 GPUs = {nodes * 8} GPUs; backlog {backlog} jobs; policy full; "
          f"appends signed ({'a separate signing seed' if args.signed else 'each service by its identity'}); NATS: {args.nats_cluster} server(s), log at R{replicas}")
    print(f"raw publish-ack: sequential {raw[0]:8.0f}/s   pipelined(256) {raw[1]:8.0f}/s   "
          f"load average {os.getloadavg()[0]:.1f}")
    regs = simulated_nodes(nodes, 8, 16, "all")
    for i in range(0, len(regs), 256):
        await asyncio.gather(*(log.append(e, msg_id=f"register-{e.node}") for e in regs[i:i + 256]))

    adm = spawn_service("admission", url, redis_url, ["--placeholders", "any", "--auto-create-teams"], log_path=work / "admission.log",
                        env=env["admission"])
    plc = spawn_service("placement", url, redis_url, [], log_path=work / "placement.log", env=env["placement"])
    procs += [adm, plc]
    await wait_ready(work / "admission.log", "admission", adm)
    await wait_ready(work / "placement.log", "placement", plc)
    client = await Client.connect(url, timeout=30)
    watch = GrantWatch(log)
    await watch.start()
    await asyncio.sleep(1.0)  # the lease is taken, the first cycle ran
    sent = await latency_phase(client, watch, args.latency_jobs, args.latency_rate)

    # --- throughput with a backlog: placement stopped, the backlog submitted, placement started ---
    stop_processes([plc])
    procs.remove(plc)
    await submit_backlog(client, backlog)
    base = len(watch.at)
    t_start = time.perf_counter()
    from gpusched.cli import stack

    plain, command = profiled(args.profile_placement) if args.profile_placement else (None, None)
    if command is not None:
        stack.service_command = command
    plc = spawn_service("placement", url, redis_url, ["--log-level", args.placement_log_level],
                        log_path=work / "placement2.log", env=env["placement"])
    if plain is not None:
        stack.service_command = plain
    procs.append(plc)
    await wait_ready(work / "placement2.log", "placement", plc)
    print(f"placement start (process + replay of {await log.last_seq()} events): {time.perf_counter() - t_start:.2f} s")
    ready_unix = time.time()
    await watch.wait_count(base + 1, 120)
    await wait_quiet(watch)
    report_fill(watch, sent, t_start, ready_unix, backlog, raw)
    if args.churn_s > 0:
        result = await churn(url, watch, set(sent), args.churn_s, args.churn_rate, args.churn_workers,
                             work / "placement2.log", plc.pid, log)
        print(f"  ratio of sustained grants to raw sequential publish-ack: {result['grants_per_s'] / raw[0]:.2f}   "
              f"to pipelined: {result['grants_per_s'] / raw[1]:.2f}")
        granted = sum(1 for j in watch.stored if j not in sent)
        if granted >= backlog:
            print(f"  WARNING: all {backlog} backlog jobs were granted by the window's end: the sustained figure is "
                  f"bounded by the backlog, not by placement; run again with a larger --backlog")
    await watch.stop()
    await client.close()
    await log.close()


async def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpusched-bench-"))
    # as deployed: authentication on, each service as its own identity, this process as admin
    from gpusched.security.trust import TrustStore

    trust = TrustStore(tempfile.mkdtemp(prefix="bench-trust-"))
    trust.ensure_stack()
    os.environ["GPUSCHED_CREDS"] = str(trust.creds("admin"))
    os.environ["GPUSCHED_IDENTITY_DIR"] = str(trust.ids)
    servers, url = start_servers(args, trust)
    redis = start_redis()
    procs: list = []
    try:
        await run(args, url, redis.url, work, procs)
    finally:
        print(f"logs: {work}")
        stop_processes(procs)
        if args.profile_placement:
            print(f"placement profile: {args.profile_placement} (python -m pstats)")
        redis.stop()
        for server in servers:
            server.stop()
        import shutil

        shutil.rmtree(trust.dir, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
