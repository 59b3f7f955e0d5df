"""Wall time of the Philly week (bundled, 7,748 jobs, 2x32x8) under every preset, and the ratio
to the fifo baseline measured in the same run. Target: `full` under 10 s.

    python bench/bench_sim.py [--runtime-model ideal] [--repeat 1] [--presets fifo,full]
"""

from __future__ import annotations

import argparse
import time

from gpusched.policy.config import PRESETS
from gpusched.sim.engine import Cluster
from gpusched.sim.report import runtime_model, simulate
from gpusched.sim.traces import load_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime-model", default="realistic", choices=("realistic", "ideal"))
    ap.add_argument("--repeat", type=int, default=1, help="runs per preset; the best one counts")
    ap.add_argument("--cluster", default="2x32x8")
    ap.add_argument("--presets", default=",".join(PRESETS),
                    help="comma-separated presets (default: all); fifo, the baseline, always runs first")
    args = ap.parse_args()
    names = ["fifo", *(n for n in args.presets.split(",") if n != "fifo")]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        ap.error(f"unknown presets: {', '.join(unknown)}")
    t0 = time.perf_counter()
    jobs = load_trace()
    load_s = time.perf_counter() - t0
    cluster, model = Cluster.parse(args.cluster), runtime_model(args.runtime_model)
    print(f"Philly week: {len(jobs)} jobs on {cluster} ({cluster.total_gpus} GPUs), runtime {model.name}; "
          f"trace load {load_s:.2f} s")
    print(f"{'preset':<10} {'wall s':>8} {'vs fifo':>8} {'events':>8} {'cycles':>7} {'ev/s':>9}")
    base = None
    for name in names:
        best = None
        for _ in range(args.repeat):
            sim = simulate(jobs, cluster, name, model)
            best = sim if best is None or sim.wall_s < best.wall_s else best
        base = base or best.wall_s
        print(f"{name:<10} {best.wall_s:8.2f} {best.wall_s / base:7.2f}x {best.state.events:8d} {best.cycles:7d} "
              f"{best.state.events / best.wall_s:9.0f}" + ("   (target < 10 s)" if name == "full" else ""))


if __name__ == "__main__":
    main()
