"""GPU models as pools on the Philly week (issue 30; docs/gpu-pools.md): the same trace on one
model and on 128 H100 + 384 A100, with and without the fallback, with per-model quotas.

    python bench/bench_gpu_pools.py            # prints the table of docs/gpu-pools.md

Each run is the `gpusched sim` command the docs page names; ratios are against run A in the
same process.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from gpusched.sim.pools import node_models, parse_mix, types_of
from gpusched.sim.report import load_jobs, runtime_model, simulate
from gpusched.sim.traces import load_quotas
from gpusched.sim.world import Cluster

HERE = Path(__file__).resolve().parent
RUNS = {  # name: (--gpu-types, --gpu-type-mix, --quotas)
    "one model": (None, None, None),
    "A: 50% H100 only": ("16:H100,48:A100", "H100=0.5", None),
    "B: 15% H100 only, 35% H100 then A100": ("16:H100,48:A100", "H100=0.15,H100|A100=0.35", None),
    "C: B + per-model quotas": ("16:H100,48:A100", "H100=0.15,H100|A100=0.35", HERE / "philly-pools.csv"),
}


def run(gpu_types: str | None, mix: str | None, quotas: Path | None) -> dict:
    jobs, _ = load_jobs(None, None, None, None)
    cluster = Cluster.parse("2x32x8")
    if gpu_types:
        cluster = replace(cluster, models=node_models(gpu_types, 64))
    types = {j.job_id: t for j in jobs if (t := types_of(j.job_id, parse_mix(mix)))} if mix else None
    sim = simulate(jobs, cluster, "full", runtime_model("realistic"), quotas=load_quotas(quotas) if quotas else None,
                   job_types=types)
    return sim.summary()


def row(name: str, d: dict, base: dict) -> str:
    pools = d.get("pools") or {}
    h, a = pools.get("H100"), pools.get("A100")
    cells = [name, f"{d['avg_jct_s'] / 3600:.2f}", f"{d['avg_jct_s'] / base['avg_jct_s']:.2f}x",
             f"{d['avg_queue_s'] / 3600:.2f}", f"{d['p99_jct_s'] / 3600:.1f}", f"{d['utilization']:.3f}",
             f"{d['jain_fairness']:.3f}", str(d["preemptions"]), str(d["unfinished"]),
             f"{h['utilization']:.3f}" if h else "-", f"{a['utilization']:.3f}" if a else "-",
             f"{h['mean_queue_h']:.2f}" if h else "-",
             f"{h['gpu_hours_by_team'].get('ee9e8c', 0):,.0f}" if h else "-"]
    return "| " + " | ".join(cells) + " |"


def main() -> int:
    results = {}
    for name, args in RUNS.items():
        results[name] = run(*args)
        print(f"{name}: done in {results[name]['sim_wall_s']:.0f} s", file=sys.stderr, flush=True)
    base = results["A: 50% H100 only"]
    print("| run | avg JCT h | vs A | avg queue h | p99 JCT h | util | Jain | preemptions | unfinished "
          "| H100 held share | A100 held share | H100 wait h | ee9e8c H100 GPU-h |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, d in results.items():
        print(row(name, d, base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
