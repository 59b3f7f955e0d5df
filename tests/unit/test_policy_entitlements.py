"""The team contract's promises (issue 26): what a guarantee, a hard limit and a reservation owe
each other. Each row failed on the code before the issue."""

from __future__ import annotations

import pytest

from .policy_helpers import Scenario, gpus
from .test_policy_preemption import summary

NODES = [gpus(f"r0n{i}", *range(8)) for i in range(4)]


def _elastic_under_guarantee(s):
    # vision holds 8 of its 16 (an elastic job 8, minimum 6); nlp holds 24 of 16 and wants 2
    s.team("vision", guaranteed=16)
    s.team("nlp", guaranteed=16)
    s.run("el", NODES[0], size=8, min_gpus=6, team="vision", at=0)
    for i in (1, 2, 3):
        s.run(f"n{i}", NODES[i], team="nlp", at=0)
    s.submit("x", 2, team="nlp", at=1000)


def _elastic_over_guarantee(s):
    # the same elastic job, its team now over its guarantee: the extras go to a team under its own
    s.team("vision", guaranteed=4)
    s.team("nlp", guaranteed=28)
    s.run("el", NODES[0], size=8, min_gpus=6, team="vision", at=0)
    for i in (1, 2, 3):
        s.run(f"n{i}", NODES[i], team="nlp", at=0)
    s.submit("x", 2, team="nlp", at=1000)


def _firm_beyond_guarantee(s):
    # a holds its whole guarantee with a non-preemptible job; a second one would hold b's guarantee
    s.team("a", guaranteed=16)
    s.team("b", guaranteed=16)
    s.run("a1", NODES[0] + NODES[1], team="a", at=0)
    s.submit("a2", 8, team="a", at=1000)
    s.submit("a3", 8, team="a", at=1000, preemptible=True)


def _firm_in_slack(s):
    # guarantees leave 8 GPUs nobody is guaranteed: a non-preemptible job may use them
    s.team("a", guaranteed=16)
    s.team("b", guaranteed=8)
    s.run("a1", NODES[0] + NODES[1], team="a", at=0)
    s.submit("a2", 8, team="a", at=1000)


def _firm_slack_taken(s):
    # ... but only once: b's guarantee stays reclaimable
    _firm_in_slack(s)
    s.cycle("full", now=1000)
    s.submit("a4", 8, team="a", at=1000)


def _firm_never_fits(s):
    # a non-preemptible job its guarantee (plus the slack) could never hold is not barred for ever
    s.team("a", guaranteed=8)
    s.team("b", guaranteed=24)
    s.submit("a1", 16, team="a", at=1000)


def _limit_head(s):
    # 4x8, nlp --limit 32: a 24-GPU job (limit 120 s), then a 32-GPU head H, then 8-GPU jobs of
    # 60 s and 600 s. The 60-s one ends before H is due and may start; the 600-s one may not.
    s.team("nlp", limit=32)
    s.run("big", NODES[0] + NODES[1] + NODES[2], team="nlp", at=0, time_limit_s=120)
    s.submit("H", 32, team="nlp", at=1)
    s.submit("short", 8, team="nlp", at=2, time_limit_s=60)
    s.submit("long", 8, team="nlp", at=3, time_limit_s=600)
    s.cycle("full", now=3)
    s.finish("short", 63)


def _limit_head_due(s):
    _limit_head(s)
    s.cycle("full", now=63)
    s.finish("big", 120)


def _reserved_head_room(s):
    # nlp --limit 8: its 8-GPU head H (one node) reserves r0n0 (o1 ends at 120); a later 4-GPU
    # job of nlp with no time limit fits outside the reserved GPUs, but would leave H at its limit
    s.team("nlp", limit=8)
    s.run("o1", NODES[0], team="other", at=0, time_limit_s=120)
    s.run("o2", NODES[1] + NODES[2] + gpus("r0n3", 0, 1, 2, 3), team="other", at=0)
    s.submit("H", 8, team="nlp", at=1, required="node")
    s.submit("long", 4, team="nlp", at=2)

