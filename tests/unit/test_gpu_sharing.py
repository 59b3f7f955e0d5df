"""Fractional GPUs (docs/gpu-sharing.md): the fold's shares, packing, never mixed with whole
GPUs, the writer's re-check, the charge by fraction, and the simulator honouring `gpu_milli`."""

from __future__ import annotations

import msgspec
import pytest

from gpusched.core import events as ev
from gpusched.core import limits
from gpusched.core.model import GpuInfo, JobSpec, TeamQuota
from gpusched.core.rules import BatchCheck
from gpusched.core.state import ClusterState
from gpusched.policy.config import PRESETS
from gpusched.policy.cycle import cycle
from gpusched.sim.engine import Cluster, Simulation
from gpusched.sim.traces import TraceJob

from .policy_helpers import run_full_cycle as run_cycle
from .policy_helpers import submit_one as submit

FULL = PRESETS["full"]


def cluster(gpus: int = 2, memory_mb: int = 80_000, nodes: int = 1) -> ClusterState:
    st = ClusterState()
    for n in range(nodes):
        st.apply(ev.NodeRegistered(at=0, node=f"n{n}", rack="r0", block=None, gpus=[
            GpuInfo(index=i, uuid=f"u{n}-{i}", model="H100", memory_mb=memory_mb) for i in range(gpus)]))
    return st


def placed(st: ClusterState) -> dict[str, str]:
    return {j: st.jobs[j].gpus[0] for j in st.running}


def test_fractions_pack_onto_the_fullest_shared_gpu_and_open_a_free_one_only_when_none_fits():
    st = cluster(gpus=2)
    for i, f in enumerate([0.5, 0.3, 0.25, 0.6, 0.1]):
        submit(st, f"f{i}", gpu_fraction=f)
    run_cycle(st, 2)
    where = placed(st)
    assert where["f0"] == where["f1"]  # 0.5 + 0.3 on one GPU
    assert where["f2"] != where["f0"]  # 0.25 does not fit beside 0.8: a second GPU opens
    assert where["f3"] == where["f2"]  # 0.6 fits beside 0.25
    assert where["f4"] == where["f2"]  # 0.1 goes to the fuller GPU (0.85) rather than 0.8
    loads = sorted(round(g.shared_load, 6) for g in st.gpus.values())
    assert loads == [0.8, 0.95]
    assert st.free_count == 0 and st.held_gpus == 2
    assert st.teams["a"].held == pytest.approx(1.75)


def test_a_whole_gpu_job_never_lands_on_a_shared_gpu_and_a_share_never_beside_a_whole_one():
    st = cluster(gpus=2)
    submit(st, "w0")
    run_cycle(st, 2)  # w0 holds one GPU whole
    submit(st, "f", at=3, gpu_fraction=0.25)
    submit(st, "w1", at=3)
    run_cycle(st, 4)
    assert "f" in st.running and "w1" not in st.running  # the share took the free GPU: no room for w1
    assert st.jobs["f"].gpus != st.jobs["w0"].gpus
    shared = st.jobs["f"].gpus[0]
    assert shared not in st.nodes["n0"].free and st.gpu_blocker(shared) == "shared by f"
    st.apply(ev.JobCompleted(at=5, job_id="f", attempt=1, exit_code=0))
    assert st.gpus[shared].shares == {} and shared in st.nodes["n0"].free
    run_cycle(st, 6)
    assert st.jobs["w1"].gpus == [shared]  # once its last share left, the GPU is whole again


def test_the_fold_records_a_mixed_or_overfull_gpu_as_a_violation():
    st = cluster(gpus=1)
    submit(st, "f0", gpu_fraction=0.7)
    submit(st, "f1", gpu_fraction=0.5)
    submit(st, "w")
    st.apply(ev.GpusGranted(at=2, job_id="f0", attempt=1, gpus=["n0/0"]))
    st.apply(ev.GpusGranted(at=2, job_id="f1", attempt=1, gpus=["n0/0"]))
    st.apply(ev.GpusGranted(at=2, job_id="w", attempt=1, gpus=["n0/0"]))
    rules = [v.rule for v in st.violations()]
    assert rules == ["unplaceable_share", "double_booking"]
    assert st.gpus["n0/0"].shares == {"f0": 0.7} and st.gpus["n0/0"].holder is None


