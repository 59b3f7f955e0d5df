"""Safe checkpoints (issue 9): the pickle-overwrite attack, checksums, the fallback to the
previous good checkpoint; and secrets that reach the job without entering the log."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest

from gpusched.job import checkpoint_io
from gpusched.job import env as E
from gpusched.job.context import JobContext, load_checkpoint


class _Evil:
    """What a co-tenant writes over a victim's checkpoint: unpickling it runs code."""

    def __init__(self, sentinel: str):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def _env(tmp_path, **extra) -> dict[str, str]:
    (tmp_path / "control").mkdir(exist_ok=True)
    return {E.JOB_ID: "victim", E.ATTEMPT: "1", E.CHECKPOINT_DIR: str(tmp_path / "ckpt"),
            E.CONTROL_DIR: str(tmp_path / "control"), **extra}


def _acks(tmp_path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "control").glob(E.ACK_PREFIX + "*.json"))]


def _resume_env(tmp_path, newest: dict, previous: dict | None) -> dict[str, str]:
    """What the node daemon passes on resume, from the CheckpointSaved events (the acks)."""
    env = _env(tmp_path, **{E.RESUME_FROM: newest["path"], E.RESUME_STEP: str(newest["step"]),
                            E.RESUME_SHA256: newest["sha256"]})
    if previous is not None:
        env.update({E.RESUME_PREVIOUS: previous["path"], E.RESUME_PREVIOUS_STEP: str(previous["step"]),
                    E.RESUME_PREVIOUS_SHA256: previous["sha256"]})
    return env


def test_pickle_overwrite_attack_cannot_run_code(tmp_path, capfd):
    """Issue 9: a co-tenant overwrote a victim's `ckpt-*.pkl` and ran code inside the victim
    job at its next resume. Now the checkpoint is msgpack (no code on load), its checksum is
    in the log, and a tampered one is skipped for the previous good checkpoint."""
    victim = JobContext(environ=_env(tmp_path), install_signal=False)
    victim.checkpoint({"step": 1, "w": [1.0, 2.0]}, step=1)
    newest = victim.checkpoint({"step": 2, "w": [3.0, 4.0]}, step=2)
    first, second = _acks(tmp_path)
    sentinel = tmp_path / "pwned"
    with open(newest, "wb") as f:  # the attack: same name, a pickle that runs a command
        pickle.dump(_Evil(str(sentinel)), f)
    for name in ("ckpt-000000002.pkl", "ckpt-000000003.pkl"):
        with open(tmp_path / "ckpt" / name, "wb") as f:
            pickle.dump(_Evil(str(sentinel)), f)

    resumed = JobContext(environ=_resume_env(tmp_path, second, first), install_signal=False)
    state = resumed.load()
    assert not sentinel.exists(), "the attacker's code ran inside the victim job"
    assert state == {"step": 1, "w": [1.0, 2.0]} and resumed.resume_step == 1
    err = capfd.readouterr().err
    assert f"checkpoint {newest} (step 2) is not used: its SHA-256 is" in err
    assert "resuming from the previous good checkpoint" in err


def test_pickle_checkpoints_are_never_unpickled(tmp_path):
    path = tmp_path / "ckpt-000000005.pkl"
    sentinel = tmp_path / "pwned"
    with open(path, "wb") as f:
        pickle.dump(_Evil(str(sentinel)), f)
    with pytest.raises(checkpoint_io.UnsafeCheckpoint, match="never unpickles"):
        load_checkpoint(path)
    ctx = JobContext(environ=_env(tmp_path, **{E.RESUME_FROM: str(path), E.RESUME_STEP: "5"}), install_signal=False)
    assert ctx.load() is None and not sentinel.exists()


def test_no_checkpoint_verifies_means_a_fresh_start(tmp_path, capfd):
    ctx = JobContext(environ=_env(tmp_path), install_signal=False)
    path = ctx.checkpoint({"a": 1}, step=1)
    (ack,) = _acks(tmp_path)
    with open(path, "ab") as f:
        f.write(b"x")
    resumed = JobContext(environ=_resume_env(tmp_path, ack, None), install_signal=False)
    assert resumed.load() is None and resumed.resume_step is None
    assert "no checkpoint verified: starting from scratch" in capfd.readouterr().err


def test_numpy_arrays_round_trip_and_object_arrays_are_refused():
    data = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.int64(3), "t": (1, 2)}
    back = checkpoint_io.loads(checkpoint_io.dumps(data))
    assert back["w"].dtype == np.float32 and back["w"].shape == (2, 3) and np.array_equal(back["w"], data["w"])
    assert back["n"] == 3 and back["t"] == [1, 2]
    with pytest.raises(TypeError, match="Python objects"):
        checkpoint_io.dumps({"bad": np.array([object()], dtype=object)})
    with pytest.raises(TypeError, match="cannot checkpoint _Evil"):
        checkpoint_io.dumps({"bad": _Evil("x")})


def test_a_directory_checkpoint_is_verified_as_a_tree(tmp_path):
    tree = tmp_path / "step-9"
    (tree / "shards").mkdir(parents=True)
    (tree / "shards" / "0.pt").write_bytes(b"tensor-0")
    sha = checkpoint_io.sha256_of(tree)
    assert checkpoint_io.problem(str(tree), sha) is None
    (tree / "shards" / "0.pt").write_bytes(b"tensor-X")
    assert "tampered" in checkpoint_io.problem(str(tree), sha)


# --- secrets ----------------------------------------------------------------------------------

def test_secret_env_reaches_the_job_and_only_the_path_is_in_the_spec(tmp_path):
    import msgspec

    from gpusched.core import events as ev
    from gpusched.core.model import JobSpec
    from gpusched.services.nodeagent import secrets

    token = tmp_path / "hf_token"
    token.write_text("hf_s3cr3t\n")
    token.chmod(0o600)
    spec = JobSpec(team="a", gpus=1, command=["env"], secret_env={"HF_TOKEN": str(token)})
    event = ev.encode_event(ev.JobSubmitted(at=1.0, job_id="j", spec=spec))
    assert b"hf_s3cr3t" not in event and str(token).encode() in event
    assert secrets.read_secret_env(spec.secret_env) == {"HF_TOKEN": "hf_s3cr3t"}
    assert msgspec.json.decode(event)["spec"]["secret_env"] == {"HF_TOKEN": str(token)}


@pytest.mark.parametrize("setup, fragment", [
    ("missing", "cannot open"),
    ("world-writable", "writable by group or others"),
    ("directory", "not a regular file"),
    ("symlink", "cannot open"),
    ("foreign-owner", "may not read"),
    ("group-readable-other-group", "may not read"),
])
def test_unusable_secret_files_are_refused_without_their_content(tmp_path, setup, fragment):
    from gpusched.services.nodeagent import secrets

    path = tmp_path / "s"
    reader = None
    if setup == "world-writable":
        path.write_text("x")
        path.chmod(0o666)
    elif setup == "directory":
        path.mkdir()
    elif setup == "symlink":
        (tmp_path / "real").write_text("x")
        path.symlink_to(tmp_path / "real")
    elif setup == "foreign-owner":
        path.write_text("x")
        path.chmod(0o600)
        reader = (os.geteuid() + 1, {os.getegid()})  # another user: the owner alone may read it
    elif setup == "group-readable-other-group":
        path.write_text("x")
        path.chmod(0o640)
        reader = (os.geteuid() + 1, {os.getegid() + 1})  # neither its owner nor in its group
    with pytest.raises(secrets.SecretError, match=fragment):
        secrets.read_secret("TOKEN", str(path), reader)
