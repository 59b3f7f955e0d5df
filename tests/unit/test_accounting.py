"""Accounting from the log: a table of small clusters, each job's bill computed by hand."""

from __future__ import annotations

import pytest

from gpusched.accounting import account, job_records, period_report
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec

DAY = 86400.0
T0 = 20 * 365 * DAY  # a UTC midnight (a multiple of a day since the epoch)


def node(name="n0", gpus=4):
    return ev.NodeRegistered(at=T0, node=name, rack="r0", gpus=[GpuInfo(index=i, uuid=f"{name}-u{i}") for i in range(gpus)])


def gpus(*idx, node="n0"):
    return [f"{node}/{i}" for i in idx]


CASES = {
    "ran to completion": (
        [node(), ev.JobSubmitted(at=T0 + 10, job_id="a", spec=JobSpec(team="t1", gpus=2)),
         ev.GpusGranted(at=T0 + 40, job_id="a", attempt=1, gpus=gpus(0, 1)),
         ev.JobStarted(at=T0 + 41, job_id="a", attempt=1, node="n0"),
         ev.JobCompleted(at=T0 + 3640, job_id="a", attempt=1)],
        {"a": dict(state="completed", wait_s=30, run_s=3600, gpu_s=7200, gpu_hours=2.0, attempts=1, lost_gpu_s=0)},
    ),
    "preempted, lost work, ran again": (
        [node(), ev.JobSubmitted(at=T0, job_id="b", spec=JobSpec(team="t2", gpus=4, preemptible=True)),
         ev.GpusGranted(at=T0 + 100, job_id="b", attempt=1, gpus=gpus(0, 1, 2, 3)),
         ev.PreemptionRequested(at=T0 + 200, job_id="b", for_job="x", reason="priority", deadline=T0 + 300),
         ev.GpusReleased(at=T0 + 300, job_id="b", reason="preempted", forced=True, lost_gpu_s=800.0),
         ev.GpusGranted(at=T0 + 500, job_id="b", attempt=2, gpus=gpus(0, 1, 2, 3)),
         ev.JobCompleted(at=T0 + 600, job_id="b", attempt=2)],
        {"b": dict(state="completed", wait_s=100, run_s=300, gpu_s=1200, attempts=2, lost_gpu_s=800, preemptions=1)},
    ),
    "elastic shrink halves the rate": (
        [node(), ev.JobSubmitted(at=T0, job_id="c", spec=JobSpec(team="t1", gpus=4, min_gpus=2)),
         ev.GpusGranted(at=T0, job_id="c", attempt=1, gpus=gpus(0, 1, 2, 3)),
         ev.JobResized(at=T0 + 100, job_id="c", removed=gpus(2, 3), reason="shrink"),
         ev.JobCancelled(at=T0 + 200, job_id="c", reason="user")],
        {"c": dict(state="cancelled", wait_s=0, run_s=200, gpu_s=600, attempts=1)},
    ),
    "never ran: waits until now": (
        [node(gpus=1), ev.JobSubmitted(at=T0, job_id="d", spec=JobSpec(team="t1", gpus=8)),
         ev.PlacementDegraded(at=T0 + 50, reason="x")],
        {"d": dict(state="pending", wait_s=50, run_s=0, gpu_s=0, attempts=0)},
    ),
    "lost node: the bill stops there": (
        [node(), ev.JobSubmitted(at=T0, job_id="e", spec=JobSpec(team="t1", gpus=2)),
         ev.GpusGranted(at=T0 + 10, job_id="e", attempt=1, gpus=gpus(0, 1)),
         ev.NodeLost(at=T0 + 70, node="n0", reason="silent")],
        {"e": dict(state="pending", wait_s=10, run_s=60, gpu_s=120, attempts=1, lost_gpu_s=120)},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_job_bill(name):
    events, want = CASES[name]
    state, ledger = account(enumerate(events, 1))
    got = {r["job_id"]: r for r in job_records(state, ledger)}
    for job_id, fields in want.items():
        for key, value in fields.items():
            assert got[job_id][key] == pytest.approx(value), (name, job_id, key, got[job_id])


def test_period_report_splits_usage_at_midnight():
    events = [node(), ev.JobSubmitted(at=T0 + DAY - 3600, job_id="a", spec=JobSpec(team="t1", gpus=2)),
              ev.GpusGranted(at=T0 + DAY - 3600, job_id="a", attempt=1, gpus=gpus(0, 1)),
              ev.JobCompleted(at=T0 + DAY + 7200, job_id="a", attempt=1)]
    state, ledger = account(enumerate(events, 1))
    rows = period_report(state, ledger, "day")
    assert [(r["team"], r["gpu_hours"], r["submitted"], r["ended"]) for r in rows] == [("t1", 2.0, 1, 0), ("t1", 4.0, 0, 1)]
    weekly = period_report(state, ledger, "week")
    assert sum(r["gpu_hours"] for r in weekly) == pytest.approx(6.0)
    assert period_report(state, ledger, "day", jobs=[]) == []


def test_demo_verdict_names_a_team_left_waiting_under_its_guarantee():
    """The demo's fairness verdict: a team under its guarantee with a job that fits in the rest
    of it, waiting, fails; a team at its guarantee, or whose waiting job is too big, does not."""
    from gpusched.cli.demo import waiting_under_guarantee
    from gpusched.core.model import TeamQuota

    events = [node(gpus=4), ev.JobSubmitted(at=T0, job_id="c1", spec=JobSpec(team="chat", gpus=1)),
              ev.JobSubmitted(at=T0, job_id="c2", spec=JobSpec(team="chat", gpus=1)),
              ev.GpusGranted(at=T0 + 1, job_id="c1", attempt=1, gpus=gpus(0)),
              ev.JobSubmitted(at=T0, job_id="v1", spec=JobSpec(team="vision", gpus=4))]
    state, _ = account(enumerate(events, 1))
    quotas = {"chat": TeamQuota(guaranteed=2), "vision": TeamQuota(guaranteed=2), "nlp": TeamQuota(guaranteed=1)}
    assert waiting_under_guarantee(state, quotas) == {"chat": {"held": 1, "guaranteed": 2, "waiting_jobs": 1}}
    quotas["chat"] = TeamQuota(guaranteed=1)
    assert waiting_under_guarantee(state, quotas) == {}


def test_simulator_bills_with_the_same_ledger():
    """The simulator keeps the ledger `gpusched history` uses: its GPU-hours per team are the sum
    of the per-job bills of its own fold."""
    from gpusched.sim.engine import Cluster
    from gpusched.sim.report import load_jobs, runtime_model, simulate

    jobs, burst = load_jobs(None, None, 40, None)
    sim = simulate(jobs, Cluster.parse("1x4x8", "all"), "full", runtime_model("ideal"), {}, burst, None, "pack")
    per_team = sim.summary()["gpu_hours_by_team"]
    bills = job_records(sim.state, sim.ledger)
    assert per_team and sum(per_team.values()) > 0
    for team, hours in per_team.items():
        assert hours == pytest.approx(sum(r["gpu_hours"] for r in bills if r["team"] == team), abs=1e-2)
