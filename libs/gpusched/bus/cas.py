"""Append a writer's decisions as compare-and-set batches over the alloc tree, against the view
of its fold: what every writer of the log (the services, the node daemons, the admin's CLI and
the simulator's composition) appends through. `Folded` is what it needs of a fold: the live
services' `services.runtime.FoldedLog` and the simulator's `sim.composed.LogFold` both are one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from gpusched import metrics, telemetry
from gpusched.bus.log import MAX_BATCH, Conflict
from gpusched.core.events import Event
from gpusched.core.state import ClusterState


class BatchLog(Protocol):
    """What appending asks of a log: `bus.log.EventLog`'s atomic batch (or the simulator's
    `bus.memory.MemoryEventLog`'s, the same contract over a list)."""

    async def append_batch(self, events: Sequence[Event], *, msg_ids: Sequence[str | None] | None = None,
                           expect_alloc_seq: int | None = None,
                           headers: dict[str, str] | None = None) -> list[int]: ...


class Folded(Protocol):
    """A writer's fold of the log: its state, the alloc tree's last sequence it has seen, the
    log it appends to, and the two ways to move it on."""

    state: ClusterState
    alloc_seq: int

    @property
    def log(self) -> BatchLog: ...

    async def catch_up(self) -> None: ...

    async def wait_seq(self, seq: int) -> None: ...


async def catch_up_after(folded: Folded, conflict: Conflict) -> None:
    """A compare-and-set append lost: fold what the writer missed before it decides again."""
    metrics.CONFLICTS.labels(telemetry.current_service()).inc()
    if conflict.actual is None:
        await folded.catch_up()
    else:  # the server named the change we missed: wait for it, no stream-info round trip
        await folded.wait_seq(conflict.actual)
        # self-heal: the server knows the alloc tree's last sequence even when this fold
        # could not attribute it (e.g. a snapshot that predates a dead-lettered message)
        folded.alloc_seq = max(folded.alloc_seq, conflict.actual)


async def append_cas(folded: Folded, events: Sequence[Event], msg_id: Callable[[Event], str | None] = lambda e: None,
                     headers: dict[str, str] | None = None, view: int | None = None) -> tuple[int, bool]:
    """Append one cycle's decisions as atomic batches, compare-and-set over the alloc tree
    against what this writer's fold has seen: a cycle lands whole or not at all (per
    MAX_BATCH events). Returns (appended count, conflicted). On conflict the fold is caught up
    and the caller decides again from the fresher state. `view` is the alloc sequence the
    decisions were made at (default: the fold's, right now — decide and append with no await
    in between, or pass it).

    Every writer of the alloc tree appends through a compare-and-set, not only those that grant
    (docs/scale.md, "Every alloc fact is a compare-and-set"): a clustered stream's leader checks
    the expected sequence against what it has applied, and a plain append to the tree that is
    proposed but not yet applied is invisible to the check, so a grant would be stored after a
    change it never saw."""
    expected = folded.alloc_seq if view is None else view
    appended = last = 0
    for start in range(0, len(events), MAX_BATCH):
        chunk = list(events[start:start + MAX_BATCH])
        cas = expected if any(e.ALLOC for e in chunk) else None
        try:
            seqs = await folded.log.append_batch(chunk, msg_ids=[msg_id(e) for e in chunk],
                                                 expect_alloc_seq=cas, headers=headers)
        except Conflict as conflict:
            await catch_up_after(folded, conflict)
            return appended, True
        appended += len(chunk)
        last = seqs[-1]
        expected = max([expected] + [seq for seq, e in zip(seqs, chunk) if e.ALLOC])
    if appended:
        await folded.wait_seq(last)  # the next decision must see this writer's own appends
    return appended, False
