"""GPU models as pools through real processes (issue 30): `gpusched up --gpu-types` starts a
mixed cluster of simulated node daemons; a job that accepts only H100 waits while an A100 is
free, one that accepts H100 then A100 falls back to the A100, `quota --model` sets a per-model
limit, and `show` and `teams` say so."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

from gpusched.core.state import ClusterState

from .test_up import UNCONFINED_USERS, _cli, _fold, free_port_block


async def _until(nats: str, what: str, ok, timeout: float = 20.0) -> ClusterState:
    deadline = time.monotonic() + timeout
    while True:
        state = await _fold(nats)
        if ok(state):
            return state
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.3)


async def test_a_mixed_stack_keeps_an_h100_job_off_the_a100_and_falls_back_when_asked(tmp_path):
    data = tmp_path / "stack"
    up = subprocess.Popen(
        [sys.executable, "-m", "gpusched.cli.main", "up", "--gpu-types", "1:H100,1:A100", "--gpus-per-node", "1",
         "--data-dir", str(data), "--nats-port", "0", "--redis-port", "0", "--dashboard-port", "0",
         "--metrics-port-base", str(free_port_block(12)), "--services",
         "admission,placement,projector,quota_ledger,reconciler,nodeagent", *UNCONFINED_USERS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(up.stdout.readline), 60)
        assert line.startswith("gpusched up: ready - nats nats://"), line + up.stderr.read()
        nats = json.loads((data / "stack.json").read_text())["nats"]
        env = {**os.environ, "GPUSCHED_NATS_URL": nats}
        state = await _fold(nats)
        assert sorted(g.model for g in state.gpus.values()) == ["A100", "H100"]

        def submit(*flags: str) -> str:
            r = _cli("submit", "--team", "a", "--gpus", "1", *flags, "--", "/bin/sh", "-c", "sleep 60", env=env)
            assert r.returncode == 0, r.stderr
            return r.stdout.strip()

        first = submit("--gpu-type", "H100")
        await _until(nats, "the first H100 job runs", lambda s: s.jobs[first].state == "running")
        assert state.nodes  # node00 is the H100 node, node01 the A100 one
        h100_only = submit("--gpu-type", "h100")
        st = await _until(nats, "the H100-only job has its reason",
                          lambda s: s.jobs[h100_only].pending_reason != "")
        assert st.jobs[h100_only].state == "pending" and st.nodes["node01"].free  # an A100 is free all along
        reason = st.jobs[h100_only].pending_reason  # the head's: which job holds the H100
        assert reason.startswith("waiting for 1 H100 GPUs; 0 free") and reason.endswith("; A100 not accepted"), reason
        shown = _cli("show", h100_only, env=env)
        assert "A100 not accepted" in shown.stdout and first in shown.stdout, shown.stdout + shown.stderr
        assert "GPU pools: A100 1/1 free  H100 0/1 free; accepts H100; not accepted: A100" in shown.stdout

        either = submit("--gpu-type", "H100,A100")
        st = await _until(nats, "the H100,A100 job falls back to the A100",
                          lambda s: s.jobs[either].state == "running")
        assert st.jobs[either].gpus == ["node01/0"] and st.jobs[h100_only].state == "pending"
        quota = _cli("quota", "a", "--model", "h100", "--limit", "1", env=env)  # at it: no second H100
        assert quota.returncode == 0 and "team a on h100: guaranteed 0, limit 1" in quota.stdout, quota.stderr
        teams = json.loads(_cli("teams", "--json", env=env).stdout)
        row = next(t for t in (teams["teams"] if isinstance(teams, dict) else teams) if t["team"] == "a")
        assert {p: (r["held"], r["limit"]) for p, r in row["pools"].items()} == {"A100": (1, None), "H100": (1, 1)}

        assert _cli("cancel", first, env=env).returncode == 0  # the H100 frees: the waiting job takes it
        st = await _until(nats, "the H100-only job starts on the H100", lambda s: s.jobs[h100_only].state == "running")
        assert st.jobs[h100_only].gpus == ["node00/0"]
        assert st.violations() == []
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)
            try:
                up.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
