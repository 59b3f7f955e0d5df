"""Snapshots in the log's own store: sealed in the log, kept in JetStream's object store, adopted
by a starting process only when verified (an altered one is refused with why, and an older one
or a full replay is used), and enough to start after the head of the stream has aged out."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import structlog
from nats.js.api import ObjectMeta

from gpusched.bus import subjects
from gpusched.bus.log import EventLog
from gpusched.core import events as ev
from gpusched.core.model import JobSpec
from gpusched.core.state import ClusterState
from gpusched.services.runtime import FoldedLog
from gpusched.store import KEEP, Refused, SnapshotStore, fold_log

from ..verdicts import Attacker


def submitted(i: int) -> ev.JobSubmitted:
    return ev.JobSubmitted(at=float(i), job_id=f"j-{i}", spec=JobSpec(team="t", gpus=1), user="u")


async def append_jobs(log: EventLog, start: int, count: int) -> None:
    for i in range(start, start + count):
        await log.append(submitted(i))


async def started(url: str) -> FoldedLog:
    folded = FoldedLog(await EventLog.open(url, name="snapshot-test"))
    await folded.start()
    return folded


async def test_a_process_starts_from_the_sealed_snapshot_and_folds_only_the_tail(event_log, nats_url):
    await append_jobs(event_log, 0, 30)
    meta = await SnapshotStore(event_log).save(await fold_log(event_log))
    await append_jobs(event_log, 30, 5)
    with structlog.testing.capture_logs() as logs:
        folded = await started(nats_url)
    try:
        assert any(e["event"] == "snapshot_adopted" and e["seq"] == meta.seq for e in logs)
        whole = await fold_log(event_log)
        assert folded.state.snapshot() == whole.snapshot()  # the same fold as a replay from the start
        assert len(folded.state.jobs) == 35
    finally:
        await folded.close()


async def test_an_altered_snapshot_is_refused_with_why_and_an_older_one_is_used(event_log, nats_url):
    store = SnapshotStore(event_log)
    await append_jobs(event_log, 0, 10)
    older = await store.save(await fold_log(event_log))
    await append_jobs(event_log, 10, 10)
    newer = await store.save(await fold_log(event_log))
    assert older.name != newer.name and len(await store.metas()) == 2
    # someone who can write the bucket swaps in a state with fewer jobs, keeping the metadata
    forged = await fold_log(event_log, until=older.seq)
    forged.last_seq = newer.seq
    await store.put(newer, forged.snapshot())
    with structlog.testing.capture_logs() as logs:
        folded = await started(nats_url)
    try:
        rejected = [e for e in logs if e["event"] == "snapshot_rejected"]
        assert rejected and rejected[0]["seq"] == newer.seq and "altered" in rejected[0]["reason"]
        assert any(e["event"] == "snapshot_adopted" and e["seq"] == older.seq for e in logs)
        assert len(folded.state.jobs) == 20 and folded.state.snapshot() == (await fold_log(event_log)).snapshot()
    finally:
        await folded.close()


async def test_with_every_snapshot_refused_the_process_replays_the_whole_log(event_log, nats_url):
    store = SnapshotStore(event_log)
    await append_jobs(event_log, 0, 8)
    meta = await store.save(await fold_log(event_log))
    # metadata that names a log message that is no seal
    await store.put(dataclasses.replace(meta, seal_seq=1), (await fold_log(event_log)).snapshot())
    with structlog.testing.capture_logs() as logs:
        folded = await started(nats_url)
    try:
        assert any(e["event"] == "snapshot_rejected" and "not a snapshot seal" in e["reason"] for e in logs)
        assert not any(e["event"] == "snapshot_adopted" for e in logs)
        assert len(folded.state.jobs) == 8  # replayed from seq 1
    finally:
        await folded.close()


async def test_the_store_keeps_a_bounded_number_of_snapshots(event_log):
    store = SnapshotStore(event_log)
    for round_ in range(KEEP + 2):
        await append_jobs(event_log, round_ * 3, 3)
        await store.save(await fold_log(event_log))
    metas = await store.metas()
    assert len(metas) == KEEP
    assert metas[0].seq == await event_log.last_seq() - 1  # the newest (its seal came after it)


async def test_start_up_works_after_the_head_of_the_stream_aged_out_behind_a_snapshot(event_log, nats_url):
    await append_jobs(event_log, 0, 40)
    await SnapshotStore(event_log).save(await fold_log(event_log))
    await append_jobs(event_log, 40, 10)
    whole = await fold_log(event_log)
    # the operator bounds the log (purge is denied; limits are how it shrinks)
    await event_log.set_retention(max_msgs=20)
    assert await event_log.first_seq() > 1
    info = (await event_log.js.stream_info(subjects.STREAM)).config
    assert info.deny_purge and info.deny_delete
    folded = await started(nats_url)
    try:
        assert folded.state.snapshot() == whole.snapshot()
    finally:
        await folded.close()
    # the limits survive the admin's next start (`gpusched up` re-applies the stream config)
    await event_log.create_streams()
    assert (await event_log.js.stream_info(subjects.STREAM)).config.max_msgs == 20


async def test_a_process_refuses_to_start_when_aged_out_facts_are_covered_by_no_snapshot(event_log, nats_url):
    await append_jobs(event_log, 0, 30)
    await event_log.set_retention(max_msgs=10)
    folded = FoldedLog(await EventLog.open(nats_url, name="snapshot-test"))
    try:
        with pytest.raises(RuntimeError, match="no verified snapshot covers"):
            await folded.start()
    finally:
        await folded.close()


async def _forged_put(nc) -> None:
    bucket = await nc.jetstream().object_store(subjects.SNAPSHOT_BUCKET)
    await bucket.put("fold-9", b"forged", meta=ObjectMeta(name="fold-9"))


async def test_readers_read_snapshots_and_only_the_projector_writes_them(event_log, nats_url, trust):
    await append_jobs(event_log, 0, 5)
    projector = await EventLog.open(nats_url, name="projector", creds=trust.creds("projector"))
    try:
        meta = await SnapshotStore(projector).save(await fold_log(projector))
    finally:
        await projector.close()
    for who in ("nodeagent", "dashboard", "reconciler"):
        reader = await EventLog.open(nats_url, name=f"reader-{who}", creds=trust.creds(who))
        try:
            store = SnapshotStore(reader)
            state = await store.load((await store.metas())[0], 1, await reader.last_seq())
            assert state.last_seq == meta.seq and len(state.jobs) == 5
        finally:
            await reader.close()
        forge = Attacker(nats_url, str(trust.creds(who)))
        assert await forge.refused(f"$O.{subjects.SNAPSHOT_BUCKET}.C.", _forged_put, prefix=True)
    assert [m.name for m in await SnapshotStore(event_log).metas()] == [meta.name]


def test_a_restored_fold_re_encodes_to_its_digest():
    state = ClusterState()
    for i in range(3):
        state.apply(submitted(i), i + 1)
    assert ClusterState.restore(state.snapshot()).snapshot() == state.snapshot()


async def test_a_snapshot_folded_with_another_horizon_is_refused_and_one_with_ours_is_adopted(event_log, nats_url,
                                                                                              monkeypatch):
    """A fold that forgets other jobs is another fold: the horizon is the log's fact, so a
    service refuses a snapshot a keep-everything reader folded (`GPUSCHED_FORGET_AFTER_S=none`),
    and a started process forgets what a replay forgets."""
    from gpusched.core.model import FoldSettings

    base = time.time() - 5 * 86400.0  # the horizon is measured on the server's clock: jobs that ended in the past
    await event_log.append(ev.FoldSettingsSet(at=base - 60, settings=FoldSettings(forget_after_s=2 * 86400.0)))
    for i in range(6):  # jobs ending a day apart: 2 days before the last one, the first four ended
        at = base + i * 86400.0
        await event_log.append(ev.JobSubmitted(at=at, job_id=f"j-{i}", spec=JobSpec(team="t", gpus=1)))
        await event_log.append(ev.JobCancelled(at=at, job_id=f"j-{i}"))
    monkeypatch.setenv("GPUSCHED_FORGET_AFTER_S", "none")
    keep_all = await SnapshotStore(event_log).save(await fold_log(event_log))
    monkeypatch.delenv("GPUSCHED_FORGET_AFTER_S")
    with structlog.testing.capture_logs() as logs:
        folded = await started(nats_url)
    try:
        assert not any(e["event"] == "snapshot_adopted" for e in logs)
        assert any(e["event"] == "snapshot_rejected" and "keeping every job whole" in e["reason"] for e in logs)
        assert sorted(folded.state.forgotten) == ["j-0", "j-1", "j-2", "j-3"] and len(folded.state.jobs) == 2
    finally:
        await folded.close()
    ours = await SnapshotStore(event_log).save(await fold_log(event_log))
    await event_log.append(ev.JobSubmitted(at=time.time(), job_id="j-6", spec=JobSpec(team="t", gpus=1)))
    with structlog.testing.capture_logs() as logs:
        folded = await started(nats_url)
    try:
        assert any(e["event"] == "snapshot_adopted" and e["seq"] == ours.seq for e in logs)
        assert folded.state.snapshot() == (await fold_log(event_log)).snapshot()
        assert "j-3" in folded.state.forgotten and keep_all.forget_after_s == "None"
    finally:
        await folded.close()


async def test_a_snapshot_taken_while_facts_flow_names_the_seq_it_seals_and_a_restart_adopts_it(event_log, nats_url):
    """Before, `save` read `state.last_seq` again after the seal's append and the store's
    listing: a live fold had moved on by then, so the object named a later seq than its seal
    ("seal at seq N is for seq N-1 ... rejected") and every restart replayed the whole log."""
    await append_jobs(event_log, 0, 20)
    live = await started(nats_url)  # follows the log: its state moves during the awaits in `save`
    writer = await EventLog.open(nats_url, name="snapshot-flow")
    stop = asyncio.Event()

    async def flow() -> None:
        i = 1000
        while not stop.is_set():
            await asyncio.gather(*[writer.append(submitted(i + k)) for k in range(20)])
            i += 20

    flowing = asyncio.create_task(flow())
    try:
        store, metas = SnapshotStore(event_log), []
        for _ in range(KEEP):
            await asyncio.sleep(0.05)
            metas.append(await store.save(live.state))
    finally:
        stop.set()
        await flowing
        await writer.close()
        await live.close()
    newest = max(metas, key=lambda m: m.seal_seq)
    assert len({m.seq for m in metas}) == KEEP  # facts did flow between the snapshots
    with structlog.testing.capture_logs() as logs:
        folded = await started(nats_url)
    try:
        assert not [e for e in logs if e["event"] == "snapshot_rejected"], logs
        assert any(e["event"] == "snapshot_adopted" and e["seq"] == newest.seq for e in logs)
        assert folded.state.snapshot() == (await fold_log(event_log)).snapshot()
    finally:
        await folded.close()


async def test_a_snapshot_whose_chunks_were_altered_is_refused_with_why(event_log):
    """The chunks are read and checked here (count, size, the SHA-256 in the object's info), not
    by nats-py's `ObjectStore.get`: whoever can write the bucket adds, removes or replaces a
    chunk, and the snapshot is refused before it is decoded."""
    from nats.js.api import ObjectMetaOptions
    from nats.js.errors import NotFoundError

    store, js = SnapshotStore(event_log), event_log.js
    await append_jobs(event_log, 0, 10)
    meta = await store.save(await fold_log(event_log))
    bucket = await js.object_store(subjects.SNAPSHOT_BUCKET)
    stored = await bucket.get(meta.name)
    info = await bucket.put(meta.name, stored.data, meta=ObjectMeta(  # in small chunks, so one can be altered
        name=meta.name, description=stored.info.description, options=ObjectMetaOptions(max_chunk_size=256)))
    assert info.chunks > 3
    first, last = 1, await event_log.last_seq()
    assert len((await store.load(meta, first, last)).jobs) == 10  # intact: adopted
    subject = f"$O.{subjects.SNAPSHOT_BUCKET}.C.{info.nuid}"
    chunks = []
    for seq in range(1, (await js.stream_info(subjects.SNAPSHOT_STREAM)).state.last_seq + 1):
        try:
            msg = await js.get_msg(subjects.SNAPSHOT_STREAM, seq)
        except NotFoundError:  # the chunks of the objects `put` replaced
            continue
        if msg.subject == subject:
            chunks.append(msg)
    assert len(chunks) == info.chunks

    extra = await js.publish(subject, b"\x00" * 10, stream=subjects.SNAPSHOT_STREAM)
    with pytest.raises(Refused, match="more than the"):
        await store.load(meta, first, last)
    await js.delete_msg(subjects.SNAPSHOT_STREAM, extra.seq)
    await js.delete_msg(subjects.SNAPSHOT_STREAM, chunks[1].seq)
    with pytest.raises(Refused, match="altered"):  # one fewer
        await store.load(meta, first, last)
    await js.publish(subject, bytes(b ^ 1 for b in chunks[1].data), stream=subjects.SNAPSHOT_STREAM)
    with pytest.raises(Refused, match="do not match the SHA-256"):  # as many, as long, other bytes
        await store.load(meta, first, last)
