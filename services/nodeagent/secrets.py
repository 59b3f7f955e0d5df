"""Secrets for a job without a trace in the log: `spec.secret_env` maps a variable to a file on
the node; the agent reads the file when it starts the job's process and passes the content in
the environment. The log, Redis and service logs only ever hold the variable name and path.

The file must be a regular file owned by the user the job runs as (so a tenant cannot have the
agent read someone else's file into its job) and not writable by others; at most
`limits.MAX_SECRET_BYTES`. One trailing newline is dropped (`echo token > file`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from gpusched.core import limits


class SecretError(OSError):
    """A secret file cannot be used; the message names the variable and the file, never content."""


def read_secret(name: str, path: str, uid: int | None = None) -> str:
    uid = os.geteuid() if uid is None else uid
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise SecretError(f"secret {name}: cannot open {path}: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"secret {name}: {path} is not a regular file")
        if st.st_uid != uid:
            raise SecretError(f"secret {name}: {path} is owned by uid {st.st_uid}, not by the job's user ({uid})")
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


def read_secret_env(secret_env: Mapping[str, str], uid: int | None = None) -> dict[str, str]:
    """Variable -> content for every secret of the job; SecretError on the first that fails."""
    return {name: read_secret(name, path, uid) for name, path in secret_env.items()}
