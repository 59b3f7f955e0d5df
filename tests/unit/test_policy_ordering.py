"""Which pending job goes first: priority, submission time, least attained service, fair share."""

from __future__ import annotations

import pytest

from gpusched.policy.config import PRESETS
from gpusched.policy.memo import Indexes
from gpusched.policy.ordering import ordered

from .policy_helpers import Scenario, gpus


def _order(s: Scenario, config, now=None) -> list[str]:
    return [j.job_id for j in ordered(s.state, s.now if now is None else now, config)]


def _fifo_queue(s: Scenario) -> None:
    s.submit("a", 1, at=1, priority="low")
    s.submit("b", 1, at=2, priority="high")
    s.submit("c", 1, at=3, priority="interactive")
    s.submit("d", 1, at=3, priority="high")


def _teams(s: Scenario) -> None:
    s.team("rich", guaranteed=2)
    s.team("poor", guaranteed=4)
    s.run("r1", gpus("r0n0", 0, 1, 2, 3), team="rich", at=0)
    s.submit("rich-hi", 1, team="rich", at=1, priority="interactive")
    s.submit("poor-lo", 1, team="poor", at=2, priority="low")
    s.submit("poor-2", 1, team="poor", at=3)


def _usage(s: Scenario) -> None:
    s.team("used", guaranteed=0)
    s.team("fresh", guaranteed=0)
    s.run("u", gpus("r0n0", 0), team="used", at=0)
    s.finish("u", at=1000)
    s.submit("used-1", 1, team="used", at=1001)
    s.submit("fresh-1", 1, team="fresh", at=1002)
    s.submit("used-2", 1, team="used", at=1003)


def _weights(s: Scenario) -> None:
    s.team("heavy", weight=4.0)
    s.team("light", weight=1.0)
    s.run("h", gpus("r0n0", 0, 1), team="heavy", at=0)
    s.run("l", gpus("r0n0", 2), team="light", at=0)
    s.submit("light-1", 1, team="light", at=1)
    s.submit("heavy-1", 1, team="heavy", at=2)


def _requeued(s: Scenario) -> None:
    s.submit("old", 1, at=1)
    s.submit("new", 1, at=5)
    s.run("old", gpus("r0n0", 0), at=6)
    s.apply(_release("old", 100))


def _las(s: Scenario) -> None:
    s.run("served", gpus("r0n0", 0, 1), at=0)
    s.apply(_release("served", 500))  # attained 1000 GPU-s, submitted first
    s.submit("new", 1, at=600)


def _release(job, at):
    from gpusched.core.events import GpusReleased

    return GpusReleased(at=at, job_id=job, reason="preempted")


# name: (setup, preset, knob changes, expected order)
CASES = {
    "fifo ignores priority": (_fifo_queue, "fifo", {}, ["a", "b", "c", "d"]),
    "priority classes, then submission time, then job id": (_fifo_queue, "preempt", {}, ["c", "b", "d", "a"]),
    "a team below its guaranteed share goes first, whatever the priority": (
        _teams, "fairshare", {}, ["poor-2", "poor-lo", "rich-hi"]),
    "then the team with the least decayed usage": (_usage, "fairshare", {}, ["fresh-1", "used-1", "used-2"]),
    "usage is divided by the team's weight": (_weights, "fairshare", {}, ["heavy-1", "light-1"]),
    "a requeued job keeps its submission time": (_requeued, "topo", {}, ["old", "new"]),
    "least attained service first among equal jobs": (_las, "topo", {"las": True}, ["new", "served"]),
    "without LAS, submission order": (_las, "topo", {}, ["served", "new"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_order(name):
    setup, preset, changes, want = CASES[name]
    s = Scenario(racks=1, nodes=1, half_life_s=3600.0)
    setup(s)
    assert _order(s, PRESETS[preset].replace(**changes)) == want


def test_index_follows_the_fold_incrementally_and_matches_a_fresh_sort():
    s = Scenario(racks=1, nodes=1)
    config = PRESETS["fairshare"].replace(las=True)
    for i in range(20):
        s.submit(f"j{i}", 1, team=f"t{i % 3}", at=i, priority=("low", "normal", "high")[i % 3])
    indexes = Indexes()  # one index kept across the steps, as a service keeps it across cycles
    for step in range(12):
        idx = indexes.queue(s.state, config)
        got = [j.job_id for j in idx.ordered(s.now, lambda t: s.state.teams[t].held)]
        assert got == _order(s, config)
        jid = got[step % len(got)]
        s.run(jid, [s.state.nodes["r0n0"].free and next(iter(s.state.nodes["r0n0"].free))], at=s.now + 1)
        if step % 2:
            s.apply(_release(jid, s.now + 2))
            s.now += 2
        else:
            s.finish(jid, s.now + 2)
            s.now += 2
