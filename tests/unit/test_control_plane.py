"""The pure parts of the control-plane services: admission's decision, the last check before a
decision is appended (`own_decisions`), the reasons budget, entitled shares, policy overrides."""

from __future__ import annotations

import pytest

from gpusched.cli.stack import simulated_nodes
from gpusched.core import events as ev
from gpusched.core.commands import CancelJob, DrainNode, SetTeamQuota, SubmitJob
from gpusched.core.model import JobSpec, TeamQuota, TopologyConstraint
from gpusched.core.state import ClusterState
from gpusched.decider import PLACEMENT_KINDS, budget_reasons, own_decisions
from gpusched.services.admission import AdmissionConfig, Capacity, admit, decode, job_id_for
from gpusched.services.placement import policy_config
from gpusched.services.quota_ledger import entitled_shares, standings


def cluster(nodes: int = 2, gpus: int = 8, nvlink: str = "pairs") -> ClusterState:
    state = ClusterState()
    for e in simulated_nodes(nodes, gpus, 2, nvlink, at=1.0):
        state.apply(e)
    return state


def submit(state: ClusterState, job_id: str, team: str = "a", gpus: int = 1, **kw) -> None:
    state.apply(ev.JobSubmitted(at=2.0, job_id=job_id, spec=JobSpec(team=team, gpus=gpus, **kw)))


def grant(state: ClusterState, job_id: str, gpus: list[str]) -> None:
    state.apply(ev.GpusGranted(at=3.0, job_id=job_id, attempt=state.jobs[job_id].attempt + 1, gpus=gpus))


# --- admission -------------------------------------------------------------------------------

def _state_for_admission() -> ClusterState:
    state = cluster(2, 8)
    state.apply(ev.TeamQuotaSet(at=1.0, team="capped", quota=TeamQuota(limit=2)))
    submit(state, "j-done")
    state.apply(ev.JobCancelled(at=3.0, job_id="j-done"))
    state.requests["seen"] = "j-seen"
    return state


ADMIT_CASES = {
    "accepted": (SubmitJob(request_id="r1", spec=JobSpec(team="a", gpus=4)), True, ""),
    "repeat names the same job": (SubmitJob(request_id="seen", spec=JobSpec(team="a", gpus=1)), True, ""),
    "min above gang": (SubmitJob(request_id="r2", spec=JobSpec(team="a", gpus=2, min_gpus=3)), False,
                       "spec.min_gpus (3) exceeds spec.gpus (2)"),
    "preferred wider than required": (
        SubmitJob(request_id="r3", spec=JobSpec(team="a", gpus=2, topology=TopologyConstraint(required="node",
                                                                                                 preferred="rack"))),
        False, "spec.topology.preferred (rack) is wider than spec.topology.required (node)"),
    "over the team limit": (SubmitJob(request_id="r4", spec=JobSpec(team="capped", gpus=3)), False,
                            "team 'capped' has a limit of 2 GPUs; the job needs 3"),
    "elastic minimum within the limit": (SubmitJob(request_id="r5", spec=JobSpec(team="capped", gpus=8, min_gpus=2)),
                                         True, ""),
    "bigger than the cluster": (SubmitJob(request_id="r6", spec=JobSpec(team="a", gpus=17)), False,
                                "the cluster has 16 GPUs; the job needs 17"),
    "bigger than an NVLink pair": (
        SubmitJob(request_id="r7", spec=JobSpec(team="a", gpus=3, topology=TopologyConstraint(required="nvlink"))),
        False, "spec.topology.required is nvlink, but the largest NVLink domain has 2 GPUs; the job needs 3"),
    "cancel unknown": (CancelJob(request_id="c1", job_id="j-nope"), False, "unknown job 'j-nope'"),
    "cancel finished": (CancelJob(request_id="c2", job_id="j-done"), False, "job j-done already cancelled"),
    "quota above limit": (SetTeamQuota(request_id="q1", team="a", quota=TeamQuota(guaranteed=3, limit=2)), False,
                          "quota.guaranteed (3) exceeds quota.limit (2)"),
    "drain unknown node": (DrainNode(request_id="d1", node="x"), False, "unknown node 'x'"),
    "drain": (DrainNode(request_id="d2", node="node00"), True, ""),
}


