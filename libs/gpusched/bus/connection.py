"""What a NATS connection says about itself: one log line per outage period instead of
nats-py's traceback per reconnect attempt, and a hook that tells a service its connection is
gone for good (so that it exits and its supervisor restarts it, instead of staying deaf).

`connect()` in `log.py` installs these callbacks on every connection; a service's shell sets
`on_closed` to end the process when a connection closes that the service did not close itself.
"""

from __future__ import annotations

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
