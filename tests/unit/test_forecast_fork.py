"""The plan's copy of the state (`forecast.fork`) shares only what the fold never edits: a
plan folds its own events (grants, preemptions, ends) into the copy, and the live state must
not see one of them."""

from __future__ import annotations

import msgspec
import pytest

from gpusched.core.state import ClusterState
from gpusched.policy import forecast as F
from gpusched.policy.steps import explain
from gpusched.sim.engine import Cluster
from gpusched.sim.report import runtime_model, simulate
from gpusched.sim.traces import load_trace

from .policy_helpers import Scenario, gpus

fork = F.fork


def _deep_fork(state: ClusterState, pending: list[str]) -> ClusterState:
    """The reference: the same selection, deep-copied through msgpack."""
    shallow = fork(state, pending)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(shallow), type=ClusterState)


def test_every_record_the_fold_edits_is_copied():
    s = Scenario(racks=1, nodes=2)
    s.run("r", gpus("r0n0", 0, 1), at=0.0, preemptible=True)
    s.submit("w", 8, at=10.0)
    live = s.state
    copy = fork(live, ["w"])
    assert msgspec.msgpack.encode(copy) == msgspec.msgpack.encode(_deep_fork(live, ["w"]))
    for name in ClusterState.__struct_fields__:
        value = getattr(live, name)
        if isinstance(value, (dict, list, msgspec.Struct)):
            assert getattr(copy, name) is not value, name
    assert all(copy.jobs[j] is not live.jobs[j] for j in copy.jobs)
    assert all(copy.gpus[g] is not live.gpus[g] for g in live.gpus)
    assert all(copy.nodes[n] is not live.nodes[n] and copy.nodes[n].free is not live.nodes[n].free
               for n in live.nodes)
    assert all(copy.teams[t] is not live.teams[t] for t in live.teams)
    assert all(copy.node_live[n] is not live.node_live[n] for n in live.node_live)


@pytest.mark.parametrize("policy", ["full", "tiresias"])
def test_plans_leave_the_live_state_untouched_and_match_a_deep_copy(monkeypatch, policy):
    """Every plan of a contended slice of the Philly week (preemptions, checkpoints, ends):
    the live state is byte-identical after it, and the plan is the one a deep copy makes."""
    plans = []

    def checked(state, now, config, predictor, cycle, first, prelude=(), **kw):
        before = msgspec.msgpack.encode(state)
        got = F.forecast(state, now, config, predictor, cycle, first, prelude, **kw)
        assert msgspec.msgpack.encode(state) == before
        with monkeypatch.context() as m:
            m.setattr(F, "fork", _deep_fork)
            ref = F.forecast(state, now, config, predictor, cycle, first, prelude, **kw)
        assert msgspec.msgpack.encode(got) == msgspec.msgpack.encode(ref)
        plans.append(got)
        return got

    monkeypatch.setattr(explain, "forecast", checked)
    sim = simulate(load_trace(limit=300), Cluster.parse("1x4x8"), policy, runtime_model("realistic"),
                   overrides={"eta_plan_every_s": "3600"})
    assert len(plans) >= 10 and any(p.starts for p in plans)
    assert sim.state.events > 0
