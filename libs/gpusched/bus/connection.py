"""What a NATS connection says about itself: one log line per outage period instead of
nats-py's traceback per reconnect attempt, and a hook that tells a service its connection is
gone for good (so that it exits and its supervisor restarts it, instead of staying deaf).

`connect()` in `log.py` installs these callbacks on every connection; a service's shell sets
`on_closed` to end the process when a connection closes that the service did not close itself.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable


class LazyLogger:
    """structlog's logger, imported on the first line logged (structlog brings rich with it: a
    CLI call that logs nothing should not pay for it)."""

    def __getattr__(self, name: str):
        import structlog

        return getattr(structlog.get_logger(), name)


log = LazyLogger()

#: Called with (connection name, why) when a connection closes unexpectedly; None: only logged.
on_closed: Callable[[str, str], None] | None = None
#: Connections this process is closing on purpose (`expect_close`): their close is not news.
_closing: set[int] = set()
#: At most one line per this many seconds per (connection, kind of error).
QUIET_S = 30.0


class _Quiet:
    """Remember when each kind of message was last logged, to log it once per period."""

    def __init__(self) -> None:
        self.last: dict[tuple[str, str], float] = {}
        self.suppressed: dict[tuple[str, str], int] = {}

    def allow(self, key: tuple[str, str], now: float) -> int | None:
        """None: stay quiet; else how many were suppressed since the last line."""
        if now - self.last.get(key, -1e18) < QUIET_S:
            self.suppressed[key] = self.suppressed.get(key, 0) + 1
            return None
        self.last[key] = now
        if len(self.last) > 1024:  # bounded: forget the oldest kinds
            for old in sorted(self.last, key=self.last.__getitem__)[:512]:
                self.last.pop(old, None)
                self.suppressed.pop(old, None)
        return self.suppressed.pop(key, 0)


_quiet = _Quiet()


def _say(level: str, event: str, **fields: object) -> None:
    """A service's structured log; in a CLI process (structlog not configured, whose default
    prints to stdout and would corrupt `--json` output) one plain line on stderr."""
    import structlog

    if structlog.is_configured():
        getattr(log, level)(event, **fields)
    else:
        detail = " ".join(f"{k}={v}" for k, v in fields.items())
        print(f"gpusched: {event} {detail}", file=sys.stderr, flush=True)


def expect_close(nc: object) -> None:
    """Mark a connection as closing on purpose (drain/close at shutdown)."""
    _closing.add(id(nc))


#: How long `close` lets a drain run (the messages delivered to subscriptions handled, then the
#: pending publishes flushed) before it closes the connection anyway. With the server just gone
#: a drain waited 10 s for an answer and then raised, so a stopping service sat in it until the
#: shell's 8-s grace ended it (the reader of a killed `gpusched up` took 9.4 s to go), and a CLI
#: command sat 10 s after its answer. A hung server still takes the grace: nats-py's drain
#: swallows the cancellation and flushes on.
CLOSE_DRAIN_S = 2.0


async def close(nc) -> None:
    """Close a connection on purpose: drain it for at most `CLOSE_DRAIN_S`, then close it (the
    server gone or reconnecting: nothing more will reach it)."""
    from nats.errors import Error as NatsError

    expect_close(nc)
    try:
        await asyncio.wait_for(nc.drain(), CLOSE_DRAIN_S)
    except (TimeoutError, NatsError):
        await nc.close()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the caller is cancelled, not the drain
        # nats-py's own teardown on the lost connection cancelled the drain's wait for the
        # socket to close: it is closing anyway
        await nc.close()


def callbacks(name: str) -> tuple[dict[str, Callable], dict[str, object]]:
    """nats-py connection callbacks for the connection `name`, and a holder whose "nc" the
    caller sets to the connection once made."""
    holder: dict[str, object] = {}

    async def error_cb(err: Exception) -> None:
        kind = type(err).__name__
        skipped = _quiet.allow((name, kind), time.monotonic())
        if skipped is not None:
            _say("warning", "nats_error", connection=name, error=f"{kind}: {err}"[:300], repeated=skipped,
                        quiet_s=QUIET_S)

    def closing() -> bool:
        nc = holder.get("nc")
        return nc is None or id(nc) in _closing or bool(getattr(nc, "is_draining", False))

    async def disconnected_cb() -> None:
        if not closing() and _quiet.allow((name, "disconnected"), time.monotonic()) is not None:
            _say("warning", "nats_disconnected", connection=name)

    async def reconnected_cb() -> None:
        if not closing():
            _say("info", "nats_reconnected", connection=name)

    async def closed_cb() -> None:
        nc = holder.get("nc")
        if closing() or getattr(nc, "last_error", None) is None:
            _closing.discard(id(nc))
            return  # closed on purpose (a drain or close that no server error caused)
        why = repr(getattr(nc, "last_error", None))
        _say("error", "nats_connection_closed", connection=name, last_error=why[:300])
        if on_closed is not None:
            on_closed(name, why)

    return {"error_cb": error_cb, "disconnected_cb": disconnected_cb, "reconnected_cb": reconnected_cb,
            "closed_cb": closed_cb}, holder


#: How often a connection to a NATS cluster asks whether its server still has JetStream, and how
#: long it may go without an answer before the client moves to another server (issue 25).
PROBE_S = float(os.environ.get("GPUSCHED_QUORUM_PROBE_S", "2"))
QUORUM_LOST_S = float(os.environ.get("GPUSCHED_QUORUM_LOST_S", "10"))


class QuorumWatch:
    """A client on a server that a partition cut off from its cluster's majority keeps a healthy
    TCP connection, so nats-py never leaves it, while every JetStream call goes unanswered. Every
    `probe_s` this asks for the account's JetStream info (`$JS.API.INFO`, answered by the meta
    leader: never by a server in a minority); after `lost_s` without an answer it reconnects,
    trying the other servers of the list first (`choose`, nats-py's reconnect_to_server_handler)."""

    def __init__(self, name: str, probe_s: float = PROBE_S, lost_s: float = QUORUM_LOST_S):
        self.name, self.probe_s, self.lost_s = name, probe_s, lost_s
        self.left: str | None = None  # host:port of the server left for silence
        self.moves = 0
        self._tried = 0
        self._task: asyncio.Task | None = None

    @classmethod
    def for_servers(cls, servers: list[str], name: str, options: dict) -> QuorumWatch:
        """The watch of a connection to `servers` (off for a single server: nowhere to move to);
        sets its server choice in nats-py's connect `options`."""
        watch = cls(name, lost_s=QUORUM_LOST_S if len(servers) > 1 else 0)
        if watch.lost_s > 0:
            options.setdefault("reconnect_to_server_handler", watch.choose)
        return watch

    def choose(self, servers: list, info: dict) -> tuple[object | None, float]:
        """The next server to try: the others before the one left, in turn; a pause after a
        whole round of them failed (as nats-py's own `reconnect_time_wait`)."""
        order = [s for s in servers if s.uri.netloc != self.left] + [s for s in servers if s.uri.netloc == self.left]
        if not order:
            return None, 0.5
        pick = order[self._tried % len(order)]
        self._tried += 1
        return pick, (0.5 if self._tried > len(order) else 0.0)

    def start(self, nc) -> None:
        nc.gpusched_quorum_watch = self
        if self.probe_s > 0 and self.lost_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._run(nc), name=f"quorum-watch-{self.name}")

    async def _answers(self, nc) -> bool | None:
        """True: JetStream answered; False: no answer or "cluster not available"; None: the
        connection itself is down (nats-py's reconnect handles that)."""
        import json

        from nats.errors import ConnectionClosedError, ConnectionReconnectingError, NoRespondersError

        try:
            reply = await nc.request("$JS.API.INFO", b"", timeout=self.probe_s)
        except (asyncio.TimeoutError, NoRespondersError):
            return False
        except (ConnectionClosedError, ConnectionReconnectingError):
            return None
        try:
            return "error" not in json.loads(reply.data)
        except ValueError:
            return False

    async def _run(self, nc) -> None:
        silent_since: float | None = None
        while not nc.is_closed:
            await asyncio.sleep(self.probe_s)
            answered = await self._answers(nc) if nc.is_connected else None
            if answered or answered is None:
                silent_since = None
                if answered:
                    self._tried = 0
                continue
            now = time.monotonic()
            silent_since = silent_since or now
            if now - silent_since >= self.lost_s:
                server = getattr(nc.connected_url, "netloc", None)
                _say("warning", "nats_quorum_lost", connection=self.name, server=server, silent_s=round(now - silent_since, 1),
                     action="reconnecting to another server")
                self.left, self.moves, self._tried, silent_since = server, self.moves + 1, 0, None
                await nc.force_reconnect()
