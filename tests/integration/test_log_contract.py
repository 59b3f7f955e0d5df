"""One contract, two logs: the JetStream `EventLog` (on a real nats-server) and the in-memory
`MemoryEventLog` pass the same suite: sequences, message-id deduplication, compare-and-set over
the alloc tree, atomic batches, reading ranges and following."""

from __future__ import annotations

import asyncio

import pytest

from gpusched.bus.log import MAX_BATCH, Conflict, EventLog
from gpusched.bus.memory import MemoryEventLog, subject_matches
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec


@pytest.fixture(params=["jetstream", "memory"])
async def log(request):
    if request.param == "memory":
        yield MemoryEventLog()
        return
    real = await EventLog.open(request.getfixturevalue("nats_url"))
    yield real
    await real.close()


def node(name: str = "n0", gpus: int = 8) -> ev.NodeRegistered:
    return ev.NodeRegistered(at=0, node=name, rack="r0", gpus=[GpuInfo(index=i, uuid=f"{name}-{i}") for i in range(gpus)])


def submit(job: str, gpus: int = 2) -> ev.JobSubmitted:
    return ev.JobSubmitted(at=1, job_id=job, spec=JobSpec(team="a", gpus=gpus), request_id=f"req-{job}")


def grant(job: str, *idx: int, at: float = 2) -> ev.GpusGranted:
    return ev.GpusGranted(at=at, job_id=job, attempt=1, gpus=[f"n0/{i}" for i in idx])


async def seqs(log) -> list[int]:
    return [seq async for seq, _ in log.replay()]


async def test_sequences_start_at_one_and_count_every_fact(log):
    assert await log.last_seq() == 0
    assert [await log.append(submit(f"j{i}")) for i in range(3)] == [1, 2, 3]
    assert await log.last_seq() == 3 and await seqs(log) == [1, 2, 3]


async def test_a_repeated_message_id_is_stored_once_and_answers_the_stored_sequence(log):
    first = await log.append(submit("j1"), msg_id="submit-1")
    await log.append(submit("j2"))
    assert await log.append(submit("j1"), msg_id="submit-1") == first
    assert await log.append(submit("j2")) == 2  # no id: the content hash is the id
    assert await log.last_seq() == 2


async def test_a_grant_from_a_stale_view_conflicts_and_names_the_real_view(log):
    await log.append(node())
    await log.append(submit("a"))
    await log.append(submit("b"))
    await log.append(grant("a", 0, 1), expect_alloc_seq=1)  # seq 4
    with pytest.raises(Conflict) as err:
        await log.append(grant("b", 1, 2), expect_alloc_seq=1)
    assert (err.value.expected, err.value.actual) == (1, 4)
    await log.append(ev.JobPending(at=3, job_id="b", reason="waiting"))  # not an alloc fact
    assert await log.append(grant("b", 2, 3), expect_alloc_seq=4) == 6


async def test_the_compare_and_set_check_comes_before_deduplication(log):
    await log.append(node())
    await log.append(submit("a"))
    seq = await log.append(grant("a", 0, 1), msg_id="grant-a-1", expect_alloc_seq=1)
    with pytest.raises(Conflict):  # retried from its old view: the writer must catch up
        await log.append(grant("a", 0, 1), msg_id="grant-a-1", expect_alloc_seq=1)
    assert await log.append(grant("a", 0, 1), msg_id="grant-a-1", expect_alloc_seq=seq) == seq
    assert await log.append(grant("a", 0, 1), msg_id="grant-a-1") == seq and await log.last_seq() == seq


async def test_a_batch_lands_whole_with_consecutive_sequences(log):
    await log.append(node())
    for j in "abc":
        await log.append(submit(j))
    got = await log.append_batch([grant("a", 0, 1), grant("b", 2, 3), grant("c", 4, 5)], expect_alloc_seq=1)
    assert got == [5, 6, 7] and await log.last_seq() == 7


