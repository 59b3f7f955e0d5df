"""Processes a test started, found by the words it put on their command line."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def kill_marked(*words: str) -> None:
    """SIGKILL every process whose argv holds all `words` (a test's marker and its run's tag),
    wrappers included: never another test's or another run's."""
    wanted = [w.encode() for w in words]
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            if all(w in argv for w in wanted):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue
