"""Memory under hostile input (issue 9): the RSS of every service before and after 10,000
hostile commands and heartbeats, and of the reconciler after 50,000 heartbeats from node names
nobody registered. Real nats-server, redis-server and service processes.

Each figure is a ratio against the same process measured in the same run after a warm-up
(500 hostile inputs), so that allocator start-up does not count. Flat means within 10%.

    .venv/bin/python bench/bench_rss.py            # 10,000 inputs, 50,000 heartbeats
    .venv/bin/python bench/bench_rss.py --quick    # 2,000 and 10,000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from gpusched.bus import subjects
from gpusched.bus.control_client import Client
from gpusched.bus.log import EventLog
from gpusched.bus.servers import start_nats, start_redis
from gpusched.cli.stack import register_simulated_nodes, spawn_service, stop_processes
from gpusched.cli.startup import StartupNotify

SERVICES = ["admission", "placement", "fallback", "preemptor", "quota_ledger", "reconciler", "projector", "nodeagent"]
EXTRA = {"nodeagent": ["--backend", "sim", "--count", "4", "--gpus", "8", "--heartbeat-s", "2"]}

HOSTILE_SPECS = [
    {"command": ["python", "a\x00b"]}, {"env": {"A=B": "1"}}, {"env": {"A": "1\x002"}},
    {"env": {"GPUSCHED_SIM_DURATION_S": "abc"}}, {"checkpoint_dir": "/proc/self"}, {"time_limit_s": 1e-300},
    {"time_limit_s": 1e308}, {"max_restarts": 10**18}, {"team": "."}, {"team": ".."}, {"team": "a.b"},
    {"team": "null"}, {"command": []}, {"gpus": 2**64}, {"env": {f"K{i}": "v" * 8000 for i in range(20)}},
]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def hostile_commands(n: int, rng: random.Random):
    """(subject, bytes): the issue's hostile specs with random names, junk, and ~900 KB bodies."""
    for i in range(n):
        kind = rng.random()
        if kind < 0.01:
            body = {"type": "SubmitJob", "request_id": f"big{i}",
                    "spec": {"team": "a", "gpus": 1, "command": ["x" * 900_000]}}
            yield subjects.CMD_SUBMIT, json.dumps(body).encode()
        elif kind < 0.7:
            spec = {"team": f"t{rng.randrange(10**6)}", "gpus": 1, "command": ["python", "x.py"],
                    **rng.choice(HOSTILE_SPECS)}
            yield subjects.CMD_SUBMIT, json.dumps({"type": "SubmitJob", "request_id": f"h{i}-{rng.random()}",
                                                   "spec": spec}).encode()
        elif kind < 0.8:
            yield subjects.CMD_QUOTA, json.dumps({"type": "SetTeamQuota", "request_id": f"q{i}", "team": "a",
                                                  "quota": {"weight": 1e-300}}).encode()
        elif kind < 0.9:
            yield subjects.CMD_DRAIN, json.dumps({"type": "DrainNode", "request_id": f"d{i}",
                                                  "node": f"ghost{i}..x"}).encode()
        else:
            yield subjects.CMD_SUBMIT, rng.randbytes(rng.randrange(1, 400))


def heartbeat(node: str, i: int) -> bytes:
    return json.dumps({"node": node, "at": time.time(), "agent_id": "x", "seq": i, "backend": "sim",
                       "gpus": [{"index": g, "uuid": f"GPU-{node}-{g}"} for g in range(8)]}).encode()


async def hostile_round(client: Client, n: int, rng: random.Random) -> tuple[int, int]:
    answered = rejected = 0
    batch = []
    for subject, data in hostile_commands(n, rng):
        batch.append(client.request_raw(subject, data, timeout=30))
        if len(batch) == 100:
            for raw in await asyncio.gather(*batch):
                answered += 1
                rejected += not json.loads(raw)["ok"]
            batch = []
    for raw in await asyncio.gather(*batch):
        answered += 1
        rejected += not json.loads(raw)["ok"]
    for i in range(n):  # hostile heartbeats: junk, bad names, unknown nodes
        name = rng.choice([".", "a..b", "null", f"ghost-{i}"])
        await client.nc.publish(f"gpusched.hb.fuzz{i % 50}", heartbeat(name, i) if i % 3 else rng.randbytes(200))
    await client.nc.flush()
    return answered, rejected


