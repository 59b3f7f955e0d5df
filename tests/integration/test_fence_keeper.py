"""A node daemon killed -9 leaves its job processes running for the next daemon to adopt; if no
daemon comes back within the fence bound, its fence keeper (`services/nodeagent/keeper.py`, a
process of its own) stops them before the reconciler could requeue the job elsewhere: never two
running copies. A daemon back within the bound adopts them and nothing is stopped; a keeper
killed -9 is started again by the daemon."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

from gpusched.cli.stack import spawn_service
from gpusched.core import events as ev
from gpusched.core.model import JobSpec
from gpusched.services.nodeagent import keeper
from gpusched.services.nodeagent.fencing import FenceConfig

from ..marked import kill_marked, marked_pythons
from .node_helpers import CGROUP_PARENT, PY, Cluster
from .test_node_restart import wait_ready

MARK = "gpusched-keeper-test"
NODE_TIMEOUT_S, KILL_GRACE_S, HEARTBEAT_S = 6.0, 1.0, 0.3


def keeper_after_s() -> float:
    """What the daemon computes from the environment `spawn_agent` gives it (4.1 s)."""
    os.environ["GPUSCHED_NODE_TIMEOUT_S"] = str(NODE_TIMEOUT_S)
    try:
        cfg = FenceConfig.from_env()
        assert cfg is not None
        return cfg.keeper_after_s(KILL_GRACE_S, HEARTBEAT_S)
    finally:
        del os.environ["GPUSCHED_NODE_TIMEOUT_S"]


def spawn_agent(nats_url: str, redis_url: str, work: Path, log: Path, fence_after_s: float | None = None):
    env = {"GPUSCHED_NODE_TIMEOUT_S": str(NODE_TIMEOUT_S), "GPUSCHED_FENCE_AFTER_S": str(fence_after_s or "")}
    return spawn_service("nodeagent", nats_url, redis_url,
                         ["--backend", "sim", "--node", "node00", "--gpus", "2", "--work-dir", str(work),
                          "--heartbeat-s", str(HEARTBEAT_S), "--kill-grace-s", str(KILL_GRACE_S),
                          "--cgroup-parent", CGROUP_PARENT, "--uid-range", "none"], log_path=log, env=env)


def job_pids(tag: str) -> list[int]:
    return [pid for pid, _, _ in marked_pythons(MARK, tag)]


def keeper_pid(work: Path) -> int | None:
    """The live keeper of `work`, by its pidfile."""
    try:
        pid = int((work / "runs" / keeper.LOCK).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return None
    return pid if state != b"Z" else None


async def until(pred, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return got


async def run_job(c: Cluster, tag: str) -> list[int]:
    await c.wait(lambda s: "node00" in s.nodes and not s.nodes["node00"].lost, "node00 registered", timeout=20)
    await c.submit("j", JobSpec(team="t", gpus=1, command=[PY, "-c", "import time; time.sleep(300)", MARK, tag]))
    await c.grant("j", ["node00/0"])
    await c.wait(lambda s: s.jobs["j"].state == "running", "running")
    return await until(lambda: job_pids(tag), "the job's process")


async def test_a_killed_daemon_that_stays_away_has_its_jobs_fenced_by_the_keeper(nats_url, redis_url, tmp_path):
    tag = f"t{os.getpid()}-{time.time_ns()}"
    work, log = tmp_path / "work", tmp_path / "agent.log"
    after = keeper_after_s()
    agent = spawn_agent(nats_url, redis_url, work, log)
    try:
        async with Cluster(nats_url, tmp_path) as c:
            await wait_ready(log, 1)
            pids = await run_job(c, tag)
            await until(lambda: keeper_pid(work), "the keeper")
            agent.kill()  # SIGKILL; no daemon comes back
            agent.wait()
            killed = time.monotonic()
            await asyncio.sleep(0.2)
            assert job_pids(tag) == pids, "the job must outlive its daemon (for adoption)"
            await until(lambda: not job_pids(tag), "the fenced job gone", timeout=after + KILL_GRACE_S + 5)
            gone_s = time.monotonic() - killed
            print(f"\njob gone {gone_s:.2f}s after its daemon's kill -9 (keeper after {after:.2f}s, "
                  f"kill grace {KILL_GRACE_S:g}s, node timeout {NODE_TIMEOUT_S:g}s)")
            assert gone_s < after + keeper.TICK_S + KILL_GRACE_S + 0.5 < NODE_TIMEOUT_S
            await until(lambda: keeper_pid(work) is None, "the keeper's end")
            records = list((work / "runs" / "node00").glob("*.json"))
            assert [json.loads(r.read_text())["fenced"].startswith("fenced: the node agent") for r in records] \
                == [True]

            # a daemon back later reports the run as fenced: ended, not a failed exit
            agent = spawn_agent(nats_url, redis_url, work, log)
            await wait_ready(log, 2)
            await c.wait(lambda s: not s.jobs["j"].live, "the run reported ended")
            await c.refold()
            ended = c.events(ev.ProcessesEnded, "j")
            assert [e.reason.startswith("fenced: the node agent") for e in ended] == [True]
            assert not c.events(ev.JobFailed) and not c.events(ev.GpusReleased) and not c.events(ev.JobCompleted)
    finally:
        agent.kill()
        agent.wait()
        kill_marked(MARK, tag)


async def test_a_daemon_back_within_the_bound_adopts_and_the_keeper_is_kept(nats_url, redis_url, tmp_path):
    tag = f"t{os.getpid()}-{time.time_ns()}"
    work, log = tmp_path / "work", tmp_path / "agent.log"
    agent = spawn_agent(nats_url, redis_url, work, log, 20.0)
    try:
        async with Cluster(nats_url, tmp_path) as c:
            await wait_ready(log, 1)
            pids = await run_job(c, tag)
            first = await until(lambda: keeper_pid(work), "the keeper")
            agent.kill()
            agent.wait()
            # back at once, with the short bound: the job must live on past it, the lease renewed
            agent = spawn_agent(nats_url, redis_url, work, log)
            await wait_ready(log, 2)
            await asyncio.sleep(keeper_after_s() + 1.0)
            assert job_pids(tag) == pids and "job_adopted" in log.read_text()
            assert keeper_pid(work) == first, "the running keeper is found again, not replaced"

            os.kill(first, signal.SIGKILL)  # the keeper killed too: the daemon starts another
            second = await until(lambda: (p := keeper_pid(work)) not in (None, first) and p, "a new keeper")
            assert job_pids(tag) == pids

            agent.terminate()  # an orderly stop: the jobs stopped, then the keeper ends
            assert agent.wait(timeout=15) == 0
            assert not job_pids(tag)
            await until(lambda: keeper_pid(work) is None, "the keeper's end", timeout=3)
            await c.refold()
            assert not c.events(ev.JobFailed) and not c.events(ev.GpusReleased)
            assert second != first
    finally:
        agent.kill()
        agent.wait()
        kill_marked(MARK, tag)
