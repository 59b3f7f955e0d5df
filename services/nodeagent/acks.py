"""Checkpoint acknowledgements from a job's control directory, read within bounds.

A job is not trusted: the daemon reads at most `max_entries` directory entries per poll, only
regular files (never through a symlink) of at most `max_bytes`, and deletes each ack once read
(oversized or malformed ones too, with one warning). What it reports is coalesced: at most one
`CheckpointSaved` per run per `interval_s`, except an ack that answers the current checkpoint
request or that completes a step another rank already saved (collective checkpoints).

The checksum a `CheckpointSaved` records is the daemon's own (`checkpoint_sha256`), from the file
inside the job's checkpoint directory: an ack only says which file, never what it should hash to.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from gpusched.job import env as E

MAX_PATH = 4096
MAX_STEP = 2**62


@dataclass(frozen=True)
class AckLimits:
    max_bytes: int = 4096
    max_entries: int = 256
    interval_s: float = 5.0
    keep: int = 16  # recent unreported steps remembered per run


@dataclass(frozen=True)
class Ack:
    step: int
    path: str
    request: str | None
    sha256: str = ""  # filled in by the daemon from the file (`checkpoint_sha256`), never the job's claim


def _parse(raw: bytes) -> Ack:
    obj = json.loads(raw)
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    path, step, request = obj.get("path"), obj.get("step"), obj.get("request")
    if not isinstance(path, str) or not path or len(path) > MAX_PATH or "\0" in path:
        raise ValueError("path must be a non-empty string of at most 4096 characters")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an integer in 0..{MAX_STEP}")
    if request is not None and (not isinstance(request, str) or len(request) > 128):
        raise ValueError("request must be null or a short string")
    return Ack(step, path, request)


def _read_one(path: Path, max_bytes: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not (st.st_mode & 0o170000) == 0o100000:
            raise ValueError("not a regular file")
        if st.st_size > max_bytes:
            raise ValueError(f"{st.st_size} bytes, more than the {max_bytes} an ack may have")
        return os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)


def read_acks(control: Path, limits: AckLimits) -> tuple[list[Ack], list[str]]:
    """Acks found in `control` (each deleted once read) and what was wrong with the others."""
    acks: list[Ack] = []
    problems: list[str] = []
    try:
        it = os.scandir(control)
    except OSError:
        return acks, problems
    with it:
        for n, entry in enumerate(it):
            if n >= limits.max_entries:
                break
            name = entry.name
            if not (name.startswith(E.ACK_PREFIX) and name.endswith(".json")):
                continue
            path = control / name
            try:
                raw = _read_one(path, limits.max_bytes)
                if len(raw) > limits.max_bytes:
                    raise ValueError(f"more than the {limits.max_bytes} bytes an ack may have")
                acks.append(_parse(raw))
            except (OSError, ValueError, UnicodeDecodeError) as err:
                problems.append(f"{name[:64]}: {err}")
            try:
                os.unlink(path)
            except OSError:
                pass
    acks.sort(key=lambda a: a.step)
    return acks, problems


@dataclass
class AckCoalescer:
    """One run's acks on their way to `CheckpointSaved` events."""

    limits: AckLimits
    recent: dict[int, Ack] = field(default_factory=dict)  # unreported, by step
    reported: dict[int, None] = field(default_factory=dict)
    answered: dict[str, None] = field(default_factory=dict)  # request ids already answered
    last_report: float = float("-inf")
    high: int = -1  # the newest step reported

    def add(self, ack: Ack) -> None:
        if ack.step in self.reported or ack.step <= self.high:
            return  # already said, or older than what was said (directory order is arbitrary)
        self.recent[ack.step] = ack
        while len(self.recent) > self.limits.keep:
            del self.recent[min(self.recent)]

    def due(self, now: float, request: str | None, partial_steps: set[int]) -> list[Ack]:
        """The acks to report now: answers and completions at once, else the newest one when
        the interval has passed."""
        out = [a for a in self.recent.values() if a.step in partial_steps]
        answers = [a for a in self.recent.values() if request is not None and a.request == request and a not in out]
        if request is not None and answers and request not in self.answered:  # one answer per request
            self.answered[request] = None
            out.append(max(answers, key=lambda a: a.step))
        rest = [a for a in self.recent.values() if a not in out]
        if rest and now - self.last_report >= self.limits.interval_s:
            out.append(max(rest, key=lambda a: a.step))
        for a in out:
            del self.recent[a.step]
            self.reported[a.step] = None
            self.high = max(self.high, a.step)
        for step in [st for st in self.recent if st <= self.high]:
            del self.recent[step]
        while len(self.reported) > 4 * self.limits.keep:
            del self.reported[next(iter(self.reported))]
        if out:
            self.last_report = now
        return sorted(out, key=lambda a: a.step)


__all__ = ["Ack", "AckCoalescer", "AckLimits", "read_acks"]


def checkpoint_sha256(path: str, checkpoint_dir: Path, uid: int | None) -> tuple[str, str]:
    """(real path, SHA-256) of the checkpoint an ack names, computed by the daemon itself from
    what it reads: the job's claimed checksum is never used. Only inside the job's own checkpoint
    directory, never through a symlink, and (when the job has its own uid) only its own files:
    ValueError otherwise. The digest is the SDK's (`checkpoint_io.sha256_of`): a file's bytes,
    or a tree's relative paths and contents in path order."""
    real, root = os.path.realpath(path), os.path.realpath(checkpoint_dir)
    if not real.startswith(root.rstrip(os.sep) + os.sep):
        raise ValueError(f"{path} is not inside the job's checkpoint directory {checkpoint_dir}")
    top = Path(real)
    if top.is_dir() and not top.is_symlink():
        files = []
        for dirpath, dirs, names in os.walk(top):
            for name in dirs + names:
                if os.path.islink(os.path.join(dirpath, name)):
                    raise ValueError(f"{path} holds a symlink ({name})")
            files += [Path(dirpath, n) for n in names]
        files.sort(key=lambda f: f.relative_to(top))
    else:
        files = [top]
    digest = hashlib.sha256()
    for f in files:
        if f is not top:
            digest.update(str(f.relative_to(top)).encode() + b"\0")
        fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{f} is not a regular file")
            if uid is not None and st.st_uid != uid:
                raise ValueError(f"{f} is owned by uid {st.st_uid}, not by the job's (uid {uid})")
            while chunk := os.read(fd, 1 << 20):
                digest.update(chunk)
        finally:
            os.close(fd)
    return real, digest.hexdigest()
