"""What every service shell shares: follow the log into a fold, and append with compare-and-set.

A service is `consume -> apply -> decide -> append`. `FoldedLog` keeps a `ClusterState` in step
with the stream (replay from the start, then follow live) and wakes the service whenever the
fold moves; `append_cas` appends decisions that grant GPUs, and on a conflict waits until the
fold has caught up with the stream so that the caller can decide again.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import structlog

from gpusched import health, metrics, store
from gpusched.bus import subjects
from gpusched.bus.log import EventLog, Record
from gpusched.core import events as ev
from gpusched.core.state import ClusterState

if TYPE_CHECKING:
    from gpusched.policy.memo import Indexes

log = structlog.get_logger()

Listener = Callable[[Record, ClusterState], None]

#: Set by the service shell: ends the process (non-zero) so that its supervisor restarts it.
on_fatal: Callable[[str], None] | None = None
STREAM_CHECK_S = 5.0


def fatal(reason: str) -> None:
    """This process can no longer do its work (connection closed for good, stream lost, a
    retry exhausted): say so once, and let the shell end it."""
    log.error("service_fatal", reason=reason[:500])
    if on_fatal is not None:
        on_fatal(reason)


#: A decider (placement, preemptor, fallback) whose rounds fail this many times in a row ends
#: itself (non-zero, through `fatal`), so its supervisor starts it afresh from the log: a round
#: that raises on every try (a fold its indexes cannot handle) otherwise leaves it up, holding
#: its lease, deciding nothing. `GPUSCHED_MAX_FAILED_ROUNDS` sets it (0: never end).
MAX_FAILED_ROUNDS = 20


class FailedRounds:
    """Counts a decider's rounds that failed in a row; `failed` ends the process at the limit."""

    def __init__(self, service: str, limit: int | None = None):
        self.service = service
        self.limit = int(os.environ.get("GPUSCHED_MAX_FAILED_ROUNDS", MAX_FAILED_ROUNDS)) if limit is None else limit
        self.in_a_row = 0

    def ok(self) -> None:
        self.in_a_row = 0

    def failed(self) -> bool:
        """Log the round's exception; True when this one reached the limit (and `fatal` ran)."""
        self.in_a_row += 1
        log.exception(f"{self.service}_round_failed", in_a_row=self.in_a_row, limit=self.limit)
        if self.limit and self.in_a_row >= self.limit:
            fatal(f"{self.service}: {self.in_a_row} rounds failed in a row; restart from the log")
            return True
        return False


