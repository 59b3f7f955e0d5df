"""The simulator end to end: hand-computed metrics, every preset on real Philly jobs, the
runtime model's costs, determinism and the CLI."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from gpusched.cli.main import main
from gpusched.core import events as ev
from gpusched.policy.config import PRESETS
from gpusched.sim.engine import Cluster, Simulation, SimViolation
from gpusched.sim.metrics import eta_error, jain
from gpusched.sim.report import policy_config, runtime_model, simulate
from gpusched.sim.runtime_model import IDEAL, REALISTIC, RuntimeModel
from gpusched.sim.traces import TraceJob, load_trace

from .policy_helpers import FULL_INSTANT


def job(job_id, submit, duration, gpus, team, priority="normal", preemptible=False, **kw) -> TraceJob:
    return TraceJob(job_id, submit, duration, gpus, team, priority, preemptible, **kw)


def test_a_team_given_more_than_its_entitlement_counts_as_served_in_jain_shortfall():
    """4 GPUs. a (1 GPU) and b (3 GPUs) run 0..100 while b's 4-GPU job waits. b has 700 of the
    800 GPU-s: guaranteed 3, a none; the GPU left is split between them, so a is entitled to
    0.5 and holds 1 (x = 2), b to 3.5 and holds 3. Jain counts a's surplus against it;
    `jain_shortfall` only b's shortfall."""
    jobs = [job("a", 0, 100, 1, "a"), job("b", 0, 100, 3, "b"), job("b2", 0, 100, 4, "b")]
    m = Simulation(jobs, Cluster.parse("1x1x4"), PRESETS["fifo"], IDEAL, policy_name="fifo").run()
    assert m["team_share_ratio"] == {"a": 2.0, "b": pytest.approx(3 / 3.5, abs=1e-4)}
    assert m["jain_fairness"] == pytest.approx(jain([2.0, 3 / 3.5]), abs=1e-4)
    assert m["jain_shortfall"] == pytest.approx(jain([1.0, 3 / 3.5]), abs=1e-4)
    assert m["jain_shortfall"] > m["jain_fairness"]


def test_hand_made_trace_under_fifo():
    """8 GPUs (1 rack x 2 nodes x 4). a (4 GPUs, 100 s) starts at 0; b (8 GPUs) waits for a;
    c (2 GPUs, at 10 s) waits behind b (strict FIFO) and runs 150..170."""
    jobs = [job("a", 0, 100, 4, "x"), job("b", 0, 50, 8, "y"), job("c", 10, 20, 2, "x")]
    sim = Simulation(jobs, Cluster.parse("1x2x4"), PRESETS["fifo"], IDEAL, policy_name="fifo")
    m = sim.run()
    assert {j: (r.first_start, r.finish) for j, r in sim.runs.items()} == {
        "a": (0, 100), "b": (100, 150), "c": (150, 170)}
    assert m["avg_jct_s"] == pytest.approx((100 + 150 + 160) / 3, abs=0.1)
    assert m["p50_jct_s"] == 150
    assert m["avg_queue_s"] == pytest.approx((0 + 100 + 140) / 3, abs=0.1)
    assert m["avg_queue_s_by_size"] == {"1": 0.0, "2-4": 70.0, "5-8": 100.0, ">8": 0.0}
    assert m["max_queue_s"] == 140 and m["makespan_s"] == 170
    # work waits during 0..150: 4 GPUs held for 100 s, then 8 for 50 s, of 8 x 150 GPU-s
    assert m["utilization"] == pytest.approx(800 / 1200, abs=1e-4)
    assert m["locality"] == 1.0 and m["multi_gpu_grants"] == 3
    # quotas: x has 440 of 840 GPU-s -> guaranteed 4, y 3. Entitled (guarantee, then the rest
    # split evenly, capped by demand): 0..10 x 4, y 4; 10..100 x 4.5, y 3.5; 100..150 x 2, y 6.
    x = (4 * 100) / (4 * 10 + 4.5 * 90 + 2 * 50)
    y = (8 * 50) / (4 * 10 + 3.5 * 90 + 6 * 50)
    assert m["jain_fairness"] == pytest.approx(jain([x, y]), abs=1e-4)
    assert m["preemptions"] == 0 and m["lost_gpu_hours"] == 0 and m["unfinished"] == 0


