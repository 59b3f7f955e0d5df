"""A client moves off a NATS server that lost its quorum (issue 25): the lab's 3-server cluster
(the deployed config, TLS, auth) on its own hosts, a client on a fourth one that connects as
every gpusched process does (`bus.log.connect`, the three seeds) and asks JetStream for its
account info every 0.3 s. The test cuts the client's server off from the other two, not from
the client: the client's TCP connection stays up, and only its quorum watch
(`bus.connection.QuorumWatch`) can tell it to reconnect to a server of the majority."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpusched.lab import netns
from gpusched.lab.stack import LabStack

pytestmark = [pytest.mark.slow,  # ~25 s: a cluster of its own
              pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "lab available")]
LOST_S = 3.0

CLIENT = """
import asyncio, json, time
from gpusched.bus.log import connect

async def main():
    nc = await connect(None, name="quorum-client")
    while True:
        try:
            reply = await nc.request("$JS.API.INFO", b"", timeout=1)
            ok = "error" not in json.loads(reply.data)
        except Exception:
            ok = False
        print(json.dumps({"t": time.monotonic(), "server": getattr(nc.connected_url, "netloc", None), "ok": ok}),
              flush=True)
        await asyncio.sleep(0.3)

asyncio.run(main())
"""


def samples(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise TimeoutError(what)


def test_a_client_moves_off_a_server_cut_off_from_the_majority():
    work = Path(tempfile.mkdtemp(prefix="gs-labquorum-"))
    work.chmod(0o711)
    stack = LabStack(work, nodes=1)
    c = stack.nats
    client = None
    try:
        c.add_hosts()
        stack.lab.add_host("client")
        stack.lab.write_hosts()
        c.start_all()
        c.wait(lambda: all(c.ready(n) for n in c.names), 60)
        env = {**stack.env("admin"), "GPUSCHED_QUORUM_PROBE_S": "0.5", "GPUSCHED_QUORUM_LOST_S": f"{LOST_S:g}"}
        out = work / "client.out"
        client = stack.lab.popen("client", [sys.executable, "-c", CLIENT], env=env, stdout=out.open("w"),
                                 stderr=subprocess.STDOUT)
        first = wait_for(lambda: next((s for s in samples(out) if s["ok"]), None), 30, "the client answered")
        server = first["server"].split(".")[0]  # nats-N.nats:4222
        others = [n for n in c.names if n != server]
        t_cut = time.monotonic()
        stack.lab.isolate(server, others)
        try:
            c.wait(lambda: not c.ready(server), 40)  # a minority: its own probe says so
            moved = wait_for(lambda: next((s for s in samples(out) if s["t"] > t_cut and s["ok"]
                                           and not s["server"].startswith(f"{server}.")), None),
                             40, f"the client off {server}: {samples(out)[-3:]}")
        finally:
            stack.lab.heal()
        print(f"\nclient moved off {server} (cut from its peers) to {moved['server']} "
              f"{moved['t'] - t_cut:.1f}s after the cut (quorum watch: lost after {LOST_S:g}s)")
    finally:
        if client is not None:
            client.kill()
            client.wait(10)
        stack.down()
        shutil.rmtree(work, ignore_errors=True)
    assert not [ns for ns in netns.namespaces() if ns.startswith(f"{netns.PREFIX}{stack.lab.tag}-")]
