"""The job SDK: inert outside gpusched, durable checkpoints, requests by file and by signal."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gpusched.job import JobContext, load_checkpoint
from gpusched.job import env as E


def managed_env(tmp: Path, **extra: str) -> dict[str, str]:
    (tmp / "control").mkdir(exist_ok=True)
    env = {E.JOB_ID: "j1", E.ATTEMPT: "2", E.CHECKPOINT_DIR: str(tmp / "ckpt"), E.CONTROL_DIR: str(tmp / "control"),
           "RANK": "0", "WORLD_SIZE": "2"}
    env.update(extra)
    return env


def acks(tmp: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((tmp / "control").glob(f"{E.ACK_PREFIX}*.json"))]


def test_outside_gpusched_it_is_inert(tmp_path):
    ctx = JobContext(environ={})
    assert (ctx.managed, ctx.job_id, ctx.attempt, ctx.resume_from, ctx.load()) == (False, None, 0, None, None)
    assert ctx.checkpoint_requested is False
    assert ctx.checkpoint({"w": 1}, step=3) is None  # nowhere to save: a no-op
    # given a directory it still saves (a local run can checkpoint too), but acknowledges to no one
    ctx = JobContext(environ={}, checkpoint_dir=tmp_path)
    path = ctx.checkpoint({"w": 1}, step=3)
    assert load_checkpoint(path) == {"w": 1} and not list(tmp_path.glob(".*"))


def test_checkpoint_is_durable_and_acknowledged(tmp_path):
    ctx = JobContext(environ=managed_env(tmp_path), install_signal=False)
    assert (ctx.managed, ctx.job_id, ctx.attempt, ctx.rank, ctx.world_size) == (True, "j1", 2, 0, 2)
    state = {"step": 7, "w": np.arange(4.0)}
    path = ctx.checkpoint(state, step=7)
    assert path == str(tmp_path / "ckpt" / "ckpt-000000007.msgpack")
    got = load_checkpoint(path)
    assert got["step"] == 7 and np.array_equal(got["w"], state["w"])
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")]  # no temp files left
    raw = ctx.checkpoint(b"\x00\x01", step=8)
    assert load_checkpoint(raw) == b"\x00\x01"
    own = tmp_path / "model.pt"  # a file the job wrote itself: made durable in place
    own.write_bytes(b"weights")
    assert ctx.checkpoint(own, step=9) == str(own)
    assert [(a["path"], a["step"]) for a in acks(tmp_path)] == [(path, 7), (raw, 8), (str(own), 9)]
    assert all(a["request"] is None for a in acks(tmp_path))
    assert [a["sha256"] for a in acks(tmp_path)][2] == hashlib.sha256(b"weights").hexdigest()


def test_resume_from_the_last_checkpoint(tmp_path):
    first = JobContext(environ=managed_env(tmp_path), install_signal=False)
    path = first.checkpoint({"step": 5}, step=5)
    ctx = JobContext(environ=managed_env(tmp_path, **{E.RESUME_FROM: path, E.RESUME_STEP: "5"}), install_signal=False)
    assert (ctx.resume_from, ctx.resume_step, ctx.load()) == (path, 5, {"step": 5})


def test_request_by_control_file_until_checkpointed(tmp_path):
    ctx = JobContext(environ=managed_env(tmp_path), install_signal=False)
    assert not ctx.checkpoint_requested
    (tmp_path / "control" / E.REQUEST).write_text(json.dumps({"id": "41", "reason": "preempted", "deadline": 0}))
    ctx._checked = 0.0  # the file is polled at most 4 times a second
    assert ctx.checkpoint_requested
    ctx.checkpoint({"x": 1}, step=1)
    assert not ctx.checkpoint_requested
    assert acks(tmp_path)[-1]["request"] == "41"
    (tmp_path / "control" / E.REQUEST).write_text(json.dumps({"id": "57"}))  # a second request
    ctx._checked = 0.0
    assert ctx.checkpoint_requested


CHILD = """
import sys, time
from gpusched.job import context
ctx = context()
print("ready", flush=True)
deadline = time.time() + 10
while not ctx.checkpoint_requested and time.time() < deadline:
    time.sleep(0.01)
ctx.checkpoint({"ok": True}, step=1)
print("checkpointed", flush=True)
"""


@pytest.mark.timeout(20)
def test_sigusr1_reaches_a_process_using_the_sdk(tmp_path):
    env = {**os.environ, **managed_env(tmp_path)}
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        registered = list((tmp_path / "control").glob(f"{E.SDK_PREFIX}*"))
        assert [p.name for p in registered] == [f"{E.SDK_PREFIX}{child.pid}"]
        # the daemon writes the request file first, then signals
        (tmp_path / "control" / E.REQUEST).write_text(json.dumps({"id": "7"}))
        t0 = time.monotonic()
        os.kill(child.pid, signal.SIGUSR1)
        assert child.stdout.readline().strip() == "checkpointed"
        assert time.monotonic() - t0 < 5
        assert child.wait(5) == 0
    finally:
        if child.poll() is None:
            child.kill()
    assert acks(tmp_path)[0]["request"] == "7"


def test_example_is_deterministic_outside_gpusched(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
    outs = []
    for name in ("a.npy", "b.npy"):
        subprocess.run([sys.executable, str(root / "examples" / "train_numpy.py"), "--steps", "30", "--out",
                        str(tmp_path / name)], check=True, env=env, capture_output=True, timeout=60)
        outs.append((tmp_path / name).read_bytes())
    assert outs[0] == outs[1]


def test_only_the_ranks_that_must_save_are_asked(tmp_path):
    """rank0 mode: rank 1 is never asked (its save would not count); all mode: every rank is,
    and each saves under its own name in the shared checkpoint directory."""
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / E.REQUEST).write_text(json.dumps({"id": "7", "reason": "resize to 1 node(s)"}))
    rank1 = JobContext(environ=managed_env(tmp_path, RANK="1"), install_signal=False)
    assert not rank1.must_checkpoint and not rank1.checkpoint_requested
    all1 = JobContext(environ=managed_env(tmp_path, RANK="1", GPUSCHED_CHECKPOINT_MODE="all"), install_signal=False)
    assert all1.must_checkpoint and all1.checkpoint_requested and all1.request_reason == "resize to 1 node(s)"
    assert all1.checkpoint({"w": 1}, step=3).endswith("ckpt-000000003-rank1.msgpack")
    all0 = JobContext(environ=managed_env(tmp_path, GPUSCHED_CHECKPOINT_MODE="all"), install_signal=False)
    assert all0.checkpoint({"w": 1}, step=3).endswith("ckpt-000000003-rank0.msgpack")  # as docs/jobs.md names it