async def test_a_stale_batch_lands_not_at_all(log):
    await log.append(node())
    for j in "abc":
        await log.append(submit(j))
    await log.append(grant("a", 0, 1), expect_alloc_seq=1)
    with pytest.raises(Conflict):
        await log.append_batch([grant("b", 2, 3), grant("c", 4, 5)], expect_alloc_seq=1)
    assert await log.last_seq() == 5


async def test_a_batch_repeating_a_stored_message_id_is_a_conflict_and_lands_not_at_all(log):
    await log.append(node())
    for j in "ab":
        await log.append(submit(j))
    await log.append(grant("a", 0, 1), msg_id="grant-a-1", expect_alloc_seq=1)
    with pytest.raises(Conflict):
        await log.append_batch([grant("a", 0, 1), grant("b", 2, 3)], msg_ids=["grant-a-1", "grant-b-1"],
                               expect_alloc_seq=4)
    assert await log.last_seq() == 4


async def test_a_batch_is_at_most_max_batch(log):
    with pytest.raises(ValueError):
        await log.append_batch([submit(f"j{i}") for i in range(MAX_BATCH + 1)])
    assert await log.last_seq() == 0


async def test_a_fact_its_readers_would_dead_letter_is_refused_before_it_is_stored(log):
    bad = ev.GpusGranted(at=2, job_id="j", attempt=1, gpus=["n0/0"], level="nvswitch")  # type: ignore[arg-type]
    with pytest.raises(ev.InvalidFact, match="level"):
        await log.append(bad)
    with pytest.raises(ev.InvalidFact):
        await log.append_batch([submit("j"), bad])
    assert await seqs(log) == []
    assert await log.append(submit("j")) == 1


async def test_records_read_a_range_and_filter_by_subject(log):
    await log.append(node())
    for j in "abc":
        await log.append(submit(j))
    assert [s async for s, _ in log.replay(2, 3)] == [2, 3]
    # (a filtered read must end on a matching sequence: JetStream's reader waits for one)
    allocs = [r.seq async for r in log.records(1, until=1, subject="gpusched.evt.alloc.>")]
    assert allocs == [1]


async def test_following_sees_later_appends(log):
    await log.append(submit("a"))

    async def first_two():
        out = []
        async for rec in log.records(1, follow=True):
            out.append(rec.seq)
            if len(out) == 2:
                return out

    reader = asyncio.create_task(first_two())
    await asyncio.sleep(0.05)
    await log.append(submit("b"))
    assert await asyncio.wait_for(reader, 5) == [1, 2]


SUBJECTS = {
    "> matches the rest": ("gpusched.evt.>", "gpusched.evt.alloc.GpusGranted.3", True),
    "> needs one token at least": ("gpusched.evt.>", "gpusched.evt", False),
    "* is one token": ("gpusched.evt.*.JobPending.*", "gpusched.evt.job.JobPending.7", True),
    "* is not two": ("gpusched.evt.*", "gpusched.evt.job.x", False),
}


@pytest.mark.parametrize("name", list(SUBJECTS))
def test_subject_matching_is_nats(name):
    pattern, subject, want = SUBJECTS[name]
    assert subject_matches(pattern, subject) is want


async def test_filtered_records_end_at_the_tail_of_the_call(log):
    """A filtered read without `until` whose last match lies before the stream's last sequence
    (or that matches nothing) ends at the tail as of the call instead of waiting forever."""
    submits = "gpusched.evt.*.JobSubmitted.*"
    await log.append(submit("a"))
    await log.append(node())
    await log.append(submit("b"))
    await log.append(node("n2"))  # the tail matches no submit
    assert await asyncio.wait_for(_seqs(log.records(subject=submits)), 5) == [1, 3]
    assert await asyncio.wait_for(_seqs(log.records(start=2, subject=submits)), 5) == [3]
    assert await asyncio.wait_for(_seqs(log.records(start=4, subject=submits)), 5) == []
    assert await asyncio.wait_for(_seqs(log.records(subject="gpusched.evt.*.JobCancelled.*")), 5) == []
    assert await asyncio.wait_for(_seqs(log.records(1, until=2, subject=submits)), 5) == [1]


async def _seqs(records) -> list[int]:
    return [r.seq async for r in records]
