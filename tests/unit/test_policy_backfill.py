"""Reservation for the blocked head job, and backfill that can never delay it."""

from __future__ import annotations

import pytest

from gpusched.core import events as ev

from .policy_helpers import Scenario, gpus, grants

N0, N1, N2, N3 = (gpus(f"r0n{i}", *range(8)) for i in range(4))


def _known_ends(s: Scenario) -> None:
    s.run("x", N0, at=0, time_limit_s=100.0)
    s.run("y", N1, at=0, time_limit_s=1000.0)
    s.submit("big", 16, at=1)


def _room_outside(s: Scenario) -> None:
    s.run("x", N0, at=0, time_limit_s=100.0)
    s.run("y", N1, at=0, time_limit_s=1000.0)
    s.run("z", gpus("r0n2", 0, 1, 2, 3), at=0, time_limit_s=1000.0)
    s.submit("big", 16, at=1)


def _unknown_ends(s: Scenario) -> None:
    s.run("x", N0, at=0)
    s.run("y", N1, at=0)
    s.submit("big", 16, at=1)


# name: (nodes, setup, candidate job kwargs, want started?, want head eta_s)
CASES = {
    "ends before the reservation by its time limit: backfills": (
        3, _known_ends, dict(gpus=4, time_limit_s=50.0), True, 90.0),
    "would run past the reservation: waits": (3, _known_ends, dict(gpus=4, time_limit_s=500.0), False, 90.0),
    "no time limit, not preemptible: waits": (3, _known_ends, dict(gpus=4), False, 90.0),
    "fits outside the reserved set: backfills": (4, _room_outside, dict(gpus=4), True, 90.0),
    "too big for the room outside: waits": (4, _room_outside, dict(gpus=6), False, 90.0),
    "preemptible and over its share: borrows the reservation": (
        3, _known_ends, dict(gpus=4, preemptible=True), True, 90.0),
    "unknown ends: the reservation accumulates, no eta": (3, _unknown_ends, dict(gpus=4), False, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_backfill(name):
    nodes, setup, cand, want_started, want_eta = CASES[name]
    s = Scenario(racks=1, nodes=nodes)
    setup(s)
    s.submit("cand", at=2, **cand)
    out = s.cycle("full", now=10)
    assert s.state.violations() == []
    started = grants(out)
    assert ("cand" in started) == want_started
    assert "big" not in started
    if want_started:
        assert s.state.jobs["cand"].backfill
    else:
        # a stable reason: no job id in it, nothing in blockers (the head names what it waits for)
        assert s.state.jobs["cand"].pending_reason == "would delay the GPUs reserved for the head of the queue"
        assert s.state.jobs["cand"].pending_blockers == []
    big = s.state.jobs["big"]
    assert "GPUs reserved" in big.pending_reason and big.pending_eta_s == want_eta


def test_borrowed_reservation_is_taken_back_as_soon_as_the_head_could_start():
    s = Scenario(racks=1, nodes=3)
    _known_ends(s)
    s.submit("borrow", 4, at=2, preemptible=True)
    assert "borrow" in grants(s.cycle("full", now=10))
    assert not [e for e in s.cycle("full", now=45) if isinstance(e, ev.PreemptionRequested)]
    s.finish("x", at=100)  # the head now fits, but for the borrowed GPUs
    asked = [e for e in s.cycle("full", now=100) if isinstance(e, ev.PreemptionRequested)]
    assert [(e.job_id, e.for_job, e.deadline) for e in asked] == [("borrow", "big", 160.0)]
    s.checkpoint("borrow", at=110)
    out = s.cycle("full", now=110)
    assert [(type(e).__name__, e.job_id) for e in out if not isinstance(e, ev.JobPending)] == [
        ("GpusReleased", "borrow"), ("GpusGranted", "big")]
    assert s.state.violations() == []


def test_the_reserved_head_starts_when_its_set_frees():
    s = Scenario(racks=1, nodes=3)
    _unknown_ends(s)
    s.submit("small", 4, at=2)
    s.cycle("full", now=10)
    s.finish("x", at=20)
    out = s.cycle("full", now=20)
    assert list(grants(out)) == ["big"]  # small still may not delay it
    assert s.state.violations() == []