def test_gang_lets_small_jobs_skip_ahead():
    jobs = [job("a", 0, 100, 4, "x"), job("b", 0, 50, 8, "y"), job("c", 10, 20, 2, "x")]
    sim = Simulation(jobs, Cluster.parse("1x2x4"), PRESETS["gang"], IDEAL, policy_name="gang")
    sim.run()
    assert sim.runs["c"].first_start == 10 and sim.runs["b"].first_start == 100


def test_forced_kill_loses_work_since_the_checkpoint():
    """preempt (no checkpoint handshake): a high job kills a running normal one. The victim
    checkpointed at 1000 s (interval) and is killed at 1500 s: 4 GPUs x 500 s are lost."""
    model = RuntimeModel(checkpoint_interval_s=1000, restore_s=60)
    jobs = [job("low", 0, 3000, 4, "x", "normal", True), job("hi", 1500, 100, 4, "x", "high")]
    sim = Simulation(jobs, Cluster.parse("1x1x4"), PRESETS["preempt"], model, policy_name="preempt")
    m = sim.run()
    assert sim.runs["hi"].first_start == 1500
    assert m["lost_gpu_hours"] == pytest.approx(4 * 500 / 3600, abs=0.1)
    assert sim.state.jobs["low"].lost_gpu_s == pytest.approx(4 * 500)
    # low restarts at 1600 from its 1000 s checkpoint: 60 s restore + 2000 s of work left
    assert sim.runs["low"].finish == pytest.approx(1600 + 60 + 2000)


def test_checkpoint_handshake_loses_nothing():
    """full: the victim checkpoints on request (30 s), the policy releases it, the high job starts."""
    jobs = [job("low", 0, 3000, 4, "x", "normal", True), job("hi", 1500, 100, 4, "x", "high")]
    sim = Simulation(jobs, Cluster.parse("1x1x4"), PRESETS["full"], REALISTIC, policy_name="full")
    m = sim.run()
    assert sim.runs["hi"].first_start == pytest.approx(1530)
    assert m["lost_gpu_hours"] == 0 and m["preemptions"] == 1
    # 1500 s done before the request; resumes at 1630 after a 60 s restore: 1500 s left
    assert sim.runs["low"].finish == pytest.approx(1630 + 60 + 1500)


def test_cross_rack_placement_runs_slower():
    jobs = [job("big", 0, 1000, 8, "x")]
    sim = Simulation(jobs, Cluster.parse("2x1x4"), PRESETS["topo"], REALISTIC, policy_name="topo")
    sim.run()
    assert sim.runs["big"].grants[0][1] == "cluster"
    assert sim.runs["big"].finish == pytest.approx(1300)


def test_violation_aborts_with_the_event():
    def bad_cycle(state, now, config):  # grants a GPU twice
        return [ev.GpusGranted(at=now, job_id=j, attempt=1, gpus=["r00n000/0"], placer="sim", level="nvlink")
                for j in list(state.pending)[:2]]

    jobs = [job("a", 0, 10, 1, "x"), job("b", 0, 10, 1, "x")]
    sim = Simulation(jobs, Cluster.parse("1x1x2"), PRESETS["fifo"], IDEAL, cycle=bad_cycle)
    with pytest.raises(SimViolation, match=r"GpusGranted \(job b\).*double_booking"):
        sim.run()


@pytest.fixture(scope="module")
def philly_runs():
    """Every preset on the first 400 jobs of the Philly week, on 32 GPUs to make them queue."""
    jobs = load_trace(limit=400)
    cluster = Cluster.parse("2x2x8")
    return {name: simulate(jobs, cluster, name, REALISTIC) for name in PRESETS}


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_runs_clean(philly_runs, name):
    sim = philly_runs[name]
    m = sim.summary()
    assert not sim.state.violations()
    assert m["completed"] == m["jobs"] == 400 and m["unfinished"] == 0
    assert 0 < m["avg_queue_s"] < m["avg_jct_s"] and m["p50_jct_s"] <= m["p99_jct_s"]
    assert 0.5 < m["utilization"] <= 1.0 and 0 <= m["locality"] <= 1 and 0 < m["jain_fairness"] <= 1
    assert m["lost_gpu_hours"] <= m["gpu_hours"] * 0.05
    for r in sim.runs.values():  # all or nothing: no trace job is elastic, so grants are whole gangs
        assert all(g == r.trace.gpus for g, _, _ in r.grants)
        assert r.finish - r.trace.submit_s >= r.trace.duration_s - 1e-6


