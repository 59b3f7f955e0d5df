"""Operator controls of the stack over NATS request/reply: stop or start one service.

Subject `gpusched.ctl.<service>` (e.g. `gpusched.ctl.placement`), request body
`{"action": "stop" | "start" | "status"}`, reply `{"ok": bool, "service": ..., "running": bool,
"error"?: str}`. The supervisor (`gpusched up`) answers: `serve_controls` wires callbacks to the
subject; the dashboard and the demo send with `request`. Stopping a service this way is a clean
SIGTERM and the supervisor does not restart it until `start`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from gpusched import telemetry

CTL_PREFIX = "gpusched.ctl."

#: `action` ("stop" | "start" | "status") -> True when the service runs afterwards.
Handler = Callable[[str], Awaitable[bool] | bool]


def control_subject(service: str) -> str:
    return CTL_PREFIX + service


async def request(nc: NATS, service: str, action: str, timeout: float = 10.0) -> dict[str, Any]:
    """Ask the supervisor to stop/start a service; a reply dict even when nobody answers."""
    body = json.dumps({"action": action}).encode()
    for attempt in range(4):  # a supervisor that is (re)subscribing answers a moment later
        try:
            msg = await nc.request(control_subject(service), body, timeout=timeout, headers=telemetry.inject({}))
            break
        except NoRespondersError:
            if attempt == 3:
                return {"ok": False, "service": service, "error": f"no supervisor answers "
                        f"{control_subject(service)} (is this stack started by `gpusched up`?)"}
            await asyncio.sleep(0.25)
        except NatsTimeout:
            return {"ok": False, "service": service,
                    "error": f"no reply on {control_subject(service)} within {timeout}s"}
    try:
        return json.loads(msg.data)
    except json.JSONDecodeError:
        return {"ok": False, "service": service, "error": f"bad reply: {msg.data[:200]!r}"}


async def serve_controls(nc: NATS, handlers: dict[str, Handler]):
    """Answer `gpusched.ctl.<service>` for each handler; returns the subscriptions."""
    subs = []
    for service, handler in handlers.items():
        async def on_msg(msg, service=service, handler=handler) -> None:
            with telemetry.consume_span(f"ctl.{service}", msg.headers):
                try:
                    action = json.loads(msg.data or b"{}").get("action")
                except (json.JSONDecodeError, AttributeError):
                    action = None
                if action not in ("stop", "start", "status"):
                    reply: dict[str, Any] = {"ok": False, "service": service,
                                             "error": "action must be stop, start or status"}
                else:
                    try:
                        result = handler(action)
                        running = await result if isinstance(result, Awaitable) else result
                        reply = {"ok": True, "service": service, "action": action, "running": bool(running)}
                    except Exception as err:  # noqa: BLE001 - the operator sees why
                        reply = {"ok": False, "service": service, "action": action, "error": str(err)}
                await msg.respond(json.dumps(reply).encode())

        subs.append(await nc.subscribe(control_subject(service), cb=on_msg))
    await nc.flush()  # the subscriptions are known to the server when this returns
    return subs


def stack_handlers(stack: Any, services: tuple[str, ...] = ("placement",)) -> dict[str, Handler]:
    """Handlers for `serve_controls` over a `gpusched up` supervisor (`cli.stack.Stack`): `stop`
    sends SIGTERM to the child and marks it `held` (the supervisor must not restart a held
    child), `start` clears the mark and spawns it if it is not running."""

    def make(name: str) -> Handler:
        def handle(action: str) -> bool:
            child = stack.children.get(name)
            if child is None:
                raise RuntimeError(f"service {name} is not part of this stack")
            running = child.proc is not None and child.proc.poll() is None
            if action == "stop":
                child.held = True
                if running:
                    child.proc.terminate()
                return False
            if action == "start":
                child.held = False
                if not running:
                    stack.spawn(child)
                return True
            return running

        return handle

    return {name: make(name) for name in services}


__all__ = ["CTL_PREFIX", "control_subject", "request", "serve_controls", "stack_handlers"]
