"""Grants/s sustained at R3 across hosts, against the raw publish-ack rate across the same hosts
in the same run (issue 25's figure). Root only: the lab's network namespaces.

    sudo python bench/bench_lab_grants.py              # 3 node hosts x 64 simulated GPUs
    sudo python bench/bench_lab_grants.py --gpus 16    # a smoke run

The deployed shape of `gpusched.lab.stack`: three NATS hosts (TLS, auth, the log at R3), the
control plane on two service hosts, the node agents on their own hosts, the load from the
`client` host. One-GPU jobs enough to fill the cluster are submitted through admission (256 in
flight) while placement runs: grants/s sustained through the whole path (client -> admission ->
the log -> placement -> the log, every hop across hosts), from the first submit sent to the last
grant stored (the servers' store times; the hosts share one clock). The raw rates are
publish-acks on a scratch stream at R3 from the same client host: one in flight (what a
compare-and-set chain can do at best) and 256 in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


async def inner(backlog: int, raw_n: int) -> None:
    """On the client host: raw rates, then the backlog; the result as one JSON line."""
    from bench_e2e import GrantWatch, raw_rates, wait_quiet

    from gpusched.bus.control_client import Client
    from gpusched.bus.log import EventLog
    from gpusched.core.commands import SubmitJob
    from gpusched.core.model import JobSpec

    log = await EventLog.open(name="bench-lab")
    raw = await raw_rates(log, raw_n, replicas=3)
    watch = GrantWatch(log)
    await watch.start()
    client = await Client.connect(name="bench-lab-submit")
    spec = JobSpec(team="bench", gpus=1, command=["sleep", "3600"])
    t0, t0_unix = time.perf_counter(), time.time()
    for i in range(0, backlog, 256):
        replies = await asyncio.gather(*(client.send(SubmitJob(request_id=f"lab-{j}", spec=spec))
                                         for j in range(i, min(backlog, i + 256))))
        assert all(r.ok for r in replies), [r.error for r in replies if not r.ok][:3]
    submit_s = time.perf_counter() - t0
    filled = await watch.wait_count(backlog, 180)
    await wait_quiet(watch, 2.0)
    stored = sorted(watch.stored.values())
    span = max(1e-3, stored[-1] - t0_unix) if stored else 0.0
    await watch.stop()
    await client.close()
    await log.close()
    print(json.dumps({"raw_seq_acks_per_s": round(raw[0], 1), "raw_pipelined_acks_per_s": round(raw[1], 1),
                      "submits_per_s": round(backlog / submit_s, 1), "granted": len(stored), "filled": filled,
                      "grants_per_s": round(len(stored) / span, 1) if stored else 0.0}), flush=True)


def outer(args: argparse.Namespace) -> int:
    from gpusched.lab import netns
    from gpusched.lab.stack import LabStack

    why = netns.available()
    if why:
        print(f"bench_lab_grants: {why}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gs-labbench-"))
    work.chmod(0o711)
    stack = LabStack(work, nodes=args.nodes, gpus=args.gpus)
    try:
        stack.up()
        backlog = args.nodes * args.gpus
        cmd = ["ip", "netns", "exec", stack.lab.ns("client"), sys.executable, __file__, "--inner",
               "--backlog", str(backlog), "--raw", str(args.raw)]
        proc = subprocess.Popen(cmd, env=stack.env("admin"), stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        result = None
        for line in proc.stdout:
            if line.startswith("{"):
                result = json.loads(line)
        if proc.wait() != 0 or result is None:
            print(f"bench_lab_grants: the client host's run failed (logs in {work})", file=sys.stderr)
            return 1
        result |= {"hosts": len(stack.lab.hosts), "nodes": args.nodes, "gpus_per_node": args.gpus,
                   "ratio_to_raw_seq": round(result["grants_per_s"] / result["raw_seq_acks_per_s"], 2),
                   "ratio_to_raw_pipelined": round(result["grants_per_s"] / result["raw_pipelined_acks_per_s"], 3)}
        print(json.dumps(result, indent=1) if args.json else
              f"raw publish-acks at R3 across hosts: {result['raw_seq_acks_per_s']:.0f}/s one in flight, "
              f"{result['raw_pipelined_acks_per_s']:.0f}/s 256 in flight\n"
              f"grants at R3 across hosts: {result['granted']} (submitted at {result['submits_per_s']:.0f}/s) = "
              f"{result['grants_per_s']:.0f} grants/s, first submit to last grant  "
              f"(ratio to raw one-in-flight {result['ratio_to_raw_seq']:.2f}, to pipelined "
              f"{result['ratio_to_raw_pipelined']:.3f})")
        return 0
    finally:
        stack.down()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=3, help="node hosts (default 3)")
    p.add_argument("--gpus", type=int, default=64, help="simulated GPUs per node (default 64)")
    p.add_argument("--raw", type=int, default=2000, help="publish-acks per raw rate (default 2000)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backlog", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inner:
        asyncio.run(inner(args.backlog, args.raw))
        return 0
    return outer(args)


if __name__ == "__main__":
    sys.exit(main())
