"""The preemptor's CPU per decision round: the whole cycle (what it ran before, keeping only its
own kinds) against the cycle less the steps whose decisions it throws away (`PREEMPTOR_SKIPS`:
the queue's reasons and the ETA forecast), on bench_cycle's cluster (1000 busy nodes, 10,000
pending gangs). Both keep one `Indexes` across their rounds, as the service does, and must
decide the same preemptions.

    python bench/bench_preemptor.py [--rounds 6] [--preset full]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "libs"))

from bench_cycle import build  # noqa: E402  (bench/ is on the path: the script's folder)

from gpusched.core import events as ev  # noqa: E402
from gpusched.decider import PREEMPTOR_KINDS, PREEMPTOR_SKIPS  # noqa: E402
from gpusched.policy.config import parse_policy  # noqa: E402
from gpusched.policy.cycle import cycle  # noqa: E402
from gpusched.policy.memo import Indexes  # noqa: E402


def rounds(config, skip: tuple[str, ...], n: int) -> tuple[list[float], list[list[ev.Event]]]:
    """CPU seconds of each round, and what the preemptor keeps of each. Between rounds a running
    job completes, so the queue's reasons change as they do on a live cluster."""
    state, ix, now = build(), Indexes(), 100.0
    cpu, kept = [], []
    for i in range(n):
        t0 = time.process_time()
        out = cycle(state, now, config, ix, skip)
        cpu.append(time.process_time() - t0)
        mine = [e for e in out if isinstance(e, PREEMPTOR_KINDS)]
        kept.append(mine)
        for e in mine:
            state.apply(e)
        now += 60.0
        state.apply(ev.JobCompleted(at=now, job_id=f"run{i}", attempt=1))
    return cpu, kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--preset", default="full")
    args = ap.parse_args()
    config = parse_policy(args.preset, [])
    whole, kept_whole = rounds(config, (), args.rounds)
    own, kept_own = rounds(config, PREEMPTOR_SKIPS, args.rounds)
    assert kept_whole == kept_own, "skipping what it throws away changed the preemptor's decisions"
    decided = sum(map(len, kept_own))
    print(f"preemptor round CPU ({args.preset}, {args.rounds} rounds, {decided} decisions, identical):")
    print(f"  whole cycle      first {whole[0] * 1e3:8.1f} ms  mean of the rest {sum(whole[1:]) / max(1, len(whole) - 1) * 1e3:8.1f} ms")
    print(f"  own question     first {own[0] * 1e3:8.1f} ms  mean of the rest {sum(own[1:]) / max(1, len(own) - 1) * 1e3:8.1f} ms")
    print(f"  ratio (own / whole, all rounds) {sum(own) / max(sum(whole), 1e-9):.2f}x")


if __name__ == "__main__":
    main()
