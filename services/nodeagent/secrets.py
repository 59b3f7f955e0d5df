"""Secrets for a job without a trace in the log: `spec.secret_env` maps a variable to a file on
the node; the agent reads the file when it starts the job's process and passes the content in
the environment. The log, Redis and service logs only ever hold the variable name and path.

The file must be one the job's own user may read by its mode bits (owner, group or other, as the
kernel would decide for that uid and its groups): the root daemon reads it, but never a file
the job could not have read itself, so a tenant naming another tenant's secret file gets a
refusal, not the secret. It must be a regular file (never through a symlink), not writable by
group or others, at most `limits.MAX_SECRET_BYTES`. One trailing newline is dropped.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from gpusched.core import limits


class SecretError(OSError):
    """A secret file cannot be used; the message names the variable and the file, never content."""


def may_read(st: os.stat_result, uid: int, gids: set[int]) -> bool:
    """Whether `uid` (with `gids`) may read a file of this mode and owner (root's bypass aside)."""
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IRUSR)
    if st.st_gid in gids:
        return bool(st.st_mode & stat.S_IRGRP)
    return bool(st.st_mode & stat.S_IROTH)


def read_secret(name: str, path: str, reader: tuple[int, set[int]] | None = None) -> str:
    uid, gids = reader if reader is not None else (os.geteuid(), set(os.getgroups()))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise SecretError(f"secret {name}: cannot open {path}: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"secret {name}: {path} is not a regular file")
        if not may_read(st, uid, gids):
            raise SecretError(f"secret {name}: the job's user (uid {uid}) may not read {path} (owner uid "
                              f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise SecretError(f"secret {name}: {path} is writable by group or others")
        if st.st_size > limits.MAX_SECRET_BYTES:
            raise SecretError(f"secret {name}: {path} holds {st.st_size} bytes; at most {limits.MAX_SECRET_BYTES}")
        data = os.read(fd, limits.MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SecretError(f"secret {name}: {path} is not UTF-8 text") from None
    if "\0" in text:
        raise SecretError(f"secret {name}: {path} holds a NUL byte")
    return text[:-1] if text.endswith("\n") else text


def read_secret_env(secret_env: Mapping[str, str], reader: tuple[int, set[int]] | None = None) -> dict[str, str]:
    """Variable -> content for every secret of the job; SecretError on the first that fails."""
    return {name: read_secret(name, path, reader) for name, path in secret_env.items()}
