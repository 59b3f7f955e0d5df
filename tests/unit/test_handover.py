"""The hand-over: GPUs a preemption freed go first to the job they were freed for
(policy/steps/handover.py), whether the release is decided in the same cycle or appended
earlier by another writer (the fold's `handover`), for one turn, and never over another team's
turn in the fair-share order."""

from __future__ import annotations

from gpusched.core import events as ev
from gpusched.readmodel import describe

from .policy_helpers import FULL_INSTANT, Scenario, gpus

N0, N1 = gpus("r0n0", *range(8)), gpus("r0n1", *range(8))


def _granted(events) -> list[str]:
    return [e.job_id for e in events if isinstance(e, ev.GpusGranted)]


def _own_team() -> Scenario:
    """`x` LAS-preempts `lo` at 3000 (both team a); `z`, of the same team and ahead of `x` in
    its queue, was held then and did not ask; it is released before `lo` checkpoints."""
    s = Scenario(racks=1, nodes=2)
    s.team("a", guaranteed=16)
    s.run("lo", N0, at=0, team="a", preemptible=True)
    s.run("keep", N1, at=0, team="a", preemptible=False)
    s.submit("z", 8, team="a", at=100)
    s.apply(ev.JobHeld(at=100, job_id="z", user="ops", reason="test"))
    s.submit("x", 8, team="a", at=200)
    out = s.cycle(FULL_INSTANT, now=3000)
    assert [(e.job_id, e.for_job) for e in out if isinstance(e, ev.PreemptionRequested)] == [("lo", "x")]
    s.apply(ev.JobHeld(at=3005, job_id="z", held=False, user="ops"))
    s.checkpoint("lo", at=3010)
    return s


def test_the_freed_gpus_go_to_the_job_they_were_freed_for():
    s = _own_team()
    out = s.cycle(FULL_INSTANT, now=3010)
    assert [e.job_id for e in out if isinstance(e, ev.GpusReleased)] == ["lo"]
    assert _granted(out) == ["x"]
    assert s.state.jobs["x"].gpus == N0
    assert s.state.handover == {} and s.state.violations() == []
    grant = next(e for e in out if isinstance(e, ev.GpusGranted))
    assert grant.handover  # the log says why x went ahead of z: `gpusched show` prints it
    assert "handed over: GPUs a preemption freed for it" in describe(grant)


def test_without_the_hand_over_the_walk_gives_them_to_the_queue_head():
    """The case the hand-over exists for: `z` leads the next walk and takes the GPUs, and `x`,
    preempted for, is left to ask again."""
    s = _own_team()
    out = s.cycle(FULL_INSTANT.replace(hand_over=False), now=3010)
    assert _granted(out) == ["z"]
    assert not any(e.handover for e in out if isinstance(e, ev.GpusGranted))
    assert s.state.jobs["x"].state == "pending"


def test_a_hand_over_never_takes_another_teams_turn():
    """`x` (team a, high) preempts `lo` (team a); once team a is back at its guarantee, team b's
    `y` leads the fair-share order and fits: it gets the GPUs, as without the hand-over."""
    s = Scenario(racks=1, nodes=2)
    s.team("a", guaranteed=8)
    s.team("b", guaranteed=0)
    s.run("lo", N0, at=0, team="a", preemptible=True)
    s.run("keep", N1, at=0, team="a", preemptible=False)
    s.submit("y", 8, team="b", at=500)
    s.submit("x", 8, team="a", at=1000, priority="high")
    out = s.cycle(FULL_INSTANT, now=1000)
    assert [(e.job_id, e.for_job) for e in out if isinstance(e, ev.PreemptionRequested)] == [("lo", "x")]
    s.checkpoint("lo", at=1010)
    assert _granted(s.cycle(FULL_INSTANT, now=1010)) == ["y"]
    assert s.state.violations() == []


def test_a_release_appended_by_another_writer_is_handed_over_by_the_next_cycle():
    """Services: the preemptor appends the release, placement decides the grant later."""
    s = _own_team()
    s.apply(ev.GpusReleased(at=3010, job_id="lo", reason="preempted"))
    assert s.state.handover == {"x": None}
    assert _granted(s.cycle(FULL_INSTANT, now=3011)) == ["x"]
    assert s.state.handover == {}


def test_the_turn_ends_with_the_first_grant_after_the_release():
    """A hand-over never reorders the queue later: once any grant follows the release, the job
    it was for goes by the queue again."""
    s = _own_team()
    s.apply(ev.GpusReleased(at=3010, job_id="lo", reason="preempted"))
    s.apply(ev.GpusGranted(at=3010, job_id="z", attempt=1, gpus=N0))
    assert s.state.handover == {}
    s.finish("z", at=4000)
    s.apply(ev.JobHeld(at=4000, job_id="x", user="ops", reason="test"))
    assert _granted(s.cycle(FULL_INSTANT, now=4000)) == ["lo"]  # x is held: the queue goes on


def test_a_held_beneficiary_gets_nothing():
    s = _own_team()
    s.apply(ev.JobHeld(at=3008, job_id="x", user="ops", reason="test"))
    out = s.cycle(FULL_INSTANT, now=3010)
    assert _granted(out) == ["z"]
    assert s.state.violations() == []


def test_a_gang_freed_by_two_victims_starts_when_the_second_releases():
    """The first release alone does not fit the gang; the second release is its next turn."""
    s = Scenario(racks=1, nodes=2)
    s.team("a", guaranteed=16)
    s.run("v1", gpus("r0n0", 0, 1, 2, 3), at=0, team="a", preemptible=True)
    s.run("v2", gpus("r0n0", 4, 5, 6, 7), at=0, team="a", preemptible=True)
    s.run("keep", N1, at=0, team="a", preemptible=False)
    s.submit("small", 4, team="a", at=500)
    s.submit("x", 8, team="a", at=1000, priority="high", required="node")
    out = s.cycle(FULL_INSTANT, now=1000)
    assert sorted(e.job_id for e in out if isinstance(e, ev.PreemptionRequested)) == ["v1", "v2"]
    s.checkpoint("v1", at=1010)
    out = s.cycle(FULL_INSTANT, now=1010)
    assert "x" not in _granted(out)
    s.checkpoint("v2", at=1020)
    out = s.cycle(FULL_INSTANT, now=1020)
    assert "x" in _granted(out)
    assert s.state.violations() == []
