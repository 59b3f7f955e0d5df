"""ETAs from a plan of the queue (policy/forecast.py): the policy's own cycle run forward on a
copy of the state with predicted run times, bounded in jobs, cycles and horizon."""

from __future__ import annotations

import msgspec
import pytest

from gpusched.core import events as ev
from gpusched.policy.config import PRESETS
from gpusched.policy.cycle import cycle
from gpusched.policy.forecast import forecast
from gpusched.policy.memo import Indexes
from gpusched.policy.predict import RuntimePredictor
from gpusched.policy.steps import explain
from gpusched.sim.engine import Cluster, Simulation
from gpusched.sim.runtime_model import IDEAL
from gpusched.sim.traces import TraceJob, load_trace

from .policy_helpers import Scenario, gpus

FULL = PRESETS["full"]


def _scene() -> Scenario:
    """One 8-GPU node. History: eight 1-GPU jobs of team a that each ran 1000 s. Now (t=8100)
    `x` (8 GPUs, team a, started at 8000) runs; `big` (8) then `small` (4) and `tiny` (4) wait."""
    s = Scenario(racks=1, nodes=1)
    for i in range(8):
        s.run(f"done{i}", gpus("r0n0", 0), at=i * 1000.0)
        s.apply(ev.JobCompleted(at=i * 1000.0 + 1000.0, job_id=f"done{i}", attempt=1))
    s.run("x", gpus("r0n0", *range(8)), at=8000.0)
    s.submit("big", 8, at=8050.0)
    s.submit("small", 4, at=8060.0)
    s.submit("tiny", 4, at=8070.0)
    s.now = 8100.0
    return s


def _plan(s: Scenario, first: list[str], **kw):
    idx = Indexes()
    return forecast(s.state, s.now, FULL.replace(eta_plan_every_s=None), RuntimePredictor(s.state),
                    lambda st, t, c: cycle(st, t, c, idx), first, **kw)


def test_the_plan_follows_the_policy_with_predicted_run_times():
    s = _scene()
    f = _plan(s, ["big", "small", "tiny"])
    # Run times are learned per GPU count first, then per team: x (8 GPUs) falls back to the
    # team's 1000 s (it ran 100): it ends at 9000; big (8 GPUs, same answer) runs 9000..10000;
    # small and tiny then start together.
    assert f.complete and f.cycles >= 3
    assert f.starts["big"].at == pytest.approx(9000.0)
    assert f.starts["small"].at == pytest.approx(10000.0)
    assert f.starts["tiny"].at == pytest.approx(10000.0)
    assert f.starts["big"].low <= f.starts["big"].at <= f.starts["big"].high


def test_the_plan_is_pure_and_deterministic():
    s = _scene()
    before = s.state.snapshot()
    a, b = _plan(s, ["big", "small", "tiny"]), _plan(s, ["big", "small", "tiny"])
    assert msgspec.to_builtins(a) == msgspec.to_builtins(b)
    assert s.state.snapshot() == before  # the fold is untouched: the plan runs on a copy


@pytest.mark.parametrize("kw, planned", [
    (dict(max_cycles=1), set()),  # nothing starts in the first cycle (x holds the node)
    (dict(horizon_s=500.0), set()),  # x ends 900 s from now: beyond the horizon
    (dict(horizon_s=1000.0), {"big"}),
])
def test_the_plan_is_bounded(kw, planned):
    s = _scene()
    f = _plan(s, ["big", "small", "tiny"], **kw)
    assert set(f.starts) == planned and not f.complete


def test_the_plan_is_bounded_in_jobs():
    s = _scene()
    f = _plan(s, ["big"])  # the rest of the queue is left out of the copy
    assert set(f.starts) == {"big"} and f.pending == 1


def test_cycle_says_every_planned_eta_and_keeps_the_plan_between_plans():
    s = _scene()
    idx = Indexes()
    cfg = FULL.replace(eta_plan_every_s=1800.0, eta_plan_horizon_s=3600.0)
    out = cycle(s.state, s.now, cfg, idx)
    s.apply(*out)
    said = {e.job_id: e for e in out if isinstance(e, ev.JobPending)}
    assert said["big"].eta_s == pytest.approx(900.0)
    assert said["small"].eta_s == pytest.approx(1900.0) and said["tiny"].eta_s == pytest.approx(1900.0)
    made = idx.forecast_
    assert made is not None and made.made_at == s.now
    # Within the plan's age the same plan answers, and an unmoved ETA is not said again.
    out = cycle(s.state, s.now + 60.0, cfg, idx)
    assert idx.forecast_ is made
    assert not [e for e in out if isinstance(e, ev.JobPending)]
    # Once it is as old as `eta_plan_every_s`, a new plan is made.
    cycle(s.state, s.now + 1800.0, cfg, idx)
    assert idx.forecast_ is not made and idx.forecast_.made_at == s.now + 1800.0


def test_a_plan_uses_the_live_predictor_and_never_learns_from_its_own_guesses(monkeypatch):
    """The plan's cycles (on a copy of the state) ask the live fold's predictor as it learned:
    a fresh one per plan relearned the whole history each time, and learned the plan's
    predicted ends as if they were history."""
    made: list[RuntimePredictor] = []
    init = RuntimePredictor.__init__

    def counting(self, *args, **kw):
        made.append(self)
        init(self, *args, **kw)

    monkeypatch.setattr(RuntimePredictor, "__init__", counting)
    # `x` preemptible and in a later LAS queue than the waiting jobs: the plan's cycles search
    # victims, and the restraint (`preempt_predicted`) asks the predictor there
    s = Scenario(racks=1, nodes=1)
    for i in range(8):
        s.run(f"done{i}", gpus("r0n0", 0), at=i * 1000.0)
        s.apply(ev.JobCompleted(at=i * 1000.0 + 1000.0, job_id=f"done{i}", attempt=1))
    s.run("x", gpus("r0n0", *range(8)), at=8000.0, preemptible=True)
    s.submit("small", 4, at=8500.0)
    s.submit("tiny", 4, at=8510.0)
    idx = Indexes()
    cycle(s.state, 8600.0, FULL.replace(eta_plan_every_s=1800.0, eta_plan_horizon_s=3600.0), idx)
    assert idx.forecast_ is not None and idx.forecast_.cycles >= 2  # the plan ran the policy forward
    assert made == [idx.predictor_]  # one predictor: the live one (a fresh one per plan: 2)


