"""The run-time predictor (policy/predict.py): determinism, bounded memory, monotone in
evidence, a user's time limit as an upper bound, no oracle; and the ETA range as shown."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.cli.render import eta_text
from gpusched.core import events as ev
from gpusched.policy.config import PRESETS
from gpusched.policy.cycle import cycle
from gpusched.policy.predict import FrozenEstimates, RuntimeHistory, RuntimePredictor
from gpusched.sim.engine import Cluster, Simulation
from gpusched.sim.runtime_model import IDEAL
from gpusched.sim.traces import TraceJob

from .policy_helpers import FULL_INSTANT, Scenario


def _finish(s: Scenario, job_id: str, start: float, run_s: float, gpus: int = 1, team: str = "a", **spec) -> None:
    s.run(job_id, [f"r0n0/{i}" for i in range(gpus)], at=start, team=team, **spec)
    s.now = start + run_s
    s.apply(ev.JobCompleted(at=start + run_s, job_id=job_id, attempt=1))


#: Submissions further apart than this are not one batch (`RuntimeHistory.sibling_window_s`).
_APART = 2 * RuntimeHistory().sibling_window_s


def _history(runs: list[float], team: str = "a") -> Scenario:
    """Completed jobs one after another, each submitted `_APART` after the last ended: separate
    experiments, so the answers come from the key's distribution, not from a batch."""
    s = Scenario(nodes=1)
    t = 0.0
    for i, r in enumerate(runs):
        _finish(s, f"done{i}", t, r, team=team)
        t += r + _APART
    s.now = t
    return s


def test_learns_from_completed_jobs_conditional_on_what_ran():
    s = _history([100.0 * (i + 1) for i in range(10)])  # 100 .. 1000 s
    s.submit("q", gpus=1, at=s.now)
    p = RuntimePredictor(s.state)
    fresh = p.estimate(s.state.jobs["q"], s.now)
    assert fresh.basis == "team+gpus" and fresh.samples == 10
    assert fresh.low_s <= fresh.remaining_s <= fresh.high_s
    assert fresh.remaining_s == pytest.approx(550.0)
    s.run("q", ["r0n0/0"], at=s.now)
    later = p.estimate(s.state.jobs["q"], s.now + 450.0)  # ran 450 s: only the 5 longer runs count
    assert s.now + 450.0 + later.remaining_s >= s.now + fresh.remaining_s  # its predicted end moved later
    assert later.samples == 6 or later.basis != "team+gpus"


def _batch_scene() -> Scenario:
    """Team a's 1-GPU jobs: ten old ones, six of 100 s and four of 20,000 s (a mixed key), then
    a batch of three 3,000 s runs submitted together, the last of which (`q`) still runs."""
    s = _history([100.0] * 6 + [20_000.0] * 4)
    t0 = s.now
    for i in range(2):
        s.submit(f"b{i}", at=t0 + i)
    s.submit("q", at=t0 + 2)
    for i in range(2):
        s.run(f"b{i}", [f"r0n0/{i}"], at=t0 + 10)
    s.run("q", ["r0n0/2"], at=t0 + 10)
    for i in range(2):
        s.apply(ev.JobCompleted(at=t0 + 3_010.0, job_id=f"b{i}", attempt=1))
    s.now = t0 + 3_010.0
    return s


def test_a_batch_runs_about_as_long_as_its_finished_siblings():
    """A running job whose batch-mates (same team and size, submitted with it) finished after
    3,000 s is predicted to end about when they did, not at the mixed key's median."""
    s = _batch_scene()
    p = RuntimePredictor(s.state)
    q = s.state.jobs["q"]
    e = p.estimate(q, s.now - 1_000.0)  # ran 2,000 s: its siblings ran 3,000 s
    assert e.basis.endswith("+batch") and e.remaining_s == pytest.approx(1_000.0)
    assert e.low_s <= e.remaining_s <= e.high_s
    without = RuntimeHistory(siblings=0)
    for jid in ("done0", "done1", "done2", "done3", "done4", "done5", "done6", "done7", "done8", "done9", "b0", "b1"):
        without.learn(s.state.jobs[jid])
    assert abs(without.estimate(q, s.now - 1_000.0).remaining_s - 1_000.0) > 5_000.0  # the key alone is far off


