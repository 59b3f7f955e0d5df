"""CPUs and memory as resources through `gpusched up`: a simulated node offering 4 CPUs
(`--node-cpus`), a job holding 3 of them, a job asking 2 more waits on free GPUs and says why in
`show`, a job given its team's default of 1 CPU runs beside it (backfill: its time limit ends
before the waiting job's turn), and a job no node can ever hold is refused at submit."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

from .test_up import UNCONFINED_USERS, _cli, _fold, kill_stack


async def test_a_node_with_few_cpus_runs_what_fits_and_says_why_the_rest_waits(tmp_path):
    data = tmp_path / "stack"
    up = subprocess.Popen(
        [sys.executable, "-m", "gpusched.cli.main", "up", "--nodes", "1", "--gpus-per-node", "4",
         "--node-cpus", "4", "--node-mem", "8G", "--data-dir", str(data), "--nats-port", "0", "--redis-port", "0",
         "--services", "admission,placement,reconciler,nodeagent", "--restart-delay", "0.5",
         *UNCONFINED_USERS],  # pytest's tmp dir is 0700: out of the dynamic uids' reach
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(up.stdout.readline), 60)
        assert line.startswith("gpusched up: ready"), line + up.stderr.read()
        stack = json.loads((data / "stack.json").read_text())
        env = {**os.environ, "GPUSCHED_NATS_URL": stack["nats"]}

        def submit(*args: str) -> subprocess.CompletedProcess:
            return _cli("submit", "--team", "a", "--gpus", "1", *args, env=env)

        never = submit("--cpus", "8", "--", "true")
        assert never.returncode == 1
        assert "no node can hold 8 CPUs per node for 1 GPUs (the largest node offers 4 CPUs)" in never.stderr
        assert "no node can hold 16G memory" in submit("--mem", "16G", "--", "true").stderr

        big = submit("--cpus", "3", "--time-limit", "10m", "--", "sleep", "60")
        assert big.returncode == 0, big.stderr
        big_id = big.stdout.strip()
        deadline = time.monotonic() + 20
        while (state := await _fold(stack["nats"])).jobs.get(big_id) is None or state.jobs[big_id].state != "running":
            assert time.monotonic() < deadline, f"the 3-CPU job did not start: {state.jobs.get(big_id)}"
            await asyncio.sleep(0.3)
        assert state.nodes["node00"].cpus == 4 and state.nodes["node00"].cpus_used == 3
        assert state.nodes["node00"].memory_mb == 8192

        waits = submit("--cpus", "2", "--", "sleep", "1")
        assert waits.returncode == 0, waits.stderr
        waits_id = waits.stdout.strip()
        quota = _cli("quota", "a", "--default-cpus", "1", "--default-mem", "256M", env=env)
        assert quota.returncode == 0, quota.stderr
        small = submit("--time-limit", "1m", "--", "true")  # the team's default: 1 CPU, 256 MiB
        assert small.returncode == 0, small.stderr
        small_id = small.stdout.strip()
        deadline = time.monotonic() + 20
        while True:
            state = await _fold(stack["nats"])
            job = state.jobs.get(waits_id)
            if state.jobs.get(small_id) and state.jobs[small_id].state == "completed" and job and job.pending_reason:
                break
            assert time.monotonic() < deadline, {j: (state.jobs[j].state, state.jobs[j].pending_reason)
                                                 for j in (waits_id, small_id) if j in state.jobs}
            await asyncio.sleep(0.3)
        reason = "fits on GPUs but no node has 2 CPUs free (per node; needs 1 GPUs)"
        assert job.state == "pending" and job.pending_reason == reason
        assert (state.jobs[small_id].spec.cpus, state.jobs[small_id].spec.memory_mb) == (1, 256)
        show = _cli("show", waits_id, env=env)
        assert show.returncode == 0 and reason in show.stdout, show.stdout + show.stderr
        assert "2 CPUs per node" in show.stdout, show.stdout  # what it asks
        assert state.violations() == []

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=20) == 0
    finally:
        kill_stack(up, data)
