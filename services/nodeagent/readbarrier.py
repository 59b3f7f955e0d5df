"""The node host's read barrier: a launch trusts the fold only while it is known to hold the
whole log as of a moment ago."""

from __future__ import annotations

import asyncio
import math
import time

import structlog

from gpusched.bus.log import EventLog
from gpusched.services.runtime import FoldedLog

log = structlog.get_logger()

#: A node daemon starts a job only while its fold held the whole log as of at most this long
#: ago (`ReadBarrier.fresh`); well under the reconciler's node timeout (30 s).
VIEW_MAX_AGE_S = 2.0


class ReadBarrier:
    """A daemon that lags (starved of CPU, restarting a thousand nodes, cut off from NATS) would
    otherwise start an attempt the log already superseded: its node declared lost and the job
    granted elsewhere, in facts it has not folded yet."""

    def __init__(self, event_log: EventLog, folded: FoldedLog, max_age_s: float = VIEW_MAX_AGE_S,
                 retry_s: float = 1.0):
        self.log = event_log
        self.folded = folded
        self.max_age_s = max_age_s
        self.retry_s = retry_s
        self.confirmed_at = -math.inf  # when the log's head last fetched was found folded
        self._wanted = asyncio.Event()  # set by a launch that found the view stale

    def fresh(self) -> bool:
        """Whether launches may trust the fold: it held the whole log as of at most `max_age_s` ago."""
        if time.monotonic() - self.confirmed_at <= self.max_age_s:
            return True
        self._wanted.set()  # a launch waits for it: confirm now
        return False

    async def run(self) -> None:
        """When a launch asks, fetch the log's head, wait until the fold holds it, record when it
        was fetched. On demand, not on a timer: an idle host asks the stream nothing, a busy one
        at most once per `max_age_s`."""
        warned = False
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            asked = time.monotonic()
            try:
                head = await self.log.last_seq()
            except Exception as err:  # noqa: BLE001 - cannot confirm: launches wait
                if not warned:
                    log.warning("nodeagent_view_unconfirmed", error=f"{type(err).__name__}: {err}"[:200],
                                hint="no job starts on these nodes until the log answers")
                warned = True
                self._wanted.set()
                await asyncio.sleep(self.retry_s)
                continue
            warned = False
            while self.folded.seen_seq < head:
                await asyncio.sleep(0.02)
            self.confirmed_at = asked
