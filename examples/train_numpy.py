#!/usr/bin/env python3
"""A small deterministic training loop that checkpoints on request and resumes.

Linear regression by minibatch SGD on fixed synthetic data: step `k` draws its minibatch from
a generator seeded by (seed, k), so a run resumed from a checkpoint at step `k` computes the
same weights, bit for bit, as a run that never stopped. It checkpoints every K steps and
whenever the scheduler asks (`ctx.checkpoint_requested`), and writes its final weights to
`final.npy` in the checkpoint directory (or `--out`). Outside gpusched it just trains.

Every rank computes the same weights (a replicated model), so it checkpoints from rank 0 only
(the default `--checkpoint rank0`; the SDK's `must_checkpoint` is False on other ranks) and
rank 0 writes the final weights. Ranks of a real data-parallel job step in lockstep (every
all-reduce is a barrier); only such a job can use `--checkpoint all` (every rank saves the same
step): examples/train_lockstep.py is this loop with that barrier.

    python examples/train_numpy.py --steps 200 --out /tmp/final.npy
"""

from __future__ import annotations

import argparse
import io
import os
import time
from pathlib import Path

import numpy as np

from gpusched.job import context, write_durably


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--checkpoint-every", type=int, default=50, help="0: only when asked")
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep per step (to look busy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--out", default=None, help="final weights (default: <checkpoint dir>/final.npy)")
    args = ap.parse_args(argv)

    ctx = context()
    rng = np.random.default_rng(args.seed)
    x = rng.normal(size=(512, 16))
    y = x @ rng.normal(size=16) + 0.1 * rng.normal(size=512)

    state = ctx.load() or {"step": 0, "w": np.zeros(16)}
    step, w = int(state["step"]), np.array(state["w"], dtype=np.float64)
    print(f"job {ctx.job_id} attempt {ctx.attempt}: rank {ctx.rank}/{ctx.world_size} starting at step {step} "
          f"(resume_from={ctx.resume_from})", flush=True)

    while step < args.steps:
        if ctx.checkpoint_requested:
            path = ctx.checkpoint({"step": step, "w": w}, step)
            print(f"checkpoint on request at step {step}: {path}", flush=True)
        batch = np.random.default_rng([args.seed, step]).integers(0, len(x), size=32)
        xb, yb = x[batch], y[batch]
        w = w - args.lr * (2.0 / len(batch)) * xb.T @ (xb @ w - yb)
        step += 1
        if args.checkpoint_every and step % args.checkpoint_every == 0 and step < args.steps and ctx.must_checkpoint:
            ctx.checkpoint({"step": step, "w": w}, step)
        if args.step_time:
            time.sleep(args.step_time)

    if ctx.rank != 0:
        print(f"done: rank {ctx.rank} finished {args.steps} steps", flush=True)
        return 0
    out = Path(args.out) if args.out else (ctx.checkpoint_dir or Path(os.getcwd())) / "final.npy"
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.save(buf, w)
    write_durably(out, buf.getvalue())
    loss = float(np.mean((x @ w - y) ** 2))
    print(f"done: {args.steps} steps, loss {loss:.6f}, weights in {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
