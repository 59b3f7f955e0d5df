"""How far one placement writer goes: its decision and fold cost per grant under churn, in
memory (no NATS: the CPU one writer spends per grant, which bounds grants/s on one core).

N nodes x 8 GPUs, a backlog of jobs (sizes 1,1,1,1,2,2,4,8: mean 2.5 GPUs, as bench_e2e.py);
the first cycle fills the cluster, then each round completes the `--per-round` oldest running
jobs (what the node daemons report between two cycles), runs one `full` cycle, keeps at most
250 reasons (as placement's writer does) and applies what it decided. Reports the CPU time (this
process's, so a busy machine slows it less than wall time) of deciding and folding per round and
per grant, and grants/s one core could sustain (1 / (decide + fold) per grant), against the
naive fallback's cycle measured in the same run.

    python bench/bench_churn.py [--nodes 1000 2000 4000] [--rounds 40] [--per-round 200]
"""

from __future__ import annotations

import argparse
import random
import time
from collections import deque

from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.core.state import ClusterState
from gpusched.policy.config import PRESETS
from gpusched.policy.cycle import cycle, naive_cycle
from gpusched.policy.memo import Indexes

SIZES = [1, 1, 1, 1, 2, 2, 4, 8]
MAX_REASONS = 250


def build(nodes: int, backlog: int) -> ClusterState:
    state = ClusterState()
    for i in range(nodes):
        name = f"node{i:04d}"
        state.apply(ev.NodeRegistered(at=0, node=name, rack=f"r{i // 32}", nvlink="all",
                                      gpus=[GpuInfo(index=k, uuid=f"{name}-{k}") for k in range(8)]))
    rng = random.Random(1)
    for i in range(backlog):
        state.apply(ev.JobSubmitted(at=1 + i * 1e-4, job_id=f"j{i:07d}", spec=JobSpec(team=f"t{i % 8}",
                                                                                     gpus=rng.choice(SIZES))))
    return state


def apply_round(state: ClusterState, events: list[ev.Event], running: deque) -> tuple[int, int, float]:
    """Apply a round's decisions as the writer would append them (reasons budgeted)."""
    t0 = time.process_time()
    grants = reasons = 0
    for e in events:
        if isinstance(e, ev.JobPending):
            reasons += 1
            if reasons > MAX_REASONS:
                continue
        elif isinstance(e, ev.GpusGranted):
            grants += 1
            running.append((e.job_id, e.attempt))
        state.apply(e)
    return grants, min(reasons, MAX_REASONS), time.process_time() - t0


def churn(nodes: int, rounds: int, per_round: int, decide) -> dict:
    state = build(nodes, backlog=nodes * 20)
    running: deque = deque()
    now = 100.0
    apply_round(state, decide(state, now), running)  # the fill
    t_decide = t_fold = 0.0
    grants = reasons = 0
    for _ in range(rounds):
        now += 0.1
        t0 = time.process_time()
        for _ in range(min(per_round, len(running))):
            job, attempt = running.popleft()
            state.apply(ev.JobCompleted(at=now, job_id=job, attempt=attempt))
        t_fold += time.process_time() - t0
        t0 = time.process_time()
        out = decide(state, now)
        t_decide += time.process_time() - t0
        g, r, folded = apply_round(state, out, running)
        t_fold += folded
        grants += g
        reasons += r
    per_grant = (t_decide + t_fold) / max(1, grants)
    return {"grants": grants, "reasons": reasons, "decide_ms": 1000 * t_decide / rounds,
            "fold_ms": 1000 * t_fold / rounds, "per_grant_us": 1e6 * per_grant, "grants_per_s": 1 / per_grant}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1000, 2000, 4000])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--per-round", type=int, default=200, help="completions between two cycles")
    args = ap.parse_args()
    import os

    print(f"load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds of {args.per_round} completions each")
    for nodes in args.nodes:
        base = churn(nodes, args.rounds, args.per_round, lambda s, now, ix=Indexes(MAX_REASONS): naive_cycle(s, now, ix))
        full = churn(nodes, args.rounds, args.per_round,
                     lambda s, now, ix=Indexes(MAX_REASONS): cycle(s, now, PRESETS["full"], ix))
        print(f"{nodes:5d} nodes: full: {full['grants']} grants, {full['reasons']} reasons kept; decide "
              f"{full['decide_ms']:.1f} ms + fold {full['fold_ms']:.1f} ms per round; {full['per_grant_us']:.0f} us "
              f"per grant = {full['grants_per_s']:.0f} grants/s on one core   (naive: {base['grants_per_s']:.0f}/s, "
              f"ratio {full['grants_per_s'] / base['grants_per_s']:.2f})")


if __name__ == "__main__":
    main()
