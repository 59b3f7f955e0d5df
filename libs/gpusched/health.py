"""Liveness and readiness of a service process, for Kubernetes probes and compose healthchecks.

Served beside `/metrics` on the `--metrics-port` server (`metrics.start_metrics_server`):

- `/healthz` (liveness): 200 while the process's asyncio loop still runs callbacks (the probe
  thread asks the loop to run one and waits `LOOP_TIMEOUT_S`); 503 when the loop is wedged or
  gone. A probe before the loop starts answers 200 ("starting"): the process is alive.
- `/readyz` (readiness): 200 once the service called `notify_ready()` (subscribed, caught up
  with the log) and while every log it follows is connected to NATS and still following; 503
  otherwise (before start-up finished, during a NATS outage, after the follow ended).

Only the HTTP thread and the loop touch this state; the checks read it without locks (one
attribute read each).

`nats_readiness(monitor_url, peers)`: the readiness of one clustered NATS server, from its
monitoring endpoints. `/healthz?js-enabled-only` says only that JetStream is on, so a server
whose routes never formed answered ok; ready here means all three of: `/healthz?js-server-only`
(the JetStream meta layer is current with a leader), `/routez` has routes to at least `peers`
distinct servers (a quorum with itself: 1 of the 2 others in a cluster of 3, so that one
server down leaves the other two ready, and one cut off in a minority is not), `/jsz` names a
meta leader. deploy/k8s/nats.yaml's readiness probe is the same check
in `sh` + `wget` (`NATS_READY_SH`), for the nats image that has no Python."""

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


def _get_json(url: str, timeout: float) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


def nats_readiness(monitor_url: str, peers: int, timeout: float = 2.0) -> tuple[bool, str]:
    """Ready: JetStream meta layer current, routes up to `peers` other servers, a meta leader."""
    base = monitor_url.rstrip("/")
    try:
        code, body = _get_json(f"{base}/healthz?js-server-only=true", timeout)
        if code != 200:
            return False, f"jetstream not current: {body.get('error') or body.get('status') or code}"
        _, routez = _get_json(f"{base}/routez", timeout)
        up = {r.get("remote_name") for r in routez.get("routes") or [] if r.get("remote_name")}
        if len(up) < peers:
            return False, f"routes to {len(up)} of {peers} peers ({', '.join(sorted(up)) or 'none'})"
        _, jsz = _get_json(f"{base}/jsz", timeout)
        leader = (jsz.get("meta_cluster") or {}).get("leader")
        if not leader:
            return False, "no JetStream meta leader"
    except OSError as e:
        return False, f"monitoring endpoint unreachable: {e}"
    return True, f"ok: routes to {len(up)} peers, meta leader {leader}"


#: `nats_readiness` for the nats image's busybox (deploy/k8s/nats.yaml): PEERS and PORT filled in.
NATS_READY_SH = (
    'm=http://127.0.0.1:PORT; wget -qO- "$m/healthz?js-server-only=true" >/dev/null'
    ' && [ "$(wget -qO- $m/routez | grep -o \'"remote_name": *"[^"]*"\' | sort -u | wc -l)" -ge PEERS ]'
    ' && wget -qO- $m/jsz | grep -q \'"leader": *"[^"]\'')


def nats_ready_sh(peers: int, port: int = 8222) -> str:
    return NATS_READY_SH.replace("PORT", str(port)).replace("PEERS", str(peers))


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


__all__ = ["bind_loop", "mark_ready", "watch", "unwatch", "reset", "liveness", "readiness", "wsgi", "LOOP_TIMEOUT_S",
           "nats_readiness", "nats_ready_sh"]
