"""`gpusched.bus` imports nats-py without what a request/reply never uses (its JetStream package,
importlib.metadata, aiohttp), and each is still there, once, for whoever uses it: checked in
fresh interpreters, whichever way JetStream is reached first."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version

import pytest

FIRST_USE = {
    "an attribute": "nats.js.api.Header.STATUS",
    "a submodule import": "__import__('nats.js.errors')",
    "the event log": "__import__('gpusched.bus.log')",
}


def _run(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("use", FIRST_USE.values(), ids=FIRST_USE.keys())
def test_jetstream_is_loaded_on_first_use_as_one_module(use):
    seen = _run(f"""
import json, sys
import gpusched.bus, nats
before = [type(nats.js).__name__, 'nats.js' in sys.modules, 'importlib.metadata' in sys.modules, 'aiohttp' in sys.modules]
{use}
import nats.js, nats.js.api, nats.js.errors
real = sys.modules['nats.js']
print(json.dumps({{"before": before, "after": type(real).__name__,
                  "one": nats.js is real and real.api is sys.modules['nats.js.api'] and real.errors is sys.modules['nats.js.errors'],
                  "stream": real.JetStreamContext.__module__, "version": nats.aio.client.__version__}}))
""")
    assert seen["before"] == ["Deferred", False, False, False]
    assert seen["after"] == "module" and seen["one"] and seen["stream"] == "nats.js.client"
    assert seen["version"] == version("nats-py")  # what the client tells the server in CONNECT
