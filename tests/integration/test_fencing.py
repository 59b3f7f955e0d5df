"""Fencing: a node agent that cannot reach the log stops its jobs before the reconciler could
give their GPUs to another attempt. The NATS server the agent uses is frozen (SIGSTOP: packets
go unanswered, like a cut link); the job's real process must be gone within the bound
`heartbeat_s + fence_after_s + probe_s + probe_timeout_s + checkpoint_grace_s + kill_grace_s <
node_timeout_s`, and
the agent works on once the server answers again. A checkpoint written by a stale attempt is
never the one a new attempt resumes from."""

from __future__ import annotations

import signal
import sys
import time

from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.core.state import ClusterState
from gpusched.services.nodeagent.fencing import FenceConfig

from .node_helpers import Cluster, alive, wait_gone

FENCE = FenceConfig(node_timeout_s=4.0, probe_s=0.2, probe_timeout_s=0.5, checkpoint_grace_s=0.3, slack_s=0.5)


async def test_a_cut_off_agent_stops_its_jobs_before_the_node_timeout(nats_server, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSCHED_NODE_TIMEOUT_S", "4")
    monkeypatch.setenv("GPUSCHED_FENCE_AFTER_S", str(FENCE.after_s(1.0, 0.2)))
    async with Cluster(nats_server.url, tmp_path) as c:
        host = await c.start_nodes(["f0"], gpus=2, kill_grace_s=1.0)
        assert host.fence.after_s == FENCE.after_s(1.0, 0.2) < FENCE.node_timeout_s - 1.0
        await c.submit("long", JobSpec(team="t", gpus=2, command=[sys.executable, "-c", "import time; time.sleep(120)"]))
        await c.grant("long", ["f0/0", "f0/1"])
        await c.wait(lambda s: s.jobs["long"].state == "running", "running")
        pid = host.agents["f0"].current("long").proc.pid
        nats_server.proc.send_signal(signal.SIGSTOP)  # the control plane is out of reach
        cut = time.monotonic()
        try:
            await wait_gone(pid, timeout=FENCE.node_timeout_s + 2)
            ran_on_s = time.monotonic() - cut
        finally:
            nats_server.proc.send_signal(signal.SIGCONT)
        print(f"\ncut-off job stopped {ran_on_s:.2f}s after the cut (fence after {host.fence.after_s:.2f}s, "
              f"node timeout {FENCE.node_timeout_s:g}s)")
        assert host.fence.after_s <= ran_on_s < FENCE.node_timeout_s
        assert host.fence.fences == 1
        await c.wait(lambda s: s.jobs["long"].state != "running" or "f0" not in s.node_live, "ended reported",
                     timeout=10)
        assert host.fence.fenced_at is None or await _lifted(host)
        assert not alive(pid)


async def _lifted(host) -> bool:
    import asyncio

    for _ in range(50):
        if host.fence.fenced_at is None:
            return True
        await asyncio.sleep(0.1)
    return False


def test_a_stale_attempts_checkpoint_is_never_resumed_from():
    st = ClusterState()
    st.apply(ev.NodeRegistered(at=1.0, node="n0", rack="r0", gpus=[GpuInfo(index=0, uuid="u0", model="m")]))
    st.apply(ev.NodeRegistered(at=1.0, node="n1", rack="r0", gpus=[GpuInfo(index=0, uuid="u1", model="m")]))
    st.apply(ev.JobSubmitted(at=2.0, job_id="j", spec=JobSpec(team="t", gpus=1, preemptible=True,
                                                               checkpoint_dir="/ck", command=["x"])))
    st.apply(ev.GpusGranted(at=3.0, job_id="j", attempt=1, gpus=["n0/0"], placer="t"))
    st.apply(ev.CheckpointSaved(at=4.0, job_id="j", attempt=1, path="/ck/10", step=10, node="n0"))
    st.apply(ev.NodeLost(at=40.0, node="n0", reason="no heartbeat"))
    st.apply(ev.GpusGranted(at=41.0, job_id="j", attempt=2, gpus=["n1/0"], placer="t"))
    # the cut-off first attempt saves again, late: its fact reaches the log after the new grant
    st.apply(ev.CheckpointSaved(at=42.0, job_id="j", attempt=1, path="/ck/99", step=99, node="n0"))
    assert st.jobs["j"].checkpoint.path == "/ck/10" and st.jobs["j"].attempt == 2
