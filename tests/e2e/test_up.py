"""The whole stack through `gpusched up` as a user runs it: start, submit real commands with the
CLI, see them complete, kill one service and see `up` restart it, Ctrl-C, clean exit."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from gpusched.bus.log import EventLog
from gpusched.bus.servers import port_free
from gpusched.core.state import ClusterState

#: Jobs run as `up`'s own user here: the test's Python is under /root (0700), out of reach of the
#: dynamic uids `up` runs jobs as by default (tests/integration/test_tenant_boundary.py covers those).
UNCONFINED_USERS = ("--uid-range", "none")


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpusched.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=30)


async def _fold(nats_url: str) -> ClusterState:
    log = await EventLog.open(nats_url, name="e2e-up")
    state = ClusterState()
    try:
        async for seq, event in log.replay():
            state.apply(event, seq)
    finally:
        await log.close()
    return state


async def test_gpusched_up_runs_real_jobs_and_stops_cleanly(tmp_path):
    data = tmp_path / "stack"
    metrics_base = free_port_block(12)
    up = subprocess.Popen(
        [sys.executable, "-m", "gpusched.cli.main", "up", "--nodes", "2", "--gpus-per-node", "2",
         "--data-dir", str(data), "--nats-port", "0", "--redis-port", "0", "--dashboard-port", "0",
         "--restart-delay", "0.5", "--metrics-port-base", str(metrics_base), *UNCONFINED_USERS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(up.stdout.readline), 60)
        assert line.startswith("gpusched up: ready - nats nats://"), line + up.stderr.read()
        stack = json.loads((data / "stack.json").read_text())
        assert f"dashboard {stack['dashboard']}" in line
        env = {**os.environ, "GPUSCHED_NATS_URL": stack["nats"]}

        sleeper = _cli("submit", "--team", "a", "--gpus", "1", "--", "sleep", "1", env=env)
        assert sleeper.returncode == 0, sleeper.stderr
        script = "import os; print('rank', os.environ.get('RANK'), 'gpus', os.environ.get('CUDA_VISIBLE_DEVICES'))"
        pyjob = _cli("submit", "--team", "b", "--gpus", "2", "--json", "--", sys.executable, "-c", script, env=env)
        assert pyjob.returncode == 0, pyjob.stderr
        jobs = [sleeper.stdout.strip(), json.loads(pyjob.stdout)["job_id"]]
        refused = _cli("submit", "--team", "a", "--gpus", "5", "--", "true", env=env)
        assert refused.returncode == 1 and "the cluster has 4 GPUs; the job needs 5" in refused.stderr

        deadline = time.monotonic() + 20
        while True:
            state = await _fold(stack["nats"])
            if all(j in state.jobs and state.jobs[j].state == "completed" for j in jobs):
                break
            assert time.monotonic() < deadline, {j: state.jobs[j].state for j in jobs if j in state.jobs}
            await asyncio.sleep(0.3)
        assert state.violations() == []
        # every fact so far was signed by the service (or node daemon) whose role decides it
        audit = _cli("replay", "--verify", "--keys", str(data / "trust" / "keys.json"), "--json", env=env)
        assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr
        assert json.loads(audit.stdout)["trust"]["unsigned"] == 0

        # Each service serves its own metrics; the cluster's come from the projector alone, the
        # per-GPU ones (gpusched_gpu_*) from the reconciler.
        services = list(stack["services"])

        def scrape(name: str) -> str:
            port = metrics_base + services.index(name)
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

        placement = scrape("placement")
        assert 'gpusched_log_seq{service="placement"}' in placement
        assert "gpusched_grants_total" not in placement and 'gpusched_gpus{status="held"}' not in placement
        projector = scrape("projector")
        assert 'gpusched_gpus{status="held"}' in projector and "gpusched_grants_total" in projector
        deadline = time.monotonic() + 10
        while "gpusched_gpu_utilization_ratio{" not in (gpus := scrape("reconciler")):
            assert time.monotonic() < deadline, "no per-GPU metrics from the reconciler"
            await asyncio.sleep(0.5)
        assert "gpusched_gpu_temperature_celsius{" in gpus

        # The Redis password reaches the services in a 0600 file: not in their arguments (`ps`)
        # nor in their environment.
        password = urlsplit(stack["redis"]).password.encode()
        assert stat.S_IMODE((data / "redis.password").stat().st_mode) == 0o600
        for pid in stack["services"].values():
            assert password not in Path(f"/proc/{pid}/cmdline").read_bytes()
            assert password not in Path(f"/proc/{pid}/environ").read_bytes()

        # A service killed with SIGKILL is restarted by `up`.
        os.kill(stack["services"]["admission"], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while json.loads((data / "stack.json").read_text())["services"]["admission"] == stack["services"]["admission"]:
            assert time.monotonic() < deadline, "admission was not restarted"
            await asyncio.sleep(0.2)
        again = None
        while again is None or again.returncode == 2:  # until the new admission answers
            assert time.monotonic() < deadline, again.stderr
            again = _cli("cancel", "j-00000000", "--timeout", "1", env=env)
        assert again.returncode == 1 and "unknown job" in again.stderr

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=20) == 0
        assert "gpusched up: stopped" in up.stderr.read()
        for pid in stack["services"].values():
            assert not _alive(pid), f"service pid {pid} survived"
    finally:
        kill_stack(up, data)


def kill_stack(up: subprocess.Popen, data: Path) -> None:
    """A test's `up` still running at its end: the services run in their own sessions, so kill
    them by the pids `stack.json` names, then `up`."""
    if up.poll() is not None:
        return
    try:
        for pid in json.loads((data / "stack.json").read_text())["services"].values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass
    up.kill()
    up.wait()


def free_port_block(n: int) -> int:
    """A base port whose next n ports are free now (best effort)."""
    for base in range(21000, 60000, 97):
        if all(port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no block of free ports")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
