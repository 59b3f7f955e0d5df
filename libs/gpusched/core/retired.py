"""Ids of jobs past the fold's second horizon, kept only so that no id is ever handed out twice.

Admission names a job `j-` + 8 hex digits (`services.admission.job_id_for`); such an id is kept as
a 4-byte integer in sorted runs of a log-structured merge (a run merges into the one before it
while that one is at most twice its size), so that a lookup bisects a few runs and an insert
moves O(log n) integers on average. Other ids (a test's, the 64-hex fallback) are kept as they
are. Runs are little-endian `uint32` bytes, so a snapshot reads the same on any host."""

from __future__ import annotations

import re
import sys
from array import array
from bisect import bisect_left
from heapq import merge

from msgspec import Struct

_COMPACT = re.compile(r"j-[0-9a-f]{8}")


def _compact(job_id: str) -> int | None:
    """An admission-made id (`j-` + 8 hex) as its integer; None for any other id."""
    return int(job_id[2:], 16) if _COMPACT.fullmatch(job_id) else None


def _ints(run: bytes) -> array:
    values = array("I", run)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def _bytes(values: array) -> bytes:
    if sys.byteorder == "big":
        values = array("I", values)
        values.byteswap()
    return values.tobytes()


class RetiredIds(Struct, array_like=True):
    runs: list[bytes] = []
    other: dict[str, None] = {}

    def add(self, job_id: str) -> None:
        value = _compact(job_id)
        if value is None:
            self.other[job_id] = None
            return
        merged = array("I", [value])
        while self.runs and len(self.runs[-1]) <= 2 * 4 * len(merged):
            merged = array("I", merge(_ints(self.runs.pop()), merged))  # no list of n ints in between
        self.runs.append(_bytes(merged))

    def __contains__(self, job_id: str) -> bool:
        value = _compact(job_id)
        if value is None:
            return job_id in self.other
        for run in self.runs:
            values = memoryview(run).cast("I") if sys.byteorder == "little" else _ints(run)
            i = bisect_left(values, value)
            if i < len(values) and values[i] == value:
                return True
        return False

    def __len__(self) -> int:
        return sum(len(run) // 4 for run in self.runs) + len(self.other)
