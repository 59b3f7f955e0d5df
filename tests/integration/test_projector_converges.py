"""The read models converge on the fold: what the projector folds while a flush waits on Redis
is written by the next flush. Before, `flush` cleared its dirty marks after `await
pipe.execute()`, so every job, node or team changed during that await kept its old document
for good (`gpusched jobs` showed cancelled jobs as pending). A real projector process, real
Redis, bursts of facts appended while it flushes every few milliseconds."""

from __future__ import annotations

import asyncio
import time

import msgspec
import redis.asyncio as aioredis

from gpusched import readmodel
from gpusched.core import events as ev
from gpusched.core.model import JobSpec
from gpusched.views import K

from ..e2e.harness import harness  # noqa: F401

TEAMS = ("nlp", "vision", "speech")


def _burst(start: int, n: int) -> list[ev.Event]:
    """Jobs submitted, half of them cancelled, a node drained back and forth: every view moves."""
    out: list[ev.Event] = []
    for i in range(start, start + n):
        out.append(ev.JobSubmitted(at=time.time(), job_id=f"c{i}", spec=JobSpec(team=TEAMS[i % 3], gpus=1)))
        if i % 2:
            out.append(ev.JobCancelled(at=time.time(), job_id=f"c{i}"))
        if i % 7 == 0:
            out.append(ev.NodeDrained(at=time.time(), node=f"node{i % 4:02d}", drain=bool(i % 14), reason="t"))
    return out


async def _written_seq(r: aioredis.Redis, seq: int, timeout: float = 5.0) -> int:
    """The seq the views cover, once it reaches `seq` (or whatever it is at the deadline)."""
    deadline = time.monotonic() + timeout
    written = 0
    while time.monotonic() < deadline:
        meta = await r.hgetall(K["meta"])
        written = int(meta[b"seq"]) if meta else 0
        if written >= seq:
            break
        await asyncio.sleep(0.05)
    return written


async def test_read_models_equal_the_fold_key_by_key_after_bursts_during_flushes(harness, redis_url):  # noqa: F811
    harness.start("projector", "--flush-s", "0.002")
    await harness.ready("projector")
    await harness.nodes(4, gpus=2)
    n = 0
    for _ in range(6):  # bursts of concurrent appends: many land while a flush awaits Redis
        events = _burst(n, 150)
        n += 150
        await asyncio.gather(*[harness.append(e) for e in events])
        await asyncio.sleep(0.01)
    state = await harness.sync()
    r = aioredis.Redis.from_url(redis_url)
    try:
        written = await _written_seq(r, state.last_seq)
        await asyncio.sleep(0.3)  # nothing more to write: what is there now stays
        jobs = {k.decode(): msgspec.json.decode(v) for k, v in (await r.hgetall(K["jobs"])).items()}
        nodes = {k.decode(): msgspec.json.decode(v) for k, v in (await r.hgetall(K["nodes"])).items()}
        teams = {k.decode(): msgspec.json.decode(v) for k, v in (await r.hgetall(K["teams"])).items()}
        queue = {k.decode() for k in await r.zrange(K["queue"], 0, -1)}
    finally:
        await r.aclose()
    assert set(jobs) == set(state.jobs) and len(jobs) == n
    stale = [j for j, job in state.jobs.items() if jobs[j]["state"] != job.state]
    assert not stale, f"{len(stale)} jobs stale in Redis, e.g. {stale[:5]}"
    assert written == state.last_seq
    timed = {"seq", "gpu_s"}  # the write's seq, and GPU-seconds as of the write's clock
    for j, job in state.jobs.items():
        want = msgspec.json.decode(msgspec.json.encode(readmodel.job_doc(state, job)))
        assert {k: v for k, v in jobs[j].items() if k not in timed} == {k: v for k, v in want.items()
                                                                         if k not in timed}, j
    assert set(nodes) == set(state.nodes)
    for name in state.nodes:
        want = msgspec.json.decode(msgspec.json.encode(readmodel.node_doc(state, name)))
        assert {k: v for k, v in nodes[name].items() if k != "seq"} == want, name
    assert set(teams) == set(state.teams)
    for name in state.teams:
        want = readmodel.team_doc(state, name)
        got = teams[name]
        assert (got["held"], got["pending_jobs"], got["running_jobs"]) == \
            (want["held"], want["pending_jobs"], want["running_jobs"]), name
    assert queue == set(state.pending)