@pytest.mark.parametrize("name", list(ADMIT_CASES))
def test_admit(name):
    command, ok, error = ADMIT_CASES[name]
    d = admit(_state_for_admission(), command, 10.0, AdmissionConfig(placeholders="any"), Capacity())
    assert d.reply.ok is ok, d.reply.error
    assert error in d.reply.error
    if isinstance(command, SubmitJob) and not ok:
        assert isinstance(d.event, ev.JobRejected) and d.msg_id == f"reject-{command.spec.team}/admin/{command.request_id}"
    if name == "repeat names the same job":
        assert d.event is None and d.reply.duplicate and d.reply.job_id == "j-seen"
    if name == "accepted":
        assert d.event.job_id == job_id_for("a/admin/r1", ClusterState()) and d.msg_id == "submit-a/admin/r1"


def test_unknown_teams_are_refused_unless_auto_created():
    submit = SubmitJob(request_id="r", spec=JobSpec(team="ghost", gpus=1))
    d = admit(_state_for_admission(), submit, 1.0, AdmissionConfig(placeholders="any"), Capacity())
    assert not d.reply.ok and "unknown team 'ghost'" in d.reply.error and "--auto-create-teams" in d.reply.error
    d = admit(_state_for_admission(), submit, 1.0, AdmissionConfig(auto_create_teams=True, placeholders="any"),
              Capacity())
    assert d.reply.ok and d.event.spec.team == "ghost"


def _quota_state() -> ClusterState:
    state = cluster(2, 8)  # 16 GPUs
    state.apply(ev.TeamQuotaSet(at=1.0, team="vision", quota=TeamQuota(guaranteed=8, weight=1.0, limit=12)))
    return state


# name: (command's quota, `only`, the quota the team ends with, a warning expected)
QUOTA_CASES = {
    "--weight 2 keeps the guarantee and the limit": (TeamQuota(weight=2.0), ["weight"], TeamQuota(8, 2.0, 12), False),
    "--no-limit removes only the limit": (TeamQuota(), ["limit"], TeamQuota(8, 1.0, None), False),
    "a whole quota replaces everything": (TeamQuota(guaranteed=2), [], TeamQuota(2, 1.0, None), False),
    "a new team starts from the default terms": (TeamQuota(limit=4), ["limit"], TeamQuota(0, 1.0, 4), False),
    "guarantees beyond the cluster are accepted with a warning": (
        TeamQuota(guaranteed=12), ["guaranteed"], TeamQuota(12, 1.0, 12), True),
}


@pytest.mark.parametrize("name", list(QUOTA_CASES))
def test_quota_changes_only_the_fields_given(name):
    quota, only, want, warns = QUOTA_CASES[name]
    state = _quota_state()
    team = "new" if "new team" in name else "vision"
    if warns:
        state.apply(ev.TeamQuotaSet(at=1.0, team="nlp", quota=TeamQuota(guaranteed=6)))
    d = admit(state, SetTeamQuota(request_id="q", team=team, quota=quota, only=only), 2.0, AdmissionConfig(),
              Capacity())
    assert d.reply.ok and d.event.quota == want
    assert bool(d.reply.warning) == warns
    if warns:
        assert "add up to 18 GPUs, more than the cluster's 16" in d.reply.warning


def test_a_partial_quota_is_still_checked_whole():
    d = admit(_quota_state(), SetTeamQuota(request_id="q", team="vision", quota=TeamQuota(guaranteed=13),
                                           only=["guaranteed"]), 2.0, AdmissionConfig(), Capacity())
    assert not d.reply.ok and "quota.guaranteed (13) exceeds quota.limit (12)" in d.reply.error


