"""The sha256 of every event a simulation applies, in order: a change meant to make the policy
faster, not different, must leave it unchanged (stop 42: the head's discarded ETA).

    python bench/event_hash.py [--cluster 2x32x8] [--runtime-model realistic] [--preset full]
                               [--trace FILE [--format F]] [--topology any]

Another trace than the bundled week (a Philly week cut by `bench/price_of_fairness.py`, Alibaba)
shows the same on a schedule the change was not tuned on.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import msgspec

from gpusched.core import events as ev
from gpusched.policy.config import PRESETS
from gpusched.sim import engine
from gpusched.sim.engine import TOPOLOGY_MAPPINGS, Cluster
from gpusched.sim.report import runtime_model, simulate
from gpusched.sim.traces import FORMATS, TraceError, load_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="2x32x8")
    ap.add_argument("--runtime-model", default="realistic", choices=("realistic", "ideal"))
    ap.add_argument("--preset", default="full", choices=sorted(PRESETS))
    ap.add_argument("--trace", help="trace file (default: the bundled Philly week)")
    ap.add_argument("--format", choices=FORMATS, help="trace format (default: guessed from the file)")
    ap.add_argument("--topology", default="pack", choices=TOPOLOGY_MAPPINGS)
    args = ap.parse_args()
    try:
        jobs = load_trace(args.trace, args.format)
    except TraceError as e:
        ap.error(str(e))
    digest, encode = hashlib.sha256(), msgspec.msgpack.Encoder().encode
    applied = engine.Simulation._apply

    def hashed(sim: engine.Simulation, event: ev.Event) -> None:
        digest.update(encode(event))
        applied(sim, event)

    engine.Simulation._apply = hashed  # type: ignore[method-assign]
    began = time.perf_counter()
    sim = simulate(jobs, Cluster.parse(args.cluster), args.preset,
                   runtime_model(args.runtime_model), topology=args.topology)
    print(f"{args.preset} on {args.cluster}, {args.runtime_model}, {args.topology}: events sha256 {digest.hexdigest()[:16]}, "
          f"{sim.state.events} events, {sim.cycles} cycles, {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
