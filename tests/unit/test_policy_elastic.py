"""Elastic jobs: start small when space is short, grow into idle GPUs, shrink before preemption."""

from __future__ import annotations

import pytest

from gpusched.core import events as ev

from .policy_helpers import Scenario, gpus
from .test_policy_preemption import summary


def _short(s):
    s.run("x", gpus("r0n0", *range(8)) + gpus("r0n1", 0, 1, 2, 3))
    s.submit("el", 8, min_gpus=2, at=1)


def _too_short(s):
    s.run("x", gpus("r0n0", *range(8)) + gpus("r0n1", 0, 1, 2, 3, 4, 5, 6))
    s.submit("el", 8, min_gpus=2, at=1)


def _grow(s):
    s.run("el", gpus("r0n0", 0, 1, 2, 3), size=8, min_gpus=2)


def _no_grow_while_waiting(s):
    s.run("el", gpus("r0n0", 0, 1, 2, 3), size=8, min_gpus=2)
    s.run("x", gpus("r0n1", *range(8)))
    s.submit("wait", 8, at=1)


def _grow_to_limit(s):
    s.team("capped", limit=6)
    s.run("el", gpus("r0n0", 0, 1, 2, 3), size=8, min_gpus=2, team="capped")


def _shrink(s):
    s.run("el", gpus("r0n0", *range(8)) + gpus("r0n1", 0, 1, 2, 3), size=12, min_gpus=4, at=0)
    s.run("lo", gpus("r0n1", 4, 5, 6, 7), at=0, priority="low", preemptible=True)
    s.submit("hi", 8, at=1000, priority="high")


def _preempted_then_shrunk(s):
    # "big" cannot be served by el's extra GPUs and preempts el (checkpoint: in flight); "small"
    # must not then shrink el: its GPUs are already promised, and a job is touched once a cycle.
    s.run("el", gpus("r0n0", *range(8)), size=8, min_gpus=2, at=0, priority="low", preemptible=True)
    s.run("x", gpus("r0n1", *range(8)), at=0)
    s.submit("big", 8, at=1000, priority="interactive", required="node")
    s.submit("small", 2, at=1000)


def _shared_shrink(s):
    # two blocked jobs, one elastic job: it gives back what each needs, the second JobResized
    # accounting for the GPUs already taken back for the first one.
    s.run("el", gpus("r0n0", *range(8)), size=8, min_gpus=2, at=0)
    s.run("x", gpus("r0n1", *range(8)), at=0)
    s.submit("a", 2, at=1000)
    s.submit("b", 2, at=1001)


# name: (setup, want decisions at t=1000, want GPUs held by "el" after)
CASES = {
    "starts with what fits when space is short": (_short, [("grant", "el")], 4),
    "below its minimum it waits": (_too_short, [], 0),
    "grows into idle GPUs, its own node first": (_grow, [("resize", "el", 4)], 8),
    "does not grow while a job that could use the GPUs waits": (_no_grow_while_waiting, [], 4),
    "grows no further than its team's limit": (_grow_to_limit, [("resize", "el", 2)], 6),
    "shrinks to its minimum before anyone is preempted": (_shrink, [("resize", "el", -8), ("grant", "hi")], 4),
    "a job asked to yield is not also shrunk in the same cycle": (_preempted_then_shrunk, [("preempt", "el", "big")], 8),
    "two blocked jobs share one job's extras: one JobResized each (emitted events are never edited), "
    "each GPU granted once": (
        _shared_shrink, [("resize", "el", -2), ("grant", "a"), ("resize", "el", -2), ("grant", "b")], 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_elastic(name):
    setup, want, held = CASES[name]
    s = Scenario(racks=1, nodes=2)
    setup(s)
    out = s.cycle("full", now=max(1000, s.now))
    assert summary(out) == want
    assert len(s.state.jobs["el"].gpus) == held
    assert s.state.violations() == []
    given = [g for e in out if isinstance(e, ev.GpusGranted) for g in e.gpus]
    given += [g for e in out if isinstance(e, ev.JobResized) for g in e.added]
    assert len(given) == len(set(given))


def test_growth_stays_near_the_job():
    s = Scenario(racks=2, nodes=2)
    s.run("el", gpus("r1n1", 0, 1), size=8, min_gpus=2)
    out = s.cycle("full", now=10)
    added = next(e for e in out if isinstance(e, ev.JobResized)).added
    assert added == gpus("r1n1", 2, 3, 4, 5, 6, 7)
