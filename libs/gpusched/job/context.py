"""The job side of checkpoint-don't-restart: where to resume from, whether the scheduler asks
for a checkpoint, and a durable save that the node daemon turns into `CheckpointSaved`."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from . import checkpoint_io
from . import env as E


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    if path.is_dir():
        for child in sorted(path.rglob("*")):
            if child.is_file():
                with open(child, "rb") as f:
                    os.fsync(f.fileno())
        _fsync_dir(path)
    else:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(path.parent)


def write_durably(path: Path, data: bytes) -> None:
    """Temp file in the same directory, fsync, rename, fsync the directory: after a crash the
    path holds either the old content or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def load_checkpoint(path: str | os.PathLike) -> object:
    """What `JobContext.checkpoint` saved: the object (.msgpack), the bytes (.bin), else the
    path. Pickle files are refused (`checkpoint_io`)."""
    return checkpoint_io.load_file(path)


class JobContext:
    """Built from the environment the node daemon gives the job. Outside gpusched (no
    GPUSCHED_JOB_ID) it is inert: no resume point, never asked to checkpoint, and
    `checkpoint()` only saves if a checkpoint directory was given."""

    def __init__(self, environ: Mapping[str, str] | None = None, checkpoint_dir: str | os.PathLike | None = None,
                 install_signal: bool = True):
        environ = os.environ if environ is None else environ
        self._environ = dict(environ)
        self.job_id: str | None = environ.get(E.JOB_ID) or None
        self.attempt = int(environ.get(E.ATTEMPT, "0") or 0)
        self.resume_from: str | None = environ.get(E.RESUME_FROM) or None
        self.resume_step: int | None = int(environ[E.RESUME_STEP]) if environ.get(E.RESUME_STEP) else None
        ck = checkpoint_dir or environ.get(E.CHECKPOINT_DIR)
        self.checkpoint_dir: Path | None = Path(ck) if ck else None
        ctl = environ.get(E.CONTROL_DIR) if self.job_id else None
        self.control_dir: Path | None = Path(ctl) if ctl else None
        self.rank = int(environ.get("RANK", "0") or 0)
        self.world_size = int(environ.get("WORLD_SIZE", "1") or 1)
        self.local_rank = int(environ.get("LOCAL_RANK", "0") or 0)
        #: "rank0": only rank 0 saves checkpoints; "all": every rank saves its own, and a
        #: checkpoint counts once all ranks saved the same step.
        self.checkpoint_mode = environ.get(E.CHECKPOINT_MODE, "rank0") or "rank0"
        self.generation = int(environ.get(E.GENERATION, "0") or 0)
        self._signalled = False
        self._acked: str | None = None
        self._request: str | None = None
        self._checked = 0.0
        if install_signal and self.control_dir is not None:
            self._install_signal(self.control_dir)

    @property
    def must_checkpoint(self) -> bool:
        """Whether this rank saves checkpoints: rank 0, or every rank in "all" mode."""
        return self.checkpoint_mode == "all" or self.rank == 0

    @property
    def request_reason(self) -> str:
        """Why a checkpoint is asked for ("preempted for ...", "resize to N node(s)", "time
        limit ..."): after a resize the job restarts with the new WORLD_SIZE."""
        if self.control_dir is None:
            return ""
        try:
            return str(json.loads((self.control_dir / E.REQUEST).read_text())["reason"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return ""

    @property
    def managed(self) -> bool:
        """True when a gpusched node daemon started this process."""
        return self.job_id is not None

    def _install_signal(self, control: Path) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals only reach the main thread; the control file still works
        previous = signal.getsignal(signal.SIGUSR1)

        def on_usr1(signum, frame):
            self._signalled = True
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGUSR1, on_usr1)
        try:
            (control / f"{E.SDK_PREFIX}{os.getpid()}").write_text("SIGUSR1\n")
        except OSError:
            pass

    def _read_request(self) -> str | None:
        if self.control_dir is None:  # not started by a node daemon: nothing asks
            return None
        try:
            return str(json.loads((self.control_dir / E.REQUEST).read_text())["id"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @property
    def checkpoint_requested(self) -> bool:
        """True from the moment the scheduler asks for a checkpoint until one is saved. Cheap
        enough for every step: a signal flag, and the control file at most 4 times a second."""
        if self.control_dir is None or not self.must_checkpoint:
            return False
        now = time.monotonic()
        if self._signalled or now - self._checked >= 0.25:
            self._checked = now
            self._request = self._read_request()
        return self._request is not None and self._request != self._acked

    def checkpoint(self, data: object, step: int) -> str | None:
        """Save durably and tell the node daemon. `data`: a path the job already wrote (file or
        directory: made durable in place), bytes, or plain data (dicts, lists, numbers, str,
        bytes, numpy arrays: see `checkpoint_io`). Returns the path."""
        request = self._read_request() if self.control_dir is not None else None
        if isinstance(data, (str, os.PathLike)):
            path = Path(data)
            _fsync_tree(path)
        else:
            if self.checkpoint_dir is None:
                return None
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            # every rank saving into one directory needs its own names (rank 0's too: `-rank0`)
            stem = f"ckpt-{step:09d}" + (f"-rank{self.rank}" if self.checkpoint_mode == "all" else "")
            if isinstance(data, (bytes, bytearray, memoryview)):
                path, payload = self.checkpoint_dir / f"{stem}.bin", bytes(data)
            else:
                path, payload = self.checkpoint_dir / f"{stem}{checkpoint_io.SUFFIX}", checkpoint_io.dumps(data)
            write_durably(path, payload)
        if self.control_dir is not None:
            ack = {"path": str(path.resolve()), "step": int(step), "request": request, "at": time.time(),
                   "sha256": checkpoint_io.sha256_of(path)}
            name = f"{E.ACK_PREFIX}{step:09d}-{time.time_ns()}.json"
            tmp = self.control_dir / f".{name}.tmp"
            tmp.write_text(json.dumps(ack))
            os.replace(tmp, self.control_dir / name)
            self._acked, self._signalled = request, False
            self._request = request
        return str(path)

    def verified_resume(self) -> str | None:
        """The newest checkpoint whose checksum matches the log's record (falling back to the
        previous one, with a message on stderr), or None: a fresh start. `resume_step`
        follows the choice."""
        chosen = checkpoint_io.choose(self._environ)
        self.resume_step = chosen[1] if chosen else None
        return chosen[0] if chosen else None

    def load(self) -> object | None:
        """The verified checkpoint to resume from (see `load_checkpoint`), or None."""
        path = self.verified_resume() if self.resume_from else None
        return load_checkpoint(path) if path else None


_context: JobContext | None = None


def context() -> JobContext:
    """The process-wide job context (built once, from the environment)."""
    global _context
    if _context is None:
        _context = JobContext()
    return _context
