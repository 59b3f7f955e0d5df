"""One cycle per preset: what starts, what waits and why; reasons only when they change."""

from __future__ import annotations

import pytest

from gpusched.core import events as ev
from gpusched.policy.config import PRESETS
from gpusched.policy.cycle import cycle, naive_cycle

from .policy_helpers import FULL_INSTANT, Scenario, gpus, grants, pinned


def _big_head(s: Scenario) -> None:
    s.run("x", gpus("r0n0", 0, 1, 2, 3))
    s.submit("big", 16, at=1)
    s.submit("small", 2, at=2)


def _limit(s: Scenario) -> None:
    s.team("capped", limit=4)
    s.run("x", gpus("r0n0", 0, 1, 2), team="capped")
    s.submit("over", 2, team="capped", at=1)
    s.submit("other", 2, team="b", at=2)


def _same_cycle(s: Scenario) -> None:
    for i in range(5):
        s.submit(f"j{i}", 4, at=i)


# name: (setup, preset, want started {job: level or None}, want pending {job: reason prefix})
CASES = {
    "fifo: the head blocks everything behind it": (
        _big_head, "fifo", {}, {"big": "waiting for 16 GPUs; 12 free", "small": "queued behind earlier jobs"}),
    "gang: a job that does not fit does not block the ones behind it": (
        _big_head, "gang", {"small": "nvlink"}, {"big": "waiting for 16 GPUs; 10 free"}),
    "full: the small job may not take the head's reservation": (
        _big_head, FULL_INSTANT, {}, {"big": "waiting for 16 GPUs; 12 free; GPUs reserved", "small": "would delay"}),
    "never over a team's hard limit": (
        _limit, "fairshare", {"other": None}, {"over": "team capped at its limit 4"}),
    "grants within one cycle never reuse a GPU": (
        _same_cycle, "topo", {"j0": None, "j1": None, "j2": None, "j3": None}, {"j4": "waiting for 4 free GPUs"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cycle(name):
    setup, preset, want_started, want_pending = CASES[name]
    s = Scenario(racks=1, nodes=2)
    setup(s)
    out = s.cycle(preset)
    assert s.state.violations() == []
    started = grants(out)
    assert set(started) == set(want_started)
    for job, level in want_started.items():
        if level is not None:
            assert s.state.jobs[job].level == level
    for job, prefix in want_pending.items():
        assert s.state.jobs[job].pending_reason.startswith(prefix), s.state.jobs[job].pending_reason
    # Nothing changed: the next cycle appends nothing, not even a JobPending.
    assert s.cycle(preset) == []


@pytest.mark.parametrize("preset, want", [
    ("gang", gpus("r0n0", 0, 1, 2, 3)),  # naive: the first free GPUs, breaking the whole free node
    ("topo", gpus("r0n1", 2, 3, 4, 5)),  # topology: the partly used node, r0n0 stays whole
])
def test_naive_takes_the_first_free_gpus_and_topology_keeps_a_whole_node_free(preset, want):
    s = Scenario(racks=1, nodes=2)
    s.run("x", gpus("r0n1", 0, 1))
    s.submit("four", 4, at=1)
    assert grants(s.cycle(preset))["four"] == want
    assert s.state.violations() == [] and s.state.jobs["four"].level == "nvlink"


def test_topology_vs_naive_placement_of_a_small_gang():
    naive, topo = Scenario(racks=1, nodes=2), Scenario(racks=1, nodes=2)
    for s in (naive, topo):
        s.run("x", gpus("r0n0", 0, 1, 2, 3, 4, 5))
        s.submit("four", 4, at=1)
    assert grants(naive.cycle("gang"))["four"] == gpus("r0n0", 6, 7) + gpus("r0n1", 0, 1)
    assert grants(topo.cycle("topo"))["four"] == gpus("r0n1", 0, 1, 2, 3)
    assert naive.state.jobs["four"].level == "rack" and topo.state.jobs["four"].level == "nvlink"


def test_pending_reason_is_appended_only_when_it_changes():
    s = Scenario(racks=1, nodes=1)
    s.run("x", gpus("r0n0", *range(8)), time_limit_s=100.0)
    s.submit("a", 4, at=1)
    s.submit("b", 4, at=2)
    first = s.cycle("topo")
    assert [e.job_id for e in first if isinstance(e, ev.JobPending)] == ["a", "b"]
    assert s.cycle("topo", now=5) == []
    s.submit("c", 4, at=6)
    assert [e.job_id for e in s.cycle("topo") if isinstance(e, ev.JobPending)] == ["c"]


def test_naive_cycle_is_fifo_with_gangs_first_free_and_marks_its_grants():
    s = Scenario(racks=1, nodes=2)
    s.run("x", gpus("r0n0", 0, 1, 2, 3, 4, 5))
    s.submit("big", 16, at=1)
    s.submit("four", 4, at=2)
    out = naive_cycle(s.state, 3.0)
    g = [e for e in out if isinstance(e, ev.GpusGranted)]
    assert [(e.job_id, e.placer, e.gpus) for e in g] == [("four", "naive", gpus("r0n0", 6, 7) + gpus("r0n1", 0, 1))]
    assert not any(isinstance(e, (ev.PreemptionRequested, ev.GpusReleased)) for e in out)


def test_presets_tell_the_story_one_step_at_a_time():
    # the story, then the peer's policy for calibration (issue 12)
    assert list(PRESETS) == ["fifo", "gang", "topo", "preempt", "fairshare", "full", "tiresias"]
    p = PRESETS
    assert p["tiresias"].las and p["tiresias"].las_preempt and p["tiresias"].las_queues_gpu_s
    assert not p["tiresias"].topology and not p["tiresias"].fairshare and not p["tiresias"].priority
    assert p["fifo"].strict_fifo and not p["fifo"].topology and not p["fifo"].preemption
    assert not p["gang"].strict_fifo and not p["gang"].topology
    assert p["topo"].topology and not p["topo"].preemption
    assert p["preempt"].preemption and p["preempt"].priority and not p["preempt"].fairshare
    assert p["fairshare"].fairshare and not p["fairshare"].checkpoint
    assert p["full"].checkpoint and p["full"].elastic and p["full"].backfill


def test_cycle_does_not_mutate_the_state():
    s = Scenario(racks=1, nodes=2)
    s.run("x", gpus("r0n0", 0, 1))
    s.submit("a", 8, at=1, preemptible=True)
    s.submit("b", 12, at=2, priority="high")
    before = s.state.snapshot()
    cycle(s.state, 3.0, PRESETS["full"])
    assert s.state.snapshot() == before


def _head_changes(s: Scenario) -> None:
    s.run("x", gpus("r0n0", *range(8)), at=0, time_limit_s=100.0)
    s.run("y", gpus("r0n1", *range(8)), at=0, time_limit_s=1000.0)
    s.submit("big", 16, at=1)
    s.submit("big2", 16, at=2)
    for i in range(6):
        s.submit(f"small{i}", 2, at=3 + i)


def _head_will_start(s: Scenario) -> None:
    s.run("x", gpus("r0n0", *range(8)), at=0, time_limit_s=100.0)
    s.run("u", gpus("r0n2", 0, 1, 2, 3), at=0, time_limit_s=100.0)
    s.run("y", gpus("r0n1", *range(8)), at=0, time_limit_s=1000.0)
    s.submit("big", 16, at=1)
    s.submit("big2", 16, at=2)
    for i in range(6):
        s.submit(f"small{i}", 8, at=3 + i)


def _head_cancelled(s: Scenario) -> None:
    s.apply(ev.JobCancelled(at=20, job_id="big", reason="user"))


def _head_started(s: Scenario) -> None:
    s.finish("x", at=100)
    s.finish("u", at=100)


# name: (setup, cluster nodes, first cycle at, change, next cycle at, want JobPending of the next cycle)
REASON_CASES = {
    "a new head re-explains only itself, not every job behind it": (
        _head_changes, 3, 10, _head_cancelled, 20, ["big2"]),
    "the head starts: the next head and nobody else gets a new reason": (
        _head_will_start, 4, 10, _head_started, 100, ["big2"]),
}


@pytest.mark.parametrize("name", list(REASON_CASES))
def test_reasons_behind_the_head_are_stable(name):
    setup, nodes, t0, change, t1, want = REASON_CASES[name]
    s = Scenario(racks=1, nodes=nodes)
    setup(s)
    s.cycle(FULL_INSTANT, now=t0)
    small = s.state.jobs["small0"]
    assert small.pending_reason == "would delay the GPUs reserved for the head of the queue"
    assert small.pending_blockers == []
    change(s)
    out = s.cycle(FULL_INSTANT, now=t1)
    assert s.state.jobs["big"].state != "pending"  # the head changed
    assert [e.job_id for e in out if isinstance(e, ev.JobPending)] == want
    assert s.state.violations() == []


@pytest.mark.parametrize("preset, want_eta", [("topo", None), ("full", 490.0)])
def test_the_head_names_the_jobs_it_waits_for(preset, want_eta):
    s = Scenario(racks=1, nodes=2)
    s.run("x", gpus("r0n0", *range(8)), at=0, time_limit_s=100.0)
    s.run("y", gpus("r0n1", 0, 1, 2, 3), at=0, time_limit_s=500.0)
    s.submit("big", 16, at=1)
    s.cycle(pinned(preset).replace(eta_plan_every_s=None), now=10)  # the reservation's ETA (the plan's: test_forecast.py)
    big = s.state.jobs["big"]
    assert big.pending_reason.startswith("waiting for 16 GPUs; 4 free")
    assert big.pending_blockers == ["x", "y"]
    assert big.pending_eta_s == want_eta  # only a protected reservation has a time


# --- cost: a long queue of jobs alike costs one placement, not one each ----------------------


def _scattered(s: Scenario, pending: int, **spec) -> None:
    """Every node runs a 7-GPU job (one GPU free per node); `pending` jobs that fit no node."""
    for n in range(4):
        s.run(f"x{n}", gpus(f"r0n{n}", *range(7)), at=0)
    for i in range(pending):
        s.submit(f"p{i:03d}", gpus=2 + 2 * (i % 2), at=1 + i, required="node", **spec)


# name: (preset, pending jobs, job kwargs, most placements one cycle may try)
COST_CASES = {
    "topo: 200 waiting jobs of two shapes, a few placements": ("topo", 200, {}, 4),
    "full: 200 waiting jobs of two shapes behind a reservation, a few placements": ("full", 200, {}, 16),
    "full, preemptible (borrowers): still a few placements": ("full", 200, dict(preemptible=True), 16),
}


@pytest.mark.parametrize("name", list(COST_CASES))
def test_failed_placements_are_remembered_within_a_cycle(name, monkeypatch):
    import gpusched.policy.placer as plan_mod

    preset, pending, spec, most = COST_CASES[name]
    s = Scenario(racks=1, nodes=4)
    _scattered(s, pending, **spec)
    calls = []

    def counting(real):
        def wrapper(pool, n, *args, **kw):
            calls.append(n)
            return real(pool, n, *args, **kw)
        return wrapper

    monkeypatch.setattr(plan_mod, "place", counting(plan_mod.place))  # the cycle's one placer
    # (the ETA plan's own cycles place too: its cost is bounded apart, test_forecast.py)
    out = s.cycle(PRESETS[preset].replace(eta_plan_every_s=None), now=10)
    assert not grants(out)
    assert len(calls) <= most, len(calls)
    assert s.state.violations() == []


def test_a_remembered_failure_is_forgotten_when_the_pool_grows():
    from gpusched.policy.placement import Pool

    s = Scenario(racks=1, nodes=2)
    s.run("x", gpus("r0n0", *range(7)), at=0)
    s.run("y", gpus("r0n1", *range(7)), at=0)
    pool = Pool(s.state)
    pool.fails.add((2, 2, "node", "nvlink"))
    pool.take(gpus("r0n0", 7))
    assert pool.fails  # fewer GPUs: what failed still fails
    assert pool.copy().fails and pool.without(gpus("r0n1", 7)).fails
    pool.add(gpus("r0n0", 0))
    assert not pool.fails  # it grew
