"""Whom to preempt, and the checkpoint handshake that follows."""

from __future__ import annotations

import pytest

from gpusched.core import events as ev

from .policy_helpers import Scenario, gpus

N0, N1 = gpus("r0n0", *range(8)), gpus("r0n1", *range(8))


def summary(events) -> list[tuple]:
    out = []
    for e in events:
        if isinstance(e, ev.PreemptionRequested):
            out.append(("preempt", e.job_id, e.for_job))
        elif isinstance(e, ev.GpusReleased):
            out.append(("release", e.job_id, e.forced))
        elif isinstance(e, ev.GpusGranted):
            out.append(("grant", e.job_id))
        elif isinstance(e, ev.JobResized):
            out.append(("resize", e.job_id, len(e.added) - len(e.removed)))
    return out


def _priority(s):
    s.run("lo", N0, at=0, priority="low", preemptible=True)
    s.run("keep", N1, at=0)
    s.submit("hi", 8, at=1000, priority="high")


def _non_preemptible(s):
    s.run("lo", N0, at=0, priority="low")
    s.run("keep", N1, at=0)
    s.submit("hi", 8, at=1000, priority="high")


def _equal(s):
    s.run("lo", N0, at=0, preemptible=True)
    s.run("keep", N1, at=0)
    s.submit("hi", 8, at=1000)


def _young(s):
    s.run("lo", N0, at=900, priority="low", preemptible=True)
    s.run("keep", N1, at=0)
    s.submit("hi", 8, at=1000, priority="high")


def _least_lost(s):
    s.run("a", N0, at=0, priority="low", preemptible=True)
    s.run("b", N1, at=0, priority="low", preemptible=True)
    s.checkpoint("b", at=990)
    s.submit("hi", 8, at=1000, priority="high")


def _smallest_set(s):
    s.run("a", gpus("r0n0", 0, 1, 2, 3), at=0, priority="low", preemptible=True)
    s.run("b", gpus("r0n0", 4, 5, 6, 7), at=0, priority="low", preemptible=True)
    s.run("c", N1, at=0, priority="low", preemptible=True)
    s.checkpoint("c", at=999)
    s.submit("hi", 8, at=1000, priority="high")


def _reclaim(s):
    s.team("poor", guaranteed=8)
    s.team("rich", guaranteed=0)
    s.run("r1", N0, at=0, team="rich", preemptible=True)
    s.run("r2", N1, at=10, team="rich", preemptible=True)
    s.submit("p", 8, team="poor", at=1000)


def _protected(s):
    s.team("owner", guaranteed=16)
    s.team("greedy", guaranteed=0)
    s.run("o1", N0, at=0, team="owner", priority="low", preemptible=True)
    s.run("o2", N1, at=0, team="owner", priority="low", preemptible=True)
    s.submit("g", 8, team="greedy", at=1000, priority="high")


def _furthest_over(s):
    s.team("a", guaranteed=4)
    s.team("b", guaranteed=0)
    s.team("c", guaranteed=16)
    s.run("ja", N0, at=0, team="a", priority="low", preemptible=True)
    s.run("jb", N1, at=0, team="b", priority="low", preemptible=True)
    s.checkpoint("jb", at=999)  # cheaper, but team a is further over... no: a is 4 over, b 8 over
    s.submit("hi", 8, team="c", at=1000, priority="high")


def _required_node(s):
    s.run("a", gpus("r0n0", 0, 1, 2, 3), at=0, priority="low", preemptible=True)
    s.run("k0", gpus("r0n0", 6, 7), at=0)
    s.run("b", gpus("r0n1", 0, 1), at=0, priority="low", preemptible=True)
    s.run("k1", gpus("r0n1", 2, 3, 4, 5, 6, 7), at=0)
    s.checkpoint("b", at=999)  # the cheapest victim, but its node cannot hold the gang
    s.submit("hi", 6, at=1000, priority="high", required="node")


# name: (setup, preset, want decisions of the cycle at t=1000)
CASES = {
    "higher priority preempts a lower-priority preemptible job (killed, no checkpoint)": (
        _priority, "preempt", [("preempt", "lo", "hi"), ("release", "lo", True), ("grant", "hi")]),
    "non-preemptible jobs are never victims": (_non_preemptible, "preempt", []),
    "equal priority does not preempt": (_equal, "preempt", []),
    "a job just (re)started is protected by min_runtime_s": (_young, "preempt", []),
    "least work lost since the last checkpoint first": (
        _least_lost, "preempt", [("preempt", "b", "hi"), ("release", "b", True), ("grant", "hi")]),
    "fewest victims for the same need": (
        _smallest_set, "preempt", [("preempt", "c", "hi"), ("release", "c", True), ("grant", "hi")]),
    "a team below its guarantee reclaims from a team over its own": (
        _reclaim, "fairshare", [("preempt", "r2", "p"), ("release", "r2", True), ("grant", "p")]),
    "a team at its guarantee is never preempted for a team over its own": (_protected, "fairshare", []),
    "teams furthest over their share first": (
        _furthest_over, "fairshare", [("preempt", "jb", "hi"), ("release", "jb", True), ("grant", "hi")]),
    "required topology: victims free one node": (
        _required_node, "preempt", [("preempt", "a", "hi"), ("release", "a", True), ("grant", "hi")]),
    "checkpoint handshake: ask and wait": (_priority, "full", [("preempt", "lo", "hi")]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_preemption(name):
    setup, preset, want = CASES[name]
    s = Scenario(racks=1, nodes=2)
    setup(s)
    out = s.cycle(preset, now=1000)
    assert summary(out) == want
    assert s.state.violations() == []
    if want and want[0][0] == "preempt":
        req = next(e for e in out if isinstance(e, ev.PreemptionRequested))
        assert req.reason.startswith(f"preempted for {want[0][2]}")


def test_checkpointed_job_is_released_and_the_waiting_job_starts():
    s = Scenario(racks=1, nodes=2)
    _priority(s)
    req = next(e for e in s.cycle("full", now=1000) if isinstance(e, ev.PreemptionRequested))
    assert req.deadline == 1060.0
    assert summary(s.cycle("full", now=1010)) == []  # waiting, and no second request
    assert s.state.jobs["hi"].pending_blockers == ["lo"]
    s.checkpoint("lo", at=1020)
    out = s.cycle("full", now=1020)
    assert summary(out) == [("release", "lo", False), ("grant", "hi")]
    assert s.state.jobs["lo"].lost_gpu_s == 0.0 and s.state.jobs["lo"].state == "pending"
    assert s.state.violations() == []


def test_overdue_preemption_is_forced_and_counts_the_lost_work():
    s = Scenario(racks=1, nodes=2)
    _priority(s)
    s.checkpoint("lo", at=500)
    s.cycle("full", now=1000)
    out = s.cycle("full", now=1060)
    assert summary(out) == [("release", "lo", True), ("grant", "hi")]
    rel = next(e for e in out if isinstance(e, ev.GpusReleased))
    assert rel.lost_gpu_s == 8 * (1060 - 500)
    assert s.state.violations() == []
