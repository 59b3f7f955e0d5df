"""GPU models as pools (issue 30): canonical pool names, per-model team terms, and the ordered
fallback of a job that names several GPU types. Each scenario is a whole small mixed cluster:
node h0 has 4 H100, node a0 4 A100."""

from __future__ import annotations

import msgspec
import pytest

from gpusched.core import events as ev
from gpusched.core.commands import SetTeamQuota
from gpusched.core.model import JobSpec, ModelQuota, TeamQuota
from gpusched.core.pools import canonical_model, parse_gpu_types
from gpusched.core.state import ClusterState
from gpusched.services.admission import AdmissionConfig, Capacity, admit
from gpusched.sim.pools import parse_mix, types_of

from .policy_helpers import FULL_INSTANT, Scenario

# name: (a registered model, its pool)
CANONICAL = {
    "an NVML name": ("NVIDIA H100 80GB HBM3", "H100"),
    "a variant with a dash": ("NVIDIA A100-SXM4-80GB", "A100"),
    "an older product line": ("Tesla V100-SXM2-16GB", "V100"),
    "the simulated default": ("SIM-H100-80GB", "H100"),
    "a word without a digit joins the next": ("NVIDIA GeForce RTX 4090", "RTX4090"),
    "lower case": ("l4", "L4"),
    "nothing left": ("NVIDIA", "UNKNOWN"),
}


@pytest.mark.parametrize("name", list(CANONICAL))
def test_a_registered_model_belongs_to_one_pool(name):
    model, pool = CANONICAL[name]
    assert canonical_model(model) == pool


def test_gpu_types_name_each_nodes_model_and_bad_ones_are_refused_precisely():
    assert parse_gpu_types("2:H100,1:A100,L4") == ["H100", "H100", "A100", "L4"]
    for bad, why in {"2:H100,,1:A100": "empty entry", "0:H100": "bad entry", "x:H100": "bad entry",
                     "2:": "bad entry"}.items():
        with pytest.raises(ValueError, match=why):
            parse_gpu_types(bad)


def mixed(*teams: tuple[str, TeamQuota]) -> Scenario:
    s = Scenario(racks=0)
    s.node("h0", "r0", 4, model="NVIDIA H100 80GB HBM3")
    s.node("a0", "r0", 4, model="NVIDIA A100-SXM4-80GB")
    for name, quota in teams:
        s.apply(ev.TeamQuotaSet(at=0, team=name, quota=quota))
    return s


def outcome(s: Scenario, *jobs: str) -> dict[str, str]:
    """Each job's pool if it started this cycle, else its pending reason."""
    s.cycle(FULL_INSTANT)
    st = s.state
    return {j: (canonical_model(st.gpus[st.jobs[j].gpus[0]].model) if st.jobs[j].gpus else st.jobs[j].pending_reason)
            for j in jobs}


#: The head's reason: the free GPUs it could use, its reservation, the pools it does not accept.
H100_ONLY_WAITS = "waiting for 2 H100 GPUs; 1 free; GPUs reserved, waiting for them to free; A100 not accepted"

