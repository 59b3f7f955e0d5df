"""GPU models as pools (issue 30): canonical pool names, per-model team terms, and the ordered
fallback of a job that names several GPU types. Each scenario is a whole small mixed cluster:
node h0 has 4 H100, node a0 4 A100."""

from __future__ import annotations

import msgspec
import pytest

from gpusched.core import events as ev
from gpusched.core import rules
from gpusched.core.commands import SetTeamQuota
from gpusched.core.model import JobSpec, ModelQuota, TeamQuota
from gpusched.core.pools import canonical_model, parse_gpu_types
from gpusched.core.state import ClusterState
from gpusched.decider import PLACEMENT_KINDS, PREEMPTOR_KINDS, own_decisions
from gpusched.policy.config import DEFAULT
from gpusched.policy.explain import explain_pending
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
    assert raw["v"] >= 5 and raw["spec"]["gpu_type"] == "H100"  # a v4 reader drops the fallback: H100 only


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


# --- reclaim across teams judged per model -----------------------------------------------------

SPLIT = TeamQuota(guaranteed=4, models={"H100": ModelQuota(guaranteed=2), "A100": ModelQuota(guaranteed=2)})
A100_ONLY = TeamQuota(guaranteed=4, models={"A100": ModelQuota(guaranteed=4)})
LATER = 1000.0  # past `min_runtime_s`: the running jobs may be taken

# name: (team a's quota, team b's quota, what runs (job, team, GPUs, preemptible), a's job's spec,
#        the jobs asked to yield for it)
RECLAIM_CASES = {
    # a is at its total (4 A100 of 2 H100 + 2 A100), b under its (4 H100 of 4 A100)
    "under its H100 guarantee it reclaims H100s from a team over its own, whatever the totals": (
        SPLIT, A100_ONLY,
        [("mine", "a", ["a0/0", "a0/1", "a0/2", "a0/3"], True),
         ("b1", "b", ["h0/0", "h0/1"], True), ("b2", "b", ["h0/2", "h0/3"], True)],
        {"gpu_type": "H100"}, ["b1"]),
    "an H100 deficit takes no A100 from a team over its total": (
        SPLIT, TeamQuota(),
        [("mine", "a", ["a0/0", "a0/1"], False), ("b1", "b", ["a0/2", "a0/3"], True),
         ("b2", "b", ["h0/0", "h0/1", "h0/2", "h0/3"], False)],
        {"gpu_type": "A100"}, []),
    "under its A100 guarantee it reclaims A100s, whatever its H100s": (
        SPLIT, TeamQuota(),
        [("mine", "a", ["h0/0", "h0/1", "h0/2"], False), ("b1", "b", ["a0/0", "a0/1", "a0/2", "a0/3"], True)],
        {"gpu_type": "A100"}, ["b1"]),
    "b at its own H100 guarantee is not taken for a's H100 deficit": (
        SPLIT, TeamQuota(guaranteed=4, models={"H100": ModelQuota(guaranteed=4)}),
        [("mine", "a", ["a0/0", "a0/1"], False), ("b1", "b", ["h0/0", "h0/1", "h0/2", "h0/3"], True)],
        {"gpu_type": "H100"}, []),
    "teams without per-model terms reclaim by their totals, as before": (
        TeamQuota(guaranteed=4), TeamQuota(),
        [("mine", "a", ["a0/0", "a0/1"], False), ("b1", "b", ["a0/2", "a0/3"], True),
         ("b2", "b", ["h0/0", "h0/1", "h0/2", "h0/3"], False)],
        {"gpu_type": "A100"}, ["b1"]),
}


@pytest.mark.parametrize("name", list(RECLAIM_CASES))
def test_reclaim_across_teams_compares_per_model_guarantees(name):
    qa, qb, running, spec, want = RECLAIM_CASES[name]
    s = mixed(("a", qa), ("b", qb))
    for job, team, gpus, preemptible in running:
        s.run(job, gpus, team=team, preemptible=preemptible)
    s.now = LATER
    s.submit("j", 2, team="a", **spec)
    asked = [e.job_id for e in s.cycle("full") if isinstance(e, ev.PreemptionRequested)]
    assert asked == want
    assert s.state.violations() == []  # the fold judges the request as the policy did


def test_the_h100s_a_per_model_reclaim_frees_go_to_its_job_not_back_to_the_victims_team():
    s = mixed(("a", SPLIT), ("b", A100_ONLY))
    s.run("mine", ["a0/0", "a0/1", "a0/2", "a0/3"], team="a", preemptible=True)
    s.run("b1", ["h0/0", "h0/1"], team="b", preemptible=True, gpu_type="H100")
    s.run("b2", ["h0/2", "h0/3"], team="b", preemptible=True, gpu_type="H100")
    s.now = LATER
    s.submit("j", 2, team="a", gpu_type="H100")
    s.cycle("full")
    s.checkpoint("b1", LATER + 10)
    # b ranks first by its totals (under its 4) and b1 waits for H100s again, yet a's job gets them
    s.cycle("full", now=LATER + 10)
    st = s.state
    assert st.jobs["j"].gpus == ["h0/0", "h0/1"] and st.jobs["b1"].state == "pending"
    assert st.violations() == []


# --- the writer's re-check (decider.own_decisions, rules.BatchCheck) ---------------------

H100_CAP_2 = TeamQuota(models={"H100": ModelQuota(limit=2)})


