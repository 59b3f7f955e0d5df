"""The node host's one writer: every fact its agents report, appended in the order submitted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from gpusched.bus.cas import append_cas
from gpusched.bus.log import EventLog, EventTooLarge
from gpusched.core import events as ev
from gpusched.core.state import ClusterState
from gpusched.services.runtime import FoldedLog, fatal

log = structlog.get_logger()

#: A fact decided against the fold at the moment of appending (None: nothing to append any more).
Build = Callable[[ClusterState], "ev.Event | None"]


class AppendQueue:
    """Appends in order, one at a time. A `Build` is decided against the fold when its turn
    comes; a fact of the alloc tree is a compare-and-set (`bus.cas.append_cas`), decided again
    after a conflict."""

    def __init__(self, event_log: EventLog, folded: FoldedLog):
        self.log = event_log
        self.folded = folded
        self._queue: asyncio.Queue[tuple[Build | ev.Event, str | None]] = asyncio.Queue()

    def submit(self, item: Build | ev.Event, msg_id: str | None = None) -> None:
        self._queue.put_nowait((item, msg_id))

    def pending(self) -> int:
        return self._queue.qsize()

    async def flush(self, timeout: float = 10.0) -> None:
        """Wait until every queued append is written."""
        await asyncio.wait_for(self._queue.join(), timeout)

    async def run(self) -> None:
        while True:
            item, msg_id = await self._queue.get()
            for _ in range(50):
                try:
                    event = item(self.folded.state) if callable(item) else item
                    if event is None:
                        break
                    if event.ALLOC:
                        _, conflicted = await append_cas(self.folded, [event], msg_id=lambda e: msg_id)
                        if conflicted:
                            continue
                    else:
                        await self.log.append(event, msg_id=msg_id)
                    break
                except asyncio.CancelledError:
                    raise
                except EventTooLarge as err:  # permanent: retrying cannot help
                    log.error("append_refused", msg_id=msg_id, error=str(err))
                    break
                except Exception:
                    log.exception("append_failed", msg_id=msg_id)
                    await asyncio.sleep(0.5)
            else:  # retries exhausted: end, so that a restarted daemon converges from the log
                fatal(f"append {msg_id} failed 50 times")
            self._queue.task_done()
