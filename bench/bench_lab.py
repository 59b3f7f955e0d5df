"""Grants/s at R3 across network hosts ÷ the same run's plain publish-ack rate across the same
hosts: the deployed NATS cluster of `gpusched lab` (three hosts, TLS, nkey auth, the log at
R3), the writers on a fourth host (`client`), `bench_log.bench_grants` as the workload (4
concurrent compare-and-set writers, each with its own fold, against 4 plain publish-ack
writers), once with 1 grant per cycle and once with 64. Root only.

    python bench/bench_lab.py [--grants 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

URLS = "tls://nats-0.nats:4222,tls://nats-1.nats:4222,tls://nats-2.nats:4222"


async def inside(grants: int) -> None:
    """Run on the client host: streams at R3 as admin, then the grant benchmark."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_log import bench_grants

    from gpusched.security.bootstrap import create_streams

    await create_streams(URLS, os.environ["GPUSCHED_CREDS"], replicas=3)
    out = {}
    for per_cycle in (1, 64):
        out[per_cycle] = await bench_grants(URLS, grants, per_cycle=per_cycle)
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grants", type=int, default=2000)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        asyncio.run(inside(args.grants))
        return
    from gpusched.lab import netns
    from gpusched.lab.cluster import NatsCluster, make_secrets

    if netns.available():
        raise SystemExit(netns.available())
    work = Path(tempfile.mkdtemp(prefix="gs-lab-bench-"))
    lab = netns.Lab().up()
    try:
        secrets = make_secrets(work / "secrets", ["gpu01"])
        c = NatsCluster(lab, work, secrets)
        c.add_hosts()
        lab.add_host("client")
        lab.write_hosts()
        c.start_all()
        c.wait(lambda: all(c.ready(n) for n in c.names), 60)
        env = {**os.environ, "GPUSCHED_CREDS": str(secrets / "trust" / "identities" / "admin.nk"),
               "GPUSCHED_CA": str(secrets / "tls" / "ca.pem")}
        done = subprocess.run(["ip", "netns", "exec", lab.ns("client"), sys.executable, __file__, "--inside",
                               "--grants", str(args.grants)], env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-2000:])
        for per_cycle, g in json.loads(done.stdout.strip().splitlines()[-1]).items():
            print(f"R3 across hosts  {g['grants']:>6} grants  plain publish-ack {g['plain_per_s']:>7,.0f}/s  "
                  f"CAS grants {g['cas_per_s']:>7,.0f}/s  ratio {g['ratio']:.2f}  conflicts {g['conflicts']:>4}  "
                  f"(4 writers, {per_cycle} grants per cycle)")
        c.stop()
    finally:
        lab.down()


if __name__ == "__main__":
    main()
