"""The node daemon against a real log: registration, heartbeats, real job processes and their
environment, exits, cancellation, failures (the test plays placement by appending grants)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import msgspec

from gpusched.bus import subjects
from gpusched.core import events as ev
from gpusched.core.heartbeat import Heartbeat, KillProcesses, NodeReply, decode_heartbeat
from gpusched.core.model import JobSpec
from gpusched.services.nodeagent.launcher import master_port

from .node_helpers import PY, Cluster, alive, wait_gone

ENV_KEYS = ["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
            "LOCAL_RANK", "GPUSCHED_JOB_ID", "GPUSCHED_ATTEMPT", "GPUSCHED_NODE", "GPUSCHED_GPUS",
            "GPUSCHED_NPROC_PER_NODE", "GPUSCHED_CHECKPOINT_DIR", "GPUSCHED_CONTROL_DIR", "GPUSCHED_RESUME_FROM",
            "GPUSCHED_GPU_UUIDS", "FROM_SPEC"]


async def test_registration_and_heartbeats(nats_url, tmp_path):
    async with Cluster(nats_url, tmp_path) as c:
        beats: dict[str, list[Heartbeat]] = {}

        async def on_hb(msg):
            hb = decode_heartbeat(msg.data)
            beats.setdefault(hb.node, []).append(hb)

        sub = await c.log.nc.subscribe(subjects.HEARTBEATS, cb=on_hb)
        await c.log.nc.flush()
        await c.start_nodes(["a0", "a1"], gpus=4, nvlink="pairs", racks=["r0", "r1"])
        node = c.state.nodes["a0"]
        assert (node.rack, node.address, node.nvlink) == ("r0", "127.0.0.1", "pairs")
        assert [c.state.gpus[g].nvlink_domain for g in node.gpus] == [0, 0, 1, 1]
        deadline = time.monotonic() + 5
        while not all(len(beats.get(n, [])) >= 2 for n in ("a0", "a1")):
            assert time.monotonic() < deadline, beats.keys()
            await asyncio.sleep(0.05)
        await sub.unsubscribe()
        hb = beats["a0"][-1]
        assert [g.uuid for g in hb.gpus] == [c.state.gpus[g].uuid for g in node.gpus]
        assert all(g.healthy and g.pids == [] and g.memory_total_mb > 0 for g in hb.gpus)
        assert hb.backend == "sim" and hb.seq >= 2 and hb.jobs == []
        # a restarted daemon does not register again (the fold already knows the node)
        host2 = await c.start_nodes(["a0"], gpus=4)
        await host2.stop()
        c.hosts.remove(host2)
        state = await c.refold()
        assert len(c.events(ev.NodeRegistered)) == 2
        assert state.violations() == []


async def test_multi_node_job_gets_its_environment_and_completes(nats_url, tmp_path):
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["b0", "b1"], gpus=4)
        out = tmp_path / "env"
        out.mkdir()
        script = ("import os, json, sys, time; "
                  f"json.dump({{k: os.environ.get(k) for k in {ENV_KEYS!r}}}, "
                  f"open(os.path.join({str(out)!r}, os.environ['GPUSCHED_NODE'] + '.json'), 'w')); "
                  "print('hello from', os.environ['RANK']); time.sleep(0.5 if os.environ['RANK'] == '0' else 0)")
        spec = JobSpec(team="t", gpus=4, command=[PY, "-c", script], env={"FROM_SPEC": "yes", "GPUSCHED_JOB_ID": "x"})
        await c.submit("j1", spec)
        # the grant lists b1 first: b1 is rank 0 and MASTER_ADDR is its address
        attempt = await c.grant("j1", ["b1/2", "b1/3", "b0/0", "b0/1"])
        job = await c.wait(lambda s: s.jobs["j1"].state == "completed" and s.jobs["j1"], "j1 completed")
        assert sorted(job.nodes_started) == ["b0", "b1"]
        envs = {n: json.loads((out / f"{n}.json").read_text()) for n in ("b0", "b1")}
        assert envs["b1"]["CUDA_VISIBLE_DEVICES"] == "2,3" and envs["b0"]["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert (envs["b1"]["RANK"], envs["b0"]["RANK"]) == ("0", "1")
        port = str(master_port("j1", attempt))
        for n, env in envs.items():
            assert env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0" and env["MASTER_ADDR"] == "127.0.0.1"
            assert env["MASTER_PORT"] == port and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
            assert env["GPUSCHED_JOB_ID"] == "j1" and env["GPUSCHED_ATTEMPT"] == str(attempt)
            assert env["GPUSCHED_NPROC_PER_NODE"] == "2" and env["GPUSCHED_RESUME_FROM"] is None
            assert env["FROM_SPEC"] == "yes"
            assert env["GPUSCHED_CONTROL_DIR"].endswith(f"control/j1/{attempt}-{n}")
            assert len(env["GPUSCHED_GPU_UUIDS"].split(",")) == 2
        assert envs["b0"]["GPUSCHED_GPUS"] == "b0/0,b0/1"
        logfile = tmp_path / "work" / "logs" / "j1" / f"{attempt}-b1.log"
        assert "hello from 0" in logfile.read_text()
        state = await c.refold()
        assert [e.node for e in c.events(ev.JobStarted)] in (["b0", "b1"], ["b1", "b0"])
        assert len(c.events(ev.JobCompleted)) == 1 and not c.events(ev.JobFailed)
        assert state.violations() == []


async def test_cancel_kills_the_process_group(nats_url, tmp_path):
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["c0"], gpus=2, kill_grace_s=1.0)
        # a shell that ignores SIGTERM, with a child: the whole group must go, SIGKILL after the grace
        spec = JobSpec(team="t", gpus=1, command=["sh", "-c", "trap '' TERM; echo trapped; sleep 60 & wait"])
        await c.submit("j2", spec)
        await c.grant("j2", ["c0/1"])
        started = await c.wait(lambda s: s.jobs["j2"].state == "running", "j2 running")
        assert started
        await c.refold()
        (pid,) = c.events(ev.JobStarted)[0].pids
        assert alive(pid)
        logfile = tmp_path / "work" / "logs" / "j2" / "1-c0.log"
        deadline = time.monotonic() + 5
        while "trapped" not in logfile.read_text():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        t0 = time.monotonic()
        await c.append(ev.JobCancelled(at=time.time(), job_id="j2"))
        await wait_gone(pid, timeout=5)
        assert time.monotonic() - t0 >= 0.9  # it ignored SIGTERM: killed after the grace
        await asyncio.sleep(0.3)
        state = await c.refold()
        assert state.jobs["j2"].state == "cancelled"
        assert not c.events(ev.JobFailed) and not c.events(ev.JobCompleted) and not c.events(ev.GpusReleased)
        assert state.violations() == []


async def test_failures_requeue_then_fail_and_kill9_requeues(nats_url, tmp_path):
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["d0"], gpus=2)
        await c.submit("bad", JobSpec(team="t", gpus=1, command=[PY, "-c", "raise SystemExit(3)"], max_restarts=1))
        await c.grant("bad", ["d0/0"])
        await c.wait(lambda s: s.jobs["bad"].state == "pending" and s.jobs["bad"].restarts == 1, "requeued")
        await c.grant("bad", ["d0/0"])
        job = await c.wait(lambda s: s.jobs["bad"].state == "failed" and s.jobs["bad"], "failed")
        assert "exit code 3" in job.end_reason
        # kill -9 of a running job's process: the daemon sees the exit and requeues the attempt
        await c.submit("victim", JobSpec(team="t", gpus=1, command=["sleep", "60"]))
        await c.grant("victim", ["d0/1"])
        await c.wait(lambda s: s.jobs["victim"].state == "running", "victim running")
        await c.refold()
        (pid,) = c.events(ev.JobStarted, "victim")[0].pids
        os.kill(pid, signal.SIGKILL)
        job = await c.wait(lambda s: s.jobs["victim"].state == "pending" and s.jobs["victim"], "victim requeued")
        assert job.restarts == 1 and job.pending_reason == "requeued: process_failed"
        # a command that does not exist is a launch error: the job fails at once, never retried
        await c.submit("nope", JobSpec(team="t", gpus=1, command=["/no/such/binary"]))
        await c.grant("nope", ["d0/1"])
        job = await c.wait(lambda s: s.jobs["nope"].state == "failed" and s.jobs["nope"], "nope failed")
        assert job.end_reason == "launch error on node d0: command '/no/such/binary' not found " \
                                 "(/no/such/binary does not exist)"
        assert job.restarts == 0 and job.attempt == 1
        state = await c.refold()
        assert [e.reason for e in c.events(ev.GpusReleased)] == ["process_failed", "process_failed"]
        assert state.violations() == []


async def test_kill_requests_only_touch_processes_on_its_gpus(nats_url, tmp_path):
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["e0"], gpus=2)
        request = KillProcesses(pids=[os.getpid(), 4_000_000], reason="test")
        msg = await c.log.nc.request(subjects.node_control_subject("e0"), msgspec.json.encode(request), timeout=2)
        reply = msgspec.json.decode(msg.data, type=NodeReply)
        assert reply.ok and reply.killed == [] and reply.refused == [os.getpid()] and reply.missing == [4_000_000]
        msg = await c.log.nc.request(subjects.node_control_subject("e0"), b'{"type":"Nuke"}', timeout=2)
        assert "Invalid value 'Nuke'" in msgspec.json.decode(msg.data, type=NodeReply).error


async def test_elastic_resize_restarts_every_rank_with_the_new_world_size(nats_url, tmp_path):
    """A resize is checkpoint, stop all ranks, start all ranks: no rank is killed or started
    alone, and every new rank sees the new world size (a job that never checkpoints is
    stopped after `resize_grace_s`)."""
    async with Cluster(nats_url, tmp_path) as c:
        host = await c.start_nodes(["f0", "f1"], gpus=4, resize_grace_s=0.5)
        out = tmp_path / "env"
        out.mkdir()
        script = ("import os, json, time; e = os.environ; "
                  f"json.dump({{k: e[k] for k in ('RANK', 'WORLD_SIZE', 'GPUSCHED_GENERATION')}}, "
                  f"open(os.path.join({str(out)!r}, e['GPUSCHED_NODE'] + '-' + e['GPUSCHED_GENERATION']), 'w')); "
                  "time.sleep(60)")
        await c.submit("el", JobSpec(team="t", gpus=4, min_gpus=1, command=[PY, "-c", script]))
        await c.grant("el", ["f0/0", "f0/1", "f1/0", "f1/1"])
        await c.wait(lambda s: sorted(s.jobs["el"].nodes_started) == ["f0", "f1"], "both launched")
        old = [host.agents[n].current("el").proc.pid for n in ("f0", "f1")]
        # shrink off f1: both ranks stop, then rank 0 alone starts again with world size 1
        await c.append(ev.JobResized(at=time.time(), job_id="el", removed=["f1/0", "f1/1", "f0/1"]))
        for pid in old:
            await wait_gone(pid, timeout=5)
        await c.wait(lambda s: (out / "f0-1").exists(), "f0 restarted")
        assert json.loads((out / "f0-1").read_text()) == {"RANK": "0", "WORLD_SIZE": "1", "GPUSCHED_GENERATION": "1"}
        assert host.agents["f1"].current("el") is None and host.agents["f0"].current("el").gpus == (0,)
        # grow onto f1 again: the rank on f0 restarts too, and both see world size 2
        await c.append(ev.JobResized(at=time.time(), job_id="el", added=["f1/2", "f1/3"]))
        await c.wait(lambda s: (out / "f0-2").exists() and (out / "f1-2").exists(), "both restarted")
        assert json.loads((out / "f1-2").read_text())["WORLD_SIZE"] == "2"
        assert json.loads((out / "f0-2").read_text()) == {"RANK": "0", "WORLD_SIZE": "2", "GPUSCHED_GENERATION": "2"}
        state = await c.refold()
        assert state.jobs["el"].state == "running" and not c.events(ev.GpusReleased) and not c.events(ev.JobFailed)
        starts = [(e.node, e.generation) for e in c.events(ev.JobStarted, "el")]
        assert sorted(starts) == [("f0", 0), ("f0", 1), ("f0", 2), ("f1", 0), ("f1", 2)]
        assert state.violations() == []


async def test_a_node_announces_its_labels_and_an_admins_label_keeps_winning(nats_url, tmp_path):
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["a0"], labels={"zone": "b"})
        assert c.state.nodes["a0"].labels == {"zone": "b"}
        await c.append(ev.NodeLabeled(at=time.time(), node="a0", labels={"zone": "c"}))
        host2 = await c.start_nodes(["a0"], labels={"zone": "b"})  # a restart: the node is known, no registration
        await host2.stop()
        c.hosts.remove(host2)
        state = await c.refold()
        assert state.nodes["a0"].labels == {"zone": "c"} and len(c.events(ev.NodeRegistered)) == 1
        # a registration after the node was lost fills in labels it lacks, and keeps the admin's
        state.apply(ev.NodeLost(at=time.time(), node="a0", reason="test"))
        state.apply(msgspec.structs.replace(c.events(ev.NodeRegistered)[0], labels={"zone": "b", "disk": "nvme"}))
        assert state.nodes["a0"].labels == {"zone": "c", "disk": "nvme"} and not state.nodes["a0"].lost


def test_label_flags_are_held_to_the_registration_bounds():
    import pytest

    from gpusched.services.nodeagent.main import parse_labels

    assert parse_labels(["zone=b", "disk=nvme", "empty="]) == {"zone": "b", "disk": "nvme", "empty": ""}
    with pytest.raises(SystemExit, match="is not KEY=VALUE"):
        parse_labels(["zone"])
    with pytest.raises(SystemExit, match="--label"):
        parse_labels(["zone=has space"])


async def test_a_daemon_whose_view_of_the_log_is_not_fresh_starts_nothing(nats_url, tmp_path):
    """The read barrier: a grant folded while the daemon cannot confirm it holds the log's head
    (it lags, or NATS does not answer) waits; the launch happens once the view is confirmed."""
    async with Cluster(nats_url, tmp_path) as c:
        host = await c.start_nodes(["v0"], gpus=2)
        assert host.fresh_view()
        host.barrier.max_age_s = 0.0  # no confirmation is ever fresh enough
        await c.submit("jv", JobSpec(team="t", gpus=1, command=["sleep", "30"]))
        await c.grant("jv", ["v0/0"])
        await asyncio.sleep(1.0)  # five polls that retry the deferred launch
        await c.refold()
        assert c.state.jobs["jv"].state == "pending" or not c.state.jobs["jv"].nodes_started
        assert not c.events(ev.JobStarted, "jv") and ("jv", 1, 0) in host.agents["v0"].deferred
        host.barrier.max_age_s = 2.0
        await c.wait(lambda s: s.jobs["jv"].state == "running", "jv started once the view is fresh")
        await c.refold()
        assert len(c.events(ev.JobStarted, "jv")) == 1
