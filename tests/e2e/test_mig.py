"""MIG slices through real processes (docs/gpu-sharing.md#mig-slices): admission takes the
admin's geometry of an idle GPU and refuses it once the GPU is busy, placement packs two MIG jobs
onto slices of that one GPU beside a whole-GPU job on the other, and the simulated node daemon
launches each with its own MIG device; their processes are not taken for strays."""

from __future__ import annotations

import asyncio

import pytest

from gpusched.core import events as ev
from gpusched.core.mig import slice_uuid

from .harness import harness  # noqa: F401

SCRIPT = 'echo "visible=$CUDA_VISIBLE_DEVICES slices=$GPUSCHED_MIG_SLICES"; sleep 60'


async def test_two_mig_jobs_run_on_their_own_slices_of_one_gpu(harness):
    h = harness
    h.start("admission")
    h.start("placement", "--policy-set=min_runtime_s=0")
    h.start("reconciler", "--tick-s", "0.2", "--node-timeout-s", "15", "--zombie-grace-s", "0.5")
    h.start("nodeagent", "--backend", "sim", "--count", "1", "--gpus", "2", "--mig", "--heartbeat-s", "0.3",
            "--kill-grace-s", "1", "--work-dir", str(h.tmp / "work"), "--uid-range", "none")
    await h.ready("admission", "placement", "reconciler", "nodeagent")
    (node,) = await h.wait_for("node registered", lambda s: list(s.nodes))
    reply = await h.client.set_mig_geometry(node, 0, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"])
    assert reply.ok, reply.error
    whole = await h.submit(team="lab", gpus=1, command=["/bin/sh", "-c", "sleep 60"])
    small = await h.submit(team="lab", gpus=1, mig="1g.10gb", command=["/bin/sh", "-c", SCRIPT])
    big = await h.submit(team="lab", gpus=1, mig="3g.40gb", command=["/bin/sh", "-c", SCRIPT])
    jobs = (whole, small, big)
    st = await h.wait_for("all running", lambda s: all(s.jobs[j].state == "running" for j in jobs) and s, timeout=20)
    gpu = f"{node}/0"
    assert st.jobs[whole].gpus == [f"{node}/1"]  # the partitioned GPU is never held whole
    assert (st.jobs[small].gpus, st.jobs[small].slices) == ([gpu], [2])
    assert (st.jobs[big].gpus, st.jobs[big].slices) == ([gpu], [0])
    assert st.teams["lab"].held == pytest.approx(1 + 4 / 7)  # each slice charged its compute slices / 7

    refused = await h.client.set_mig_geometry(node, 0, ["7g.80gb"])
    assert not refused.ok and "is in use by" in refused.error and "only while it is idle" in refused.error

    uuid = st.gpus[gpu].uuid
    logs = await h.job_logs([small, big], "visible=")
    assert f"visible={slice_uuid(uuid, 2)} slices=2" in logs[small]
    assert f"visible={slice_uuid(uuid, 0)} slices=0" in logs[big]

    await asyncio.sleep(1.5)  # three zombie graces: the slices' processes are the GPU's jobs
    await h.sync()
    assert not h.events(ev.ZombieDetected)
    assert [e.profiles for e in h.events(ev.MigGeometrySet)] == [["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]]
