"""Fairness over a horizon (issue 26, `fair_owed_after_s`, `starve_after_s`): teams take turns by
the LAS level of their next job, then by decayed usage relative to their entitlement; a team
below its guarantee is owed (first in line, reclaims) once its oldest job has waited
`fair_owed_after_s`; a team's oldest job leads its team once it has waited `starve_after_s`."""

from __future__ import annotations

import pytest

from gpusched.policy.config import PRESETS
from gpusched.sim.engine import Cluster, Simulation
from gpusched.sim.runtime_model import IDEAL
from gpusched.sim.traces import TraceJob

from .policy_helpers import Scenario, gpus
from .test_policy_preemption import summary

HOUR = 3600.0
# run-time predictions off: whom reclaim may take is the rule's question here, not the predictor's
HORIZON = PRESETS["full"].replace(fair_owed_after_s=HOUR, starve_after_s=24 * HOUR, preempt_predicted=False)
OLD = PRESETS["full"].replace(fair_owed_after_s=None, starve_after_s=None, preempt_predicted=False)
N0, N1 = gpus("r0n0", *range(8)), gpus("r0n1", *range(8))


def _borrowed(s):
    # a ran ahead (the whole cluster for 20,000 s); then b borrows a's half (preemptible, since
    # 20,000), and a asks for 8 GPUs at 21,000
    s.team("a", guaranteed=8)
    s.team("b", guaranteed=8)
    s.run("a0", N0 + N1, team="a", at=0)
    s.finish("a0", 20000)
    s.run("b1", N0, team="b", at=20000, preemptible=True)
    s.run("b2", N1, team="b", at=20000, preemptible=True)
    s.submit("a1", 8, team="a", at=21000)


def _borrowed_behind(s):
    # the same, but a never ran ahead: it is owed at once
    s.team("a", guaranteed=8)
    s.team("b", guaranteed=8)
    s.run("b1", N0, team="b", at=0, preemptible=True)
    s.run("b2", N1, team="b", at=0, preemptible=True)
    s.submit("a1", 8, team="a", at=1000)


def _short_first(s):
    # one GPU comes free; a (below its guarantee, ahead over the horizon) offers a job that
    # already ran an hour on 1 GPU (LAS level 1), b (over its own) a fresh one: the short job
    # goes first, a is not yet owed
    s.team("a", guaranteed=8)
    s.team("b", guaranteed=4)
    s.run("a9", N1, team="a", at=0)  # a ran ahead: a whole node for an hour
    s.finish("a9", 3600)
    s.run("b1", N0, team="b", at=7000)
    s.run("a0", gpus("r0n1", 0), team="a", at=3600, preemptible=True)
    s.submit("a2", 7, team="a", at=7200)
    s.preempt("a0", "a2", at=7200)
    s.checkpoint("a0", at=7200)
    s.run("a2", gpus("r0n1", *range(1, 8)), team="a", at=7200)
    s.submit("b2", 1, team="b", at=7300, preemptible=True)


def _owed_first(s):
    # the same, once a0 has waited an hour: a is owed, its job goes first
    _short_first(s)


def _usage_at_equal_level(s):
    # two fresh 1-GPU jobs, one free GPU, neither team below its guarantee: the team that used
    # less of its entitlement over the horizon goes first (a: 8 of 8, b: 7 of 4), though b used
    # fewer GPU-seconds
    s.team("a", guaranteed=8)
    s.team("b", guaranteed=4)
    s.run("a1", N0, team="a", at=0)
    s.run("b1", gpus("r0n1", *range(7)), team="b", at=0)
    s.finish("a1", 3600)
    s.run("a2", N0, team="a", at=3600)
    s.submit("z", 1, team="a", at=7000)
    s.submit("y", 1, team="b", at=7000)


def _low_starved(s):
    # a's low-priority job waits behind its team's normal jobs until it has waited a day
    s.team("a", guaranteed=16)
    s.run("a0", N0, team="a", at=0)
    s.run("a1", gpus("r0n1", *range(7)), team="a", at=0)
    s.submit("low", 1, team="a", at=0, priority="low")
    s.submit("n1", 1, team="a", at=100)


CASES = {
    "second by second (old rule): a team below its guarantee reclaims at once": (
        _borrowed, OLD, 21000, [("preempt", "b1", "a1")]),
    "over a horizon: a team that ran ahead reclaims not before its oldest job waited the owed time": (
        _borrowed, HORIZON, 21000, []),
    "... then it reclaims": (_borrowed, HORIZON, 21000 + HOUR, [("preempt", "b1", "a1")]),
    "a team that did not run ahead is owed at once": (_borrowed_behind, HORIZON, 1000, [("preempt", "b1", "a1")]),
    "a team's short job runs ahead of a team below its guarantee that is not owed": (
        _short_first, HORIZON, 7300, [("grant", "b2")]),
    "(old rule: the team below its guarantee goes first)": (_short_first, OLD, 7300, [("grant", "a0")]),
    "an owed team goes first": (_owed_first, HORIZON, 7200 + HOUR, [("grant", "a0")]),
    "at equal LAS level: less usage relative to entitlement first": (
        _usage_at_equal_level, HORIZON, 7000, [("grant", "z")]),
    "within a team, priority first before the starvation bound": (_low_starved, HORIZON, 1000, [("grant", "n1")]),
    "after it, the team's oldest job leads its queue": (_low_starved, HORIZON, 24 * HOUR, [("grant", "low")]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_horizon(name):
    setup, config, now, want = CASES[name]
    s = Scenario(racks=1, nodes=2)
    setup(s)
    out = s.cycle(config, now=now)
    assert [d for d in summary(out) if d[0] != "release"] == want
    assert s.state.violations() == []


def _job(job_id, submit, duration, gpus, team) -> TraceJob:
    return TraceJob(job_id=job_id, submit_s=submit, duration_s=duration, gpus=gpus, team=team, preemptible=True)


def test_a_guaranteed_team_gets_its_gpus_back_within_the_bound():
    """The starvation bound, end to end: a runs ahead (16 GPUs for 10 h), then b floods the 16
    GPUs with long 1-GPU jobs; a's demand (guaranteed 8) comes back 1000 s later in 8 one-GPU
    jobs. a is owed an hour later and reclaims then: its GPUs come back within the owed time
    plus `min_runtime_s` plus the checkpoint grace."""
    from gpusched.core.model import TeamQuota

    jobs = [_job(f"e{i}", 0, 10 * HOUR, 1, "a") for i in range(16)]
    jobs += [_job(f"b{i}", 10 * HOUR + 1, 40 * HOUR, 1, "b") for i in range(24)]
    back = 10 * HOUR + 1000
    jobs += [_job(f"a{i}", back, HOUR, 1, "a") for i in range(8)]
    quotas = {"a": TeamQuota(guaranteed=8), "b": TeamQuota(guaranteed=8)}
    sim = Simulation(jobs, Cluster.parse("1x2x8"), HORIZON, IDEAL, policy_name="horizon", quotas=quotas)
    m = sim.run()
    bound = HOUR + HORIZON.min_runtime_s + HORIZON.checkpoint_grace_s
    short = m["guarantee_wait"]["team_shortfall"]
    assert short["count"] >= 1 and HOUR <= short["max_s"] <= bound
    assert max(sim.runs[f"a{i}"].first_start for i in range(8)) - back <= bound
    assert sim.state.violations() == []
    assert sum(r.preemptions for r in sim.runs.values()) >= 1  # the GPUs came back by reclaim
