"""Liveness and readiness of a service process, for Kubernetes probes and compose healthchecks.

Served beside `/metrics` on the `--metrics-port` server (`metrics.start_metrics_server`):

- `/healthz` (liveness): 200 while the process's asyncio loop still runs callbacks (the probe
  thread asks the loop to run one and waits `LOOP_TIMEOUT_S`); 503 when the loop is wedged or
  gone. A probe before the loop starts answers 200 ("starting"): the process is alive.
- `/readyz` (readiness): 200 once the service called `notify_ready()` (subscribed, caught up
  with the log) and while every log it follows is connected to NATS and still following; 503
  otherwise (before start-up finished, during a NATS outage, after the follow ended).

Only the HTTP thread and the loop touch this state; the checks read it without locks (one
attribute read each)."""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any

#: How long the loop may take to run one callback before liveness fails.
LOOP_TIMEOUT_S = 5.0

_loop: asyncio.AbstractEventLoop | None = None
_ready = False
#: The folds (`runtime.FoldedLog`) this process follows the log with: readiness needs each live.
_folds: weakref.WeakSet[Any] = weakref.WeakSet()


def bind_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The loop liveness watches (the service shell's)."""
    global _loop
    _loop = loop


def mark_ready() -> None:
    global _ready
    _ready = True


def watch(fold: Any) -> None:
    """Make readiness depend on this fold's NATS connection and follow task."""
    _folds.add(fold)


def unwatch(fold: Any) -> None:
    _folds.discard(fold)


def reset() -> None:
    """Forget everything (tests; a process that restarts its service in place)."""
    global _loop, _ready
    _loop, _ready = None, False
    _folds.clear()


def liveness(timeout: float = LOOP_TIMEOUT_S) -> tuple[bool, str]:
    loop = _loop
    if loop is None:
        return True, "starting"
    turned = threading.Event()
    try:
        loop.call_soon_threadsafe(turned.set)
    except RuntimeError:  # the loop is closed: the service is leaving
        return False, "event loop closed"
    if not turned.wait(timeout):
        return False, f"event loop did not turn within {timeout:g}s"
    return True, "ok"


def readiness() -> tuple[bool, str]:
    if not _ready:
        return False, "starting: not subscribed and caught up yet"
    for fold in list(_folds):
        why = _fold_trouble(fold)
        if why:
            return False, why
    return True, "ok"


def _fold_trouble(fold: Any) -> str:
    nc = getattr(getattr(fold, "log", None), "nc", None)
    if nc is not None and getattr(nc, "is_closed", False):
        return "NATS connection closed"
    if nc is not None and not getattr(nc, "is_connected", True):
        return "NATS disconnected"
    task = getattr(fold, "_task", None)
    if task is not None and task.done():
        return "no longer following the log"
    return ""


ROUTES = {"/healthz": liveness, "/readyz": readiness}


def wsgi(app: Any) -> Any:
    """Wrap a WSGI app (prometheus_client's `/metrics`) with `/healthz` and `/readyz`."""

    def handle(environ: dict, start_response: Any) -> list[bytes]:
        check = ROUTES.get(environ.get("PATH_INFO", ""))
        if check is None:
            return app(environ, start_response)
        ok, why = check()
        start_response("200 OK" if ok else "503 Service Unavailable",
                       [("Content-Type", "text/plain; charset=utf-8"), ("Cache-Control", "no-store")])
        return [f"{why}\n".encode()]

    return handle


__all__ = ["bind_loop", "mark_ready", "watch", "unwatch", "reset", "liveness", "readiness", "wsgi", "LOOP_TIMEOUT_S"]
