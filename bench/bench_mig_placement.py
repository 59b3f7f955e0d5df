"""MIG placement's cost (docs/gpu-sharing.md#mig-slices): one placement cycle that starts 2,000
jobs of one 1g.10gb slice each on 512 H100s partitioned 7 x 1g.10gb, against the same cycle for
2,000 fractional jobs of 1/7 of a GPU on the same GPUs whole (the baseline, in the same run).

    python bench/bench_mig_placement.py [--nodes 64] [--jobs 2000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from gpusched.core import events as ev
from gpusched.core.mig import MigInfo, published_profiles
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.core.state import ClusterState
from gpusched.policy.config import PRESETS
from gpusched.policy.cycle import cycle

H100 = 80 * 1024


def cluster(kind: str, nodes: int, jobs: int) -> ClusterState:
    st = ClusterState()
    mig = MigInfo("enabled", "enabled", published_profiles("H100", H100))
    for n in range(nodes):
        st.apply(ev.NodeRegistered(at=0, node=f"n{n}", rack=f"r{n // 8}", gpus=[
            GpuInfo(index=i, uuid=f"u{n}-{i}", model="H100", memory_mb=H100, mig=mig) for i in range(8)]))
        for i in range(8) if kind == "mig" else ():
            st.apply(ev.MigGeometrySet(at=0, gpu=f"n{n}/{i}", profiles=["1g.10gb"] * 7))
    for j in range(jobs):
        ask = {"mig": "1g.10gb"} if kind == "mig" else {"gpu_fraction": 1 / 7}
        st.apply(ev.JobSubmitted(at=1, job_id=f"j{j}", spec=JobSpec(team=f"t{j % 4}", gpus=1, **ask)))
    return st


def timed(kind: str, nodes: int, jobs: int) -> tuple[float, int]:
    st = cluster(kind, nodes, jobs)
    t = time.perf_counter()
    events = cycle(st, 2, PRESETS["full"])
    return time.perf_counter() - t, sum(isinstance(e, ev.GpusGranted) for e in events)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    out = {}
    for kind in ("fractions", "mig"):
        runs = [timed(kind, a.nodes, a.jobs) for _ in range(a.repeat)]
        out[kind] = statistics.median(s for s, _ in runs)
        print(f"{kind}: median {out[kind] * 1000:.0f} ms a cycle, {runs[0][1]} of {a.jobs} jobs started "
              f"on {a.nodes * 8} GPUs")
    print(f"mig / fractions: {out['mig'] / out['fractions']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
