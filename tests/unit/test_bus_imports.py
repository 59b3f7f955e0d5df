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


def test_the_status_headers_answered_without_jetstream_are_every_one_nats_py_reads():
    """nats-py's client reads `nats.js.api.Header.NAME` of a message with a status (a request's 503
    "no responders"): `gpusched.bus.StatusHeader` answers those names without loading JetStream's
    package, so it must hold every name the client reads, with the real header's value."""
    import re
    from pathlib import Path

    import nats.aio.client
    import nats.js.api

    from gpusched.bus import StatusHeader

    read = set(re.findall(r"nats\.js\.api\.Header\.([A-Z_]+)", Path(nats.aio.client.__file__).read_text()))
    assert read and read <= set(StatusHeader.__members__), read - set(StatusHeader.__members__)
    assert {h.name: h.value for h in StatusHeader} == {n: nats.js.api.Header[n].value for n in StatusHeader.__members__}



def test_redis_loads_without_importlib_metadata_and_still_tells_the_server_its_version():
    """redis-py imports importlib.metadata at its start to read its own version when it connects:
    it loads with a stand-in, and every connection is given the version its dist-info names (what
    CLIENT SETINFO says); redis-py's own lookup still works, loading the real module then."""
    seen = _run("""
import json, sys
from gpusched import redis_client
before = 'importlib.metadata' in sys.modules
import redis.utils
print(json.dumps([before, redis_client.DRIVER.lib_version, redis.utils.get_lib_version(),
                  type(sys.modules['importlib.metadata']).__name__]))
""")
    assert seen == [False, version("redis"), version("redis"), "module"]