def _entitled_past_reservation(s):
    # free (guarantee 0) leads the queue with a 16-GPU head and reserves 16 GPUs; prod, at its
    # guarantee, submits an interactive 4-GPU job: the borrowing head does not hold it off
    s.team("prod", guaranteed=16)
    s.team("free", guaranteed=0)
    s.team("other", guaranteed=8)
    s.run("p1", NODES[0] + NODES[1], team="prod", at=0)
    s.run("f1", NODES[2], team="free", at=0, preemptible=True)
    s.submit("head", 16, team="free", at=10, preemptible=True)
    s.submit("inter", 4, team="prod", at=20, priority="interactive")


def _big_borrower(s):
    # b (guarantee 16) borrows with one preemptible 32-GPU gang; a (guarantee 16) asks for its 16.
    # Taking the gang leaves b 16 below its guarantee, as far as a is now: the no-ping-pong rule
    # kept it, so a's guarantee was never reclaimable from a gang bigger than its owner's guarantee.
    s.team("a", guaranteed=16)
    s.team("b", guaranteed=16)
    s.run("b1", NODES[0] + NODES[1] + NODES[2] + NODES[3], team="b", at=0, preemptible=True)
    s.submit("a1", 16, team="a", at=1000)


def _big_borrower_yielded(s):
    # ... and the GPUs it frees go to a1, although b leads the queue (0 of 16, its job older)
    _big_borrower(s)
    s.cycle("full", now=1000)
    s.checkpoint("b1", 1010)


# name: (setup, now, want decisions)
CASES = {
    "a team under its guarantee is never shrunk for a team over its own": (_elastic_under_guarantee, 1000, []),
    "a team over its guarantee gives its elastic extras": (
        _elastic_over_guarantee, 1000, [("resize", "el", -2), ("grant", "x")]),
    "a non-preemptible job runs only within its guarantee: a borrower must be preemptible": (
        _firm_beyond_guarantee, 1000, [("grant", "a3")]),
    "a non-preemptible job may use GPUs nobody is guaranteed": (_firm_in_slack, 1000, [("grant", "a2")]),
    "... once: the other team's guarantee stays reclaimable": (_firm_slack_taken, 1001, []),
    "a non-preemptible job larger than its guarantee and the slack is not starved": (
        _firm_never_fits, 1000, [("grant", "a1")]),
    "a job at its team's hard limit keeps its team's room: a later job that outlasts it waits": (
        _limit_head, 63, []),
    "... and it starts when the room comes": (_limit_head_due, 120, [("grant", "H")]),
    "a reserved head keeps its team's room too: a later job of its team that outlasts it waits": (
        _reserved_head_room, 3, []),
    "a reservation does not outrank an entitlement": (_entitled_past_reservation, 20, [("grant", "inter")]),
    "a guarantee is reclaimable from a borrowing gang bigger than its own team's guarantee": (
        _big_borrower, 1000, [("preempt", "b1", "a1")]),
    "... and what it frees goes to the job it was freed for": (
        _big_borrower_yielded, 1010, [("release", "b1", False), ("grant", "a1")]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_entitlements(name):
    setup, now, want = CASES[name]
    s = Scenario(racks=1, nodes=4)
    setup(s)
    out = s.cycle("full", now=now)
    assert summary(out) == want
    assert s.state.violations() == []


def test_a_firm_job_beyond_its_guarantee_says_why():
    from gpusched.core.reasons import BeyondGuarantee  # new in issue 26: the rows above run on older code too

    s = Scenario(racks=1, nodes=4)
    _firm_beyond_guarantee(s)
    s.cycle("full", now=1000)
    assert isinstance(s.state.jobs["a2"].pending_why, BeyondGuarantee)
    assert "only preemptible jobs may borrow" in s.state.jobs["a2"].pending_reason
