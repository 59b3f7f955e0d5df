"""A scheduling cycle's decisions land as one atomic, compare-and-set batch."""

from gpusched.bus.log import MAX_BATCH, EventLog
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.services.runtime import FoldedLog, append_cas


async def test_a_cycle_lands_whole_or_not_at_all(event_log, nats_url):
    await event_log.append(ev.NodeRegistered(at=0, node="n0", rack="r0", gpus=[GpuInfo(index=i, uuid=f"u{i}") for i in range(8)]))
    for j in range(4):
        await event_log.append(ev.JobSubmitted(at=1, job_id=f"j{j}", spec=JobSpec(team="a", gpus=2)))
    folded = FoldedLog(await EventLog.open(nats_url, name="placer"))
    await folded.start()
    view = folded.alloc_seq
    cycle = [ev.GpusGranted(at=2, job_id=f"j{j}", attempt=1, gpus=[f"n0/{2 * j}", f"n0/{2 * j + 1}"]) for j in range(3)]
    cycle.insert(1, ev.JobPending(at=2, job_id="j3", reason="waiting for 2 GPUs"))
    # another writer changes ownership first: the whole cycle is refused, nothing of it lands
    await event_log.append(ev.GpuQuarantined(at=2, gpu="n0/7", reason="XID 79"))
    before = await event_log.last_seq()
    assert await append_cas(folded, cycle, view=view) == (0, True)
    assert await event_log.last_seq() == before
    # decided again from the caught-up view, it lands whole, in order
    assert await append_cas(folded, cycle) == (4, False)
    assert folded.state.job_counts()["starting"] == 3 and folded.state.jobs["j3"].pending_reason
    assert [type(e) for _, e in [x async for x in event_log.replay(before + 1)]] == [type(e) for e in cycle]
    assert folded.state.violations() == []
    await folded.stop()
    await folded.log.close()


async def test_cycles_larger_than_one_batch_are_chained(event_log, nats_url):
    n = MAX_BATCH + 10
    await event_log.append(ev.NodeRegistered(at=0, node="n0", rack="r0", gpus=[GpuInfo(index=i, uuid=f"u{i}") for i in range(n)]))
    folded = FoldedLog(await EventLog.open(nats_url, name="placer"))
    await folded.start()
    subs = [ev.JobSubmitted(at=1, job_id=f"j{j}", spec=JobSpec(team="a", gpus=1)) for j in range(n)]
    assert await append_cas(folded, subs) == (n, False)
    grants = [ev.GpusGranted(at=2, job_id=f"j{j}", attempt=1, gpus=[f"n0/{j}"]) for j in range(n)]
    assert await append_cas(folded, grants) == (n, False)
    assert folded.state.free_count == 0 and folded.state.violations() == []
    await folded.stop()
    await folded.log.close()
