"""How far ordering and preemption *within* fair share can take `full`'s mean JCT: `full` with
`las_predicted`, where the "prediction" is the trace's true remaining run time (an oracle no
policy has), against `full` itself, measured in the same run.

    python bench/bench_oracle_order.py [--cluster 2x32x8] [--topology any|pack]
                                       [--runtime-model ideal|realistic] [--srpt-preempt]

`--srpt-preempt` also replaces LAS's preemption test by the oracle's: a blocked job takes a
running job of its own team when the victim's true remaining GPU-seconds exceed the job's by
more than the checkpoint + restore cost (shortest remaining first within a team). Everything
else (fair share across teams, priority classes, reservation, back-off) is `full`'s. This is a
bound for measurement only: it patches the policy in this process and never ships.
"""

from __future__ import annotations

import argparse
import json
import time

from gpusched.policy import predict, preemption
from gpusched.sim.engine import Cluster
from gpusched.sim.report import load_jobs, runtime_model, simulate

_KEYS = ("avg_jct_s", "avg_queue_s", "avg_queue_s_by_size", "jain_fairness", "preemptions")


def _run(jobs, cluster, runtime, topology, overrides) -> dict:
    t0 = time.perf_counter()
    s = simulate(jobs, cluster, "full", runtime, overrides, topology=topology).summary()
    return {**{k: s[k] for k in _KEYS}, "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cluster", default="2x32x8")
    p.add_argument("--topology", default="any")
    p.add_argument("--runtime-model", default="ideal")
    p.add_argument("--srpt-preempt", action="store_true")
    args = p.parse_args()
    jobs, _ = load_jobs(None, None, None, None)
    cluster, runtime = Cluster.parse(args.cluster), runtime_model(args.runtime_model)
    base = _run(jobs, cluster, runtime, args.topology, {})
    duration = {j.job_id: j.duration_s for j in jobs}

    def remaining(job) -> float:
        ran = job.attained_gpu_s(job.held_since) / max(1, job.spec.gpus)
        return max(0.0, duration[job.job_id] - ran) * job.spec.gpus

    predict.FrozenEstimates.remaining_gpu_s = lambda self, job: remaining(job)  # type: ignore[method-assign]
    if args.srpt_preempt:
        def las_after(rule, v) -> bool:
            if rule.las_level is None:
                return False
            v_left = max(0.0, duration[v.job_id] - v.attained_gpu_s(rule.now) / max(1, v.spec.gpus)) * len(v.gpus)
            return preemption.las_worth(v, v_left, remaining(rule.job), rule.now, rule.config)

        preemption._Rule.las_after = las_after  # type: ignore[method-assign]
    oracle = _run(jobs, cluster, runtime, args.topology, {"las_predicted": "true"})
    print(json.dumps({"full": base, "oracle": oracle,
                      "avg_jct_ratio": round(oracle["avg_jct_s"] / base["avg_jct_s"], 3)}, indent=1))


if __name__ == "__main__":
    main()
