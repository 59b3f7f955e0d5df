"""Preemption over the real log, placement and preemptor as separate processes: a checkpointing
victim yields and resumes from its checkpoint; one that does not checkpoint is released at the
deadline with its lost work counted; fair share reclaims GPUs from a team over its share."""

from __future__ import annotations

import time

from gpusched.core import events as ev
from gpusched.core.model import TeamQuota

from .harness import harness  # noqa: F401


async def _control_plane(h, nodes: int = 1, gpus: int = 8) -> None:
    h.start("admission")
    h.start("placement")
    h.start("preemptor")
    await h.ready("admission", "placement", "preemptor")
    await h.nodes(nodes, gpus)


async def test_preempted_job_checkpoints_yields_and_resumes_from_its_checkpoint(harness):
    h = harness
    await _control_plane(h)
    low = await h.submit(team="a", gpus=8, priority="low", preemptible=True, checkpoint_dir="/ckpt")
    await h.wait_for("low granted", lambda s: h.holding(low))
    await h.run_job(low)
    await h.checkpoint(low, step=10)  # a periodic checkpoint, before any request

    high = await h.submit(team="a", gpus=8, priority="high")
    request = await h.wait_for("preemption request", lambda s: s.jobs[low].preemption)
    assert request.for_job == high
    assert not h.events(ev.GpusReleased)  # it waits for the checkpoint (or the deadline)
    await h.checkpoint(low, step=42)  # the job acknowledges: checkpoint saved
    await h.wait_for("high granted", lambda s: h.holding(high))

    released = h.events(ev.GpusReleased)
    assert [(r.job_id, r.reason, r.forced) for r in released] == [(low, "preempted", False)]
    assert released[0].lost_gpu_s < 8 * 5  # only the seconds since the acknowledged checkpoint
    job = h.state.jobs[low]
    assert job.state == "pending" and job.preemptions == 1
    assert job.checkpoint.step == 42  # the next attempt resumes from here

    await h.run_job(high)
    await h.complete(high)
    await h.wait_for("low resumed", lambda s: h.holding(low))
    assert h.state.jobs[low].attempt == 2 and h.state.jobs[low].checkpoint.path == f"/ckpt/{low}/42"


async def test_a_job_that_does_not_checkpoint_is_released_at_the_deadline(harness):
    h = harness
    await _control_plane(h)
    low = await h.submit(team="a", gpus=8, priority="low", preemptible=True)
    await h.wait_for("low granted", lambda s: h.holding(low))
    await h.run_job(low)
    high = await h.submit(team="a", gpus=4, priority="interactive")
    request = await h.wait_for("preemption request", lambda s: s.jobs[low].preemption)
    await h.wait_for("high granted", lambda s: h.holding(high), timeout=10)
    released = h.events(ev.GpusReleased)
    assert len(released) == 1 and released[0].forced and released[0].lost_gpu_s > 0
    grant = next(e for e in h.events(ev.GpusGranted) if e.job_id == high)
    assert released[0].at >= request.deadline - 0.05 and grant.at >= released[0].at


async def test_fair_share_reclaims_gpus_from_a_team_over_its_share(harness):
    h = harness
    await _control_plane(h)
    assert (await h.client.set_quota("a", TeamQuota(guaranteed=4))).ok
    assert (await h.client.set_quota("b", TeamQuota(guaranteed=4))).ok
    # Team a borrows the whole node while b is idle.
    borrowed = [await h.submit(team="a", gpus=4, preemptible=True, priority="normal") for _ in range(2)]
    await h.wait_for("a holds all 8", lambda s: all(h.holding(j) for j in borrowed))
    for j in borrowed:
        await h.run_job(j)
    # Team b, under its guarantee, asks for its share: a (over its share) yields one job.
    started = time.monotonic()
    mine = await h.submit(team="b", gpus=4)  # same priority class: fair share alone decides
    request = await h.wait_for("reclaim", lambda s: next((s.jobs[j].preemption for j in borrowed
                                                          if s.jobs[j].preemption), None))
    assert request.for_job == mine
    victim = next(j for j in borrowed if h.state.jobs[j].preemption)
    await h.checkpoint(victim)
    await h.wait_for("b granted", lambda s: h.holding(mine))
    assert time.monotonic() - started < 10
    state = h.state
    assert state.teams["a"].held == 4 and state.teams["b"].held == 4
    assert len(h.events(ev.PreemptionRequested)) == 1  # a, now at its share, is left alone

    # The quota ledger publishes the standings.
    h.start("quota_ledger")
    await h.ready("quota_ledger")
    shares = await h.client.shares()
    assert shares["teams"]["a"]["standing"] == "within" and shares["teams"]["b"]["held"] == 4
    assert shares["teams"]["a"]["entitled"] == 4.0


async def test_a_job_past_its_time_limit_is_ended_and_its_gpus_go_to_the_next(harness):
    """Reservations and backfill count on time limits: an overrunning job is ended (as Slurm's
    TIMEOUT) by the preemptor, and the waiting job gets the GPUs."""
    h = harness
    await _control_plane(h)
    short = await h.submit(team="a", gpus=8, time_limit_s=1.5)
    await h.wait_for("short granted", lambda s: h.holding(short))
    await h.run_job(short)
    waiting = await h.submit(team="b", gpus=8)
    await h.wait_for("time limit enforced", lambda s: s.jobs[short].state == "timeout", timeout=10)
    assert h.state.jobs[short].end_reason == "time limit of 1.5 s exceeded"
    await h.wait_for("the next job granted", lambda s: h.holding(waiting))
    [grant] = [e for e in h.events(ev.GpusGranted) if e.job_id == short]
    [end] = [e for e in h.events(ev.JobTimedOut) if e.job_id == short]
    assert end.at - grant.at >= 1.5
