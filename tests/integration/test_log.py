"""The log on a real JetStream: idempotent appends, compare-and-set grants, dead letters, audit."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from datetime import datetime, timezone

import pytest

from gpusched.bus import subjects
from gpusched.bus.cas import append_cas
from gpusched.bus.log import Conflict, EventLog
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec, TeamQuota
from gpusched.core.state import ClusterState
from gpusched.services.runtime import FoldedLog


def node(name: str, gpus: int = 8) -> ev.NodeRegistered:
    return ev.NodeRegistered(at=0, node=name, rack="r0", gpus=[GpuInfo(index=i, uuid=f"{name}-{i}") for i in range(gpus)])


def submit(job: str, team: str = "a", gpus: int = 4) -> ev.JobSubmitted:
    return ev.JobSubmitted(at=1, job_id=job, spec=JobSpec(team=team, gpus=gpus), request_id=f"req-{job}")


async def fold_stream(log: EventLog) -> ClusterState:
    state = ClusterState()
    async for seq, event in log.replay():
        state.apply(event, seq)
    return state


async def test_ensure_is_idempotent(event_log):
    await event_log.ensure()
    await event_log.ensure()
    info = await event_log.js.stream_info(subjects.STREAM)
    assert info.config.subjects == [subjects.EVENTS]


async def test_a_retried_append_is_stored_once(event_log):
    e = submit("j1")
    first = await event_log.append(e, msg_id="submit-req-j1")
    again = await event_log.append(e, msg_id="submit-req-j1")
    assert first == again and await event_log.last_seq() == 1


async def test_grant_with_a_stale_view_is_rejected(event_log):
    await event_log.append(node("n0"))
    await event_log.append(submit("j1"))
    await event_log.append(submit("j2"))
    view = 1  # both writers saw the node registration (seq 1) as the last alloc event
    await event_log.append(ev.GpusGranted(at=2, job_id="j1", attempt=1, gpus=["n0/0", "n0/1", "n0/2", "n0/3"]),
                           expect_alloc_seq=view)
    with pytest.raises(Conflict) as err:
        await event_log.append(ev.GpusGranted(at=2, job_id="j2", attempt=1, gpus=["n0/3", "n0/4", "n0/5", "n0/6"]),
                               expect_alloc_seq=view)
    assert (err.value.expected, err.value.actual) == (1, 4)  # the server names the real last alloc seq
    # a non-alloc append in between does not make a fresh view stale
    await event_log.append(ev.JobPending(at=3, job_id="j2", reason="waiting"))
    await event_log.append(ev.GpusGranted(at=3, job_id="j2", attempt=1, gpus=["n0/4", "n0/5", "n0/6", "n0/7"]),
                           expect_alloc_seq=4)
    assert (await fold_stream(event_log)).violations() == []


async def test_replay_until_a_sequence(event_log):
    for i in range(5):
        await event_log.append(submit(f"j{i}"))
    got = [seq async for seq, _ in event_log.replay(2, 4)]
    assert got == [2, 3, 4]


RACES = 1000
WRITERS = 4


async def test_concurrent_writers_never_double_book(nats_url):
    """WRITERS placement writers decide from the same view and grant overlapping GPUs:
    over RACES races exactly one wins each, and the final log books no GPU twice."""
    setup = await EventLog.open(nats_url)
    await setup.append(node("n0"))
    await asyncio.gather(*(setup.append(submit(f"r{r}w{w}")) for r in range(RACES) for w in range(WRITERS)))
    writers = [FoldedLog(await EventLog.open(nats_url, name=f"writer-{w}")) for w in range(WRITERS)]
    for f in writers:
        await f.start()

    async def attempt(w: int, r: int, view: int, decided: asyncio.Barrier) -> bool:
        folded = writers[w]
        while folded.seen_seq < view:
            await folded.wait_changed(0.05)
        state = folded.state  # every writer decides from exactly the shared view ...
        free = sorted((g for n in state.nodes.values() for g in n.free), key=lambda g: int(g.split("/")[1]))
        gpus = free[w: w + 4]  # overlapping windows: every pair of writers collides
        grant = ev.GpusGranted(at=2 + r, job_id=f"r{r}w{w}", attempt=1, gpus=gpus)
        seen = folded.alloc_seq
        await decided.wait()  # ... and nobody appends before all have decided
        appended, conflicted = await append_cas(folded, [grant], view=seen)
        assert appended + conflicted == 1
        return appended == 1

    wins = []
    for r in range(RACES):
        view = await setup.last_seq()
        decided = asyncio.Barrier(WRITERS)
        results = await asyncio.gather(*(attempt(w, r, view, decided) for w in range(WRITERS)))
        assert sum(results) == 1, f"race {r}: {sum(results)} winners"
        winner = results.index(True)
        wins.append(winner)
        await setup.append(ev.JobCompleted(at=3 + r, job_id=f"r{r}w{winner}", attempt=1))

    state = await fold_stream(setup)
    assert state.violations() == []
    assert state.job_counts()["completed"] == RACES
    assert len(set(wins)) > 1, "the races were not real races: one writer always won"
    for f in writers:
        await f.stop()
        await f.log.close()
    await setup.close()


async def test_a_fold_does_not_start_twice_while_it_follows(nats_url):
    """`FoldedLog.open` starts the fold: a second start would leave a follower nothing stops.
    After `stop` it may start again, and reads on from where it was."""
    folded = await FoldedLog.open(nats_url, name="started-once")
    try:
        with pytest.raises(RuntimeError, match="already following"):
            await folded.start()
        await folded.stop()
        writer = await EventLog.open(nats_url, name="writer")
        seq = await writer.append(submit("after-stop"))
        await writer.close()
        await folded.start()
        await folded.wait_seq(seq)
        assert "after-stop" in folded.state.jobs
    finally:
        await folded.close()


async def test_bad_messages_go_to_the_dead_letter_stream_and_followers_keep_going(event_log, nats_url):
    folded = FoldedLog(await EventLog.open(nats_url, name="follower"))
    await folded.start()
    await event_log.append(node("n0"))
    await event_log.nc.publish("gpusched.evt.alloc.GpusGranted.x", b"{not json")
    await event_log.js.publish("gpusched.evt.alloc.GpusGranted.y", b'{"type":"GpusGranted","at":1,"job_id":"y"}')
    await event_log.js.publish("gpusched.evt.info.Meteor.z", b'{"type":"MeteorStrike","at":1}')
    await event_log.append(submit("j1"))
    await folded.catch_up()
    assert "j1" in folded.state.jobs and folded.seen_seq == 5
    # the follower's compare-and-set view counts the bad message in the alloc tree
    grant = ev.GpusGranted(at=2, job_id="j1", attempt=1, gpus=["n0/0", "n0/1", "n0/2", "n0/3"])
    appended, conflicted = await append_cas(folded, [grant])
    assert (appended, conflicted) == (1, False)
    dead = await event_log.dead_letters_list()
    reasons = {d["subject"]: d["reason"] for d in dead}
    assert "missing required field `attempt`" in reasons["gpusched.dead.gpusched.evt.alloc.GpusGranted.y"]
    assert "Invalid value 'MeteorStrike'" in reasons["gpusched.dead.gpusched.evt.info.Meteor.z"]
    assert "JSON is malformed" in reasons["gpusched.dead.gpusched.evt.alloc.GpusGranted.x"]
    assert len(dead) == 3  # a plain core-NATS publish on an event subject is stored by the stream too
    await folded.stop()
    await folded.log.close()


def run_replay(nats_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpusched.cli.main", "replay", "--nats", nats_url, *args],
                          capture_output=True, text=True, timeout=60)


async def test_replay_verify_names_an_injected_double_grant_and_over_limit_grant(event_log, nats_url):
    await event_log.append(node("n0"))
    await event_log.append(node("n1"))
    await event_log.append(ev.TeamQuotaSet(at=0, team="b", quota=TeamQuota(limit=2)))
    await event_log.append(submit("j1"))
    await event_log.append(ev.GpusGranted(at=2, job_id="j1", attempt=1, gpus=["n0/0", "n0/1", "n0/2", "n0/3"]))
    clean = run_replay(nats_url, "--verify", "--allow-unsigned", "--json")
    assert clean.returncode == 0, clean.stderr
    assert json.loads(clean.stdout)["violations"] == []
    # inject what a buggy writer without compare-and-set could append
    await event_log.append(submit("j2"))
    double = await event_log.append(ev.GpusGranted(at=3, job_id="j2", attempt=1, gpus=["n0/3", "n0/4", "n0/5", "n0/6"]))
    await asyncio.sleep(0.2)
    stored_before_j3 = time.time()  # the server stores what follows after this instant
    await asyncio.sleep(0.2)
    await event_log.append(submit("j3", team="b", gpus=3))
    over = await event_log.append(ev.GpusGranted(at=4, job_id="j3", attempt=1, gpus=["n1/0", "n1/1", "n1/2"]))

    result = run_replay(nats_url, "--verify", "--allow-unsigned", "--json")
    assert result.returncode == 1
    out = json.loads(result.stdout)
    assert [(v["seq"], v["rule"], v["jobs"], v["gpus"]) for v in out["violations"]] == [
        (double, "double_booking", ["j2", "j1"], ["n0/3"]),
        (over, "over_limit", ["j3"], ["n1/0", "n1/1", "n1/2"]),
    ]
    assert out["gpus"] == {"total": 16, "held": 10, "free": 6, "unavailable": 0}
    assert out["jobs"]["starting"] == 3 and out["last_seq"] == over and out["events"] == over

    text = run_replay(nats_url, "--verify", "--allow-unsigned")
    assert text.returncode == 1 and "double_booking" in text.stdout and "over_limit" in text.stdout
    before = run_replay(nats_url, "--verify", "--allow-unsigned", "--json", "--until", str(double - 1))
    assert before.returncode == 0 and json.loads(before.stdout)["last_seq"] == double - 1
    # by time: the log as the server had stored it then (its store timestamps, not the events' `at`)
    when = datetime.fromtimestamp(stored_before_j3, timezone.utc).isoformat()
    then = json.loads(run_replay(nats_url, "--json", "--until", when).stdout)
    assert then["last_seq"] == double and [v["rule"] for v in then["violations"]] == ["double_booking"]
    before_all = json.loads(run_replay(nats_url, "--json", "--until", "1970-01-01T00:00:03").stdout)
    assert before_all["last_seq"] == 0 and before_all["events"] == 0
    bad = run_replay(nats_url, "--until", "yesterday")
    assert bad.returncode != 0 and "neither a sequence number nor an ISO time" in bad.stderr


async def test_the_alloc_tree_stays_bounded_however_many_jobs(event_log):
    """The CAS check's cost grows with the distinct subjects under the alloc tree, so jobs share
    a bounded set of shards there; their info subjects stay per job."""
    await event_log.append(node("n0", gpus=600))
    grants = [ev.GpusGranted(at=2, job_id=f"j{i}", attempt=1, gpus=[f"n0/{i}"]) for i in range(600)]
    await asyncio.gather(*(event_log.append(submit(f"j{i}", gpus=1)) for i in range(600)))
    for i in range(0, 600, 200):
        await event_log.append_batch(grants[i:i + 200])
    alloc = await event_log.js.stream_info(subjects.STREAM, subjects_filter=subjects.ALLOC_TREE)
    info = await event_log.js.stream_info(subjects.STREAM, subjects_filter="gpusched.evt.info.>")
    assert len(alloc.state.subjects) <= 1 + subjects.ALLOC_SHARDS  # NodeRegistered + GpusGranted shards
    assert len(info.state.subjects) == 600
    assert subjects.event_subject(grants[7]).startswith("gpusched.evt.alloc.GpusGranted.s")


async def test_one_writers_flood_of_bad_facts_files_a_bounded_number_of_dead_letters(event_log, nats_url):
    """A node that publishes garbage on its own subject gets its first DEAD_PER_WRITER filed
    per window and the rest only counted; another writer's bad fact is still filed after it."""
    from gpusched.bus import log as buslog

    folded = FoldedLog(await EventLog.open(nats_url, name="flood-follower"))
    folded.log.dead_budget = buslog.DeadLetterBudget(per_writer=5, window_s=3600)
    await folded.start()
    for i in range(40):
        await event_log.js.publish("gpusched.evt.alloc.JobCompleted.node.n9", b'{"type":"JobCompleted","at":%d}' % i)
    await event_log.js.publish("gpusched.evt.alloc.JobCompleted.node.n8", b"{not json")
    await folded.catch_up()
    dead = await event_log.dead_letters_list(limit=1000)
    by_writer = [d["subject"].rsplit(".", 1)[-1] for d in dead]
    assert by_writer.count("n9") == 5 and by_writer.count("n8") == 1
    assert folded.log.dead_budget.dropped == 35 and folded.log.dead_letters == 41
    await folded.stop()
    await folded.log.close()
