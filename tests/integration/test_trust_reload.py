"""`gpusched user add/revoke` reloads the NATS server the trust store remembers: after that
server was restarted (as `up` restarts a dead one), or when its pid now names another process,
the reload never signals a stranger."""

from __future__ import annotations

import json
import subprocess

from gpusched.bus.servers import start_nats
from gpusched.security.trust import TrustStore


def test_reload_signals_only_the_remembered_nats_server(tmp_path):
    store = TrustStore(tmp_path / "trust")
    store.ensure_stack()
    server = start_nats(store_dir=tmp_path / "nats", trust=store)
    stranger = subprocess.Popen(["sleep", "30"])
    try:
        assert store.reload_server()  # the live server: reloaded
        assert server.proc.poll() is None
        saved = json.loads(store.server_file.read_text())
        stale = [{**entry, "pid": stranger.pid} for entry in saved["servers"]]  # a stale pid, reused
        store.server_file.write_text(json.dumps({"servers": stale}))
        assert not store.reload_server()
        assert stranger.poll() is None  # not SIGHUPed
    finally:
        stranger.kill()
        stranger.wait()
        server.stop()
