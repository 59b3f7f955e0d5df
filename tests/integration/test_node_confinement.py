"""A tenant job cannot steer its node daemon: it can make it signal only its own processes,
and what it writes into its control directory is read within bounds and coalesced."""

from __future__ import annotations

import asyncio
import math
import subprocess
import time

from gpusched.core import events as ev
from gpusched.core.model import JobSpec

from .node_helpers import PY, Cluster, alive

ATTACKER = """
import os, signal, sys, time
ctl = os.environ["GPUSCHED_CONTROL_DIR"]
got = os.path.join(ctl, "..", "attacker-signalled")
signal.signal(signal.SIGUSR1, lambda *a: open(got, "w").write("yes"))
open(os.path.join(ctl, "sdk-%d" % os.getpid()), "w").write("SIGUSR1")  # itself: fine
for pid in sys.argv[1:]:  # pids that are not its own: the daemon, a co-tenant, a stray
    open(os.path.join(ctl, "sdk-" + pid), "w").write("SIGUSR1")
open(os.path.join(ctl, "..", "attacker-ready"), "w").write("1")
time.sleep(60)
"""


async def test_pid_registration_attack_signals_only_the_jobs_own_processes(nats_url, tmp_path):
    """A job that registers other processes' pids as SDK processes gets only its own
    signalled on preemption: a co-tenant's job and an unrelated process survive SIGUSR1."""
    stray = subprocess.Popen(["sleep", "60"])
    try:
        async with Cluster(nats_url, tmp_path) as c:
            host = await c.start_nodes(["p0"], gpus=2)
            await c.submit("victim", JobSpec(team="u", gpus=1, command=["sleep", "60"]))
            await c.grant("victim", ["p0/0"])
            await c.wait(lambda s: s.jobs["victim"].state == "running", "victim running")
            victim = host.agents["p0"].current("victim").proc
            victim_pids = victim.group.members()
            targets = [str(p) for p in [*victim_pids, stray.pid]]
            await c.submit("attacker", JobSpec(team="t", gpus=1, preemptible=True,
                                               command=[PY, "-c", ATTACKER, *targets]))
            await c.submit("urgent", JobSpec(team="t", gpus=1))
            await c.grant("attacker", ["p0/1"])
            await c.wait(lambda s: s.jobs["attacker"].state == "running", "attacker running")
            run = host.agents["p0"].current("attacker")
            ready = run.proc.launch.control_dir.parent / "attacker-ready"
            deadline = time.monotonic() + 10
            while not ready.exists():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await c.append(ev.PreemptionRequested(at=time.time(), job_id="attacker", for_job="urgent",
                                                  reason="test", deadline=time.time() + 30))
            signalled = run.proc.launch.control_dir.parent / "attacker-signalled"
            deadline = time.monotonic() + 10
            while not signalled.exists():  # the attacker itself is asked, as the protocol says
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            assert stray.poll() is None, "a process the job named was signalled"
            assert all(alive(p) for p in victim_pids), "a co-tenant's process was signalled"
            assert c.state.jobs["victim"].state == "running"
    finally:
        stray.kill()
        stray.wait()


FLOOD = """
import json, os, sys, time
ctl = os.environ["GPUSCHED_CONTROL_DIR"]
n, seconds, big = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "big"
if big:  # one 1 MB acknowledgement, then a good one
    with open(os.path.join(ctl, ".tmp"), "w") as f:
        f.write(json.dumps({"path": "/x" * 500000, "step": 1}))
    os.replace(os.path.join(ctl, ".tmp"), os.path.join(ctl, "ack-big.json"))
    time.sleep(0.5)
weights = os.path.join(os.environ["GPUSCHED_CHECKPOINT_DIR"], "w")  # acks name a file of its own
open(weights, "w").write("w")
start = time.monotonic()
for i in range(n):
    tmp = os.path.join(ctl, ".t%d" % i)
    with open(tmp, "w") as f:
        json.dump({"path": weights, "step": i + 2, "request": None}, f)
    os.replace(tmp, os.path.join(ctl, "ack-%09d.json" % i))
    time.sleep(max(0.0, start + seconds * (i + 1) / n - time.monotonic()))
open(os.path.join(ctl, "..", "flood-done"), "w").write("%.3f" % (time.monotonic() - start))  # how long it took
time.sleep(60)
"""


async def _flood(c: Cluster, host, job_id: str, gpu: str, n: int, seconds: float, big: bool) -> float:
    """Run the flood job; returns how long its acks really took (longer than `seconds` under load)."""
    await c.submit(job_id, JobSpec(team="t", gpus=1, command=[PY, "-c", FLOOD, str(n), str(seconds),
                                                               "big" if big else "small"]))
    await c.grant(job_id, [gpu])
    await c.wait(lambda s: s.jobs[job_id].state == "running", f"{job_id} running")
    done = host.agents[gpu.split("/")[0]].current(job_id).proc.launch.control_dir.parent / "flood-done"
    deadline = time.monotonic() + seconds + 20
    while not done.exists():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)  # the last poll and the coalesced report
    return float(done.read_text())


async def test_3000_acks_make_a_bounded_number_of_events(nats_url, tmp_path):
    """3,000 acknowledgements in 3 s with one report per second allowed: at most a handful of
    CheckpointSaved events (unbounded before), the newest step among them. The bound is the rule
    (one per interval, plus 3) over the time the acks really took: 6 for the 3 s planned, more
    only when a loaded machine stretched the flood itself (it once read 11 for a slow flood)."""
    async with Cluster(nats_url, tmp_path) as c:
        host = await c.start_nodes(["q0"], gpus=1, ack_interval_s=1.0)
        took = await _flood(c, host, "flood", "q0/0", 3000, 3.0, big=False)
        await asyncio.sleep(1.2)
        state = await c.refold()
        saved = c.events(ev.CheckpointSaved, "flood")
        assert 1 <= len(saved) <= 3 + math.floor(max(3.0, took) / 1.0), (len(saved), took)
        assert state.jobs["flood"].checkpoint.step == 3001  # the last one is not lost, only coalesced
        assert not list(host.agents["q0"].current("flood").proc.launch.control_dir.glob("ack-*"))


async def test_a_1mb_ack_does_not_break_the_daemon(nats_url, tmp_path):
    """One 1 MB acknowledgement is refused (and removed); the daemon stays connected, keeps
    heartbeating, and reports the job's next good acknowledgement."""
    async with Cluster(nats_url, tmp_path) as c:
        host = await c.start_nodes(["m0"], gpus=1, ack_interval_s=0.0)
        await _flood(c, host, "big", "m0/0", 3, 0.3, big=True)
        await c.wait(lambda s: s.jobs["big"].checkpoint is not None and s.jobs["big"].checkpoint.step == 4,
                     "the good acks reported")
        state = await c.refold()
        assert all(len(e.path) < 100 for e in c.events(ev.CheckpointSaved, "big"))
        assert host.log.nc.is_connected and not host.log.nc.is_closed
        beats = host.agents["m0"].heartbeats
        await asyncio.sleep(0.5)
        assert host.agents["m0"].heartbeats > beats
        assert state.violations() == []
