"""Reservation for the blocked head job, and backfill that can never delay it."""

from __future__ import annotations

import pytest

from gpusched.core import events as ev

from .policy_helpers import FULL_INSTANT, Scenario, gpus, grants

#: `full` with the head's ETA from its reservation, what these tests check (the ETAs of the
#: plan of the queue: test_forecast.py).
FULL = FULL_INSTANT.replace(eta_plan_every_s=None)

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


def _being_freed(s: Scenario) -> None:
    """The head's set is free or being freed: half of n0 is idle, the other half is held by a
    job already asked to yield for the head (deadline t=50)."""
    s.run("v", gpus("r0n0", 0, 1, 2, 3), at=0, priority="low", preemptible=True)
    s.run("y", N1, at=0)
    s.run("z", N2, at=0)
    s.submit("big", 8, at=1, required="node")
    s.apply(ev.PreemptionRequested(at=5, job_id="v", for_job="big", reason="preempted for big", deadline=50.0))


# name: (nodes, setup, candidate job kwargs, want started?,
#        want head: its eta_s while it waits reserved, or the start of its reason)
CASES = {
    "ends before the reservation by its time limit: backfills": (
        3, _known_ends, dict(gpus=4, time_limit_s=50.0), True, 90.0),
    "would run past the reservation: waits": (3, _known_ends, dict(gpus=4, time_limit_s=500.0), False, 90.0),
    "no time limit, not preemptible: waits": (3, _known_ends, dict(gpus=4), False, 90.0),
    "fits outside the reserved set: backfills": (4, _room_outside, dict(gpus=4), True, 90.0),
    "too big for the room outside: waits": (4, _room_outside, dict(gpus=6), False, 90.0),
    # x frees its half at 100; the borrower is asked then and yields within the grace (60 s)
    "preemptible and over its share: borrows the reservation": (
        3, _known_ends, dict(gpus=4, preemptible=True), True, 150.0),
    "unknown ends: the reservation accumulates, no eta": (3, _unknown_ends, dict(gpus=4), False, None),
    # Borrowing a set that is free or coming free now would only push the head back by the
    # borrower's checkpoint: the GPUs are the head's.
    "the reservation is due (its GPUs are being freed): no borrowing": (
        3, _being_freed, dict(gpus=4, preemptible=True, required="node"), False, "preempted 1 job(s) for it"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_backfill(name):
    nodes, setup, cand, want_started, want_head = CASES[name]
    s = Scenario(racks=1, nodes=nodes)
    setup(s)
    s.submit("cand", at=2, **cand)
    out = s.cycle(FULL, now=10)
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
    if isinstance(want_head, str):
        assert big.pending_reason.startswith(want_head), big.pending_reason
    else:
        assert "GPUs reserved" in big.pending_reason and big.pending_eta_s == want_head


def test_borrowed_reservation_is_taken_back_as_soon_as_the_head_could_start():
    # The mechanism alone: with predictions, x's 100 s run (the whole history) would predict
    # the borrower ends first and leave it to finish (test_policy_preemption.py, PREDICTED_CASES).
    full = FULL.replace(preempt_predicted=False)
    s = Scenario(racks=1, nodes=3)
    _known_ends(s)
    s.submit("borrow", 4, at=2, preemptible=True)
    assert "borrow" in grants(s.cycle(full, now=10))
    assert not [e for e in s.cycle(full, now=45) if isinstance(e, ev.PreemptionRequested)]
    s.finish("x", at=100)  # the head now fits, but for the borrowed GPUs
    asked = [e for e in s.cycle(full, now=100) if isinstance(e, ev.PreemptionRequested)]
    assert [(e.job_id, e.for_job, e.deadline) for e in asked] == [("borrow", "big", 160.0)]
    s.checkpoint("borrow", at=110)
    out = s.cycle(full, now=110)
    assert [(type(e).__name__, e.job_id) for e in out if not isinstance(e, ev.JobPending)] == [
        ("GpusReleased", "borrow"), ("GpusGranted", "big")]
    assert s.state.violations() == []


def test_the_reserved_head_starts_when_its_set_frees():
    s = Scenario(racks=1, nodes=3)
    _unknown_ends(s)
    s.submit("small", 4, at=2)
    s.cycle(FULL, now=10)
    s.finish("x", at=20)
    out = s.cycle(FULL, now=20)
    assert list(grants(out)) == ["big"]  # small still may not delay it
    assert s.state.violations() == []


# --- convergence: cycles at one instant (checkpoints are instant) must come to rest ----------


def _other_head_would_hand_back(s: Scenario) -> None:
    """The Philly livelock (t=340549 s, ideal runtime) in miniature. Team a (guarantee 7) holds
    4, so it goes first: its 8-GPU head waits with a reservation on n0. Its preemptible 4-GPU job
    p backfills n1; team a is now over its guarantee, so the next cycle b's 4-GPU job heads the
    queue. Evicting p for it would put team a under its guarantee again: a's head would lead,
    and a's q would backfill the freed GPUs, not b's job. So p stays (before the fix: p is
    evicted, q starts, q is evicted, p starts... without end)."""
    s.team("a", guaranteed=7)
    s.team("b", guaranteed=2)
    s.team("c", guaranteed=0)
    s.run("x", N0, at=0, team="c")  # the head's reservation waits for it (unknown end)
    s.run("a0", gpus("r0n1", 0, 1, 2, 3), at=0, team="a")
    s.run("b0", gpus("r0n2", 0, 1, 2, 3), at=0, team="b")
    s.run("c0", gpus("r0n2", 4, 5, 6, 7), at=0, team="c")
    s.submit("head", 8, team="a", at=1, required="node")
    s.submit("other", 4, team="b", at=2, required="node")
    s.submit("p", 4, team="a", at=3, required="node", preemptible=True)
    s.submit("q", 4, team="a", at=4, required="node", preemptible=True)


def _borrower_of_the_heads_team(s: Scenario) -> None:
    """Team a (guarantee 16) holds 4 (x, on n0), team b (guarantee 20) holds 8: a goes first and
    its 8-GPU head reserves n0. a's preemptible job p borrows the idle half of n0, and a now
    ranks after b: b's 4-GPU job heads the queue. Taking p back for it would rank a first again
    (a's head would lead, p borrow again, b's job take it back...): it waits. When x ends, a's
    head leads, takes its loan back and starts: the loan did not push it back."""
    s.team("a", guaranteed=16)
    s.team("b", guaranteed=20)
    s.run("x", gpus("r0n0", 0, 1, 2, 3), at=0, team="a")
    s.run("y", N1, at=0, team="b")
    s.submit("head", 8, team="a", at=1, required="node")
    s.submit("other", 4, team="b", at=2, required="node")
    s.submit("p", 4, team="a", at=3, required="node", preemptible=True)


def _borrower_yields_when_due(s: Scenario) -> None:
    s.finish("x", at=s.now)


# name: (nodes, setup, want running at rest, want preempted at all, then: change, want running at rest)
CONVERGE = {
    "no eviction for a head that would rank the borrower's team first again (Philly livelock)": (
        3, _other_head_would_hand_back, {"p"}, [], None, None),
    "a borrower of the head's team stays until its own head is due, whoever leads meanwhile": (
        2, _borrower_of_the_heads_team, {"p"}, [], _borrower_yields_when_due, {"head"}),
}


def _until_rest(s: Scenario, now: float, most: int = 12) -> list[str]:
    """Cycles at one instant, every preempted job checkpointing at once (the ideal runtime),
    until a cycle decides nothing and nothing is in flight. Returns the jobs preempted."""
    preempted: list[str] = []
    for _ in range(most):
        for jid in list(s.state.running):
            if s.state.jobs[jid].preemption is not None:
                s.checkpoint(jid, at=now)
        out = s.cycle(FULL, now=now)
        assert s.state.violations() == []
        preempted += [e.job_id for e in out if isinstance(e, ev.PreemptionRequested)]
        busy = [e for e in out if not isinstance(e, ev.JobPending)]
        if not busy and not any(s.state.jobs[j].preemption is not None for j in s.state.running):
            return preempted
    raise AssertionError(f"no rest after {most} cycles at t={now}: preempted {preempted}")


@pytest.mark.parametrize("name", list(CONVERGE))
def test_cycles_at_one_instant_come_to_rest(name):
    nodes, setup, want_running, want_preempted, change, want_after = CONVERGE[name]
    s = Scenario(racks=1, nodes=nodes)
    setup(s)
    before = set(s.state.running)
    assert _until_rest(s, 1000.0) == want_preempted
    assert set(s.state.running) - before == want_running
    if change is not None:
        before = set(s.state.running)
        change(s)
        _until_rest(s, s.now)
        # the head's reserved GPUs were lent, not given: it starts as soon as they free
        assert set(s.state.running) - before == want_after


# --- the walk stops once every free GPU is the head's: a long queue costs nothing per cycle ---

def _queue_behind_a_reservation(tail: dict, ends: dict) -> Scenario:
    """Two nodes, 14 of 16 GPUs held (unknown ends), a 10-GPU head whose reservation holds the
    2 free GPUs, and 300 jobs of 2 and 4 GPUs behind it; `tail`: the spec of one more job at the
    very end (a timed or preemptible one may still start on the reservation); `ends`: the
    running jobs' time limit, if any (the reservation's start is then known)."""
    s = Scenario(nodes=2)
    s.run("x", gpus("r0n0", *range(8)), at=0, **ends)
    s.run("y", gpus("r0n1", *range(6)), at=0, **ends)
    s.submit("head", 10, at=1)
    for i in range(300):
        s.submit(f"q{i:03d}", 2 + 2 * (i % 2), at=2 + i)
    if tail:
        s.submit("last", 2, at=400, **tail)
    return s


@pytest.mark.parametrize("tail, ends, stops", [
    ({}, {}, True),
    ({"preemptible": True}, {}, False),  # it may borrow the reservation
    ({"time_limit_s": 10.0}, {}, True),  # the reservation's start is unknown: a time limit cannot help
    ({"time_limit_s": 10.0}, {"time_limit_s": 1000.0}, False),  # it ends before the reservation is due
], ids=["plain", "preemptible-last", "timed-last-unknown-ends", "timed-last-known-ends"])
def test_walk_stops_when_only_the_reservation_is_free_and_decides_the_same(tail, ends, stops, monkeypatch):
    from gpusched.policy import cycle as cycle_mod
    from gpusched.policy.steps import walk

    considered: list[str] = []
    consider = walk._consider

    def counting(plan, ctx, job):
        considered.append(job.job_id)
        return consider(plan, ctx, job)

    monkeypatch.setattr(walk, "_consider", counting)
    s = _queue_behind_a_reservation(tail, ends)
    fast = cycle_mod.decide(s.state, s.now, FULL)
    fast_considered = len(considered)
    monkeypatch.setattr(walk, "_all_reserved", lambda plan, ctx, idx: False)  # the whole queue, as before
    considered.clear()
    full = cycle_mod.decide(s.state, s.now, FULL)
    # the same decisions; the reasons of the jobs the walk did not reach come in job id order
    assert [e for e in fast.events if not isinstance(e, ev.JobPending)] == \
        [e for e in full.events if not isinstance(e, ev.JobPending)]
    assert sorted(e.job_id for e in fast.events) == sorted(e.job_id for e in full.events)
    assert {e.job_id: e for e in fast.events} == {e.job_id: e for e in full.events}
    assert {j: r for j, (r, _) in fast.reasons.items()} == {j: r for j, (r, _) in full.reasons.items()}
    assert len(considered) >= 300
    if stops:
        assert fast_considered < 20  # stopped as soon as reclaim had enough blocked jobs
    else:
        assert fast_considered >= 300  # a job that may use the reservation is still reached


def test_a_budget_of_tail_reasons_explains_the_queue_over_several_cycles_to_the_same_reasons():
    from gpusched.policy.cycle import cycle
    from gpusched.policy.memo import Indexes

    full = _queue_behind_a_reservation({}, {})
    budgeted = _queue_behind_a_reservation({}, {})
    for e in cycle(full.state, full.now, FULL_INSTANT, Indexes()):
        full.state.apply(e)
    indexes = Indexes(tail_reasons=50)
    sizes = []
    for _ in range(10):
        out = cycle(budgeted.state, budgeted.now, FULL_INSTANT, indexes)
        sizes.append(sum(isinstance(e, ev.JobPending) for e in out))
        for e in out:
            budgeted.state.apply(e)
    assert sizes[0] <= 50 + 20  # the walk's own reasons, then at most 50 of the rest
    assert sizes[-1] == 0  # all explained: nothing changes any more
    assert {j: (job.pending_reason, job.pending_blockers) for j, job in budgeted.state.jobs.items()} == \
        {j: (job.pending_reason, job.pending_blockers) for j, job in full.state.jobs.items()}


@pytest.mark.parametrize("setup", [_known_ends, _unknown_ends, _being_freed])
def test_the_holders_of_some_jobs_are_the_same_entries_in_the_same_order_as_among_all(setup):
    """`freed_at` asks `holders` for the reserved set's holders only (`only`): the entries and
    their order must be those of every holder, filtered (the order decides which borrower the
    head evicts first)."""
    from gpusched.policy import cycle as cycle_mod
    from gpusched.policy.steps.reservation import holders

    s = Scenario(racks=1, nodes=4)
    setup(s)
    s.submit("borrow", 4, at=2, preemptible=True)
    s.run("late", gpus("r0n3", 0, 1), at=3, time_limit_s=30.0)
    s.run("later", gpus("r0n3", 2, 3), at=4)
    plan = cycle_mod.decide(s.state, 10.0, FULL)
    every = [(end, job.job_id, gpus) for end, job, gpus in holders(plan, plan.ctx)]
    assert len(every) >= 4
    ids = [jid for _, jid, _ in every]
    for only in ({ids[0]}, {ids[-1]}, set(ids[1::2]), set(ids), {"not-a-holder"}):
        assert [(end, job.job_id, gpus) for end, job, gpus in holders(plan, plan.ctx, only)] == \
            [h for h in every if h[1] in only]