def test_siblings_that_ran_shorter_or_were_submitted_apart_do_not_count():
    s = _batch_scene()
    p = RuntimePredictor(s.state)
    q = s.state.jobs["q"]
    past = p.estimate(q, s.now + 1_000.0)  # ran 4,000 s: longer than its siblings, they say nothing
    assert not past.basis.endswith("+batch")
    later = Scenario(nodes=1)  # the same runs, but q submitted long after its would-be batch
    for jid in ("b0", "b1"):
        later.run(jid, ["r0n0/0"], at=later.now)
        later.now += 3_000.0
        later.apply(ev.JobCompleted(at=later.now, job_id=jid, attempt=1))
    later.run("q", ["r0n0/1"], at=later.now + _APART)
    e = RuntimePredictor(later.state).estimate(later.state.jobs["q"], later.now + _APART + 10.0)
    assert not e.basis.endswith("+batch")


def test_the_frozen_las_keys_keep_the_keys_median():
    """`las_predicted` orders by estimates frozen at queue time; they leave batches out (no
    better on the week), so that knob's order is what it was: a batch-mate of b0 and b1
    queued after they finished is keyed by the mixed key's median, not their 3,000 s."""
    s = _batch_scene()
    s.submit("late", at=s.now + 1.0)
    frozen = FrozenEstimates(RuntimePredictor(s.state, record=True))
    key_only = RuntimeHistory(siblings=0)
    for jid in [f"done{i}" for i in range(10)] + ["b0", "b1"]:
        key_only.learn(s.state.jobs[jid])
    job = s.state.jobs["late"]
    assert frozen.remaining_gpu_s(job) == pytest.approx(key_only.estimate(job, s.now).remaining_s) == 1_550.0
    ours = RuntimePredictor(s.state).estimate(job, s.now)  # the ETAs do use the batch
    assert ours.basis.endswith("+batch") and ours.remaining_s == pytest.approx(3_000.0)


def test_time_limit_bounds_every_answer():
    s = _history([5000.0] * 10)
    s.submit("q", gpus=1, at=s.now, time_limit_s=600.0)
    e = RuntimePredictor(s.state).estimate(s.state.jobs["q"], s.now)
    assert e.remaining_s <= 600.0 and e.high_s <= 600.0 and e.basis.endswith("+limit")


def test_beyond_every_known_run_time_is_a_wide_guess_not_a_crash():
    s = _history([100.0] * 10)
    s.run("q", ["r0n0/0"], at=s.now)
    e = RuntimePredictor(s.state).estimate(s.state.jobs["q"], s.now + 7200.0)
    assert e.basis == "lindy" and e.low_s == 0.0 and e.remaining_s == 7200.0 and e.uncertain


def test_incremental_learning_equals_a_fresh_build():
    """The predictor a cycle keeps (told of the jobs the cycle granted, updated now and then:
    jobs granted and completed between two updates) answers as one built from the whole fold."""
    s = Scenario(nodes=1)
    kept = RuntimePredictor(s.state)
    for i in range(30):
        start = 100.0 * i
        kept.watch([f"j{i}"])  # what `cycle.decide` does with the jobs it granted
        _finish(s, f"j{i}", start, 50.0 + 37.0 * (i % 7), team="ab"[i % 2])
        if i % 4 == 1:
            kept.update()
    kept.update()
    s.submit("q", team="a", at=s.now)
    fresh = RuntimePredictor(s.state)
    assert kept.history.learned == fresh.history.learned == 30
    assert kept.estimate(s.state.jobs["q"], s.now) == fresh.estimate(s.state.jobs["q"], s.now)