def test_job_ids_are_deterministic_and_avoid_collisions():
    state = ClusterState()
    first = job_id_for("req", state)
    assert first == job_id_for("req", state) and first.startswith("j-") and len(first) == 10
    assert job_id_for("req", state, taken={first: "another request"}) != first


def test_a_retried_submit_whose_reply_was_lost_is_answered_with_the_job_it_created():
    """The drills' "lost" submits: the first append landed, its reply did not; the retry came
    before admission's fold held the job, and the id it had just used looked like a collision,
    so the client was told of a job nobody created. An id this request took is its own."""
    state, cmd = _state_for_admission(), SubmitJob(request_id="r1", spec=JobSpec(team="a", gpus=1))
    first = admit(state, cmd, 1.0, AdmissionConfig(placeholders="any"), Capacity())
    retry = admit(state, cmd, 2.0, AdmissionConfig(placeholders="any"), Capacity(), {first.event.job_id: "a/admin/r1"})
    assert retry.reply.ok and retry.reply.job_id == retry.event.job_id == first.event.job_id
    assert retry.msg_id == first.msg_id == "submit-a/admin/r1"  # JetStream's dedupe answers it with the stored fact


def test_decode_names_the_field():
    assert decode("gpusched.cmd.submit", b'{"request_id":"x","spec":{"team":"a","gpus":"two"}}') == \
        "invalid SubmitJob: Expected `int`, got `str` - at `$.spec.gpus`"
    assert decode("gpusched.cmd.nope", b"{}").startswith("unknown command subject")


# --- the last check before an append ---------------------------------------------------------

def test_a_gpu_shrunk_twice_in_one_cycle_is_not_granted_twice():
    state = cluster(1, 8)
    submit(state, "elastic", gpus=8, min_gpus=2)
    grant(state, "elastic", [f"node00/{i}" for i in range(8)])
    submit(state, "x", gpus=2)
    submit(state, "y", gpus=2)
    freed = ["node00/6", "node00/7"]
    decided = [
        ev.JobResized(at=4.0, job_id="elastic", removed=freed), ev.GpusGranted(at=4.0, job_id="x", attempt=1, gpus=freed),
        ev.JobResized(at=4.0, job_id="elastic", removed=freed), ev.GpusGranted(at=4.0, job_id="y", attempt=1, gpus=freed),
    ]
    kept = own_decisions(state, decided, PLACEMENT_KINDS)
    assert kept == decided[:2]


def test_a_grant_that_needs_another_writers_release_waits():
    state = cluster(1, 4)
    submit(state, "low", gpus=4, preemptible=True)
    grant(state, "low", [f"node00/{i}" for i in range(4)])
    submit(state, "high", gpus=4)
    decided = [ev.GpusReleased(at=5.0, job_id="low", reason="preempted", forced=True),
               ev.GpusGranted(at=5.0, job_id="high", attempt=1, gpus=[f"node00/{i}" for i in range(4)])]
    assert own_decisions(state, decided, PLACEMENT_KINDS) == []
    assert own_decisions(state, decided, (ev.GpusReleased, ev.GpusGranted)) == decided


def test_limits_gang_sizes_and_states_are_checked():
    state = cluster(1, 8)
    state.apply(ev.TeamQuotaSet(at=1.0, team="a", quota=TeamQuota(limit=2)))
    submit(state, "j1", gpus=2)
    submit(state, "j2", gpus=1)
    submit(state, "j3", gpus=4)
    decided = [ev.GpusGranted(at=4.0, job_id="j1", attempt=1, gpus=["node00/0", "node00/1"]),
               ev.GpusGranted(at=4.0, job_id="j2", attempt=1, gpus=["node00/2"]),  # over the limit
               ev.GpusGranted(at=4.0, job_id="j3", attempt=1, gpus=["node00/3"]),  # not a whole gang
               ev.GpusGranted(at=4.0, job_id="j1", attempt=1, gpus=["node00/4", "node00/5"]),  # granted twice
               ev.JobPending(at=4.0, job_id="j2", reason="team a at its limit")]
    assert own_decisions(state, decided, PLACEMENT_KINDS) == [decided[0], decided[4]]


