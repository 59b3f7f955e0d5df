"""`gpusched up` as a supervisor (issue 9) and its start-up (issue 14): NATS and Redis killed
with SIGKILL come back on the same port and data dir and the stack recovers with nothing lost;
readiness does not depend on the log format; `up` killed, or stopped with SIGTERM while NATS
hangs, leaves no service or server behind; the data dir persists; a busy explicit port is an
error."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusched.bus.servers import free_port
from gpusched.cli.startup import claim_data_dir

from .test_up import UNCONFINED_USERS, _alive, _cli, _fold


def _up(data: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gpusched.cli.main", "up", "--nodes", "2", "--gpus-per-node", "2", "--data-dir",
         str(data), "--nats-port", "0", "--redis-port", "0", "--dashboard-port", "0", "--restart-delay", "0.5",
         *UNCONFINED_USERS, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, **(env or {})})


async def _ready(up: subprocess.Popen, data: Path) -> dict:
    line = await asyncio.wait_for(asyncio.to_thread(up.stdout.readline), 90)
    assert line.startswith("gpusched up: ready"), line + (up.stderr.read() if up.poll() is not None else "")
    return json.loads((data / "stack.json").read_text())


def _pids(stack: dict) -> list[int]:
    return [*stack["services"].values(), *stack["servers"].values()]


async def _all_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        await asyncio.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _kill_all(up: subprocess.Popen, data: Path) -> None:
    if up.poll() is None:
        up.kill()
        up.wait()
    try:
        for pid in _pids(json.loads((data / "stack.json").read_text())):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError, KeyError):
        pass


async def _completed(nats_url: str, jobs: list[str], timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = await _fold(nats_url)
            if all(j in state.jobs and state.jobs[j].state == "completed" for j in jobs):
                return state
        except Exception:  # NATS coming back
            pass
        assert time.monotonic() < deadline, f"jobs {jobs} not completed"
        await asyncio.sleep(0.3)


async def test_nats_and_redis_killed_come_back_and_killing_up_leaves_nothing(tmp_path):
    data = tmp_path / "stack"
    up = _up(data, env={"GPUSCHED_LOG_FORMAT": "console"})  # readiness must not read log text
    try:
        stack = await _ready(up, data)
        env = {**os.environ, "GPUSCHED_NATS_URL": stack["nats"], "GPUSCHED_REDIS_URL": stack["redis"]}
        first = _cli("submit", "--team", "a", "--gpus", "1", "--", "sleep", "0.5", env=env)
        assert first.returncode == 0, first.stderr
        await _completed(stack["nats"], [first.stdout.strip()])

        for name in ("nats", "redis"):
            os.kill(stack["servers"][name], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:  # both restarted on the same ports
            now = json.loads((data / "stack.json").read_text())
            if all(now["servers"][n] != stack["servers"][n] and _alive(now["servers"][n]) for n in ("nats", "redis")):
                break
            assert time.monotonic() < deadline, (now, up.stderr)
            await asyncio.sleep(0.2)
        assert now["nats"] == stack["nats"] and now["redis"] == stack["redis"]
        # `gpusched user add/revoke` reloads the restarted server, not the dead one's pid
        remembered = json.loads((data / "trust" / "nats-server.json").read_text())["servers"]
        assert [s["pid"] for s in remembered] == [now["servers"]["nats"]]

        second = None
        while second is None or second.returncode != 0:  # the services reconnect by themselves
            assert time.monotonic() < deadline + 30, second.stderr if second else ""
            second = _cli("submit", "--team", "a", "--gpus", "1", "--timeout", "2", "--", "sleep", "0.5", env=env)
        jobs = [first.stdout.strip(), second.stdout.strip()]
        state = await _completed(stack["nats"], jobs)  # nothing lost: the first job is still in the log
        assert state.violations() == []
        while True:  # and the read models in the restarted Redis were written again
            listed = _cli("jobs", "--json", env=env)
            if listed.returncode == 0 and all(j in listed.stdout for j in jobs):
                break
            assert time.monotonic() < deadline + 60, listed.stdout + listed.stderr
            await asyncio.sleep(0.5)

        now = json.loads((data / "stack.json").read_text())
        up.kill()  # SIGKILL: no chance to clean up; the children must go by themselves
        up.wait()
        left = await _all_gone(_pids(now), 25)
        assert left == [], f"left running after `up` was killed: {left}"
    finally:
        _kill_all(up, data)


@pytest.mark.slow
async def test_sigterm_with_nats_hanging_leaves_nothing_and_the_data_dir_persists(tmp_path):
    data = tmp_path / "stack"
    services = ["--services", "admission,placement,reconciler,nodeagent,projector"]
    up = _up(data, *services)
    try:
        stack = await _ready(up, data)
        env = {**os.environ, "GPUSCHED_NATS_URL": stack["nats"]}
        job = _cli("submit", "--team", "a", "--gpus", "1", "--", "true", env=env)
        assert job.returncode == 0, job.stderr
        await _completed(stack["nats"], [job.stdout.strip()])
        os.kill(stack["servers"]["nats"], signal.SIGSTOP)  # NATS hangs: every drain would wait forever
        await asyncio.sleep(1.0)
        up.send_signal(signal.SIGTERM)  # as systemd stops a unit
        code = await asyncio.to_thread(up.wait, 40)
        assert code == 0, up.stderr.read()[-3000:]
        left = await _all_gone(_pids(stack), 10)
        assert left == [], f"left running after SIGTERM: {left}"
    finally:
        _kill_all(up, data)

    again = _up(data, *services)  # same data dir, no --fresh: the cluster is still there
    try:
        stack = await _ready(again, data)
        state = await _fold(stack["nats"])
        assert state.jobs[job.stdout.strip()].state == "completed"
    finally:
        again.send_signal(signal.SIGTERM)
        again.wait(timeout=40)
        _kill_all(again, data)


def test_an_explicit_busy_port_is_an_error(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        up = subprocess.run(
            [sys.executable, "-m", "gpusched.cli.main", "up", "--data-dir", str(tmp_path / "d"), "--nats-port",
             str(port), "--redis-port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert up.returncode == 1
    assert f"--nats-port {port}: the port is busy" in up.stderr


def test_one_up_per_data_dir_and_fresh_starts_empty(tmp_path):
    data = tmp_path / "d"
    lock = claim_data_dir(data)
    (data / "nats").mkdir()
    (data / "nats" / "store").write_text("log")
    try:
        claim_data_dir(data)
        raise AssertionError("a second claim succeeded")
    except RuntimeError as err:
        assert f"pid {os.getpid()}" in str(err)
    lock.close()
    lock = claim_data_dir(data, fresh=True)
    assert not (data / "nats").exists()
    lock.close()


def test_default_data_dir_follows_xdg(monkeypatch, tmp_path):
    from gpusched.cli.startup import default_data_dir

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_data_dir() == tmp_path / "gpusched"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_data_dir() == Path.home() / ".local" / "share" / "gpusched"
