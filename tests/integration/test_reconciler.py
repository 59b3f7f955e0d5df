"""The reconciler against real node daemons, a real log and real processes: jobs whose process
vanished, zombies, lost nodes, unhealthy GPUs; and no double reports across a restart."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from gpusched.bus import subjects
from gpusched.bus.log import EventLog
from gpusched.core import events as ev
from gpusched.core.heartbeat import InjectHealth, InjectStray, NodeReply, SimulateCrash
from gpusched.core.model import JobSpec
from gpusched.services.reconciler import Reconciler, ReconcilerConfig

from .node_helpers import Cluster, reference_weights, train_spec, wait_gone

FAST = ReconcilerConfig(node_timeout_s=3.0, no_process_grace_s=1.0, zombie_grace_s=0.5, kill_retry_s=1.0, tick_s=0.2)


async def start_reconciler(nats_url: str, config: ReconcilerConfig = FAST) -> Reconciler:
    rec = Reconciler(await EventLog.open(nats_url, name="test-reconciler"), config)
    await rec.start()
    return rec


async def control(c: Cluster, node: str, request) -> NodeReply:
    msg = await c.log.nc.request(subjects.node_control_subject(node), msgspec.json.encode(request), timeout=2)
    return msgspec.json.decode(msg.data, type=NodeReply)


async def test_job_whose_process_vanished_is_requeued(nats_url, tmp_path):
    """The daemon restarts having lost its state files (so nothing can be adopted), the job is
    killed -9 meanwhile: only the heartbeats can tell, and the reconciler requeues the job."""
    async with Cluster(nats_url, tmp_path) as c:
        rec = await start_reconciler(nats_url)
        try:
            host1 = await c.start_nodes(["r0"], gpus=2)
            await c.submit("j", JobSpec(team="t", gpus=1, command=["sleep", "60"]))
            await c.grant("j", ["r0/1"])
            await c.wait(lambda s: s.jobs["j"].state == "running", "running")
            await asyncio.sleep(0.5)  # heartbeats show it: no false alarm while it runs
            assert not rec.appended
            (run,) = host1.agents["r0"].jobs.values()
            await host1.stop(kill_jobs=False)
            c.hosts.remove(host1)
            os.kill(run.proc.pid, signal.SIGKILL)
            run.proc.popen.wait()
            run.proc.kill_stragglers()
            shutil.rmtree(tmp_path / "work" / "runs")
            await c.start_nodes(["r0"], gpus=2)
            job = await c.wait(lambda s: s.jobs["j"].state == "pending" and s.jobs["j"], "requeued by the reconciler")
            assert job.restarts == 1 and job.pending_reason == "requeued: no_process"
            # with no restarts left the job fails instead
            await c.submit("k", JobSpec(team="t", gpus=1, command=[], max_restarts=0))
            await c.grant("k", ["r0/0"])
            await c.wait(lambda s: s.jobs["k"].state == "running", "k running")
            c.hosts[-1].crash("r0")  # its placeholder process vanishes with the machine ...
            c.hosts[-1].revive("r0")  # ... and a fresh daemon comes up at once
            job = await c.wait(lambda s: s.jobs["k"].state == "failed" and s.jobs["k"], "k failed")
            assert "no process" in job.end_reason
        finally:
            await rec.stop()
        state = await c.refold()
        assert [e.reason for e in c.events(ev.GpusReleased)] == ["no_process"]
        assert not c.events(ev.NodeLost)
        assert state.violations() == []


async def test_stray_process_is_detected_killed_and_reclaimed(nats_url, tmp_path):
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["z0"], gpus=4)
        rec = await start_reconciler(nats_url)
        stray = subprocess.Popen(["sleep", "60"])
        try:
            assert (await control(c, "z0", InjectStray(index=2, pid=stray.pid))).ok
            assert (await control(c, "z0", InjectStray(index=3, pid=3_999_999))).ok  # a phantom: no such process
            await c.wait(lambda s: s.gpus["z0/2"].zombie_pids == [stray.pid], "zombie detected")
            assert "z0/2" not in c.state.nodes["z0"].free  # kept out of placement
            deadline = time.monotonic() + 5
            while stray.poll() is None:
                assert time.monotonic() < deadline, "the node daemon did not kill the stray"
                await asyncio.sleep(0.05)
            assert stray.returncode == -signal.SIGKILL
            await c.wait(lambda s: all(s.gpus[g].zombie_pids is None for g in ("z0/2", "z0/3"))
                         and len(s.nodes["z0"].free) == 4, "reclaimed")
        finally:
            if stray.poll() is None:
                stray.kill()
                stray.wait()
            await rec.stop()
        count = len([e async for e in c.log.replay()])
        # a restarted reconciler finds nothing to say
        rec2 = await start_reconciler(nats_url)
        await asyncio.sleep(1.0)
        await rec2.stop()
        assert rec2.appended == []
        state = await c.refold()
        assert len(c.history) == count
        for kind in (ev.ZombieDetected, ev.ZombieReclaimed):
            assert sorted(e.gpu for e in c.events(kind)) == ["z0/2", "z0/3"]
        assert state.violations() == []


async def test_lost_node_requeues_its_job_from_checkpoint(nats_url, tmp_path: Path):
    ckdir = tmp_path / "ckpt"
    steps = 60
    async with Cluster(nats_url, tmp_path) as c:
        host = await c.start_nodes(["l0", "l1"], gpus=2)
        rec = await start_reconciler(nats_url)
        try:
            await c.submit("train", train_spec(ckdir, steps=steps, every=10, step_time=0.03))
            await c.grant("train", ["l0/0", "l0/1"])
            ckpt = await c.wait(lambda s: s.jobs["train"].checkpoint, "a periodic checkpoint")
            pid = host.agents["l0"].current("train").proc.pid
            assert (await control(c, "l0", SimulateCrash())).ok  # the machine dies with its processes
            await wait_gone(pid, timeout=5)
            job = await c.wait(lambda s: s.nodes["l0"].lost and s.jobs["train"], "node lost", timeout=10)
            assert job.state == "pending" and job.checkpoint is not None and job.checkpoint.step >= ckpt.step
            assert job.lost_gpu_s > 0
            await c.grant("train", ["l1/0", "l1/1"])
            job = await c.wait(lambda s: s.jobs["train"].state == "completed" and s.jobs["train"], "completed")
            log2 = (tmp_path / "work" / "logs" / "train" / "2-l1.log").read_text()
            assert f"starting at step {job.checkpoint.step}" in log2 or "starting at step" in log2
            host.revive("l0")  # the machine comes back: it registers again and is usable
            await c.wait(lambda s: not s.nodes["l0"].lost and len(s.nodes["l0"].free) == 2, "l0 back")
        finally:
            await rec.stop()
        state = await c.refold()
        assert [e.node for e in c.events(ev.NodeLost)] == ["l0"]
        assert state.violations() == []
    assert (ckdir / "final.npy").read_bytes() == reference_weights(tmp_path, steps)


async def test_killed_daemon_process_means_node_lost(nats_url, tmp_path):
    """A real daemon process (`python -m gpusched.services.nodeagent`), killed -9."""
    async with Cluster(nats_url, tmp_path) as c:
        rec = await start_reconciler(nats_url)
        cmd = [sys.executable, "-m", "gpusched.services.nodeagent", "--nats", nats_url, "--backend", "sim",
               "--node", "p0", "--gpus", "2", "--heartbeat-s", "0.2", "--work-dir", str(tmp_path / "w")]
        daemon = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "daemon.log", "wb"))
        try:
            await c.wait(lambda s: "p0" in s.nodes, "registered", timeout=20)
            await asyncio.sleep(3.5)  # heartbeats keep it alive past the timeout
            assert not c.state.nodes["p0"].lost
            daemon.kill()
            daemon.wait()
            t0 = time.monotonic()
            await c.wait(lambda s: s.nodes["p0"].lost, "lost", timeout=10)
            assert 2.0 < time.monotonic() - t0 < 8
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()
            await rec.stop()
        state = await c.refold()
        assert state.violations() == []


async def test_unhealthy_gpu_is_quarantined_and_restored(nats_url, tmp_path):
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["h0"], gpus=4)
        rec = await start_reconciler(nats_url)
        try:
            assert (await control(c, "h0", InjectHealth(index=1, xid=79))).ok
            gpu = await c.wait(lambda s: s.gpus["h0/1"].quarantined and s.gpus["h0/1"], "quarantined")
            assert gpu.quarantined == "health: XID 79" and "h0/1" not in c.state.nodes["h0"].free
            assert (await control(c, "h0", InjectHealth(index=1, healthy=True))).ok
            await c.wait(lambda s: s.gpus["h0/1"].quarantined is None, "restored")
            # an operator's quarantine (any other reason) is not undone by the reconciler
            await c.append(ev.GpuQuarantined(at=time.time(), gpu="h0/2", reason="operator: flaky fan"))
            await asyncio.sleep(0.8)
            assert c.state.gpus["h0/2"].quarantined == "operator: flaky fan"
        finally:
            await rec.stop()
        state = await c.refold()
        assert len(c.events(ev.GpuQuarantined)) == 2 and len(c.events(ev.GpuRestored)) == 1
        assert state.violations() == []


async def test_quarantined_gpu_under_a_running_job_is_a_fact_and_the_job_moves(nats_url, tmp_path):
    """A GPU a running job holds turns unhealthy: the log gets `JobOnUnhealthyGpu`, `show` and
    `jobs` say so, and the policy asks the (preemptible) job to checkpoint and move."""
    from gpusched import readmodel
    from gpusched.policy.config import PRESETS
    from gpusched.policy.cycle import cycle

    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["u0"], gpus=4)
        rec = await start_reconciler(nats_url)
        try:
            await c.submit("j", JobSpec(team="t", gpus=2, preemptible=True, command=["sleep", "60"]))
            await c.grant("j", ["u0/0", "u0/1"])
            await c.wait(lambda s: s.jobs["j"].state == "running", "running")
            assert (await control(c, "u0", InjectHealth(index=1, xid=79))).ok
            job = await c.wait(lambda s: s.jobs["j"].unhealthy and s.jobs["j"], "the job is told")
            assert job.unhealthy == ["u0/1"] and job.unhealthy_reason == "health: XID 79"
            doc = readmodel.job_doc(c.state, job)
            assert doc["unhealthy_gpus"] == [{"gpu": "u0/1", "node": "u0", "index": 1}]
            decided = cycle(c.state, time.time(), PRESETS["full"])
            [move] = [e for e in decided if isinstance(e, ev.PreemptionRequested)]
            assert move.job_id == move.for_job == "j" and "unhealthy GPU(s) u0/1" in move.reason
            await asyncio.sleep(0.6)  # no second fact for the same GPU
        finally:
            await rec.stop()
        state = await c.refold()
        assert len(c.events(ev.JobOnUnhealthyGpu)) == 1 and state.violations() == []


async def test_a_node_that_crashes_and_returns_does_not_flap(nats_url, tmp_path):
    """A crash is one NodeLost; the return is one NodeRegistered, after a few heartbeats (damped),
    and re-registration resets the node's heartbeat age: no lost/registered ping-pong."""
    async with Cluster(nats_url, tmp_path) as c:
        host = await c.start_nodes(["v0"], gpus=2, heartbeat_s=0.2)
        rec = await start_reconciler(nats_url, ReconcilerConfig(node_timeout_s=1.0, no_process_grace_s=1.0,
                                                                zombie_grace_s=0.5, tick_s=0.1))
        try:
            assert (await control(c, "v0", SimulateCrash(revive_after_s=2.0))).ok
            await c.wait(lambda s: s.nodes["v0"].lost, "lost")
            await c.wait(lambda s: not s.nodes["v0"].lost, "back", timeout=10)
            await asyncio.sleep(2.0)  # several node timeouts: it stays
            assert not c.state.nodes["v0"].lost and host.agents["v0"].heartbeats > 5
        finally:
            await rec.stop()
        await c.refold()
        kinds = [e.kind for e in c.history if getattr(e, "node", None) == "v0"]
        assert kinds == ["NodeRegistered", "NodeLost", "NodeRegistered"], kinds