def test_presets_tell_the_story(philly_runs):
    m = {name: sim.summary() for name, sim in philly_runs.items()}
    assert m["topo"]["locality"] >= m["gang"]["locality"]
    assert m["gang"]["avg_queue_s"] < m["fifo"]["avg_queue_s"]
    assert m["fifo"]["preemptions"] == m["gang"]["preemptions"] == m["topo"]["preemptions"] == 0
    assert m["full"]["lost_gpu_hours"] <= m["preempt"]["lost_gpu_hours"]


def test_deterministic():
    jobs = load_trace(limit=250)
    a, b = (simulate(jobs, Cluster.parse("1x4x8"), "full", REALISTIC).summary() for _ in range(2))
    a.pop("sim_wall_s"), b.pop("sim_wall_s")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_policy_overrides():
    assert policy_config("full", {"las": "true", "min_runtime_s": "60"}).las is True
    with pytest.raises(ValueError, match="not a PolicyConfig field"):
        policy_config("full", {"nope": "1"})
    with pytest.raises(ValueError, match="unknown policy"):
        policy_config("best", None)
    assert runtime_model("ideal").lossless


def test_burst_is_bounded_by_fair_share():
    jobs = load_trace(limit=200)
    burst = [job(f"burst-{i}", 3600, 600, 1, "6c71a0", "interactive") for i in range(100)]
    sim = simulate(jobs, Cluster.parse("1x4x8"), "full", REALISTIC, burst=burst)
    m = sim.summary()
    assert m["jobs"] == 300 and m["unfinished"] == 0


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


KEYS = {"jobs", "avg_jct_s", "p50_jct_s", "p99_jct_s", "avg_queue_s", "avg_queue_s_by_size", "max_queue_s",
        "utilization", "locality", "jain_fairness", "preemptions", "lost_gpu_hours", "makespan_s", "sim_wall_s"}