async def unknown_heartbeats(client: Client, n: int) -> None:
    for i in range(n):
        node = f"ghost-{i:06d}"
        await client.nc.publish(subjects.heartbeat_subject(node), heartbeat(node, i))
        if i % 1000 == 999:
            await client.nc.flush()
    await client.nc.flush()


def wait_ready(notify: StartupNotify, procs: dict, timeout: float = 90.0) -> None:
    pending = {p.pid: name for name, p in procs.items()}
    deadline = time.monotonic() + timeout
    while pending:
        for pid in notify.ready_pids():
            pending.pop(pid, None)
        for name, p in procs.items():
            if p.poll() is not None:
                raise SystemExit(f"{name} exited with {p.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"not ready: {sorted(pending.values())}")
        time.sleep(0.1)


def measure(procs: dict) -> dict[str, int]:
    return {name: rss_kib(p.pid) for name, p in procs.items()}


async def main(args) -> int:
    work = Path(tempfile.mkdtemp(prefix="bench-rss-"))
    nats, redis = start_nats(), start_redis()
    notify = StartupNotify()
    procs = {}
    try:
        log = await EventLog.open(nats.url, name="bench-rss")
        if "nodeagent" not in args.services:
            await register_simulated_nodes(log, 4, 8, 4, "all")
        await log.close()
        for name in args.services:
            procs[name] = spawn_service(name, nats.url, redis.url, EXTRA.get(name, []), log_path=work / f"{name}.log",
                                        env={"NOTIFY_SOCKET": notify.address})
        wait_ready(notify, procs)
        client = await Client.connect(nats.url, timeout=30)
        rng = random.Random(9)
        await hostile_round(client, 500, rng)  # warm-up
        await asyncio.sleep(3)
        before = measure(procs)
        t0 = time.monotonic()
        answered, rejected = await hostile_round(client, args.inputs, rng)
        took = time.monotonic() - t0
        await asyncio.sleep(3)
        after = measure(procs)
        print(f"hostile inputs: {args.inputs} commands ({answered} answered, {rejected} rejected) and "
              f"{args.inputs} heartbeats in {took:.1f} s")
        print(f"{'service':14s} {'before MiB':>10s} {'after MiB':>10s} {'ratio':>7s}")
        worst = 0.0
        for name in procs:
            ratio = after[name] / max(1, before[name])
            worst = max(worst, ratio)
            print(f"{name:14s} {before[name] / 1024:10.1f} {after[name] / 1024:10.1f} {ratio:7.3f}")
        rec = procs.get("reconciler")
        if rec is not None:
            r0 = rss_kib(rec.pid)
            await unknown_heartbeats(client, args.heartbeats)
            await asyncio.sleep(3)
            r1 = rss_kib(rec.pid)
            print(f"reconciler after {args.heartbeats} heartbeats from unknown nodes: {r0 / 1024:.1f} -> "
                  f"{r1 / 1024:.1f} MiB, ratio {r1 / max(1, r0):.3f}")
            worst = max(worst, r1 / max(1, r0))
        dead = [n for n, p in procs.items() if p.poll() is not None]
        print(f"worst ratio {worst:.3f} ({'flat within 10%' if worst <= 1.10 else 'NOT flat'}); services dead: "
              f"{dead or 'none'}")
        await client.close()
        return 0 if worst <= 1.10 and not dead else 1
    finally:
        stop_processes(list(procs.values()), timeout=10)
        notify.close()
        nats.stop()
        redis.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=10_000)
    parser.add_argument("--heartbeats", type=int, default=50_000)
    parser.add_argument("--services", default=",".join(SERVICES))
    parser.add_argument("--quick", action="store_true", help="2,000 inputs, 10,000 heartbeats")
    a = parser.parse_args()
    a.services = a.services.split(",")
    if a.quick:
        a.inputs, a.heartbeats = 2_000, 10_000
    sys.exit(asyncio.run(main(a)))
