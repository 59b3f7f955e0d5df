"""A scheduling cycle's decisions land as one atomic, compare-and-set batch."""

from gpusched.bus.cas import append_cas
from gpusched.bus.log import MAX_BATCH, EventLog
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.services.runtime import FoldedLog


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


async def test_a_fold_restarts_from_a_snapshot_and_replays_only_the_tail(event_log, nats_url):
    import msgspec

    from gpusched.core.state import ClusterState
    from gpusched.security import snapshots
    from gpusched.store import new_fold

    await event_log.append(ev.NodeRegistered(at=0, node="n0", rack="r0", gpus=[GpuInfo(index=i, uuid=f"u{i}") for i in range(8)]))
    for j in range(4):
        await event_log.append(ev.JobSubmitted(at=1, job_id=f"j{j}", spec=JobSpec(team="a", gpus=2)))
    await event_log.append(ev.GpusGranted(at=2, job_id="j0", attempt=1, gpus=["n0/0", "n0/1"]))
    snapshot = new_fold()  # folded as the services fold (their horizon)
    async for rec in event_log.records():  # with the server's store times, the services' clock
        snapshot.apply(rec.event, rec.seq, rec.time, rec.position)  # as every fold of the log (writer chains)
    await snapshots.append_seal(event_log, snapshot)  # as the projector does after writing one
    await event_log.append(ev.GpusGranted(at=3, job_id="j1", attempt=1, gpus=["n0/2", "n0/3"]))
    await event_log.append(ev.JobCompleted(at=4, job_id="j0", attempt=1))

    tail_only = await FoldedLog.open(nats_url, "restarted", snapshot=ClusterState.restore(snapshot.snapshot()))
    from_scratch = await FoldedLog.open(nats_url, "scratch")
    assert tail_only.seen_seq == from_scratch.seen_seq == 9
    assert msgspec.msgpack.encode(tail_only.state) == msgspec.msgpack.encode(from_scratch.state)
    assert tail_only.alloc_seq == from_scratch.alloc_seq
    # it decides and appends like any writer
    grant = ev.GpusGranted(at=5, job_id="j2", attempt=1, gpus=["n0/0", "n0/1"])
    assert await append_cas(tail_only, [grant]) == (1, False)

    marked = ClusterState.restore(snapshot.snapshot())
    marked.requests["marker"] = "from-the-snapshot"  # only a fold that started from it has this
    altered = await FoldedLog.open(nats_url, "altered", snapshot=marked)  # no seal vouches for it
    assert "marker" not in altered.state.requests and altered.seen_seq == 10
    await altered.close()
    await snapshots.append_seal(event_log, marked)
    resumed = await FoldedLog.open(nats_url, "marked", snapshot=ClusterState.restore(marked.snapshot()))
    assert resumed.state.requests.get("marker") == "from-the-snapshot" and resumed.seen_seq == 11
    await resumed.close()

    future = ClusterState.restore(snapshot.snapshot())
    future.last_seq = 10_000  # a snapshot of another (longer) stream: ignored
    ignored = await FoldedLog.open(nats_url, "ignored", snapshot=future)
    assert ignored.seen_seq == 11 and "j2" in ignored.state.running
    for f in (tail_only, from_scratch, ignored):
        await f.close()