def test_the_writers_recheck_admits_a_second_share_and_refuses_overfull_and_mixed_grants():
    st = cluster(gpus=1)
    for jid, f in (("f0", 0.5), ("f1", 0.5), ("f2", 0.1)):
        submit(st, jid, gpu_fraction=f)
    submit(st, "w")
    st.apply(ev.GpusGranted(at=2, job_id="f0", attempt=1, gpus=["n0/0"]))
    check = BatchCheck(st)
    assert check.problem(ev.GpusGranted(at=3, job_id="f1", attempt=1, gpus=["n0/0"])) is None
    assert "over its capacity" in (check.problem(ev.GpusGranted(at=3, job_id="f2", attempt=1, gpus=["n0/0"])) or "")
    assert check.problem(ev.GpusGranted(at=3, job_id="w", attempt=1, gpus=["n0/0"])) == "grant of GPUs that are not free"
    assert check.problem(ev.GpusReleased(at=3, job_id="f0", reason="preempted")) is None
    assert check.problem(ev.GpusGranted(at=3, job_id="f2", attempt=1, gpus=["n0/0"])) is None  # f0's half left


def test_a_memory_ask_becomes_the_share_of_the_gpu_it_lands_on_and_waits_where_none_holds_it():
    st = cluster(gpus=1, memory_mb=40_000)
    submit(st, "m", gpu_memory_mb=10_000)
    submit(st, "big", gpu_memory_mb=50_000)
    run_cycle(st, 2)
    assert st.jobs["m"].share == pytest.approx(0.25) and st.gpus["n0/0"].shares == {"m": 0.25}
    assert "big" in st.pending


def test_fair_share_and_accounting_charge_the_fraction():
    st = cluster(gpus=2)
    st.apply(ev.TeamQuotaSet(at=0, team="a", quota=TeamQuota()))
    for i in range(4):
        submit(st, f"q{i}", gpu_fraction=0.25)
    run_cycle(st, 10)
    for i in range(4):
        st.apply(ev.JobCompleted(at=110, job_id=f"q{i}", attempt=1, exit_code=0))
    assert st.jobs["q0"].service_gpu_s == pytest.approx(25.0)  # 0.25 of a GPU for 100 s
    held, _ = st.team_gpu_seconds("a")
    assert held == pytest.approx(100.0)  # four quarters for 100 s: one GPU's worth, not four
    assert st.teams["a"].held == 0


def test_a_team_limit_counts_shares():
    st = cluster(gpus=2)
    st.apply(ev.TeamQuotaSet(at=0, team="a", quota=TeamQuota(limit=1)))
    for i in range(5):
        submit(st, f"q{i}", gpu_fraction=0.3)
    run_cycle(st, 2)
    assert len(st.running) == 3  # 0.9 of its limit of 1 GPU; a fourth share would pass it
    assert st.teams["a"].held == pytest.approx(0.9)


def test_a_fractional_spec_asks_for_one_gpu_by_one_measure():
    assert limits.share_problem(JobSpec(team="a", gpus=2, gpu_fraction=0.5)).startswith("a fractional job")
    assert "exclusive" in limits.share_problem(JobSpec(team="a", gpus=1, gpu_fraction=0.5, gpu_memory_mb=10))
    assert limits.share_problem(JobSpec(team="a", gpus=1, gpu_fraction=0.5)) is None
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"team": "a", "gpus": 1, "gpu_fraction": 1.0}, JobSpec)


def _trace(milli: int, n: int) -> list[TraceJob]:
    return [TraceJob(f"j{i}", 0.0, 3600.0, 1, "t", gpu_milli=milli) for i in range(n)]


def test_the_simulator_honours_gpu_milli_and_can_round_it_up():
    one_gpu = Cluster.parse("1x1x1")
    honoured = Simulation(_trace(250, 4), one_gpu, FULL, fractions="honour")
    honoured.run()
    rounded = Simulation(_trace(250, 4), one_gpu, FULL, fractions="round")
    rounded.run()
    h, r = honoured.summary(), rounded.summary()
    assert h["completed"] == r["completed"] == 4
    assert h["fractional_jobs"] == 4 and r["fractional_jobs"] == 0
    assert h["makespan_s"] < 7200 < r["makespan_s"]  # four quarters at once, or one after another
    assert h["gpu_hours"] == pytest.approx(r["gpu_hours"] / 4, rel=0.01)


