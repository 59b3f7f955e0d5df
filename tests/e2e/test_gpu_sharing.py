"""Fractional GPUs through real processes (docs/gpu-sharing.md): admission, placement, the
reconciler and a simulated node daemon running real `/bin/sh` jobs. Two jobs asking for a share
of one GPU run on it at once, each launched with its MPS memory limit, and the node's GPU memory
stays within their limits; the processes sharing the GPU are not taken for strays."""

from __future__ import annotations

import asyncio

from gpusched.bus import subjects
from gpusched.bus.log import connect
from gpusched.core import events as ev
from gpusched.core.heartbeat import decode_heartbeat

from .harness import harness  # noqa: F401

GPU_MB = 81920  # the simulated backend's GPU
SCRIPT = 'echo "limit=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT share=$GPUSCHED_GPU_SHARE sm=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"; sleep 60'


async def _gpu_memory(nats_url: str, node: str, index: int, want) -> int:
    """The memory used on one GPU of `node` in its first heartbeat for which `want(used)` holds."""
    nc = await connect(nats_url, name="e2e-heartbeats")
    try:
        sub = await nc.subscribe(subjects.heartbeat_subject(node))
        for _ in range(50):
            hb = decode_heartbeat((await sub.next_msg(timeout=5)).data)
            used = next(g.memory_used_mb for g in hb.gpus if g.index == index)
            if want(used):
                return used
        raise AssertionError(f"no heartbeat with the wanted memory on {node}/{index}; last {used} MB")
    finally:
        await nc.close()


async def test_two_fractional_jobs_share_one_gpu_within_their_memory_limits(harness):
    h = harness
    h.start("admission")
    h.start("placement", "--policy-set=min_runtime_s=0")
    h.start("reconciler", "--tick-s", "0.2", "--node-timeout-s", "15", "--zombie-grace-s", "0.5")
    h.start("nodeagent", "--backend", "sim", "--count", "1", "--gpus", "2", "--heartbeat-s", "0.3",
            "--kill-grace-s", "1", "--work-dir", str(h.tmp / "work"), "--uid-range", "none")  # pytest's tmp is 0700
    await h.ready("admission", "placement", "reconciler", "nodeagent")
    (node,) = await h.wait_for("node registered", lambda s: list(s.nodes))
    whole = await h.submit(team="lab", gpus=1, command=["/bin/sh", "-c", "sleep 60"])
    half = await h.submit(team="lab", gpus=1, gpu_fraction=0.5, command=["/bin/sh", "-c", SCRIPT])
    quarter = await h.submit(team="lab", gpus=1, gpu_memory_mb=20480, command=["/bin/sh", "-c", SCRIPT])
    jobs = (whole, half, quarter)
    st = await h.wait_for("all running", lambda s: all(s.jobs[j].state == "running" for j in jobs) and s, timeout=20)
    (shared,) = {g for j in (half, quarter) for g in st.jobs[j].gpus}
    assert st.jobs[whole].gpus != [shared]  # never beside a whole-GPU job
    assert st.gpus[shared].shares == {half: 0.5, quarter: 0.25}
    assert st.teams["lab"].held == 1.75

    index = int(shared.rsplit("/", 1)[1])
    limits = {half: GPU_MB // 2, quarter: 20480}
    used = await _gpu_memory(h.nats_url, node, index, lambda mb: mb > 0)
    assert used == sum(mb * 3 // 4 for mb in limits.values()) <= GPU_MB  # each within its MPS limit

    logs = await h.job_logs([half, quarter], "limit=")
    assert "limit=0=40960M share=0.5 sm=50" in logs[half]
    assert "limit=0=20480M share=0.25 sm=25" in logs[quarter]

    await asyncio.sleep(1.5)  # three zombie graces: the sharers' processes are the GPU's jobs
    await h.sync()
    assert not h.events(ev.ZombieDetected)
    assert (await h.client.cancel(half)).ok
    st = await h.wait_for("half gone", lambda s: s.jobs[half].state == "cancelled" and s)
    assert st.gpus[shared].shares == {quarter: 0.25}
    # the half's process is gone: the GPU's memory is the quarter's alone
    assert await _gpu_memory(h.nats_url, node, index, lambda mb: mb < used) == 20480 * 3 // 4
