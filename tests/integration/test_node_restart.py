"""Exactly one running copy of each job: a node daemon killed -9 (and a full restart of the
node side) adopts the processes it started, proven by pid, process group, start time and boot
id; nothing is requeued, nothing counted as lost, and the OS shows one process per job rank."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from gpusched.cli.stack import spawn_service
from gpusched.core import events as ev
from gpusched.core.model import JobSpec
from gpusched.services.reconciler import ReconcilerConfig

from ..marked import kill_marked, marked_pythons
from .node_helpers import PY, Cluster
from .test_reconciler import start_reconciler

#: Node loss after 20 s of silence (a restart takes a few seconds on a loaded machine); a job
#: without its process is requeued after 3 s: what adoption must prevent.
RECONCILER = ReconcilerConfig(node_timeout_s=20.0, no_process_grace_s=3.0, zombie_grace_s=0.5, kill_retry_s=1.0,
                              tick_s=0.2)

MARK = "gpusched-adopt-test"


def job_processes(tag: str) -> dict[str, int]:
    """Job id -> how many python processes of that job the OS runs (wrappers not counted)."""
    counts: dict[str, int] = {}
    for _, argv, _ in marked_pythons(MARK, tag):
        job = argv[argv.index(MARK.encode()) + 1].decode(errors="replace")
        counts[job] = counts.get(job, 0) + 1
    return counts


def spawn_agent(nats_url: str, redis_url: str, work: Path, log: Path, *extra: str):
    return spawn_service("nodeagent", nats_url, redis_url,
                         ["--backend", "sim", "--count", "2", "--node", "node", "--gpus", "8", "--work-dir", str(work),
                          "--heartbeat-s", "0.3", "--kill-grace-s", "1", "--uid-range", "none", *extra], log_path=log)


async def wait_ready(log: Path, count: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while log.read_text(errors="replace").count("nodeagent_ready") < count:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        await asyncio.sleep(0.1)


async def test_kill9_and_full_restart_adopt_every_job(nats_url, redis_url, tmp_path):
    tag = f"t{os.getpid()}-{time.time_ns()}"
    work, log = tmp_path / "work", tmp_path / "agent.log"
    agent = spawn_agent(nats_url, redis_url, work, log)
    rec = await start_reconciler(nats_url, RECONCILER)
    try:
        async with Cluster(nats_url, tmp_path) as c:
            await wait_ready(log, 1)
            await c.wait(lambda s: {"node00", "node01"} <= set(s.nodes), "nodes registered")
            jobs = [f"a{i}" for i in range(10)]
            for i, job_id in enumerate(jobs):
                cmd = [PY, "-c", "import time; time.sleep(300)", MARK, job_id, tag]
                await c.submit(job_id, JobSpec(team="t", gpus=1, command=cmd))
                await c.grant(job_id, [f"node0{i % 2}/{i // 2}"])
            # one job spans both nodes: two ranks
            await c.submit("wide", JobSpec(team="t", gpus=2, command=[PY, "-c", "import time; time.sleep(300)",
                                                                      MARK, "wide", tag]))
            await c.grant("wide", ["node00/7", "node01/7"])
            jobs.append("wide")
            await c.wait(lambda s: all(s.jobs[j].state == "running" for j in jobs), "all running")
            await c.wait(lambda s: job_processes(tag) == {**dict.fromkeys(jobs[:-1], 1), "wide": 2}, "processes up")

            # 1. kill -9 of the daemon; a new one on the same work dir
            agent.kill()
            agent.wait()
            await asyncio.sleep(0.5)
            agent = spawn_agent(nats_url, redis_url, work, log, "--keep-jobs")
            await wait_ready(log, 2)
            await asyncio.sleep(3.5)  # past the reconciler's no-process grace and a few heartbeats
            assert job_processes(tag) == {**dict.fromkeys(jobs[:-1], 1), "wide": 2}
            assert "job_adopted" in log.read_text()

            # 2. a full, orderly restart of the node side (SIGTERM, --keep-jobs) and the reconciler
            agent.terminate()
            assert agent.wait(timeout=20) == 0
            await rec.stop()
            rec = await start_reconciler(nats_url, RECONCILER)
            agent = spawn_agent(nats_url, redis_url, work, log)
            await wait_ready(log, 3)
            await asyncio.sleep(3.5)
            assert job_processes(tag) == {**dict.fromkeys(jobs[:-1], 1), "wide": 2}

            state = await c.refold()
            assert all(state.jobs[j].state == "running" and state.jobs[j].attempt == 1 for j in jobs)
            assert not c.events(ev.GpusReleased) and not c.events(ev.NodeLost)
            assert sum(j.lost_gpu_s for j in state.jobs.values()) == 0
            assert state.violations() == []

            # the adopted processes are still under control: a cancel stops them
            for job_id in jobs:
                await c.append(ev.JobCancelled(at=time.time(), job_id=job_id))
            deadline = time.monotonic() + 10
            while job_processes(tag):
                assert time.monotonic() < deadline, job_processes(tag)
                await asyncio.sleep(0.1)
            await c.wait(lambda s: not any(s.jobs[j].live for j in jobs), "every attempt fenced off")
    finally:
        await rec.stop()
        agent.kill()
        agent.wait()
        kill_marked(MARK, tag)


async def test_returning_node_registers_only_after_its_leftovers_are_dead(nats_url, redis_url, tmp_path):
    """A job that ignores SIGTERM, its daemon killed -9, the node declared lost and the job
    requeued: the restarted daemon adopts the leftover and stops it (SIGKILL after the grace)
    before it registers the node again; and the node then stays registered (no flapping)."""
    tag = f"t{os.getpid()}-{time.time_ns()}"
    work, log = tmp_path / "work", tmp_path / "agent.log"
    agent = spawn_agent(nats_url, redis_url, work, log)
    rec = await start_reconciler(nats_url, ReconcilerConfig(node_timeout_s=3.0, no_process_grace_s=30.0,
                                                            zombie_grace_s=30.0, kill_retry_s=1.0, tick_s=0.2))
    try:
        async with Cluster(nats_url, tmp_path) as c:
            await wait_ready(log, 1)
            await c.wait(lambda s: {"node00", "node01"} <= set(s.nodes), "nodes registered")
            stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
            await c.submit("stub", JobSpec(team="t", gpus=1, command=[PY, "-c", stubborn, MARK, "stub", tag]))
            await c.grant("stub", ["node00/0"])
            await c.wait(lambda s: s.jobs["stub"].state == "running", "running")
            await c.wait(lambda s: job_processes(tag) == {"stub": 1}, "process up")

            agent.kill()
            agent.wait()
            await c.wait(lambda s: s.nodes["node00"].lost, "node00 lost", timeout=20)
            await c.wait(lambda s: not s.jobs["stub"].holding, "job requeued")
            assert job_processes(tag) == {"stub": 1}  # the leftover outlives its daemon

            agent = spawn_agent(nats_url, redis_url, work, log)
            await wait_ready(log, 2)
            await c.wait(lambda s: not s.nodes["node00"].lost, "node00 back", timeout=20)
            assert job_processes(tag) == {}, "node00 registered while its leftover still ran"
            await asyncio.sleep(4.0)  # past the reconciler's node timeout: no NodeLost again
            assert not c.state.nodes["node00"].lost

            pairs = [(seq, e) async for seq, e in c.log.replay()]
            lost = [seq for seq, e in pairs if isinstance(e, ev.NodeLost) and e.node == "node00"]
            back = [seq for seq, e in pairs if isinstance(e, ev.NodeRegistered) and e.node == "node00"
                    and seq > lost[0]]
            ended = [seq for seq, e in pairs if isinstance(e, ev.ProcessesEnded) and e.job_id == "stub"
                     and e.node == "node00"]
            assert len(lost) == 1 and len(back) == 1, (lost, back)
            assert ended and ended[0] < back[0], (ended, back)
            assert "registration_deferred" in log.read_text()
    finally:
        await rec.stop()
        agent.kill()
        agent.wait()
        kill_marked(MARK, tag)
