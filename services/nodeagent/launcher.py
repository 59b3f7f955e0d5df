"""Start a job's process for one attempt on one node, and stop it.

One launcher process per node and attempt (the torchrun model): `RANK` is the node's rank in
the job (nodes ordered as the grant lists their GPUs), `WORLD_SIZE` the number of nodes,
`LOCAL_RANK` 0; the process may itself be `torchrun --nnodes=$WORLD_SIZE --node_rank=$RANK
--nproc_per_node=$GPUSCHED_NPROC_PER_NODE ...`. `CUDA_VISIBLE_DEVICES` holds the GPUs' indices
with `CUDA_DEVICE_ORDER=PCI_BUS_ID`, the order NVML numbers them in (the UUIDs are in
`GPUSCHED_GPU_UUIDS`). The process leads its own session, so that stopping it stops every
process it started. A job with an empty command gets a placeholder that holds its GPUs
without any OS process (simulated clusters).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpusched.job import env as E

from . import secrets
from .backends import VIRTUAL_PID_BASE

#: Placeholder jobs read these from `spec.env`: run this long then exit with this code, and
#: answer a checkpoint request after this delay ("never": do not answer).
SIM_DURATION = "GPUSCHED_SIM_DURATION_S"
SIM_EXIT_CODE = "GPUSCHED_SIM_EXIT_CODE"
SIM_CHECKPOINT = "GPUSCHED_SIM_CHECKPOINT_S"


def master_port(job_id: str, attempt: int) -> int:
    """Deterministic per job and attempt, so that every node computes the same one."""
    return 29500 + zlib.crc32(f"{job_id}:{attempt}".encode()) % 10000


@dataclass(frozen=True)
class Launch:
    job_id: str
    attempt: int
    node: str
    node_rank: int
    num_nodes: int
    gpus: tuple[int, ...]  # local indices
    gpu_ids: tuple[str, ...]
    gpu_uuids: tuple[str, ...]
    master_addr: str
    command: tuple[str, ...]
    env: Mapping[str, str]
    checkpoint_dir: Path
    control_dir: Path
    log_path: Path
    resume_from: str | None = None
    resume_step: int | None = None
    cwd: str | None = None
    resume_sha256: str = ""
    #: The checkpoint before `resume_from` (path, step, sha256): the SDK's fallback.
    resume_previous: tuple[str, int, str] | None = None
    #: Variable -> file on this node (`spec.secret_env`): read at launch, never logged.
    secret_env: Mapping[str, str] = field(default_factory=dict)


def job_env(launch: Launch, base: Mapping[str, str]) -> dict[str, str]:
    """The job's environment: the daemon's, then the spec's, then the scheduler's (which win)."""
    out = {k: v for k, v in base.items() if not k.startswith("GPUSCHED_")}
    out.setdefault("PYTHONUNBUFFERED", "1")
    out.update(launch.env)
    out.update({
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in launch.gpus),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "MASTER_ADDR": launch.master_addr,
        "MASTER_PORT": str(master_port(launch.job_id, launch.attempt)),
        "WORLD_SIZE": str(launch.num_nodes),
        "RANK": str(launch.node_rank),
        "LOCAL_RANK": "0",
        E.JOB_ID: launch.job_id,
        E.ATTEMPT: str(launch.attempt),
        E.NODE: launch.node,
        E.NODE_RANK: str(launch.node_rank),
        E.NNODES: str(launch.num_nodes),
        E.NPROC_PER_NODE: str(len(launch.gpus)),
        E.GPUS: ",".join(launch.gpu_ids),
        E.GPU_UUIDS: ",".join(launch.gpu_uuids),
        E.CHECKPOINT_DIR: str(launch.checkpoint_dir),
        E.CONTROL_DIR: str(launch.control_dir),
    })
    if launch.resume_from:
        out[E.RESUME_FROM] = launch.resume_from
        if launch.resume_step is not None:
            out[E.RESUME_STEP] = str(launch.resume_step)
        out[E.RESUME_SHA256] = launch.resume_sha256
        if launch.resume_previous is not None:
            out[E.RESUME_PREVIOUS], step, out[E.RESUME_PREVIOUS_SHA256] = launch.resume_previous
            out[E.RESUME_PREVIOUS_STEP] = str(step)
    return out


def resume_and_secrets(job) -> dict:
    """The Launch fields that come from the fold's job beyond the basics: the checkpoint's
    checksum, the one before it (the SDK's fallback), and the secret files to read."""
    ck, prev = job.checkpoint, job.previous_checkpoint
    return {
        "resume_sha256": ck.sha256 if ck is not None else "",
        "resume_previous": (prev.path, prev.step, prev.sha256) if ck is not None and prev is not None else None,
        "secret_env": dict(job.spec.secret_env),
    }


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def ack_sha256(ack: object) -> str:
    """The checksum a job's checkpoint acknowledgement carries, if well-formed ("" otherwise)."""
    value = ack.get("sha256", "") if isinstance(ack, dict) else ""
    return value if isinstance(value, str) and _SHA256.match(value) else ""


class JobProcess:
    """A started OS process (the leader of its own session)."""

    virtual = False

    def __init__(self, launch: Launch, base_env: Mapping[str, str]):
        launch.control_dir.mkdir(parents=True, exist_ok=True)
        launch.log_path.parent.mkdir(parents=True, exist_ok=True)
        launch.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.launch = launch
        self.spawn_error: str | None = None
        with open(launch.log_path, "ab") as out:
            out.write(f"--- gpusched: {launch.job_id} attempt {launch.attempt} on {launch.node} "
                      f"rank {launch.node_rank}/{launch.num_nodes} gpus {list(launch.gpus)}\n".encode())
            out.flush()
            try:
                env = {**job_env(launch, base_env), **secrets.read_secret_env(launch.secret_env)}
                self.popen: subprocess.Popen | None = subprocess.Popen(
                    list(launch.command), env=env, stdin=subprocess.DEVNULL,
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=launch.cwd,
                )
            except OSError as err:
                self.popen = None
                self.spawn_error = f"cannot start {launch.command[0]!r}: {err}"
                out.write(f"--- gpusched: {self.spawn_error}\n".encode())
        self.pid = self.popen.pid if self.popen is not None else 0

    def poll(self) -> int | None:
        if self.popen is None:
            return 127
        return self.popen.poll()

    def signal_group(self, sig: int) -> None:
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            if self.popen.poll() is None:
                try:
                    self.popen.send_signal(sig)
                except ProcessLookupError:
                    pass

    def signal_pids(self, pids: list[int], sig: int) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def kill_stragglers(self) -> None:
        """After the leader exits, nothing it started may outlive it."""
        if self.popen is not None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


_virtual_pids = itertools.count(VIRTUAL_PID_BASE)


class VirtualProcess:
    """A placeholder that holds the job's GPUs without an OS process: exits after
    GPUSCHED_SIM_DURATION_S (if set in the spec's env) with GPUSCHED_SIM_EXIT_CODE (default 0)."""

    virtual = True
    spawn_error = None

    def __init__(self, launch: Launch, now: float | None = None):
        self.launch = launch
        self.pid = next(_virtual_pids)
        self.started = time.monotonic() if now is None else now
        duration = launch.env.get(SIM_DURATION)
        self.ends_at = self.started + float(duration) if duration else None
        self.exit_code = int(launch.env.get(SIM_EXIT_CODE, "0") or 0)
        self._signalled: int | None = None
        ck = launch.env.get(SIM_CHECKPOINT, "1.0")
        self.checkpoint_after: float | None = None if ck == "never" else float(ck)

    def poll(self) -> int | None:
        if self._signalled is not None:
            return -self._signalled
        if self.ends_at is not None and time.monotonic() >= self.ends_at:
            return self.exit_code
        return None

    def signal_group(self, sig: int) -> None:
        if self._signalled is None and self.poll() is None:
            self._signalled = sig

    def signal_pids(self, pids: list[int], sig: int) -> None:
        pass

    def kill_stragglers(self) -> None:
        pass


def start(launch: Launch, base_env: Mapping[str, str] | None = None) -> JobProcess | VirtualProcess:
    if not launch.command:
        return VirtualProcess(launch)
    return JobProcess(launch, os.environ if base_env is None else base_env)


__all__ = ["Launch", "JobProcess", "VirtualProcess", "job_env", "master_port", "start"]
