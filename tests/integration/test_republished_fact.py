"""The live fold refuses a re-published fact by its writer chain position (issue 24), through a
real nats-server: a node that re-publishes its own stored `GpusReleased(process_failed)`, byte
for byte under a fresh message id, does not requeue the job a second time; the fold records
`replayed` at the copy's seq, and the audit (which folds the same way) agrees. A genuine fact is
never refused: an append that timed out after it was stored leaves its chain, and the writer's
next fact, on a new chain, is applied."""

from __future__ import annotations

import time

import pytest

from gpusched.bus.log import EventLog
from gpusched.cli.replay import audit_stream
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.security import signing
from gpusched.security.audit import Audit
from gpusched.store import fold_log

NODE = "node74"  # an identity of its own (the sim host holds node00..63)


@pytest.fixture
def node_creds(trust):
    if trust.get(f"replays-{NODE}") is None:
        trust.add(f"replays-{NODE}", "node", node=NODE)
    return trust.creds(f"replays-{NODE}")


async def running_job(admin: EventLog, node: EventLog) -> None:
    now = time.time()
    await node.append(ev.NodeRegistered(at=now, node=NODE, rack="r0", gpus=[GpuInfo(index=i, uuid=f"{NODE}-{i}")
                                                                             for i in range(2)]))
    await admin.append(ev.JobSubmitted(at=now, job_id="j", spec=JobSpec(team="b", gpus=2)))
    await admin.append(ev.GpusGranted(at=now, job_id="j", attempt=1, gpus=[f"{NODE}/0", f"{NODE}/1"]))
    await node.append(ev.JobStarted(at=now, job_id="j", attempt=1, node=NODE))


async def test_a_republished_release_is_refused_by_the_live_fold_and_the_audit(trust, node_creds, nats_url):
    admin = await EventLog.open(nats_url, name="admin")
    node = await EventLog.open(nats_url, name="node", creds=node_creds)
    try:
        await running_job(admin, node)
        released = await node.append(ev.GpusReleased(at=time.time(), job_id="j", reason="process_failed",
                                                     lost_gpu_s=10.0, node=NODE))
        await admin.append(ev.GpusGranted(at=time.time(), job_id="j", attempt=2, gpus=[f"{NODE}/0", f"{NODE}/1"]))
        await node.append(ev.ProcessesEnded(at=time.time(), job_id="j", attempt=1, node=NODE))
        await node.append(ev.JobStarted(at=time.time(), job_id="j", attempt=2, node=NODE))
        stored = [m async for m in admin.raw(released, released)][0]
        copy = {**stored.headers, "Nats-Msg-Id": "again"}  # what the node credential may publish
        replayed = (await node.js.publish(stored.subject, stored.data, headers=copy)).seq
        state = await fold_log(admin)
        audit = Audit(trust.ring(), allow_unsigned=True)
        await audit_stream(nats_url, audit)
    finally:
        await node.close()
        await admin.close()
    job = state.jobs["j"]
    assert (job.state, job.attempt, job.restarts, job.lost_gpu_s) == ("running", 2, 1, 10.0)  # requeued once
    assert [(v.seq, v.rule) for v in state.broken] == [(replayed, "replayed")]
    assert [(v.seq, v.rule) for v in audit.state.broken] == [(replayed, "replayed")]
    assert [(f.seq, f.rule) for f in audit.findings] == [(replayed, "reordered")]


async def test_an_append_that_timed_out_after_it_was_stored_loses_no_later_fact(trust, node_creds, nats_url):
    admin = await EventLog.open(nats_url, name="admin")
    node = await EventLog.open(nats_url, name="node", creds=node_creds)
    real = node._publish

    async def stored_then_timed_out(*args, **kwargs):
        await real(*args, **kwargs)  # the server stores it; its ack never reaches the writer
        raise TimeoutError

    try:
        await running_job(admin, node)
        saved = ev.CheckpointSaved(at=time.time(), job_id="j", attempt=1, path="/ckpt/j/1", step=1, node=NODE)
        node._publish = stored_then_timed_out
        with pytest.raises(TimeoutError):
            await node.append(saved, msg_id="ck-1")
        node._publish = real
        assert await node.append(saved, msg_id="ck-1") > 0  # the retry: a duplicate, nothing stored twice
        later = await node.append(ev.CheckpointSaved(at=time.time(), job_id="j", attempt=1, path="/ckpt/j/2", step=2,
                                                     node=NODE))
        state = await fold_log(admin)
        last = [m async for m in admin.raw(later, later)][0]
    finally:
        await node.close()
        await admin.close()
    assert state.broken == []
    assert state.jobs["j"].checkpoint.step == 2
    assert signing.parse(last.headers[signing.SIG_HEADER]).n == 1  # a new chain after the unknown outcome
