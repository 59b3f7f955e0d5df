"""`/healthz` and `/readyz` on a service's `--metrics-port` server, as the kubelet and compose
probe them: a real service process against a real NATS server that is unresponsive at first,
then answers, then goes away and comes back."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from gpusched import health
from gpusched.bus.servers import free_port
from gpusched.cli.stack import spawn_service, stop_processes


def probe(port: int, path: str) -> tuple[int, str]:
    """(status, body) of one GET; (0, why) while nothing listens yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError as err:
        return 0, str(err)


def wait_status(port: int, path: str, want: int, proc, log_path, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    status, body = 0, ""
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"service exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
        status, body = probe(port, path)
        if status == want:
            return body
        time.sleep(0.05)
    raise AssertionError(f"{path} stayed {status} {body!r}, wanted {want}:\n{log_path.read_text()[-3000:]}")


@pytest.mark.timeout(90)
def test_service_probes_follow_nats(nats_server, redis_url, tmp_path):
    port = free_port()
    log_path = tmp_path / "preemptor.log"
    nats_server.proc.send_signal(signal.SIGSTOP)  # accepts TCP, says nothing: the service cannot be ready
    proc = spawn_service("preemptor", nats_server.url, redis_url, ["--metrics-port", str(port)], log_path=log_path)
    try:
        try:
            wait_status(port, "/healthz", 200, proc, log_path, timeout=30)
            status, body = probe(port, "/readyz")
            assert status == 503 and "starting" in body, (status, body)
        finally:
            nats_server.proc.send_signal(signal.SIGCONT)
        wait_status(port, "/readyz", 200, proc, log_path)
        assert probe(port, "/metrics")[0] == 200  # the metrics still answer beside the probes

        nats_server.kill()  # NATS gone: still alive (reconnecting), no longer ready
        body = wait_status(port, "/readyz", 503, proc, log_path, timeout=15)
        assert "NATS" in body, body
        assert probe(port, "/healthz")[0] == 200

        nats_server.restart()  # back: ready again without a restart of the service
        wait_status(port, "/readyz", 200, proc, log_path, timeout=30)
    finally:
        stop_processes([proc], timeout=5)


def test_liveness_fails_when_the_loop_is_wedged():
    """A loop that no longer runs callbacks fails liveness; one that turns passes it."""
    health.reset()
    loop = asyncio.new_event_loop()
    release = threading.Event()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        health.bind_loop(loop)
        assert health.liveness(timeout=2.0) == (True, "ok")
        loop.call_soon_threadsafe(release.wait, 10.0)  # a callback that blocks the loop
        ok, why = health.liveness(timeout=0.3)
        assert not ok and "did not turn" in why
        release.set()
        assert health.liveness(timeout=2.0)[0]
    finally:
        release.set()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    assert health.liveness() == (False, "event loop closed")
    health.reset()
    assert health.readiness()[0] is False


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name, extra", [
    ("nodeagent", ["--backend", "sim", "--count", "1", "--gpus", "2"]),
    ("dashboard", ["--port", "0"]),
])
def test_node_agent_and_dashboard_probes(name, extra, nats_url, redis_url, tmp_path):
    """The node daemon and the dashboard serve the same probes once started."""
    port = free_port()
    log_path = tmp_path / f"{name}.log"
    if name == "nodeagent":
        extra = [*extra, "--work-dir", str(tmp_path / "work")]
    proc = spawn_service(name, nats_url, redis_url, [*extra, "--metrics-port", str(port)], log_path=log_path)
    try:
        wait_status(port, "/readyz", 200, proc, log_path)
        assert probe(port, "/healthz") == (200, "ok\n")
    finally:
        stop_processes([proc], timeout=5)