def test_cli_json_keys(tmp_path):
    rc, out, _ = run_cli("sim", "--limit", "150", "--cluster", "1x4x8", "--policy", "full", "--json",
                         "--interactive-burst", "team=6c71a0,at=3600,count=20,gpus=1,duration=600",
                         "--out", str(tmp_path))
    assert rc == 0
    m = json.loads(out)
    assert KEYS <= set(m) and m["jobs"] == 170
    assert set(m["avg_queue_s_by_size"]) == {"1", "2-4", "5-8", ">8"}
    for name in ("summary.json", "jobs.csv", "gpus_per_team.png", "queue_cdf.png", "locality.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert len((tmp_path / "jobs.csv").read_text().splitlines()) == 171


def test_cli_compare_and_errors(tmp_path):
    rc, out, _ = run_cli("sim", "--limit", "100", "--cluster", "1x2x8", "--compare", "fifo,full", "--json")
    assert rc == 0 and set(json.loads(out)["runs"]) == {"fifo", "full"}
    rc, out, _ = run_cli("sim", "--limit", "100", "--cluster", "1x2x8", "--compare", "fifo,full")
    assert rc == 0 and "fifo" in out and "full" in out
    bad = tmp_path / "bad.csv"
    bad.write_text("job_id,submit_time_s,duration_s,num_gpus,team\na,0,ten,1,t\n")
    rc, _, err = run_cli("sim", "--trace", str(bad), "--format", "csv")
    assert rc == 2 and "bad.csv:2: column duration_s" in err
    rc, _, err = run_cli("sim", "--cluster", "2x2")
    assert rc == 2 and "RxNxG" in err


def test_cli_jitter_replays_another_path_the_same_way_per_seed():
    """`--jitter SEED` (bench/seeds.py): a saturated replay of the jittered trace takes another
    path, and the same seed takes the same one."""
    base = ("sim", "--limit", "200", "--cluster", "1x2x8", "--policy", "full", "--json")
    runs = [run_cli(*base, *extra) for extra in ((), ("--jitter", "1"), ("--jitter", "1"), ("--jitter", "2"))]
    assert [rc for rc, _, _ in runs] == [0] * 4
    plain, one, again, two = ({k: v for k, v in json.loads(out).items() if k != "sim_wall_s"} for _, out, _ in runs)
    assert one == again and one["jobs"] == plain["jobs"] == 200
    assert len({plain["avg_jct_s"], one["avg_jct_s"], two["avg_jct_s"]}) == 3


@pytest.mark.slow
def test_philly_week_under_full():
    """The whole bundled week on 2x32x8 (about 5-15 s): the targets that the design can meet."""
    sim = simulate(load_trace(), Cluster.parse("2x32x8"), "full", REALISTIC)
    m = sim.summary()
    assert m["completed"] == 7748 and not sim.state.violations()
    assert m["locality"] >= 0.95 and m["jain_fairness"] >= 0.95
    assert m["lost_gpu_hours"] <= 0.01 * m["gpu_hours"]


def test_livelock_is_reported_not_spun():
    """A policy that grants and preempts the same job at one instant forever (with the ideal
    model a checkpoint takes no time, so virtual time never moves on)."""
    def flapping(state, now, config):
        out = []
        for j in list(state.running):
            if state.jobs[j].checkpoint is not None:
                out.append(ev.GpusReleased(at=now, job_id=j, reason="preempted"))
        for j in list(state.pending):  # grant, and at once ask for the GPUs back
            out.append(ev.GpusGranted(at=now, job_id=j, attempt=state.jobs[j].attempt + 1, gpus=["r00n000/0"],
                                      placer="sim", level="nvlink"))
            out.append(ev.PreemptionRequested(at=now, job_id=j, for_job=j, reason="flap", deadline=now + 60))
        return out

    sim = Simulation([job("a", 0, 100, 1, "x", preemptible=True)], Cluster.parse("1x1x1"), PRESETS["full"], IDEAL,
                     cycle=flapping, stall_cycles=50)
    with pytest.raises(Exception, match="livelock at t=0s"):
        sim.run()


def test_eta_error_of_pending_estimates():
    """One 8-GPU node. a runs 100 s with a 100 s time limit; b (team y, at 10 s) is told it
    starts when a's limit ends, at 100. At 100, fair share puts team x's d (under its larger
    guarantee) first, so b starts at 110: its estimate was 10 s late."""
    jobs = [job("a", 0, 100, 8, "x", time_limit_s=100), job("b", 10, 100, 8, "y", time_limit_s=200),
            job("d", 20, 10, 8, "x")]
    # the head's reservation ETA alone, entitlements second by second (over a horizon x is not
    # yet owed at 100: b goes first, as its estimate said)
    config = FULL_INSTANT.replace(eta_plan_every_s=None)
    sim = Simulation(jobs, Cluster.parse("1x1x8"), config, IDEAL, policy_name="full")
    m = sim.run()
    assert {j: r.first_start for j, r in sim.runs.items()} == {"a": 0, "b": 110, "d": 100}
    assert sim.eta_errors == [pytest.approx(10.0)]
    assert m["eta_error"] == {"predictions": 1, "median_abs_s": 10.0, "p90_abs_s": 10.0, "late_share": 1.0,
                              "ranges": 0, "range_coverage": None, "unscored": 0, "waits": 2, "shown_share": 0.5,
                              "first_median_abs_s": 10.0, "first_p90_abs_s": 10.0,
                              "median_abs_s_by_eta": {"<5m": 10.0, "5-30m": None, ">30m": None}}
    assert eta_error([0.0, -150.0, 30.0], [True, False], unscored=1, waits=[4, 3], first=[-150.0, 30.0],
                     ahead=[60.0, 900.0, 4000.0]) == {
        "predictions": 3, "median_abs_s": 30.0, "p90_abs_s": 126.0, "late_share": 0.3333,
        "ranges": 2, "range_coverage": 0.5, "unscored": 1, "waits": 4, "shown_share": 0.75,
        "first_median_abs_s": 90.0, "first_p90_abs_s": 138.0,
        "median_abs_s_by_eta": {"<5m": 0.0, "5-30m": 150.0, ">30m": 30.0}}


def test_planned_etas_are_all_scored():
    """Under `full` with its plan of the queue: b (arrived at 10) and c (at 400, when the plan
    is old enough to be made again) wait for a; every ETA said is scored at the job's start,
    as the log says it (the planned start) against the real one."""
    jobs = [job("a", 0, 1000, 8, "x", time_limit_s=1000), job("b", 10, 500, 8, "y"), job("c", 400, 100, 8, "x")]
    sim = Simulation(jobs, Cluster.parse("1x1x8"), PRESETS["full"], IDEAL, policy_name="full")
    said: list[tuple[str, float]] = []
    react = sim._react

    def spy(e, t, started):
        if isinstance(e, ev.JobPending) and e.eta_s is not None:
            said.append((e.job_id, e.at + e.eta_s))
        react(e, t, started)

    sim._react = spy  # type: ignore[method-assign]
    m = sim.run()
    starts = {j: r.first_start for j, r in sim.runs.items()}
    assert said and m["eta_error"]["predictions"] == len(said) == len(sim.eta_errors)
    assert sorted(sim.eta_errors) == pytest.approx(sorted(starts[j] - at for j, at in said))
    assert {j for j, _ in said} == {"b", "c"}
    assert m["eta_error"]["unscored"] == 0 and m["eta_error"]["waits"] == 2


def test_a_job_past_its_time_limit_is_ended():
    """One 8-GPU node: a needs 200 s of work but has a 100 s limit; it is ended at 100 and b,
    waiting, starts then."""
    jobs = [job("a", 0, 200, 8, "x", time_limit_s=100), job("b", 10, 50, 8, "y")]
    sim = Simulation(jobs, Cluster.parse("1x1x8"), PRESETS["full"], IDEAL, policy_name="full")
    m = sim.run()
    assert (sim.runs["a"].finish, sim.runs["a"].timed_out) == (100, True)
    assert sim.runs["b"].first_start == 100 and m["timed_out"] == 1
    assert sim.state.jobs["a"].state == "timeout" and sim.state.violations() == []



def test_simulate_uses_the_quotas_given():
    from gpusched.core.model import TeamQuota
    from gpusched.sim.engine import Cluster
    from gpusched.sim.traces import TraceJob

    jobs = [TraceJob(job_id=f"j{i}", submit_s=float(i), duration_s=60.0, gpus=2, team="t") for i in range(4)]
    sim = simulate(jobs, Cluster.parse("1x1x8"), "fairshare", runtime_model("ideal"),
                   quotas={"t": TeamQuota(guaranteed=2, weight=1.0, limit=4)})
    assert sim.state.teams["t"].quota == TeamQuota(2, 1.0, 4)
    assert sim.summary()["completed"] == 4


def test_guarantee_wait_counts_the_waits_a_guarantee_covers():
    """4 GPUs, x and y guaranteed 2 each. y (4 GPUs, 100 s) is beyond its guarantee: not counted;
    x (2 GPUs at 10 s) is within x's: under fifo it waits for y, 90 s."""
    from gpusched.core.model import TeamQuota

    jobs = [job("y", 0, 100, 4, "y"), job("x", 10, 20, 2, "x")]
    quotas = {"x": TeamQuota(guaranteed=2), "y": TeamQuota(guaranteed=2)}
    sim = Simulation(jobs, Cluster.parse("1x1x4"), PRESETS["fifo"], IDEAL, policy_name="fifo", quotas=quotas)
    m = sim.run()
    assert m["guarantee_wait"] == {"waits": 1, "unserved": 0, "p50_s": 90.0, "p99_s": 90.0, "max_s": 90.0,
                                   "team_shortfall": {"count": 1, "p99_s": 90.0, "max_s": 90.0}}


def test_a_compare_run_may_carry_its_own_knobs():
    """`--compare tiresias,tiresias+fairshare=true`: one preset twice, the second with a knob
    of its own, which wins over `--set`."""
    from gpusched.sim.report import split_variant

    assert split_variant("tiresias+fairshare=true+las=false") == ("tiresias", {"fairshare": "true", "las": "false"})
    jobs = [job("a", 0, 10, 1, "x")]
    sim = simulate(jobs, Cluster.parse("1x1x4"), "tiresias+fairshare=true", IDEAL, {"fairshare": "false"})
    assert sim.config.fairshare and not PRESETS["tiresias"].fairshare
    assert sim.summary()["policy"] == "tiresias+fairshare=true"
