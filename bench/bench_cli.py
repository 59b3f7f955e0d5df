"""How quick the command line answers, as a ratio to `python -c pass` measured in the same run
(the interpreter's own start-up, which no CLI can beat): `gpusched --version`, `--help`,
`jobs --help` (one command's parser and imports, without a server) and, with `--stack`, `jobs`
against a log of 1,000 nodes x 8 GPUs and `--jobs` jobs (bench_startup.py's churn, on a NATS
started here; folded from the log, as a client without the Redis password reads it).

    python bench/bench_cli.py [--runs 7] [--stack] [--jobs 1000]

Targets (issue 29): --version and --help <= 150 ms, jobs <= 300 ms on 1,000 nodes. Prints the
median of `--runs` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

GPUSCHED = [sys.executable, "-m", "gpusched.cli.main"]


def median_s(argv: list[str], runs: int, env: dict | None = None) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, env=env)
        times.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.decode()[-400:]}")
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--stack", action="store_true", help="also time `jobs` on a 1,000-node log")
    ap.add_argument("--jobs", type=int, default=1000, help="with --stack: jobs in the log")
    args = ap.parse_args()
    base = median_s([sys.executable, "-c", "pass"], args.runs)
    print(f"python -c pass: {base * 1000:.0f} ms (baseline)")
    for name, argv, target in (("--version", ["--version"], 0.150), ("--help", ["--help"], 0.150),
                               ("jobs --help", ["jobs", "--help"], 0.300)):
        report(name, median_s(GPUSCHED + argv, args.runs), base, target)
    if args.stack:
        stack_jobs(args, base)


def report(name: str, t: float, base: float, target: float) -> None:
    print(f"gpusched {name}: {t * 1000:.0f} ms = {t / base:.1f}x python -c pass "
          f"(target {target * 1000:.0f} ms: {'met' if t <= target else 'MISSED'})")


def stack_jobs(args: argparse.Namespace, base: float) -> None:
    """`gpusched jobs` on a log of 1,000 nodes and `--jobs` jobs (their whole lives)."""
    import tempfile

    from bench_startup import JOBS_PER_BATCH, NODES, build, nodes_batch

    from gpusched.bus.log import EventLog
    from gpusched.bus.servers import start_nats

    server = start_nats()

    async def fill() -> int:
        log = await EventLog.open(server.url, name="bench-cli-build", signer=None)
        try:
            await log.append_batch(nodes_batch())
            await build(log, 0, max(1, args.jobs // JOBS_PER_BATCH), 200.0, 4)
            return await log.last_seq()
        finally:
            await log.close()

    try:
        events = asyncio.run(fill())
        env = {k: v for k, v in os.environ.items() if k not in ("GPUSCHED_CREDS", "GPUSCHED_REDIS_URL")}
        env["GPUSCHED_CONFIG"] = os.path.join(tempfile.gettempdir(), "bench-cli-no-config.toml")
        t = median_s(GPUSCHED + ["jobs", "--nats", server.url, "--fold"], args.runs, env)
        report(f"jobs ({NODES} nodes, {events} events, folded)", t, base, 0.300)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