# name: (set up the cluster, the jobs asked about, what each got)
CASES = {
    "the first type is taken while it has room": (
        lambda s: s.submit("j", 2, gpu_type="H100", gpu_type_fallback=["A100"]), ["j"], {"j": "H100"}),
    "H100 full: the job falls back to the A100s": (
        lambda s: (s.run("busy", ["h0/0", "h0/1", "h0/2"]), s.submit("j", 2, gpu_type="H100", gpu_type_fallback=["A100"])),
        ["j"], {"j": "A100"}),
    "the order is the job's: A100 first when it says so": (
        lambda s: s.submit("j", 2, gpu_type="A100", gpu_type_fallback=["H100"]), ["j"], {"j": "A100"}),
    "an H100-only job waits while A100s are free": (
        lambda s: (s.run("busy", ["h0/0", "h0/1", "h0/2"]), s.submit("j", 2, gpu_type="H100")), ["j"],
        {"j": H100_ONLY_WAITS}),
    "a gang is never split across pools": (
        lambda s: (s.run("busy", ["h0/0", "h0/1"]), s.run("busy2", ["a0/0", "a0/1"]),
                   s.submit("j", 4, gpu_type="H100", gpu_type_fallback=["A100"])), ["j"],
        {"j": "waiting for 4 H100 or A100 GPUs; 4 free; GPUs reserved, waiting for them to free"}),
    "the fallback is tried before anyone is preempted for the first": (
        lambda s: (s.apply(ev.TeamQuotaSet(at=0, team="b", quota=TeamQuota(guaranteed=4))),
                   s.run("borrow", ["h0/0", "h0/1", "h0/2", "h0/3"], team="a", preemptible=True),
                   s.submit("j", 2, team="b", gpu_type="H100", gpu_type_fallback=["A100"])), ["j", "borrow"],
        {"j": "A100", "borrow": "H100"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_an_ordered_list_of_gpu_types_is_tried_in_order(name):
    setup, jobs, want = CASES[name]
    s = mixed()
    setup(s)
    assert outcome(s, *jobs) == want
    assert s.state.violations() == []


H100_LIMIT_2 = TeamQuota(guaranteed=4, models={"H100": ModelQuota(limit=2), "A100": ModelQuota(guaranteed=4)})

# name: (the team's quota, set up, the jobs asked about, what each got)
MODEL_CASES = {
    "untyped jobs go where the team is under its per-model guarantee first": (
        TeamQuota(guaranteed=4, models={"A100": ModelQuota(guaranteed=4)}),
        lambda s: s.submit("j", 2), ["j"], {"j": "A100"}),
    "then to the pools it named, then to the rest": (
        TeamQuota(guaranteed=2, models={"A100": ModelQuota(guaranteed=2)}),
        lambda s: (s.run("mine", ["a0/0", "a0/1"]), s.submit("j", 2)), ["j"], {"j": "A100"}),
    "the per-model limit sends an untyped job to the other pool": (
        H100_LIMIT_2, lambda s: (s.run("a4", ["a0/0", "a0/1", "a0/2"]), s.run("h2", ["h0/0", "h0/1"]),
                                 s.submit("j", 1)), ["j"], {"j": "A100"}),
    "a job its per-model limit bars on every pool it accepts waits and says why": (
        H100_LIMIT_2, lambda s: (s.run("h2", ["h0/0", "h0/1"]), s.submit("j", 1, gpu_type="H100")), ["j"],
        {"j": "waiting for 1 free H100 GPUs; team at its per-model limit on H100; A100 not accepted"}),
    "the limit caps a typed job's fallback too": (
        H100_LIMIT_2, lambda s: (s.run("a4", ["a0/0", "a0/1", "a0/2", "a0/3"]),
                                 s.submit("j", 3, gpu_type="H100", gpu_type_fallback=["A100"])), ["j"],
        {"j": "waiting for 3 free H100 or A100 GPUs; team at its per-model limit on H100; "
              "non-preemptible beyond its guarantee on A100 (the rest is guaranteed)"}),
}


@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_a_teams_per_model_terms_bound_where_its_jobs_go(name):
    quota, setup, jobs, want = MODEL_CASES[name]
    s = mixed(("a", quota))
    setup(s)
    assert outcome(s, *jobs) == want


B_OWNS_THE_H100S = TeamQuota(guaranteed=4, models={"H100": ModelQuota(guaranteed=4)})

# name: (team a's job, where it goes) while team b is guaranteed every H100 and holds none
FIRM_CASES = {
    "a non-preemptible job does not take another team's per-model guarantee": (
        {"gpu_type": "H100", "gpu_type_fallback": ["A100"]}, "A100"),
    "a preemptible one may borrow it": ({"gpu_type": "H100", "gpu_type_fallback": ["A100"], "preemptible": True}, "H100"),
    "an H100-only job that could never fit otherwise is not barred for ever (Firm's exception)": (
        {"gpu_type": "H100"}, "H100"),
}


@pytest.mark.parametrize("name", list(FIRM_CASES))
def test_per_model_guarantees_stay_reclaimable(name):
    spec, want = FIRM_CASES[name]
    s = mixed(("b", B_OWNS_THE_H100S), ("a", TeamQuota(models={"A100": ModelQuota(limit=4)})))
    s.submit("j", 2, team="a", **spec)
    assert outcome(s, "j") == {"j": want}


def test_a_job_the_per_model_rule_could_never_place_anywhere_is_not_barred_for_ever():
    # every GPU of both pools is guaranteed: a's 4-GPU job exceeds its guarantee plus the slack on
    # each (a sim of the Philly week stalled on such a head, its borrowers evicted 700 times)
    s = mixed(("b", B_OWNS_THE_H100S), ("c", TeamQuota(models={"A100": ModelQuota(guaranteed=2)})),
              ("a", TeamQuota(models={"A100": ModelQuota(guaranteed=2)})))
    s.submit("j", 4, team="a")
    assert outcome(s, "j") == {"j": "A100"}


def test_the_fold_counts_each_teams_holding_per_pool_and_forgets_what_is_released():
    s = mixed()
    s.run("x", ["h0/0", "a0/0", "a0/1"])
    assert s.state.teams["a"].pool_held == {"H100": 1, "A100": 2}
    s.finish("x", at=1.0)
    assert s.state.teams["a"].pool_held == {} and s.state.teams["a"].held == 0


def _admit_quota(state: ClusterState, quota: TeamQuota, only: list[str]):
    return admit(state, SetTeamQuota(request_id="q", team="a", quota=quota, only=only),  # type: ignore[arg-type]
                 2.0, AdmissionConfig(), Capacity())


def test_per_model_terms_are_keyed_by_pool_merged_per_pool_and_sum_to_the_guarantee():
    state = mixed().state
    d = _admit_quota(state, TeamQuota(models={"h100": ModelQuota(guaranteed=2, limit=3)}), ["models"])
    assert d.reply.ok and d.event.quota.models == {"H100": ModelQuota(2, 3)} and d.event.quota.guaranteed == 2
    state.apply(d.event)
    d = _admit_quota(state, TeamQuota(models={"A100-SXM4-80GB": ModelQuota(guaranteed=4)}), ["models"])
    assert d.event.quota.models == {"H100": ModelQuota(2, 3), "A100": ModelQuota(4)} and d.event.quota.guaranteed == 6
    state.apply(d.event)
    d = _admit_quota(state, TeamQuota(models={"H100": ModelQuota()}), ["models"])  # guarantee 0, no limit: removed
    assert d.event.quota.models == {"A100": ModelQuota(4)} and d.event.quota.guaranteed == 4


# name: (the quota asked for, `only`, the refusal or warning)
BAD_QUOTAS = {
    "a per-model guarantee over its limit": (TeamQuota(models={"H100": ModelQuota(guaranteed=3, limit=2)}), ["models"],
                                             "quota.models['H100'].guaranteed (3) exceeds its limit (2)"),
    "one pool named twice": (TeamQuota(models={"H100": ModelQuota(1), "h100": ModelQuota(2)}), ["models"],
                             "names pool H100 twice"),
    "a team guarantee beside per-model ones": (TeamQuota(guaranteed=3, models={"H100": ModelQuota(1)}),
                                               ["guaranteed", "models"], "its guarantee is their sum"),
}


@pytest.mark.parametrize("name", list(BAD_QUOTAS))
def test_bad_per_model_terms_are_refused_precisely(name):
    quota, only, why = BAD_QUOTAS[name]
    d = _admit_quota(mixed().state, quota, only)
    assert not d.reply.ok and why in d.reply.error


def test_guarantees_beyond_a_pool_warn():
    d = _admit_quota(mixed().state, TeamQuota(models={"H100": ModelQuota(guaranteed=6)}), ["models"])
    assert d.reply.ok and "guarantees on H100 add up to 6 GPUs, more than its 4" in d.reply.warning


def test_a_fallback_without_a_first_type_is_refused_and_an_old_reader_keeps_the_first():
    from gpusched.core.limits import spec_problem

    assert "needs spec.gpu_type" in (spec_problem(JobSpec(team="a", gpus=1, gpu_type_fallback=["A100"])) or "")
    stored = ev.encode_event(ev.JobSubmitted(at=1, job_id="j", spec=JobSpec(team="a", gpus=1, gpu_type="H100",
                                                                             gpu_type_fallback=["A100"])))
    raw = msgspec.json.decode(stored)
    assert raw["v"] == 5 and raw["spec"]["gpu_type"] == "H100"  # a v4 reader drops the fallback: H100 only


def test_the_simulators_mix_is_deterministic_and_shares_add_up():
    mix = parse_mix("H100=0.2,H100|A100=0.5")
    got = [types_of(f"job{i}", mix) for i in range(2000)]
    assert got == [types_of(f"job{i}", mix) for i in range(2000)]
    assert abs(got.count(("H100",)) / 2000 - 0.2) < 0.03 and abs(got.count(("H100", "A100")) / 2000 - 0.5) < 0.03
    with pytest.raises(ValueError, match="more than 1"):
        parse_mix("H100=0.7,A100=0.5")


def test_a_mixed_simulated_cluster_keeps_typed_jobs_on_their_pool_and_reports_each_pool(tmp_path):
    from dataclasses import replace

    from gpusched.sim.report import runtime_model, simulate
    from gpusched.sim.traces import TraceJob, load_quotas
    from gpusched.sim.world import Cluster

    quotas = tmp_path / "q.csv"
    quotas.write_text("team,guaranteed,weight,limit,model\na,2,1,2,H100\na,2,1,,A100\n")
    q = load_quotas(quotas)["a"]
    assert q.guaranteed == 4 and q.models == {"H100": ModelQuota(2, 2), "A100": ModelQuota(2)}
    cluster = replace(Cluster.parse("1x2x4"), models=("H100", "A100"))
    jobs = [TraceJob(f"j{i}", 0.0, 100.0, 2, "a", preemptible=False) for i in range(4)]
    types = {"j0": ("H100",), "j1": ("H100",), "j2": ("H100", "A100")}  # j3: any
    sim = simulate(jobs, cluster, "full", runtime_model("ideal"), quotas={"a": q}, job_types=types)
    pools = sim.summary()["pools"]
    assert {p: r["gpus"] for p, r in pools.items()} == {"A100": 4, "H100": 4}
    # the H100 limit 2 lets one H100 job run at a time: j2 and j3 take the A100s, j1 waits for j0
    assert pools["H100"]["jobs_started"] == 2 and pools["A100"]["jobs_started"] == 2
    assert pools["H100"]["gpu_hours_by_team"] == {"a": round(2 * 200 / 3600, 3)}
    assert sim.state.violations() == [] and sim.runs["j1"].first_start == 100.0


def test_accounting_splits_gpu_hours_by_pool():
    from gpusched.accounting import Ledger, gpu_hours_by_pool, job_records

    s, ledger = mixed(), Ledger()
    s.submit("x", 2)
    s.submit("y", 1)
    for e in [ev.GpusGranted(at=0.0, job_id="x", attempt=1, gpus=["h0/0", "h0/1"]),
              ev.JobCompleted(at=3600.0, job_id="x", attempt=1),
              ev.GpusGranted(at=3600.0, job_id="y", attempt=1, gpus=["a0/0"]),
              ev.JobCompleted(at=5400.0, job_id="y", attempt=1)]:
        s.apply(e)
        ledger.observe(s.state, e)
    assert gpu_hours_by_pool(ledger, 5400.0) == {"A100": {"a": 0.5}, "H100": {"a": 2.0}}
    rec = {r["job_id"]: r for r in job_records(s.state, ledger)}
    assert rec["x"]["gpu_hours_by_pool"] == {"H100": 2.0} and rec["y"]["gpu_hours_by_pool"] == {"A100": 0.5}
