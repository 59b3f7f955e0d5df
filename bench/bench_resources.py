"""The cost of CPUs and memory as resources: `Placer.place` for a gang that asks per-node CPUs
and memory against the same gang asking none, on the same cluster, as a ratio in one run.

    python bench/bench_resources.py [--gpus 10000] [--gang 8] [--fill 0.6] [--repeat 200]

The cluster (8-GPU nodes of 64 CPUs and 512 GiB, 32 per rack) is filled to `--fill` by seeded
jobs of 1-8 GPUs asking 4 CPUs and 16 GiB per GPU, so a job asking 8 CPUs per node finds many
nodes short of CPUs and the filter (`resources.by_resources`) has work to do. Each timed call
starts from a fresh `Pool` (as a cycle does). CPU time of this thread, median and p99.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "libs"))

from gpusched.core import events as ev  # noqa: E402
from gpusched.core.model import GpuInfo, JobSpec  # noqa: E402
from gpusched.core.state import ClusterState  # noqa: E402
from gpusched.policy.placement import Pool  # noqa: E402
from gpusched.policy.placer import Placer  # noqa: E402

GPUS, CPUS, MEM = 8, 64, 512 * 1024


def build(total_gpus: int, fill: float, seed: int = 7) -> ClusterState:
    rng = random.Random(seed)
    state = ClusterState()
    for n in range(total_gpus // GPUS):
        name = f"r{n // 32:04d}n{n % 32:02d}"
        state.apply(ev.NodeRegistered(at=0.0, node=name, rack=f"r{n // 32:04d}", nvlink="all", cpus=CPUS, memory_mb=MEM,
                                      gpus=[GpuInfo(index=i, uuid=f"{name}-{i}") for i in range(GPUS)]))
    names, i = list(state.nodes), 0
    while total_gpus - state.free_count < int(total_gpus * fill):
        size = rng.choice((1, 1, 2, 4, 8))
        node = state.nodes[rng.choice(names)]
        if len(node.free) < size:
            continue
        jid, i = f"fill{i}", i + 1
        # 1-GPU jobs asking a whole node's CPUs now and then: nodes with free GPUs but no CPUs
        cpus = CPUS if size == 1 and rng.random() < 0.3 else 4 * size
        state.apply(ev.JobSubmitted(at=0.0, job_id=jid, spec=JobSpec(team="f", gpus=size, cpus=cpus,
                                                                     memory_mb=16384 * size)))
        state.apply(ev.GpusGranted(at=0.0, job_id=jid, attempt=1, gpus=list(node.free)[:size]))
    return state


def cpu_ms(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        c = time.thread_time_ns()
        fn()
        out.append((time.thread_time_ns() - c) / 1e6)
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=10_000)
    ap.add_argument("--gang", type=int, default=8)
    ap.add_argument("--fill", type=float, default=0.6)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args(argv)
    state = build(args.gpus, args.fill)
    gc.collect()
    gc.freeze()
    placer = Placer("topo")
    plain = JobSpec(team="a", gpus=args.gang)
    asking = JobSpec(team="a", gpus=args.gang, cpus=8, memory_mb=32768)
    assert placer.place(Pool(state), asking, args.gang) is not None
    base = cpu_ms(lambda: placer.place(Pool(state), plain, args.gang), args.repeat)
    res = cpu_ms(lambda: placer.place(Pool(state), asking, args.gang), args.repeat)
    short = sum(1 for n in state.nodes.values() if n.cpus - n.cpus_used < 8)
    med_b, med_r = statistics.median(base), statistics.median(res)
    p99 = lambda xs: xs[min(len(xs) - 1, int(0.99 * (len(xs) - 1)))]  # noqa: E731
    print(f"{args.gpus} GPUs, {len(state.nodes)} nodes ({short} short of 8 CPUs), gang {args.gang}, fill {args.fill}")
    print(f"no CPUs asked:   median {med_b:.3f} ms  p99 {p99(base):.3f} ms (CPU time)")
    print(f"8 CPUs + 32 GiB: median {med_r:.3f} ms  p99 {p99(res):.3f} ms")
    print(f"ratio (asking / not): median {med_r / med_b:.2f}, p99 {p99(res) / p99(base):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
