#!/usr/bin/env python3
"""Lockstep training for `--checkpoint all`: every rank saves the same step, and a resumed run
ends with the same weights, bit for bit, as one that never stopped.

Under `--checkpoint all` a checkpoint counts once every rank saved the same step. Ranks that
step on their own notice a request at different steps and never agree (the job then runs out
its grace and loses its work). So every `--sync-every` steps the ranks meet at a barrier: each
writes whether it was asked into a directory they share (`<checkpoint dir>/lockstep`) and waits
for the others'; if any was asked, all save that step. A real data-parallel job gets the
barrier from its all-reduce; this example, with a replicated model, makes its own.

The training is train_numpy.py's (minibatch SGD on fixed data, step k's batch seeded by
(seed, k)), so resuming from step k recomputes the same weights. Rank 0 writes the final ones.

    gpusched submit --team T --gpus 16 --checkpoint all --checkpoint-dir /shared/ck -- \\
        python examples/train_lockstep.py --steps 2000 --step-time 0.01
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path

import numpy as np

from gpusched.job import context, write_durably


def barrier(shared: Path, step: int, rank: int, world: int, asked: bool, timeout_s: float) -> bool:
    """Meet the other ranks at `step`; True when any of them was asked to checkpoint."""
    mine = shared / f"step-{step:09d}-rank{rank}"
    tmp = shared / f".{mine.name}.tmp"
    tmp.write_text("1" if asked else "0")
    os.replace(tmp, mine)
    deadline = time.monotonic() + timeout_s
    votes = []
    for r in range(world):
        path = shared / f"step-{step:09d}-rank{r}"
        while not path.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {rank}: rank {r} never reached step {step} (waited {timeout_s:g} s)")
            time.sleep(0.002)
        votes.append(path.read_text() == "1")
    return any(votes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sync-every", type=int, default=10, help="steps between barriers")
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep per step (to look busy)")
    ap.add_argument("--barrier-timeout", type=float, default=600.0, help="seconds to wait for the other ranks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--out", default=None, help="final weights (default: <checkpoint dir>/final.npy)")
    args = ap.parse_args(argv)

    ctx = context()
    if ctx.checkpoint_dir is None:
        print("train_lockstep: needs a checkpoint directory every rank shares (--checkpoint-dir)", file=sys.stderr)
        return 2
    shared = ctx.checkpoint_dir / "lockstep" / f"attempt-{ctx.attempt}.{ctx.generation}"
    shared.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    x = rng.normal(size=(512, 16))
    y = x @ rng.normal(size=16) + 0.1 * rng.normal(size=512)
    state = ctx.load() or {"step": 0, "w": np.zeros(16)}
    step, w = int(state["step"]), np.array(state["w"], dtype=np.float64)
    print(f"job {ctx.job_id} attempt {ctx.attempt}: rank {ctx.rank}/{ctx.world_size} starting at step {step}",
          flush=True)

    while step < args.steps:
        batch = np.random.default_rng([args.seed, step]).integers(0, len(x), size=32)
        xb, yb = x[batch], y[batch]
        w = w - args.lr * (2.0 / len(batch)) * xb.T @ (xb @ w - yb)
        step += 1
        if step % args.sync_every == 0 and step < args.steps:
            if barrier(shared, step, ctx.rank, ctx.world_size, ctx.checkpoint_requested, args.barrier_timeout):
                path = ctx.checkpoint({"step": step, "w": w}, step)
                print(f"rank {ctx.rank}: checkpoint at step {step}: {path}", flush=True)
            old = shared / f"step-{step - 2 * args.sync_every:09d}-rank{ctx.rank}"
            old.unlink(missing_ok=True)  # every rank is past it: it wrote step - sync_every's vote
        if args.step_time:
            time.sleep(args.step_time)

    if ctx.rank != 0:
        return 0
    out = Path(args.out) if args.out else ctx.checkpoint_dir / "final.npy"
    buf = io.BytesIO()
    np.save(buf, w)
    write_durably(out, buf.getvalue())
    print(f"done: {args.steps} steps, weights in {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
