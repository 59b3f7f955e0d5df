"""The operator control subject: `gpusched.ctl.placement` stops and starts a supervised child."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

from gpusched.bus.log import connect
from gpusched.services.dashboard import control


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen | None = None
    held: bool = False


class _Stack:
    """The two things `stack_handlers` uses of `cli.stack.Stack`: `children` and `spawn`."""

    def __init__(self):
        self.children = {"placement": _Child("placement")}
        self.spawned = 0

    def spawn(self, child):
        child.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.spawned += 1


async def test_stop_and_start_placement(nats_url):
    stack = _Stack()
    stack.spawn(stack.children["placement"])
    supervisor = await connect(nats_url, name="supervisor")
    operator = await connect(nats_url, name="operator")
    try:
        await control.serve_controls(supervisor, control.stack_handlers(stack))
        child = stack.children["placement"]

        reply = await control.request(operator, "placement", "stop")
        assert reply == {"ok": True, "service": "placement", "action": "stop", "running": False}
        assert child.held and child.proc.wait(timeout=10) is not None

        reply = await control.request(operator, "placement", "start")
        assert reply["ok"] and reply["running"] and not child.held and stack.spawned == 2
        assert (await control.request(operator, "placement", "status"))["running"] is True

        bad = await control.request(operator, "placement", "explode")
        assert bad["ok"] is False and "action" in bad["error"]
        nobody = await control.request(operator, "fallback", "stop", timeout=2)
        assert nobody["ok"] is False and "no supervisor" in nobody["error"]
    finally:
        for c in stack.children.values():
            if c.proc and c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        await supervisor.drain()
        await operator.drain()
