"""A poisoned snapshot in the JetStream snapshot store (the issue's attack, by whoever could write
the bucket): held GPUs shown free, at the current sequence, so placement's compare-and-set would
pass. The restarting placement service must reject it (the log's seal vouches for other bytes),
replay the log, and double-book nothing; a snapshot the log's seal vouches for is adopted."""

from __future__ import annotations

import asyncio

from gpusched.core import events as ev
from gpusched.core.state import ClusterState
from gpusched.store import SnapshotStore, new_fold

from .harness import harness  # noqa: F401


async def _fold_without(h, skip: set[int], until: int | None = None) -> ClusterState:
    """The log's state (up to `until`) with some events left out, labelled as of `until`, folded
    as the services fold (their horizon: a snapshot with another one is refused for that)."""
    state = new_fold()
    last = until or await h.log.last_seq()
    alloc = 0
    async for rec in h.log.records(1, last):
        if rec.event.ALLOC:
            alloc = rec.seq
        if rec.seq not in skip:
            state.apply(rec.event, rec.seq)
    state.last_seq, state.last_alloc_seq = last, alloc
    return state


async def _one_job_holds_every_gpu(h) -> str:
    await h.scheduler(1, 8)
    first = await h.submit(team="a", gpus=8, name="holder")
    await h.wait_for("the first job holds all 8 GPUs", lambda s: h.holding(first))
    return first


async def test_a_poisoned_snapshot_is_rejected_and_nothing_is_double_booked(harness):
    h = harness
    first = await _one_job_holds_every_gpu(h)
    h.kill9("placement")
    second = await h.submit(team="b", gpus=8, name="hopeful")
    await h.wait_for("the second job is known", lambda s: second in s.jobs)

    # an honest, sealed snapshot of the log as it is: adopted on restart
    honest = await _fold_without(h, set())
    meta = await SnapshotStore(h.log).save(honest)
    h.start("placement", alias="placement-honest")
    await h.ready("placement-honest")
    assert "snapshot_adopted" in h.service_log("placement-honest")
    h.kill9("placement-honest")

    # the poison: the sealed state without the first job, so its 8 GPUs look free, at the
    # very sequence the seal names (so the compare-and-set would pass), in the honest one's place
    about_first = {seq for seq, e in h.records if getattr(e, "job_id", None) == first}
    poisoned = await _fold_without(h, about_first, until=honest.last_seq)
    assert poisoned.free_count == 8 and poisoned.last_seq == honest.last_seq
    await SnapshotStore(h.log).put(meta, poisoned.snapshot())  # the honest one's metadata, other bytes

    h.start("placement", alias="placement-again")
    await h.ready("placement-again")
    await asyncio.sleep(1.5)  # several placement cycles
    state = await h.sync()
    assert not [e for e in h.events(ev.GpusGranted) if e.job_id == second]
    assert state.jobs[second].state == "pending" and state.jobs[first].holding
    assert state.violations() == []  # and the harness's audit folds the whole log again
    assert "snapshot_rejected" in h.service_log("placement-again")
    assert "does not match the log's seal" in h.service_log("placement-again")


async def test_the_cli_does_not_show_a_poisoned_redis_snapshot(harness):
    """Redis caches the CLI's snapshot; whoever can write Redis must not make `show`/`nodes`
    report held GPUs as free: the CLI folds on from it only when the log's seal vouches for it."""
    from gpusched.cli.reads import fold_state
    from gpusched.redis_client import connect_redis
    from gpusched.store import SNAPSHOT_KEY, save_snapshot

    h = harness
    first = await _one_job_holds_every_gpu(h)
    honest = await _fold_without(h, set())
    r = connect_redis(h.redis_url)
    try:
        await save_snapshot(r, honest, seal_log=h.log)  # sealed and cached, as the projector does
        assert (await fold_state(h.nats_url, h.redis_url)).jobs[first].holding
        about_first = {seq for seq, e in h.records if getattr(e, "job_id", None) == first}
        poisoned = await _fold_without(h, about_first, until=honest.last_seq)
        await r.hset(SNAPSHOT_KEY, mapping={"data": poisoned.snapshot()})
        shown = await fold_state(h.nats_url, h.redis_url)
    finally:
        await r.aclose()
    assert shown.jobs[first].holding and shown.free_count == 0
