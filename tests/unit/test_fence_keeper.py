"""The fence keeper's own rules, on real processes and files, without a bus: its bound fits in
the node timeout; a stale lease stops exactly the processes the run records prove (and marks
them fenced); a fresh lease stops nothing; a removed lease ends the keeper; the keeper the agent
side starts (`Keeper.ensure`, its own session) does the same on its own."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from gpusched.services.nodeagent import keeper
from gpusched.services.nodeagent.fencing import FenceConfig
from gpusched.services.nodeagent.procs import JobGroup


@pytest.mark.parametrize("timeout,heartbeat,kill", [(30.0, 5.0, 10.0), (8.0, 0.5, 2.0), (6.0, 0.3, 1.0)])
def test_the_keeper_waits_out_the_agents_own_fence_and_fits_the_node_timeout(monkeypatch, timeout, heartbeat, kill):
    monkeypatch.setenv("GPUSCHED_NODE_TIMEOUT_S", str(timeout))
    cfg = FenceConfig.from_env()
    assert cfg is not None
    after = cfg.keeper_after_s(kill, heartbeat)
    own = cfg.after_s(kill, heartbeat) + cfg.probe_s + cfg.probe_timeout_s  # the agent's fence, at the latest
    assert after >= own + cfg.checkpoint_grace_s
    assert heartbeat + after + keeper.TICK_S + kill < timeout


def job(runs: Path, name: str, **record) -> tuple[subprocess.Popen, Path]:
    """A real process in a session of its own, and its run record as the agent writes it."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    group = JobGroup.of(proc.pid, name, 1)
    assert group is not None
    path = runs / "n0" / f"{name}.1.0.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"launch": {"job_id": name, "attempt": 1, "cgroup": None}, "virtual": False,
                                "pid": group.pid, "pgid": group.pgid, "start_ticks": group.start_ticks,
                                "boot": group.boot, **record}))
    return proc, path


def lease(runs: Path, age_s: float, after_s: float = 1.0) -> None:
    (runs / keeper.LEASE).write_text(json.dumps({"renewed": time.monotonic() - age_s, "after_s": after_s,
                                                 "kill_grace_s": 0.5, "agent_pid": 1}))


def test_a_stale_lease_stops_the_recorded_processes_and_marks_them_fenced(tmp_path):
    runs = tmp_path / "runs"
    proc, path = job(runs, "a")
    ended, _ = job(runs, "b")
    ended.kill()
    ended.wait()  # a run that ended while no agent watched: nothing to stop
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)  # no record: never touched
    try:
        lease(runs, age_s=5.0)
        assert keeper.main([str(runs)]) == 0
        assert proc.wait(timeout=5) == -15  # SIGTERM
        assert keeper.fenced(path).startswith("fenced: the node agent (pid 1) silent for 5.")
        assert not keeper.fenced(runs / "n0" / "b.1.0.json")
        assert bystander.poll() is None
    finally:
        for p in (proc, bystander):
            p.kill()
            p.wait()


def test_a_fresh_lease_stops_nothing_and_a_removed_one_ends_the_keeper(tmp_path):
    runs = tmp_path / "runs"
    proc, path = job(runs, "a")
    try:
        lease(runs, age_s=0.0, after_s=30.0)
        done: list[int] = []
        watcher = threading.Thread(target=lambda: done.append(keeper.main([str(runs)])))
        watcher.start()
        time.sleep(3 * keeper.TICK_S)
        assert keeper.main([str(runs)]) == 0, "a second keeper of the work dir ends at once"
        assert watcher.is_alive() and proc.poll() is None
        (runs / keeper.LEASE).unlink()  # the agent stopped in order
        watcher.join(timeout=2)
        assert done == [0] and proc.poll() is None and not keeper.fenced(path)
    finally:
        proc.kill()
        proc.wait()


def test_the_keeper_the_agent_starts_outlives_it_and_fences_on_its_own(tmp_path):
    runs = tmp_path / "runs"
    proc, path = job(runs, "a")
    side = keeper.Keeper(tmp_path, after_s=0.6, kill_grace_s=0.5)
    try:
        side.renew(time.monotonic())
        side.ensure()
        assert side.proc is not None
        pid = side.proc.pid
        assert os.getsid(pid) == pid, "the keeper leads a session of its own"
        deadline = time.monotonic() + 10
        while proc.poll() is None:  # the lease is not renewed again: the agent is "dead"
            assert time.monotonic() < deadline, (runs / keeper.LOG).read_text()
            time.sleep(0.05)
        assert keeper.fenced(path)
        assert side.proc.wait(timeout=5) == 0
        log = [json.loads(line)["event"] for line in (runs / keeper.LOG).read_text().splitlines()]
        assert log == ["keeper_started", "keeper_fenced"]
    finally:
        proc.kill()
        proc.wait()
        if side.proc is not None:
            side.proc.kill()
            side.proc.wait()