class FoldedLog:
    """A live fold of the log. `changed` is set after every applied event."""

    def __init__(self, event_log: EventLog):
        self.log = event_log
        self.state = store.new_fold()
        self.changed = asyncio.Event()
        self.listeners: list[Listener] = []
        self._task: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self._caught_up = asyncio.Event()
        #: Highest sequence read, and highest in the alloc tree, counting undecodable messages
        #: too: they occupy sequences that the compare-and-set check sees.
        self.seen_seq = 0
        self.alloc_seq = 0
        self.heads = SharedRead(event_log.last_seq)

    @classmethod
    async def open(cls, url: str | None, name: str, snapshot: ClusterState | None = None) -> FoldedLog:
        """Connect, replay what exists (from `snapshot` on, when one is given) and keep
        following: what every service starts with. The fold's settings (usage half-life,
        horizon) are the log's own (`FoldSettingsSet`), not the process's."""
        folded = cls(await EventLog.open(url, name=name))
        await folded.start(snapshot)
        return folded

    async def close(self) -> None:
        await self.stop()
        await self.log.close()

    async def start(self, snapshot: ClusterState | None = None) -> None:
        """Replay what exists, then keep following in the background. A snapshot (the fold as of
        its `last_seq`, e.g. the projector's in Redis) makes a restart replay only the tail; one
        from beyond the end of this stream (a stream created anew) is ignored. Not while it
        follows (after `stop` it may start again): a second follower would fold into the same
        state, and nothing would stop the first."""
        if self._task is not None and not self._task.done():
            raise RuntimeError("this fold is already following the log (FoldedLog.open starts it)")
        if metrics.ENABLED:
            metrics.attach(self)
        info = (await self.log.js.stream_info(subjects.STREAM)).state
        target, first = info.last_seq, info.first_seq
        if snapshot is not None and self.seen_seq == 0 and 0 < snapshot.last_seq <= target:
            if snapshot.keep_whole != self.state.keep_whole:
                log.warning("snapshot_rejected", seq=snapshot.last_seq, reason=store.other_fold(snapshot.keep_whole),
                            hint="replaying the log from the start")
            else:
                await self._adopt(snapshot)
        if self.seen_seq == 0 and snapshot is None:
            await self._adopt_stored(first, target)
        if first > self.seen_seq + 1 and target > 0:
            raise RuntimeError(f"the stream starts at seq {first} (older facts aged out) and no verified "
                               f"snapshot covers seq {first - 1}: this process cannot rebuild its state")
        if self.seen_seq >= target:
            self._caught_up.set()
        self._task = asyncio.create_task(self._follow(target), name="fold-follow")
        self._task.add_done_callback(self._follow_ended)
        self._watch = asyncio.create_task(self._watch_stream(), name="fold-watch")
        health.watch(self)  # /readyz: this fold's connection and follow must stay alive
        await self._caught_up.wait()

    async def _adopt(self, snapshot: ClusterState) -> None:
        """Start from the snapshot only if the log's latest seal vouches for it: a poisoned one
        could show held GPUs as free (see `gpusched.store`)."""
        why = await store.untrusted(self.log, snapshot)
        if why is not None:
            log.warning("snapshot_rejected", seq=snapshot.last_seq, reason=why, hint="replaying the log from the start")
            return
        self.state = snapshot
        self.seen_seq, self.alloc_seq = snapshot.last_seq, snapshot.last_alloc_seq
        log.info("snapshot_adopted", seq=snapshot.last_seq)

    async def _adopt_stored(self, first: int, last: int) -> None:
        """Start from the newest snapshot in JetStream that passes verification (refused ones
        are logged with why, and an older one is tried); none: replay from the start."""
        state, refused = await store.SnapshotStore(self.log).latest(first, last, self.state.keep_whole)
        if state is None:
            if refused:
                log.warning("snapshot_none_adopted", refused=len(refused), hint="replaying the log from the start")
            return
        self.state = state
        self.seen_seq, self.alloc_seq = state.last_seq, state.last_alloc_seq
        log.info("snapshot_adopted", seq=state.last_seq, source="jetstream", refused=len(refused))

    def _follow_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            err = task.exception()
            fatal(f"following the log failed: {type(err).__name__}: {err}")

    async def _watch_stream(self) -> None:
        """A deleted stream leaves the follower waiting forever: notice it and end."""
        from nats.js.errors import NotFoundError

        while True:
            await asyncio.sleep(STREAM_CHECK_S)
            try:
                await self.log.js.stream_info(subjects.STREAM)
            except NotFoundError:
                fatal(f"stream {subjects.STREAM} is gone")
                return
            except Exception:  # NATS unreachable: the connection reconnects (and logs) by itself
                pass

    def _saw(self, seq: int, subject: str, target: int) -> None:
        self.seen_seq = seq
        if subject.startswith("gpusched.evt.alloc."):
            self.alloc_seq = seq
        if seq >= target:
            self._caught_up.set()
        self.changed.set()

    async def _follow(self, target: int) -> None:
        on_dead = lambda seq, subject: self._saw(seq, subject, target)  # noqa: E731
        async for rec in self.log.records(self.seen_seq + 1, follow=True, on_dead=on_dead):
            self.state.apply(rec.event, rec.seq, rec.time, rec.position)  # the clock: the server's store time
            for listener in self.listeners:
                try:
                    listener(rec, self.state)
                except Exception:  # a listener bug must not stop the fold
                    log.exception("listener_failed", seq=rec.seq, kind=rec.event.kind)
            self._saw(rec.seq, rec.subject, target)

    async def stop(self) -> None:
        health.unwatch(self)  # stopped on purpose: no longer a reason to be unready
        tasks = [t for t in (self._task, self._watch) if t is not None]
        if tasks:
            await cancel_tasks(tasks)

    async def catch_up(self, timeout: float = 10.0) -> None:
        """Wait until the fold has applied everything in the stream as of now (one stream-info
        request serves every caller waiting at once: `SharedRead`)."""
        head = await asyncio.wait_for(self.heads.read(), timeout)
        await self.wait_seq(head, timeout)

    async def wait_seq(self, target: int, timeout: float = 10.0) -> None:
        """Wait until the fold has read up to `target` (e.g. the writer's own last append)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.seen_seq < target:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"fold at {self.seen_seq}, stream at {target}")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), 0.2)
            except TimeoutError:
                pass

    async def wait_changed(self, timeout: float) -> bool:
        """Sleep until the fold moves or `timeout` passes; True when it moved."""
        try:
            await asyncio.wait_for(self.changed.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self.changed.clear()


class ExplainIndexes:
    """The indexes of a live fold for explaining pending jobs (`explain_pending`), made at the
    first explanation and kept for the fold's life: their run-time predictor learns every
    completed job once, then watches each grant as a placement cycle's does (`Indexes.started`),
    instead of learning them all again per answer (75 ms at 2,900 completed jobs). The reader's
    `show` and the dashboard's job view use it."""

    def __init__(self, folded: FoldedLog):
        self._indexes: Indexes | None = None
        folded.listeners.append(self._granted)

    def __call__(self) -> Indexes:
        if self._indexes is None:
            from gpusched.policy.memo import Indexes

            self._indexes = Indexes()
        return self._indexes

    def _granted(self, rec: Record, state: ClusterState) -> None:
        """A job granted and ended before the next explanation is learned all the same."""
        if self._indexes is not None and isinstance(rec.event, ev.GpusGranted):
            self._indexes.started([rec.event.job_id])


