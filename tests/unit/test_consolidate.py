"""Consolidation (policy/steps/consolidate.py): a blocked head that must run within one node,
while enough GPUs are free but scattered, moves small jobs off the node nearest to holding it
onto free GPUs elsewhere, and the hand-over gives it the node; bound by the rules every
preemption is (class, back-off, the fold's fairness rule) and only where the movers have room."""

from __future__ import annotations

from gpusched.core import events as ev

from .policy_helpers import FULL_INSTANT, Scenario, gpus

N0, N1 = gpus("r0n0", *range(8)), gpus("r0n1", *range(8))
ON = FULL_INSTANT.replace(consolidate=True)


def _scene(free_on_n0: int = 2, mover_team: str = "a", mover_priority: str = "normal") -> Scenario:
    """r0n0: `keep` (not preemptible) and `s1`, `free_on_n0` GPUs free; r0n1: `s2` and `s3`
    (1 GPU each, preemptible), 6 free. `h` needs 8 GPUs on one node: 8 are free, on no node."""
    s = Scenario(racks=1, nodes=2)
    s.team("a", guaranteed=0)
    s.team("b", guaranteed=2)
    s.run("s1", N0[:1], at=0, team="a", preemptible=True)
    s.run("keep", N0[1:8 - free_on_n0], at=0, team="a", preemptible=False)
    s.run("s2", N1[:1], at=0, team=mover_team, preemptible=True, priority=mover_priority)
    s.run("s3", N1[1:2], at=0, team=mover_team, preemptible=True, priority=mover_priority)
    s.submit("h", 8, team="a", at=900, required="node")
    return s


def _asked(events) -> list[tuple[str, str]]:
    return [(e.job_id, e.for_job) for e in events if isinstance(e, ev.PreemptionRequested)]


def test_small_jobs_move_off_the_nearest_node_and_the_head_takes_it():
    s = _scene()
    out = s.cycle(ON, now=1000)
    assert sorted(_asked(out)) == [("s2", "h"), ("s3", "h")]
    s.checkpoint("s2", at=1010)
    s.checkpoint("s3", at=1010)
    s.cycle(ON, now=1010)  # released, and the node handed over
    jobs = s.state.jobs
    assert sorted(jobs["h"].gpus) == N1
    s.cycle(ON, now=1010)  # the movers, back in the queue, restart on the GPUs that were free
    assert sorted(jobs["s2"].gpus + jobs["s3"].gpus) == N0[6:]
    assert s.state.violations() == []


def test_without_the_knob_the_head_waits():
    """`full` as shipped: nothing preempts for `h` (same LAS queue, no guarantee to reclaim)."""
    out = _scene().cycle(FULL_INSTANT, now=1000)
    assert _asked(out) == [] and not [e for e in out if isinstance(e, ev.GpusGranted)]


def test_no_move_without_room_for_the_movers_elsewhere():
    assert _asked(_scene(free_on_n0=1).cycle(ON, now=1000)) == []


def test_a_job_of_a_higher_class_is_not_moved_for_the_head():
    assert _asked(_scene(mover_priority="high").cycle(ON, now=1000)) == []


def test_the_fold_fairness_rule_holds_for_moves():
    """Team b holds 2 GPUs, its guarantee: it is never preempted for team a, over its own."""
    assert _asked(_scene(mover_team="b").cycle(ON, now=1000)) == []


def test_a_job_within_its_back_off_is_not_moved():
    s = _scene()
    assert _asked(s.cycle(ON, now=200)) == []  # before min_runtime_s (300 s) since their start
