"""Idle holders and leaked GPU memory over the real stack: service processes, a simulated node
daemon whose jobs show the utilization their environment asks for (`GPUSCHED_SIM_UTIL`), the
reconciler reading its heartbeats, and the CLI's views of used versus held GPU-hours."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import msgspec

from gpusched.bus import subjects
from gpusched.cli import reads, render
from gpusched.core import events as ev
from gpusched.core.heartbeat import InjectLeak, NodeReply

from .harness import harness  # noqa: F401

HEARTBEAT_S = 0.3
IDLE_AFTER_S = 1.5
TICK_S = 0.2
POLICY = ["--policy-set=min_runtime_s=0", "--policy-set=checkpoint_grace_s=3",
          f"--policy-set=idle_after_s={IDLE_AFTER_S}", '--policy-set=idle_timeout_s={"interactive": 2.5}']


async def _stack(h, gpus: int, *reconciler: str) -> str:
    h.start("admission")
    h.start("placement", *POLICY)
    h.start("preemptor", *POLICY)
    h.start("reconciler", *POLICY, "--tick-s", str(TICK_S), "--node-timeout-s", "15", *reconciler)
    h.start("nodeagent", "--backend", "sim", "--count", "1", "--gpus", str(gpus),
            "--heartbeat-s", str(HEARTBEAT_S), "--kill-grace-s", "1", "--work-dir", str(h.tmp / "work"))
    await h.ready("admission", "placement", "preemptor", "reconciler", "nodeagent")
    (node,) = await h.wait_for("node registered", lambda s: list(s.nodes))
    return node


def _cli(h, *args: str) -> list[dict]:
    env = {**os.environ, "GPUSCHED_NATS_URL": h.nats_url, "GPUSCHED_REDIS_URL": h.redis_url}
    out = subprocess.run([sys.executable, "-m", "gpusched.cli.main", *args, "--json", "--fold"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


async def test_an_idle_job_is_reported_shown_and_timed_out_while_the_busy_one_runs(harness, capsys):
    h = harness
    await _stack(h, gpus=4)
    env = {"GPUSCHED_SIM_DURATION_S": "120"}
    idle = await h.submit(team="lab", gpus=2, priority="interactive", env={**env, "GPUSCHED_SIM_UTIL": "0"})
    busy = await h.submit(team="lab", gpus=2, env=env)
    await h.wait_for("both running", lambda s: all(s.jobs[j].state == "running" for j in (idle, busy)))
    waiting = await h.submit(team="lab", gpus=2, env=env)

    fact = await h.wait_for("idle fact", lambda s: [e for e in h.events(ev.JobIdle)], timeout=15)
    started = [e for e in h.events(ev.JobStarted) if e.job_id == idle][0]
    assert [e.job_id for e in fact] == [idle]  # for it alone, once
    (f,) = fact
    assert f.window_s >= IDLE_AFTER_S and f.util_pct == 0.0 and f.threshold_pct == 5.0
    # the evidence began within two heartbeats (and a tick) of its start, and the fact followed
    # within idle_after_s plus two heartbeats (slack for a loaded machine)
    assert f.since - started.at <= 2 * HEARTBEAT_S + TICK_S + 1.0
    assert f.at - started.at <= IDLE_AFTER_S + 2 * HEARTBEAT_S + TICK_S + 1.5

    used: dict = {}
    for _ in range(100):  # the reconciler writes its window every 2 s
        used = await reads.usage(h.redis_url)
        if idle in used and busy in used:
            break
        await asyncio.sleep(0.2)
    data = await reads.show_data(h.nats_url, h.redis_url, idle)
    assert data["job"]["idle"]["since"] == f.since
    assert data["job"]["usage"]["util_pct"] == 0.0  # the reconciler's window (read model in Redis)
    running = {d["job_id"]: d for d in _cli(h, "jobs")}
    assert running[busy]["usage"]["util_pct"] == 97.0 and running[busy]["usage"]["memory_mb"] > 0
    render.print_show(data)
    assert "IDLE" in capsys.readouterr().out

    # the interactive idle timeout: checkpoint (the placeholder answers), release, requeue
    request = await h.wait_for("idle timeout", lambda s: [e for e in h.events(ev.PreemptionRequested)
                                                          if e.job_id == idle], timeout=15)
    assert request[0].cause == "idle" and "idle timeout of 2.5 s for interactive jobs" in request[0].reason
    await h.wait_for("waiting job granted", lambda s: h.holding(waiting), timeout=15)
    st = h.state
    (released,) = [e for e in h.events(ev.GpusReleased) if e.job_id == idle]
    assert not released.forced  # it checkpointed when asked
    (grant,) = [e for e in h.events(ev.GpusGranted) if e.job_id == waiting]
    assert set(grant.gpus) == set(next(e for e in h.events(ev.GpusGranted) if e.job_id == idle).gpus)
    assert st.jobs[busy].state == "running" and st.jobs[busy].attempt == 1  # untouched
    assert st.jobs[idle].state == "pending" and st.jobs[idle].yielded_idle and st.jobs[idle].idle_requeues == 1
    assert not [e for e in h.events(ev.JobIdle) if e.job_id == busy]

    shown = await reads.show_data(h.nats_url, h.redis_url, idle)
    (p,) = shown["preemptions"]
    assert p["cause"] == "idle" and p["checkpoint"]["on_request"]

    # used versus held: the CLI's job and team figures add up across jobs
    for j in (idle, busy, waiting):
        reply = await h.client.cancel(j)
        assert reply.ok, reply.error
    await h.wait_for("all ended", lambda s: not s.running and not s.pending)
    jobs = {d["job_id"]: d for d in _cli(h, "jobs")}
    (team,) = [d for d in _cli(h, "teams") if d["team"] == "lab"]
    for key in ("gpu_hours_held", "gpu_hours_busy"):
        assert abs(sum(jobs[j][key] for j in (idle, busy, waiting)) - team[key]) < 1e-3
    assert jobs[idle]["gpu_hours_busy"] < jobs[idle]["gpu_hours_held"]  # idle since (almost) its start
    assert jobs[busy]["efficiency"] == 1.0
    assert 0 < team["efficiency"] < 1


async def test_leaked_memory_quarantines_the_gpu_until_it_is_freed(harness):
    h = harness
    node = await _stack(h, 2, "--leak-grace-s", "0.5", "--leak-min-mb", "1024")
    first = await h.submit(team="t", gpus=1, env={"GPUSCHED_SIM_DURATION_S": "0.3"})
    await h.wait_for("first done", lambda s: s.jobs[first].state == "completed", timeout=15)
    (gpu,) = next(e for e in h.events(ev.GpusGranted) if e.job_id == first).gpus
    index = int(gpu.rsplit("/", 1)[1])

    async def control(request) -> NodeReply:
        msg = await h.log.nc.request(subjects.node_control_subject(node), msgspec.json.encode(request), timeout=5)
        return msgspec.json.decode(msg.data, type=NodeReply)

    assert (await control(InjectLeak(index=index, memory_mb=4096))).ok  # the crash left driver memory behind
    reason = await h.wait_for("quarantined", lambda s: s.gpus[gpu].quarantined, timeout=15)
    assert reason.startswith("leaked memory: 4096 MB in use with no process")
    pair = await h.submit(team="t", gpus=2, env={"GPUSCHED_SIM_DURATION_S": "30"})
    single = await h.submit(team="t", gpus=1, env={"GPUSCHED_SIM_DURATION_S": "30"})
    await h.wait_for("single granted", lambda s: h.holding(single))
    assert gpu not in h.state.jobs[single].gpus and h.state.jobs[pair].state == "pending"
    assert (await control(InjectLeak(index=index, memory_mb=0))).ok  # freed (e.g. after a reset)
    await h.wait_for("restored", lambda s: s.gpus[gpu].quarantined is None, timeout=15)
    restored = [e for e in h.events(ev.GpuRestored) if e.gpu == gpu]
    assert [e.reason for e in restored] == ["leaked memory freed"]
    await h.client.cancel(single)
    await h.wait_for("pair granted on both GPUs", lambda s: h.holding(pair) and gpu in s.jobs[pair].gpus)
    assert not any(gpu in e.gpus for e in h.events(ev.GpusGranted)
                   if e.at < restored[0].at and e.job_id != first)
    await h.client.cancel(pair)