def test_the_writers_recheck_holds_per_model_limits_as_it_holds_the_team_limit():
    s = mixed(("a", H100_CAP_2))
    s.run("e", ["a0/3"], size=2, min_gpus=1)  # elastic, on an A100
    for job, spec in {"j1": {"gpus": 2}, "j2": {"gpus": 1}, "j3": {"gpus": 2}, "f": {"gpus": 1, "gpu_fraction": 0.5},
                      "k": {"gpus": 1, "team": "b"}}.items():
        s.submit(job, **spec)
    decided = [ev.GpusGranted(at=1, job_id="j1", attempt=1, gpus=["h0/0", "h0/1"]),  # a's 2 H100: at its limit
               ev.GpusGranted(at=1, job_id="j2", attempt=1, gpus=["h0/2"]),  # a third H100
               ev.GpusGranted(at=1, job_id="j3", attempt=1, gpus=["a0/0", "a0/1"]),  # A100: no limit there
               ev.JobResized(at=1, job_id="e", added=["h0/3"]),  # growing into an H100
               ev.GpusGranted(at=1, job_id="f", attempt=1, gpus=["h0/2"]),  # half an H100
               ev.GpusGranted(at=1, job_id="k", attempt=1, gpus=["h0/2"])]  # team b has no per-model terms
    assert own_decisions(s.state, decided, PLACEMENT_KINDS) == [decided[0], decided[2], decided[5]]
    problems = []
    check = rules.BatchCheck(s.state)
    for e in decided:
        problems.append(check.problem(e))
    assert problems == [None, "grant beyond team a's per-model limit on H100", None,
                        "grow beyond team a's per-model limit on H100", "grant beyond team a's per-model limit on H100",
                        None]


def test_the_writers_recheck_judges_a_preemption_on_the_victims_pool():
    # totals call it fair (b at its 4, a under its 4), but on H100 b is at its guarantee and a at its own
    s = mixed(("a", SPLIT), ("b", TeamQuota(guaranteed=4, models={"H100": ModelQuota(guaranteed=4)})))
    s.run("mine", ["h0/0", "h0/1"], team="a")
    s.run("b1", ["h0/2", "h0/3"], team="b", preemptible=True)
    s.run("b2", ["a0/0", "a0/1"], team="b", preemptible=True)
    s.submit("j", 2, team="a", gpu_type="H100")
    on_h100 = ev.PreemptionRequested(at=1, job_id="b1", for_job="j", reason="r", deadline=9)
    assert rules.BatchCheck(s.state).problem(on_h100) == "unfair preemption of team b for team a"
    # on A100, b holds 2 beyond its (zero) guarantee there: fair
    on_a100 = ev.PreemptionRequested(at=1, job_id="b2", for_job="j", reason="r", deadline=9)
    assert own_decisions(s.state, [on_a100], PREEMPTOR_KINDS) == [on_a100]


# --- what `show` says of per-model terms (policy/explain.py) -----------------------------------

def test_show_names_the_per_model_limit_that_stops_a_job_and_what_would_unblock_it():
    s = mixed(("a", H100_CAP_2))
    s.run("h2", ["h0/0", "h0/1"])
    s.submit("j", 1, gpu_type="H100")
    x = explain_pending(s.state, "j")  # before any cycle: no reason recorded yet
    assert x["pools"]["at_limit"] == ["H100"] and x["summary"] == "team a at its per-model limit on H100"
    assert "team a holds 2 of its per-model limit 2 on H100: 1 of its H100 GPUs must free up, or that limit be " \
           "raised to 3" in x["unblock"]
    s.submit("any", 1)  # untyped: the A100s are open to it, so no limit stops it
    assert explain_pending(s.state, "any")["summary"] != "team a at its per-model limit on H100"


def test_show_counts_what_may_be_reclaimed_per_model():
    # a is at its total guarantee but under on H100: b's H100s are reclaimable for an H100 job,
    # b's A100s never are (the job does not accept them), whatever the totals say; and only
    # once b1 has run `min_runtime_s`, as the rule takes it
    s = mixed(("a", SPLIT), ("b", A100_ONLY))
    s.run("mine", ["a0/0", "a0/1", "a0/2", "a0/3"], team="a", preemptible=True)
    s.run("b1", ["h0/0", "h0/1"], team="b", preemptible=True)
    s.submit("j", 2, team="a", gpu_type="H100")
    assert explain_pending(s.state, "j")["reclaimable_gpus"] == 0
    x = explain_pending(s.state, "j", now=s.state.now + DEFAULT.min_runtime_s)
    assert x["reclaimable_gpus"] == 2 and x["pools"]["under_guarantee"] == ["H100"]


def test_an_elastic_job_grows_and_a_share_lands_only_within_the_per_model_limit():
    s = mixed(("a", H100_CAP_2))
    s.run("e", ["h0/0"], size=4, min_gpus=1)  # elastic, one H100 of its limit 2
    s.cycle("full")  # nothing waits: it grows into one more H100, not three
    assert s.state.jobs["e"].gpus == ["h0/0", "h0/1"]
    s.submit("f", 1, gpu_fraction=0.5)  # a third H100, even half of one, is past the limit: an A100 then
    s.cycle("full")
    assert canonical_model(s.state.gpus[s.state.jobs["f"].gpus[0]].model) == "A100"
    assert s.state.violations() == []


def test_an_elastic_job_grows_only_on_its_own_pool_and_type():
    s = mixed()
    s.run("e", ["h0/0", "h0/1", "h0/2", "h0/3"], size=8, min_gpus=2)  # on the full H100 node, 4 A100s idle
    s.cycle("full")
    assert s.state.jobs["e"].gpus == ["h0/0", "h0/1", "h0/2", "h0/3"]  # a gang lives on one GPU model
    s.run("t", ["a0/0"], size=4, min_gpus=1, gpu_type="A100")
    s.cycle("full")  # it grows into the other A100s, the only GPUs of its type
    assert sorted(s.state.jobs["t"].gpus) == ["a0/0", "a0/1", "a0/2", "a0/3"]
    assert s.state.violations() == []
