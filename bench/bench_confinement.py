"""The cost of confinement: job start latency (grant appended -> the job's first command ran)
on a real node daemon over a real log, without and with a per-job cgroup and dynamic uid, and
with `--image` (podman + runc in that cgroup, a tiny image imported locally: no pull).

    python bench/bench_confinement.py [--jobs 10]

Needs root and cgroups for the confined case, and podman for the image case (else it reports
what it can). Prints the median and p90 of each, and their ratios, from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' image builder


async def _latencies(url: str, work: Path, jobs: int, confined: bool, image: str | None = None) -> list[float]:
    from gpusched.bus.cas import append_cas
    from gpusched.bus.log import EventLog
    from gpusched.core import events as ev
    from gpusched.core.model import JobSpec
    from gpusched.services.nodeagent.agent_config import AgentConfig
    from gpusched.services.nodeagent.backends import SimBackend
    from gpusched.services.nodeagent.host import NodeHost
    from gpusched.services.runtime import FoldedLog

    node = "node02" if image else "node01" if confined else "node00"
    host = await NodeHost.open(url, heartbeat_s=1.0, poll_s=0.01)
    host.add(AgentConfig(node=node, address="127.0.0.1", work_dir=work, cgroups=confined,
                         uid_range=(64500, 400) if confined else None, cgroup_parent="gpusched-bench"),
             SimBackend(node, 1, "all"))
    kind = "i" if image else "c" if confined else "p"
    await host.start()
    log = await EventLog.open(url, name="bench-confinement")
    watch = FoldedLog(log)
    await watch.start()
    out = []
    try:
        for i in range(jobs):
            job_id = f"{kind}{i}-{os.getpid()}"
            marker = work / "checkpoints" / job_id / "up"
            spec = JobSpec(team="t", gpus=1, workdir="/", command=["/bin/sh", "-c", f': > "{marker}"; exec sleep 30'],
                           image=image)
            await watch.catch_up()
            await append_cas(watch, [ev.JobSubmitted(at=time.time(), job_id=job_id, spec=spec)])
            await watch.catch_up()
            t0 = time.perf_counter()
            await append_cas(watch, [ev.GpusGranted(at=time.time(), job_id=job_id, attempt=1, gpus=[f"{node}/0"],
                                                    placer="sim")])
            while not marker.exists():
                await asyncio.sleep(0.001)
            out.append(time.perf_counter() - t0)
            await append_cas(watch, [ev.JobCancelled(at=time.time(), job_id=job_id, reason="bench")])
            while host.agents[node].jobs:
                await asyncio.sleep(0.01)
    finally:
        await watch.stop()
        await log.close()
        await host.stop()
    return out


def _summary(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(0.9 * len(xs)))]


async def main() -> None:
    from gpusched.bus.servers import start_nats
    from gpusched.security.bootstrap import create_streams_sync
    from gpusched.security.trust import TrustStore
    from gpusched.services.nodeagent import cgroups

    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=10)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpusched-bench-confine-"))
    os.chmod(root, 0o755)
    trust = TrustStore(root / "trust")
    trust.ensure_stack(["node00", "node01", "node02"])
    os.environ["GPUSCHED_CREDS"] = str(trust.creds("admin"))
    server = start_nats(trust=trust)
    try:
        create_streams_sync(server.url, trust.creds("admin"))
        base = await _latencies(server.url, root / "work", args.jobs, confined=False)
        bm, b90 = _summary(base)
        print(f"unconfined (daemon's user, no cgroup): median {bm * 1000:.1f} ms  p90 {b90 * 1000:.1f} ms")
        if os.geteuid() != 0 or cgroups.version() is None:
            print("confined: skipped (needs root and cgroups)")
            return
        conf = await _latencies(server.url, root / "work", args.jobs, confined=True)
        cm, c90 = _summary(conf)
        print(f"confined (cgroup v{cgroups.version()} + dynamic uid + device allow-list): median {cm * 1000:.1f} ms  "
              f"p90 {c90 * 1000:.1f} ms")
        print(f"ratio confined/unconfined: median {cm / bm:.2f}  p90 {c90 / b90:.2f}")
        await _image_column(server.url, root / "work", args.jobs, (bm, b90), (cm, c90))
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


async def _image_column(url: str, work: Path, jobs: int, base: tuple[float, float], conf: tuple[float, float]) -> None:
    from gpusched.services.nodeagent import container
    from tests.integration.container_helpers import build_image, reset

    if not container.available():
        print("image: skipped (podman is not installed: scripts/install-system-deps.sh)")
        return
    image = build_image(work / "containers")
    try:
        im, i90 = _summary(await _latencies(url, work, jobs, confined=True, image=image))
    finally:
        reset(work / "containers")
    print(f"image (podman run, runc, CDI GPU, in the job's cgroup, image present): median {im * 1000:.1f} ms  "
          f"p90 {i90 * 1000:.1f} ms")
    print(f"ratio image/unconfined: median {im / base[0]:.2f}  p90 {i90 / base[1]:.2f}")
    print(f"ratio image/confined: median {im / conf[0]:.2f}  p90 {i90 / conf[1]:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