@pytest.mark.parametrize("stale_s, replanned", [(900.0, True), (None, False)])
def test_a_plan_that_went_wrong_is_made_again(stale_s, replanned):
    """The plan says big starts at 9000, when x's predicted end frees the node; x runs on.
    Past 9000 with big still waiting, the plan is wrong: it is made again once it is
    `eta_replan_stale_s` old, and big is told its new start (x now ran longer than
    any run time known: the Lindy guess, as long again). Without the knob, the plan waits out
    its period."""
    s = _scene()
    idx = Indexes()
    cfg = FULL.replace(eta_plan_every_s=1800.0, eta_plan_horizon_s=3600.0, eta_replan_stale_s=stale_s)
    out = cycle(s.state, s.now, cfg, idx)
    s.apply(*out)
    made = idx.forecast_
    assert made is not None and made.starts["big"].at == pytest.approx(9000.0)
    cycle(s.state, 8900.0, cfg, idx)
    assert idx.forecast_ is made  # not wrong yet
    out = cycle(s.state, 9100.0, cfg, idx)
    said = {e.job_id: e.eta_s for e in out if isinstance(e, ev.JobPending)}
    if replanned:
        assert idx.forecast_ is not made and idx.forecast_.made_at == 9100.0
        assert said["big"] == pytest.approx(1100.0)
    else:
        assert idx.forecast_ is made and "big" not in said


def test_without_the_plan_only_the_head_has_an_eta():
    s = _scene()
    out = cycle(s.state, s.now, FULL.replace(eta_plan_every_s=None), Indexes())
    etas = {e.job_id for e in out if isinstance(e, ev.JobPending) and e.eta_s is not None}
    assert etas <= {"big"}


def test_an_eta_beyond_the_horizon_is_not_said():
    s = _scene()
    out = cycle(s.state, s.now, FULL.replace(eta_plan_horizon_s=1800.0), Indexes())
    etas = {e.job_id: e.eta_s for e in out if isinstance(e, ev.JobPending)}
    assert etas["big"] == pytest.approx(900.0) and etas["small"] is None and etas["tiny"] is None


def test_an_empty_plan_is_made_again_when_jobs_come():
    s = Scenario(racks=1, nodes=1)
    s.run("x", gpus("r0n0", *range(8)), at=0.0)
    idx = Indexes()
    cycle(s.state, 10.0, FULL, idx)
    empty = idx.forecast_
    assert empty is not None and empty.first == []
    s.submit("y", 8, at=100.0)
    cycle(s.state, 100.0, FULL, idx)
    assert idx.forecast_ is empty  # not at once (arrivals come in bursts)
    cycle(s.state, 400.0, FULL, idx)
    assert idx.forecast_ is not empty and idx.forecast_.first == ["y"]


def test_the_same_start_said_again_is_scored_once():
    """The sim scores each distinct estimate a job was shown: the same start said again with a
    new reason is one estimate; a moved start is another; the first of the wait is kept apart."""
    sim = Simulation([TraceJob("b", 0.0, 100.0, 1, "x")], Cluster.parse("1x1x8"), PRESETS["full"], IDEAL)
    for at, reason, eta in [(0.0, "r1", 100.0), (10.0, "r2", 90.0), (20.0, "r3", 200.0), (30.0, "r4", 190.0)]:
        sim._react(ev.JobPending(at=at, job_id="b", reason=reason, eta_s=eta), at, [])
    sim._shown(ev.GpusGranted(at=150.0, job_id="b", attempt=2, gpus=["r0n0/0"]), 150.0)
    assert sim.eta_errors == [pytest.approx(50.0), pytest.approx(-70.0)]
    assert sim.eta_first == [pytest.approx(50.0)] and sim.eta_ahead == [100.0, 200.0]


def test_a_plan_skips_the_explain_step_and_plans_the_same_starts(monkeypatch):
    """A plan's cycles skip `explain` (their reasons and ETAs feed no decision): on a saturated
    slice of the Philly week every ETA said, and every decision, is what plans whose cycles
    explain give."""
    jobs = load_trace(limit=300)
    explain_run = explain.run

    def run() -> tuple[list, int]:
        events: list = []
        forked = [0]  # explain steps run on a plan's copy of the state
        sim = Simulation(jobs, Cluster.parse("1x4x8"), FULL, IDEAL)
        apply = sim._apply

        def counting(plan, ctx, cycle=None):
            forked[0] += ctx.state is not sim.state
            return explain_run(plan, ctx, cycle)
        monkeypatch.setattr(explain, "run", counting)
        monkeypatch.setattr(sim, "_apply", lambda e: (events.append(e), apply(e))[1])
        sim.run()
        return events, forked[0]

    skipped, forked = run()
    assert forked == 0
    monkeypatch.setattr(explain, "_FORK_SKIPS", ())
    explained, forked = run()
    assert forked > 20  # the plans' cycles explained
    etas = [e for e in skipped if isinstance(e, ev.JobPending) and e.eta_s is not None]
    assert len(etas) > 20 and skipped == explained
