"""Checkpoints that cannot run code when loaded, and that are verified before a resume.

Format: MessagePack (msgspec) of plain data: dicts, lists, str, int, float, bool, None, bytes,
and numpy arrays when numpy is installed (an extension type holding dtype, shape and the raw
bytes; object dtypes are refused). Nothing in it names a class or a function, so loading a
tampered file yields wrong data at worst, never code execution. Files end in `.msgpack`;
pickle files (`.pkl`, the old format) are never unpickled.

Integrity: the SDK records the SHA-256 of every checkpoint in its acknowledgement, the node
daemon puts it in the `CheckpointSaved` event, and a resume gets it back in
`GPUSCHED_RESUME_SHA256` (with the checkpoint before it in `GPUSCHED_RESUME_PREVIOUS*`). A
checkpoint whose content no longer matches is skipped, with a message on stderr, for the
previous good one (or a fresh start when none verifies).

PyTorch: save tensors, not pickled objects: `torch.save(model.state_dict(), path)` into
`ctx.checkpoint_dir`, then `ctx.checkpoint(path, step)`; on resume
`torch.load(ctx.verified_resume(), weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from . import env as E

SUFFIX = ".msgpack"
_NDARRAY = 1  # msgpack extension code of a numpy array


class UnsafeCheckpoint(ValueError):
    """A checkpoint in a format that could run code on load (pickle): refused."""


def _enc_hook(obj: Any) -> Any:
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        have_numpy = False
    else:
        have_numpy = True
    if have_numpy and isinstance(obj, np.generic):
        return obj.item()
    if have_numpy and isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError("numpy arrays of Python objects cannot be checkpointed safely")
        header = msgspec.msgpack.encode([obj.dtype.str, list(obj.shape)])
        return msgspec.msgpack.Ext(_NDARRAY, len(header).to_bytes(4, "big") + header + obj.tobytes(order="C"))
    if isinstance(obj, (tuple, set, frozenset)):
        return list(obj)
    raise TypeError(f"cannot checkpoint {type(obj).__name__}: use dicts, lists, numbers, str, bytes or numpy arrays")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _NDARRAY:
        raise ValueError(f"unknown extension {code} in checkpoint")
    import numpy as np

    size = int.from_bytes(data[:4], "big")
    dtype_str, shape = msgspec.msgpack.decode(data[4:4 + size])
    dtype = np.dtype(dtype_str)
    if dtype.hasobject:
        raise ValueError("object arrays are not loaded from checkpoints")
    return np.frombuffer(bytes(data[4 + size:]), dtype=dtype).reshape(shape)


def dumps(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj, enc_hook=_enc_hook)


def loads(data: bytes) -> Any:
    return msgspec.msgpack.decode(data, ext_hook=_ext_hook)


def sha256_of(path: str | os.PathLike) -> str:
    """SHA-256 of a file, or of a directory tree (relative paths and contents, in order)."""
    p = Path(path)
    digest = hashlib.sha256()
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    for f in files:
        if p.is_dir():
            digest.update(str(f.relative_to(p)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def load_file(path: str | os.PathLike) -> Any:
    """What a checkpoint file holds: the object (.msgpack), the bytes (.bin), else the path.
    Pickle files are refused."""
    p = Path(path)
    if p.suffix in (".pkl", ".pickle"):
        raise UnsafeCheckpoint(f"{p} is a pickle checkpoint: gpusched never unpickles (it could run code); "
                               "save plain data or numpy arrays (msgpack), or tensors with torch.save")
    if p.suffix == SUFFIX:
        return loads(p.read_bytes())
    if p.suffix == ".bin":
        return p.read_bytes()
    return str(p)


def candidates(environ: Mapping[str, str]) -> list[tuple[str, int | None, str]]:
    """(path, step, sha256) to resume from, newest first, as the node daemon passed them."""
    out = []
    for path_key, step_key, sha_key in ((E.RESUME_FROM, E.RESUME_STEP, E.RESUME_SHA256),
                                        (E.RESUME_PREVIOUS, E.RESUME_PREVIOUS_STEP, E.RESUME_PREVIOUS_SHA256)):
        path = environ.get(path_key)
        if path:
            step = environ.get(step_key)
            out.append((path, int(step) if step and step.lstrip("-").isdigit() else None, environ.get(sha_key, "")))
    return out


def problem(path: str, sha256: str) -> str | None:
    """Why this checkpoint must not be resumed from, or None."""
    if Path(path).suffix in (".pkl", ".pickle"):
        return "it is a pickle file (never loaded: it could run code)"
    if not os.path.exists(path):
        return "it does not exist"
    if sha256:
        found = sha256_of(path)
        if found != sha256:
            return f"its SHA-256 is {found[:16]}..., the log recorded {sha256[:16]}... (corrupted or tampered)"
    return None


def choose(environ: Mapping[str, str], say=None) -> tuple[str, int | None] | None:
    """The newest checkpoint that verifies, saying on stderr why any newer one was skipped."""
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    for i, (path, step, sha) in enumerate(candidates(environ)):
        why = problem(path, sha)
        if why is None:
            if i:
                say(f"gpusched: resuming from the previous good checkpoint {path} (step {step})")
            return path, step
        say(f"gpusched: checkpoint {path} (step {step}) is not used: {why}")
    if candidates(environ):
        say("gpusched: no checkpoint verified: starting from scratch")
    return None
