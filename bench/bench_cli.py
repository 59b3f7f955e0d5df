"""How quick the command line answers, as a ratio to `python -c pass` measured in the same run
(the interpreter's own start-up, which no CLI can beat): `gpusched --version`, `--help`,
`jobs --help` (one command's parser and imports, without a server) and, with `--stack`, `jobs`
against a log of 1,000 nodes x 8 GPUs and `--jobs` jobs (bench_startup.py's churn, on a NATS
started here with the reader service): as a tenant and a platform (through the reader, as their
credentials read) and as an auditor folding the whole log.

    python bench/bench_cli.py [--runs 7] [--stack] [--jobs 1000]

Targets (issue 29): --version and --help <= 150 ms, jobs <= 300 ms on 1,000 nodes. Prints the
median of `--runs` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import time

GPUSCHED = [sys.executable, "-m", "gpusched.cli.main"]


#: The CLI as installed runs from bytecode: a development shell's PYTHONDONTWRITEBYTECODE would
#: time compiling every module on each call instead.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def median_s(argv: list[str], runs: int, env: dict | None = None) -> float:
    """The median wall time of `runs` calls, after one untimed call (it writes the bytecode).
    The median CPU time (user + system) of the same calls goes to `LAST_CPU_S`: on a shared,
    loaded machine it moves far less than the wall time."""
    env = {k: v for k, v in (env or CLEAN_ENV).items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run(argv, capture_output=True, env=env)
    times, cpu = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, env=env)
        times.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.decode()[-400:]}")
    LAST_CPU_S[0] = statistics.median(cpu)
    return statistics.median(times)


LAST_CPU_S = [0.0]
BASE_CPU_S = [0.0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--stack", action="store_true", help="also time `jobs` on a 1,000-node log")
    ap.add_argument("--jobs", type=int, default=1000, help="with --stack: jobs in the log")
    args = ap.parse_args()
    base = median_s([sys.executable, "-c", "pass"], args.runs)
    BASE_CPU_S[0] = LAST_CPU_S[0]
    print(f"python -c pass: {base * 1000:.0f} ms, {BASE_CPU_S[0] * 1000:.0f} ms CPU (baseline)")
    for name, argv, target in (("--version", ["--version"], 0.150), ("--help", ["--help"], 0.150),
                               ("jobs --help", ["jobs", "--help"], 0.300)):
        report(name, median_s(GPUSCHED + argv, args.runs), base, target)
    if args.stack:
        stack_jobs(args, base)


def report(name: str, t: float, base: float, target: float) -> None:
    cpu = LAST_CPU_S[0]
    print(f"gpusched {name}: {t * 1000:.0f} ms = {t / base:.1f}x python -c pass; CPU {cpu * 1000:.0f} ms = "
          f"{cpu / max(BASE_CPU_S[0], 1e-6):.1f}x (target {target * 1000:.0f} ms: {'met' if t <= target else 'MISSED'})")


def stack_jobs(args: argparse.Namespace, base: float) -> None:
    """`gpusched jobs` on a log of 1,000 nodes and `--jobs` jobs (their whole lives, in 7 teams),
    on an authenticated NATS with the reader service and the projector: as admin (the reader's
    unscoped answer), a tenant of one team and a platform of all seven (through the reader: what
    their credential reads); then, the reader stopped, as admin from Redis, and as an auditor
    folding the whole log."""
    import shutil
    import tempfile
    from pathlib import Path

    import msgspec
    from bench_startup import JOBS_PER_BATCH, NODES, churn_batch, nodes_batch

    from gpusched.bus.log import EventLog
    from gpusched.bus.servers import start_nats, start_redis
    from gpusched.cli.stack import spawn_service, stop_processes
    from gpusched.security.bootstrap import create_streams_sync
    from gpusched.security.trust import TrustStore

    root = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    trust = TrustStore(root / "trust")
    trust.ensure_stack()
    teams = [f"t{i}" for i in range(7)]  # bench_startup's churn
    for name, role, of in (("tenant", "tenant", teams[:1]), ("platform", "platform", teams), ("audit", "auditor", [])):
        trust.add(name, role, teams=of)
    server = start_nats(trust=trust)
    admin = str(trust.creds("admin"))
    create_streams_sync(server.url, admin)

    async def fill() -> int:
        """The churn of the last days (bench_startup's starts at 1970: every job would be past
        the fold's horizon, and the listings empty), 200 jobs a day."""
        log = await EventLog.open(server.url, name="bench-cli-build", signer=None, creds=admin)
        batches = max(1, args.jobs // JOBS_PER_BATCH)
        since = time.time() - batches * 86400.0 - 3600.0
        try:
            await log.append_batch(nodes_batch())
            for b in range(batches):
                await log.append_batch([msgspec.structs.replace(e, at=e.at + since) for e in churn_batch(b, 200.0)])
            return await log.last_seq()
        finally:
            await log.close()

    redis = start_redis()
    services = []
    try:
        events = asyncio.run(fill())
        for name in ("reader", "projector"):
            services.append(spawn_service(name, server.url, redis.url, log_path=root / f"{name}.log",
                                          creds=trust.creds(name)))
        env = {k: v for k, v in os.environ.items() if k not in ("GPUSCHED_CREDS", "GPUSCHED_REDIS_URL")}
        env["GPUSCHED_CONFIG"] = str(root / "no-client-config.toml")
        for name, proc in zip(("reader", "projector"), services):
            wait_ready(root / f"{name}.log", proc, name)
        wait_views(redis.url, events)
        env.update(GPUSCHED_CREDS=admin, GPUSCHED_REDIS_URL=redis.url)
        t = median_s(GPUSCHED + ["jobs", "--nats", server.url], args.runs, env)
        report(f"jobs as admin ({NODES} nodes, {events} events, {listed(server.url, env)} jobs listed; "
               "the reader's unscoped answer)", t, base, 0.300)
        del env["GPUSCHED_REDIS_URL"]
        for who, what in (("tenant", "1 team's jobs, through the reader"), ("platform", "7 teams, through the reader")):
            env["GPUSCHED_CREDS"] = str(trust.creds(who))
            t = median_s(GPUSCHED + ["jobs", "--nats", server.url], args.runs, env)
            report(f"jobs as a {who} ({NODES} nodes, {events} events, {listed(server.url, env)} jobs listed; {what})",
                   t, base, 0.300)
        stop_processes(services[:1])  # no reader: admin reads the projector's views in Redis
        env.update(GPUSCHED_CREDS=admin, GPUSCHED_REDIS_URL=redis.url)
        t = median_s(GPUSCHED + ["jobs", "--nats", server.url], args.runs, env)
        report(f"jobs as admin ({NODES} nodes, {events} events, {listed(server.url, env)} jobs listed; no reader: "
               "the projector's read models in Redis)", t, base, 0.300)
        del env["GPUSCHED_REDIS_URL"]
        env["GPUSCHED_CREDS"] = str(trust.creds("audit"))
        t = median_s(GPUSCHED + ["jobs", "--nats", server.url, "--fold"], args.runs, env)
        report(f"jobs --fold as an auditor ({NODES} nodes, {events} events, {listed(server.url, env, '--fold')} jobs "
               "listed; the whole log folded)", t, base, 0.300)
    finally:
        stop_processes(services)
        server.stop()
        redis.stop()
        shutil.rmtree(root, ignore_errors=True)


def listed(url: str, env: dict, *more: str) -> int:
    """How many jobs the same call lists (a timing of an empty listing would mean nothing)."""
    import json

    out = subprocess.run(GPUSCHED + ["jobs", "--nats", url, "--json", *more], capture_output=True, env=env, check=True)
    return len(json.loads(out.stdout))


def wait_ready(log_path, proc, name: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while f'"{name}_ready"' not in (log_path.read_text() if log_path.exists() else ""):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the {name} did not start: {log_path.read_text()[-2000:]}")
        time.sleep(0.1)


def wait_views(redis_url: str, seq: int, timeout: float = 120.0) -> None:
    """Until the projector's views cover the whole log."""
    import redis

    r = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout
    while int(r.hget("gpusched:v:meta", "seq") or 0) < seq:
        if time.monotonic() > deadline:
            raise SystemExit("the projector did not write the views")
        time.sleep(0.1)
    r.close()


if __name__ == "__main__":
    main()