class SharedRead:
    """One request in flight for many callers: a caller gets the answer of a request that began
    after it asked (a read barrier stays a barrier), and every caller that asks while one is in
    flight shares the next. A burst of refusals, each wanting the stream's head, costs two
    stream-info round trips instead of one each (JetStream's API is shared by the cluster)."""

    def __init__(self, read: Callable[[], Awaitable[int]]):
        self._read = read
        self._next: asyncio.Future[int] | None = None  # what callers asking now will get
        self._busy = False
        self._task: asyncio.Task | None = None  # held: the loop keeps only a weak reference

    async def read(self) -> int:
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            if not self._busy:
                self._task = asyncio.get_running_loop().create_task(self._serve())
        return await asyncio.shield(self._next)  # one caller's timeout must not cancel the others'

    async def _serve(self) -> None:
        self._busy = True
        try:
            while self._next is not None:
                answer, self._next = self._next, None
                try:
                    answer.set_result(await self._read())
                except Exception as err:  # noqa: BLE001 - handed to every caller that shared it
                    answer.set_exception(err)
        finally:
            self._busy = False


async def cancel_tasks(tasks: list[asyncio.Task], timeout: float = 5.0) -> None:
    """Cancel and wait, cancelling again if needed: Python 3.11's `wait_for` can swallow a
    cancellation that lands as its inner future completes, and the task would run on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pending = [t for t in tasks if not t.done()]
    while pending and loop.time() < deadline:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.1)
        pending = [t for t in pending if not t.done()]
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" noise


class Tracker:
    """Seqs of the latest control-plane transitions, kept by a fold listener, so that the
    transition events get deterministic message ids (exactly once per transition)."""

    def __init__(self, folded: FoldedLog):
        self.degraded_seq = 0
        self.recovered_seq = 0
        folded.listeners.append(self._on)

    def _on(self, rec, state) -> None:
        if isinstance(rec.event, ev.PlacementDegraded):
            self.degraded_seq = rec.seq
        elif isinstance(rec.event, ev.PlacementRecovered):
            self.recovered_seq = rec.seq


def notify_ready() -> None:
    """Tell the supervisor this service is ready (it logs `<service>_ready` just before): the
    systemd notify protocol (`READY=1` on the datagram socket `$NOTIFY_SOCKET`), which is what
    `gpusched up` listens on too. Readiness does not depend on log format or level. Also turns
    `/readyz` (`gpusched.health`, on the `--metrics-port` server) ready."""
    import os
    import socket

    health.mark_ready()
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(f"READY=1\nMAINPID={os.getpid()}".encode())
    except OSError as err:
        log.warning("notify_failed", socket=address.lstrip("\0"), error=str(err))