def test_the_idle_rules_reclaim_a_share_and_its_gpu_stays_with_the_busy_sharer():
    st = cluster(gpus=1)
    submit(st, "nb", priority="interactive", gpu_fraction=0.5)  # an idle notebook
    submit(st, "srv", gpu_fraction=0.5)
    run_cycle(st, 2)
    st.apply(ev.JobIdle(at=10, job_id="nb", attempt=1, since=3, window_s=7, threshold_pct=5.0))
    assert st.teams["a"].idle_gpus == 0.5  # charged as idle by its share
    events = cycle(st, 3 + 1801, FULL)  # past the interactive class's idle timeout
    asked = [e for e in events if isinstance(e, ev.PreemptionRequested)]
    assert [(e.job_id, e.cause) for e in asked] == [("nb", "idle")]
    for e in events:
        st.apply(e)
    st.apply(ev.GpusReleased(at=1810, job_id="nb", reason="preempted", forced=True))
    assert st.gpus["n0/0"].shares == {"srv": 0.5} and st.violations() == []
    assert st.jobs["nb"].state == "pending" and st.jobs["nb"].idle_gpu_s == pytest.approx(0.5 * (1810 - 3))  # idle since 3, by its share


def test_the_read_model_shows_a_shared_gpu_and_its_sharers():
    from gpusched import readmodel

    st = cluster(gpus=2)
    submit(st, "f0", gpu_fraction=0.5)
    submit(st, "f1", gpu_fraction=0.25)
    run_cycle(st, 2)
    doc = readmodel.node_doc(st, "n0")
    shared = [g for g in doc["gpus"] if g["status"] == "shared"]
    assert [g["shares"] for g in shared] == [{"f0": 0.5, "f1": 0.25}]
    assert (doc["free"], doc["held"]) == (1, 1)


def test_the_bill_charges_a_fractional_job_its_share():
    from gpusched.accounting import Ledger, job_record

    st, ledger = cluster(gpus=1, memory_mb=81920), Ledger()
    events = [ev.JobSubmitted(at=0, job_id="q", spec=JobSpec(team="a", gpus=1, gpu_memory_mb=20480)),
              ev.GpusGranted(at=100, job_id="q", attempt=1, gpus=["n0/0"]),
              ev.JobCompleted(at=3700, job_id="q", attempt=1, exit_code=0)]
    for e in events:
        st.apply(e)
        ledger.observe(st, e)
    run_s, gpu_s = ledger.per_job(3700)["q"]
    assert (run_s, gpu_s) == (3600.0, 900.0)  # a quarter of an 80 GiB GPU for an hour
    rec = job_record(st.jobs["q"], run_s, gpu_s, 3700)
    assert (rec["gpus"], rec["gpu_share"], rec["gpu_hours"]) == (1, 0.25, 0.25)


def test_show_says_what_share_a_fractional_job_asked_for_and_holds(capsys):
    from gpusched import readmodel
    from gpusched.cli import render

    st = cluster(gpus=1, memory_mb=81920)
    submit(st, "nb", gpu_memory_mb=20480)
    run_cycle(st, 2)
    doc = readmodel.job_doc(st, st.jobs["nb"])
    assert (doc["gpu_memory_mb"], doc["gpu_share"]) == (20480, 0.25)
    render.print_show({"job": doc, "now": 3.0, "seq": 3, "preemptions": [], "preempted_for_it": [], "history": []})
    out = " ".join(capsys.readouterr().out.split())
    assert "wants 20480 MiB of a GPU" in out and "holds 0.25 of GPU n0[0] (shared" in out


def test_admission_refuses_a_memory_ask_no_registered_gpu_can_hold():
    from gpusched.services.admission import share_spec_problem

    st = cluster(gpus=1, memory_mb=40_960)
    too_big = JobSpec(team="a", gpus=1, gpu_memory_mb=50_000)
    assert share_spec_problem(st, too_big) == "no GPU has 50000 MiB of memory (the largest has 40960 MiB)"
    assert share_spec_problem(st, JobSpec(team="a", gpus=1, gpu_memory_mb=40_960)) is None
    assert share_spec_problem(ClusterState(), too_big) is None  # before any node registered, it may queue


def test_a_lost_node_requeues_every_sharer_and_frees_the_gpu():
    st = cluster(gpus=1)
    submit(st, "f0", gpu_fraction=0.5)
    submit(st, "f1", gpu_fraction=0.25)
    run_cycle(st, 2)
    st.apply(ev.NodeLost(at=10, node="n0", reason="silent"))
    assert [st.jobs[j].state for j in ("f0", "f1")] == ["pending", "pending"]
    assert st.gpus["n0/0"].shares == {} and st.teams["a"].held == 0 and st.shared == {}
    assert st.violations() == []