def test_memory_is_bounded():
    h = RuntimeHistory(keep=4, max_keys=16)
    s = Scenario(nodes=1)
    for i in range(200):
        _finish(s, f"j{i}", float(i), 10.0 + i, team=f"t{i % 50}")
        h.learn(s.state.jobs[f"j{i}"])
    assert len(h.by_key) <= 16 and all(len(d) <= 4 for d in h.by_key.values())
    assert set(h.by_submit) <= set(h.by_key) and all(len(v) <= 4 for v in h.by_submit.values())
    assert h.learned == 200


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(10.0, 1e5), min_size=1, max_size=20), st.data())
def test_monotone_in_evidence_and_deterministic(runs, data):
    """A longer run time in the history never shortens a pending job's prediction; the same
    history always gives the same answer."""
    i = data.draw(st.integers(0, len(runs) - 1))
    longer = list(runs)
    longer[i] = runs[i] + data.draw(st.floats(0.0, 1e5))
    answers = []
    for history in (runs, runs, longer):
        s = _history(history)
        s.submit("q", at=s.now)
        answers.append(RuntimePredictor(s.state).estimate(s.state.jobs["q"], s.now))
    assert answers[0] == answers[1]
    for field in ("remaining_s", "low_s", "high_s"):
        assert getattr(answers[2], field) >= getattr(answers[0], field) - 1e-6


def _sim(duration_of_x: float) -> Simulation:
    jobs = [TraceJob(f"h{i}", float(i), 100.0 + 10 * i, 1, "a") for i in range(12)]
    jobs.append(TraceJob("x", 500.0, duration_of_x, 1, "a"))
    sim = Simulation(jobs, Cluster.parse("1x1x8", "all"), PRESETS["full"], IDEAL)
    sim.run()
    return sim


def test_no_oracle_a_jobs_own_duration_never_changes_its_prediction():
    short, long = _sim(50.0), _sim(50_000.0)
    assert short.summary()["runtime_prediction"]["jobs"] == 13
    guesses = [g for g in (short.runtime_errors, long.runtime_errors)]
    assert guesses[0][:-1] == guesses[1][:-1]  # the others' errors alike, and x's guess alike:
    x_short = 50.0 - guesses[0][-1][0]
    x_long = 50_000.0 - guesses[1][-1][0]
    assert x_short == pytest.approx(x_long)


@pytest.mark.parametrize("eta, span, shown", [
    (None, None, "-"),
    (None, [60.0, 120.0], "-"),
    (1500.0, None, "25m00s"),
    (1500.0, [1200.0, 2700.0], "20–45 min"),
    (30.0, [0.0, 20.0], "0–1 min"),
    (9000.0, [3600.0, 18000.0], "1–5 h"),
    (9000.0, [1200.0, 18000.0], "20m00s–5h00m"),
    (200000.0, [90000.0, 400000.0], "1.0–4.6 d"),
])
def test_eta_rendering(eta, span, shown):
    assert eta_text(eta, span) == shown


def _backfill_scene(limit_s: float | None) -> Scenario:
    """One 8-GPU node. History: ten 4-GPU runs of team a, 9,000..18,000 s. `r` (4 GPUs, no
    limit) runs; `big` (8 GPUs on one node) waits for the node: its reservation has no known
    time. `small` (4 GPUs, not preemptible, so it cannot borrow) has the given limit."""
    s = Scenario(nodes=1)
    for i in range(10):
        _finish(s, f"done{i}", 20_000.0 * i, 9_000.0 + 1_000.0 * i, gpus=4)
    s.run("r", [f"r0n0/{i}" for i in range(4)], at=s.now)
    s.submit("big", gpus=8, required="node", at=s.now + 1)
    s.submit("small", gpus=4, at=s.now + 2, **({} if limit_s is None else {"time_limit_s": limit_s}))
    return s


@pytest.mark.parametrize("knob, limit_s, starts", [
    (False, 600.0, False),  # today: a reservation without a known time lends nothing to a limit
    (True, 600.0, True),  # ends long before r's earliest predicted end (~9,000 s from its start)
    (True, 50_000.0, False),  # its limit outlasts the prediction: it could delay big
    (True, None, False),  # no limit: nothing bounds the damage, it never backfills this way
])
def test_backfill_on_predicted_reservation(knob, limit_s, starts):
    s = _backfill_scene(limit_s)
    config = FULL_INSTANT.replace(backfill_predicted=knob)
    out = cycle(s.state, s.now + 10, config)
    granted = {e.job_id for e in out if isinstance(e, ev.GpusGranted)}
    assert granted == ({"small"} if starts else set())
