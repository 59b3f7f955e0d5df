"""Many nodes silent at once is an outage, not a requeue storm: a real node daemon process
hosting four simulated nodes is frozen (SIGSTOP: the stalled loaded host of issue 25) while
its job's process runs on; the real reconciler declares the partition instead of losing the
nodes, requeues nothing, and ends it when the heartbeats return. One node silent alone is still
lost as before, and an admin's confirmation turns a partition into lost nodes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

from gpusched import readmodel
from gpusched.bus.log import EventLog
from gpusched.cli.partition import confirm, partition_data
from gpusched.core import events as ev
from gpusched.core.model import JobSpec
from gpusched.services.reconciler import Reconciler, ReconcilerConfig

from .node_helpers import Cluster

CFG = ReconcilerConfig(node_timeout_s=2.0, no_process_grace_s=1.0, zombie_grace_s=0.5, kill_retry_s=1.0, tick_s=0.2)
SIM = ["s00", "s01", "s02", "s03"]


async def start(nats_url: str, c: Cluster, tmp_path) -> tuple[Reconciler, subprocess.Popen]:
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpusched.services.nodeagent", "--nats", nats_url, "--backend", "sim", "--node", "s",
         "--count", "4", "--gpus", "2", "--nodes-per-rack", "4", "--heartbeat-s", "0.2",
         "--work-dir", str(tmp_path / "w"), "--uid-range", "none"],  # the jobs run python from under /root (0700) here
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "daemon.log", "wb"))
    await c.start_nodes(["a0", "a1"], gpus=2, racks=["r9", "r9"])
    await c.wait(lambda s: all(n in s.nodes for n in SIM), "simulated nodes registered", timeout=30)
    rec = Reconciler(await EventLog.open(nats_url, name="test-reconciler"), CFG)
    await rec.start()
    return rec, daemon


def stop(daemon: subprocess.Popen) -> None:
    daemon.send_signal(signal.SIGCONT)
    daemon.terminate()
    try:
        daemon.wait(15)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()


async def run_long_job(c: Cluster) -> None:
    """Job `long` running on the frozen host's node s00 (what a partition must keep)."""
    await c.submit("long", JobSpec(team="t", gpus=2, command=[sys.executable, "-c", "import time; time.sleep(120)"]))
    await c.grant("long", ["s00/0", "s00/1"])
    await c.wait(lambda s: s.jobs["long"].state == "running", "job running")


async def test_a_frozen_host_of_many_nodes_is_a_partition_not_a_requeue_storm(nats_url, tmp_path):
    async with Cluster(nats_url, tmp_path) as c:
        rec, daemon = await start(nats_url, c, tmp_path)
        try:
            await run_long_job(c)
            daemon.send_signal(signal.SIGSTOP)  # the host stalls: 4 of 6 nodes silent at once
            frozen = time.monotonic()
            await c.wait(lambda s: all(s.nodes[n].partitioned for n in SIM), "partition declared", timeout=10)
            assert time.monotonic() - frozen < CFG.node_timeout_s + 2
            await asyncio.sleep(2 * CFG.node_timeout_s)  # well past the node timeout: still no loss
            s = c.state
            assert not any(s.nodes[n].lost for n in SIM)
            assert s.jobs["long"].state == "running" and s.jobs["long"].attempt == 1
            assert all(not s.nodes[n].free for n in SIM), "no new work on partitioned nodes"
            assert not s.nodes["a0"].partitioned and len(s.nodes["a0"].free) == 2
            docs = [readmodel.node_doc(s, n) for n in SIM]  # what `nodes` and the dashboard show
            assert all(d["partitioned"] and not d["lost"] for d in docs)
            assert {g["status"] for d in docs for g in d["gpus"]} == {"held", "partitioned"}
            daemon.send_signal(signal.SIGCONT)  # heartbeats return
            await c.wait(lambda s: not any(s.nodes[n].partitioned for n in SIM), "partition ended", timeout=10)
            await asyncio.sleep(1.0)
            assert c.state.jobs["long"].state == "running" and c.state.jobs["long"].attempt == 1
            assert len(c.state.nodes["s01"].free) == 2
            assert {g["status"] for g in readmodel.node_doc(c.state, "s01")["gpus"]} == {"free"}
        finally:
            stop(daemon)
            await rec.stop()
        state = await c.refold()
        declared = c.events(ev.PartitionDeclared)
        assert len(declared) == 1 and declared[0].nodes == SIM and "4 of 6 nodes" in declared[0].reason
        assert sorted(n for e in c.events(ev.PartitionEnded) for n in e.nodes) == SIM
        assert not c.events(ev.NodeLost) and not c.events(ev.GpusReleased)
        assert state.violations() == []


async def test_one_silent_node_is_lost_and_an_admin_confirms_a_partition(nats_url, tmp_path):
    async with Cluster(nats_url, tmp_path) as c:
        rec, daemon = await start(nats_url, c, tmp_path)
        try:
            await run_long_job(c)
            c.hosts[0].crash("a1")  # one node of six dies: lost, as before
            await c.wait(lambda s: s.nodes["a1"].lost, "a1 lost", timeout=10)
            assert not any(n.partitioned for n in c.state.nodes.values())
            daemon.send_signal(signal.SIGSTOP)
            await c.wait(lambda s: all(s.nodes[n].partitioned for n in SIM), "partition declared", timeout=10)
            assert await partition_data(nats_url) == SIM
            assert await confirm(nats_url, [], "admin confirmed lost: host gone") == SIM  # `partition confirm`
            await c.wait(lambda s: all(s.nodes[n].lost for n in SIM), "confirmed lost")
            s = c.state
            assert all(s.nodes[n].lost and not s.nodes[n].partitioned for n in SIM)
            assert s.jobs["long"].state == "pending" and "s00 lost" in s.jobs["long"].pending_reason
        finally:
            stop(daemon)
            await rec.stop()
        state = await c.refold()
        assert [e.node for e in c.events(ev.NodeLost)] == ["a1"]
        assert state.violations() == []

