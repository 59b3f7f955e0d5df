"""The sha256 of every event a simulation applies, in order: a change meant to make the policy
faster, not different, must leave it unchanged (stop 42: the head's discarded ETA).

    python bench/event_hash.py [--cluster 2x32x8] [--runtime-model realistic] [--preset full]
"""

from __future__ import annotations

import argparse
import hashlib
import time

import msgspec

from gpusched.core import events as ev
from gpusched.policy.config import PRESETS
from gpusched.sim import engine
from gpusched.sim.engine import Cluster
from gpusched.sim.report import runtime_model, simulate
from gpusched.sim.traces import load_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="2x32x8")
    ap.add_argument("--runtime-model", default="realistic", choices=("realistic", "ideal"))
    ap.add_argument("--preset", default="full", choices=sorted(PRESETS))
    args = ap.parse_args()
    digest, encode = hashlib.sha256(), msgspec.msgpack.Encoder().encode
    applied = engine.Simulation._apply

    def hashed(sim: engine.Simulation, event: ev.Event) -> None:
        digest.update(encode(event))
        applied(sim, event)

    engine.Simulation._apply = hashed  # type: ignore[method-assign]
    began = time.perf_counter()
    sim = simulate(load_trace(), Cluster.parse(args.cluster), args.preset, runtime_model(args.runtime_model))
    print(f"{args.preset} on {args.cluster}, {args.runtime_model}: events sha256 {digest.hexdigest()[:16]}, "
          f"{sim.state.events} events, {sim.cycles} cycles, {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
