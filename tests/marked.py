"""Processes a test started, found by the words it put on their command line."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path


def marked(*words: str) -> Iterator[tuple[int, list[bytes], Path]]:
    """(pid, argv, its /proc dir) of every process whose argv holds all `words` (a test's marker
    and its run's tag): never another test's or another run's."""
    wanted = [w.encode() for w in words]
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(w in argv for w in wanted):
            yield int(entry.name), argv, Path(entry.path)


def kill_marked(*words: str) -> None:
    """SIGKILL every marked process, shell wrappers included."""
    for pid, _, _ in marked(*words):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def marked_pythons(*words: str) -> Iterator[tuple[int, list[bytes], Path]]:
    """The live (not zombie) python processes among the marked: a test's job commands, not
    their shell wrappers."""
    for pid, argv, proc in marked(*words):
        try:
            state = (proc / "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z" and b"python" in Path(argv[0].decode(errors="replace")).name.encode():
            yield pid, argv, proc
