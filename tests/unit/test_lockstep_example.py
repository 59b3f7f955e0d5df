"""examples/train_lockstep.py under `--checkpoint all`: when one rank is asked, both save the
same step (the barrier's vote; rank 0's file as `-rank0`), and a run resumed from it ends with
the weights, bit for bit, of a run that never stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpusched.job import env as E

pytest.importorskip("numpy")
EXAMPLE = Path(__file__).parents[2] / "examples" / "train_lockstep.py"
ARGS = ["--steps", "60", "--sync-every", "10", "--barrier-timeout", "30"]


def ranks(tmp: Path, ck: Path, out: Path, attempt: int, asked: bool, resume: dict[int, str] | None = None) -> None:
    procs = []
    for rank in (0, 1):
        control = tmp / f"control-{out.stem}-{rank}"
        control.mkdir()
        if asked and rank == 1:  # the request reaches one rank first
            (control / E.REQUEST).write_text(json.dumps({"id": "r1", "reason": "preempted for j-9"}))
        env = {**os.environ, E.JOB_ID: "j1", E.ATTEMPT: str(attempt), E.CHECKPOINT_DIR: str(ck),
               E.CONTROL_DIR: str(control), E.CHECKPOINT_MODE: "all", "RANK": str(rank), "WORLD_SIZE": "2"}
        if resume:
            env[E.RESUME_FROM], env[E.RESUME_STEP] = resume[rank], "10"
        procs.append(subprocess.Popen([sys.executable, str(EXAMPLE), *ARGS, "--out", str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, stderr


def test_ranks_save_the_same_step_and_resume_bit_identically(tmp_path):
    ck = tmp_path / "ck"
    ranks(tmp_path, tmp_path / "ck-plain", tmp_path / "plain.npy", 1, asked=False)
    ranks(tmp_path, ck, tmp_path / "asked.npy", 1, asked=True)
    saved = sorted(p.name for p in ck.glob("ckpt-*"))
    assert saved == ["ckpt-000000010-rank0.msgpack", "ckpt-000000010-rank1.msgpack"]  # both, at one step
    ranks(tmp_path, ck, tmp_path / "resumed.npy", 2, asked=False,
          resume={r: str(ck / f"ckpt-000000010-rank{r}.msgpack") for r in (0, 1)})
    plain = (tmp_path / "plain.npy").read_bytes()
    assert (tmp_path / "asked.npy").read_bytes() == plain
    assert (tmp_path / "resumed.npy").read_bytes() == plain
