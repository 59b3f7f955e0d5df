"""Cost of one scheduling cycle with a long queue and scattered free GPUs.

1000 nodes x 8 GPUs in 10 racks, every node running one 7-GPU job (1 GPU free per node), and
10,000 pending jobs of 2-8 GPUs that must fit on one node (none can start). Prints seconds per
cycle for each preset, against `naive_cycle` (the fallback) measured in the same run.

    python bench/bench_cycle.py [PRESET[:KEY=VALUE,...] ...]     e.g. full full:las_predicted=true
"""

from __future__ import annotations

import random
import sys
import time

from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec, TopologyConstraint
from gpusched.core.state import ClusterState
from gpusched.policy.config import parse_policy
from gpusched.policy.cycle import cycle, naive_cycle
from gpusched.policy.memo import Indexes


def build(pending: int = 10_000, nodes: int = 1000, racks: int = 10) -> ClusterState:
    state = ClusterState()
    for i in range(nodes):
        name = f"n{i:04d}"
        state.apply(ev.NodeRegistered(at=0, node=name, rack=f"r{i % racks}", nvlink="all",
                                      gpus=[GpuInfo(index=k, uuid=f"{name}-{k}") for k in range(8)]))
    for i in range(nodes):
        job = f"run{i}"
        state.apply(ev.JobSubmitted(at=0, job_id=job, spec=JobSpec(team=f"t{i % 4}", gpus=7)))
        state.apply(ev.GpusGranted(at=0, job_id=job, attempt=1, gpus=[f"n{i:04d}/{k}" for k in range(7)]))
    rng = random.Random(0)
    for i in range(pending):
        spec = JobSpec(team=f"t{i % 4}", gpus=rng.choice([2, 4, 8]), preemptible=True,
                       topology=TopologyConstraint(required="node"))
        state.apply(ev.JobSubmitted(at=1 + i * 1e-3, job_id=f"p{i:05d}", spec=spec))
    return state


def timed_cycles(decide) -> list[float]:
    """Three cycles in a row (applying what each decides), then one after a job completes."""
    state, now, times = build(), 100.0, []
    for _ in range(3):
        t0 = time.perf_counter()
        out = decide(state, now)
        times.append(time.perf_counter() - t0)
        for e in out:
            state.apply(e)
        now += 1.0
    state.apply(ev.JobCompleted(at=now, job_id="run0", attempt=1))
    t0 = time.perf_counter()
    decide(state, now)
    times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    presets = sys.argv[1:] or ["topo", "fairshare", "full"]
    # each run keeps one `Indexes` across its cycles, as a service keeps one for its fold
    base = timed_cycles(lambda s, now, ix=Indexes(): naive_cycle(s, now, ix))
    print(f"{'naive':10s} first {base[0]:.3f}s  steady {base[1]:.3f}s {base[2]:.3f}s  after a completion {base[3]:.3f}s")
    for name in presets:
        preset, _, sets = name.partition(":")
        config = parse_policy(preset, [kv for kv in sets.split(",") if kv])
        t = timed_cycles(lambda s, now, cfg=config, ix=Indexes(): cycle(s, now, cfg, ix))
        print(f"{name:10s} first {t[0]:.3f}s  steady {t[1]:.3f}s {t[2]:.3f}s  after a completion {t[3]:.3f}s"
              f"   steady ratio vs naive {t[2] / max(base[2], 1e-9):.1f}x")


if __name__ == "__main__":
    main()