def test_reasons_are_budgeted_head_first():
    events = [ev.GpusGranted(at=1.0, job_id="g", attempt=1, gpus=["n/0"])] + [
        ev.JobPending(at=1.0, job_id=f"p{i}", reason="r") for i in range(5)]
    kept, deferred = budget_reasons(events, 2)
    assert [getattr(e, "job_id") for e in kept] == ["g", "p0", "p1"] and deferred == 3
    assert budget_reasons(events, None) == (events, 0)


# --- shares and policy overrides -------------------------------------------------------------

def test_entitled_shares_fill_by_weight_and_respect_limits():
    shares = entitled_shares(16, {"a": (4, 1.0, None), "b": (0, 1.0, 2), "c": (0, 2.0, None)})
    assert shares == pytest.approx({"a": 4 + 10 / 3, "b": 2.0, "c": 20 / 3})
    assert sum(shares.values()) == pytest.approx(16)


def test_standings_say_under_within_over_and_at_limit():
    state = cluster(1, 8)
    state.apply(ev.TeamQuotaSet(at=1.0, team="under", quota=TeamQuota(guaranteed=4)))
    state.apply(ev.TeamQuotaSet(at=1.0, team="capped", quota=TeamQuota(limit=1)))
    submit(state, "o", team="over", gpus=6)
    grant(state, "o", [f"node00/{i}" for i in range(6)])
    submit(state, "c", team="capped", gpus=1)
    grant(state, "c", ["node00/6"])
    rows = {s.team: s for s in standings(state, 10.0)}
    assert rows["under"].standing == "under" and rows["over"].standing == "over"
    assert rows["capped"].standing == "at_limit" and rows["over"].running_jobs == 1


def test_policy_overrides():
    config = policy_config("full", ["min_runtime_s=0", "backfill=false"])
    assert config.min_runtime_s == 0 and config.backfill is False
    with pytest.raises(SystemExit):
        policy_config("full", ["no_such_knob=1"])
    with pytest.raises(SystemExit):
        policy_config("nope")


def test_no_service_takes_the_usage_half_life_as_an_option():
    """The half-life changes what every fold computes: a fact of the log (`gpusched
    fold-settings`), never one process's `--policy-set half_life_s=...`, which would make its
    fold another cluster's. Every service refuses it at start, naming the command to use."""
    import argparse

    from gpusched.services import fallback, placement, preemptor, projector, quota_ledger, reader
    from gpusched.services.shell import refuse_fold_knobs

    for service in (placement, preemptor, projector, quota_ledger, fallback, reader):
        parser = argparse.ArgumentParser()
        service.add_arguments(parser)
        args = parser.parse_args(["--policy-set", "half_life_s=3600"])
        with pytest.raises(SystemExit, match="gpusched fold-settings"):
            refuse_fold_knobs(args)
        refuse_fold_knobs(parser.parse_args(["--policy-set", "min_runtime_s=0"]))  # other knobs stay options


def test_a_node_daemon_has_its_kill_grace_on_top_of_the_stop_grace():
    """Its orderly stop SIGKILLs a job that ignored SIGTERM after --kill-grace-s: it must not be
    cut off before (the job would outlive it); `up` waits longer than any of its services."""
    import argparse

    from gpusched.cli.stack import NODE_KILL_GRACE_S, STOP_TIMEOUT_S
    from gpusched.services.nodeagent.main import add_arguments
    from gpusched.services.shell import STOP_GRACE_S, stop_grace_s

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    agent = parser.parse_args([])
    assert stop_grace_s(agent) == STOP_GRACE_S + agent.kill_grace_s > agent.kill_grace_s
    assert stop_grace_s(argparse.Namespace()) == STOP_GRACE_S
    assert stop_grace_s(parser.parse_args(["--kill-grace-s", str(NODE_KILL_GRACE_S)])) < STOP_TIMEOUT_S
