"""Job features users expect from Slurm: hold/release, updating a pending job, dependencies,
per-team default and maximum time limits. The fold, the policy's reasons and admission's
decisions (the pure parts; over NATS in tests/e2e/test_job_features.py)."""

from __future__ import annotations

import pytest

from gpusched.core import events as ev
from gpusched.core.commands import HoldJob, SetTeamQuota, SubmitJob, UpdateJob
from gpusched.core.model import Dependency, JobSpec, TeamQuota
from gpusched.core.reasons import DependencyNever, DependencyWait, Held, NoRoom
from gpusched.policy.config import PRESETS
from gpusched.services.admission import ADMIN, AdmissionConfig, Caller, Capacity, admit

from .policy_helpers import Scenario, grants

PRESET_NAMES = list(PRESETS)


def _scene() -> Scenario:
    s = Scenario(racks=1, nodes=1, gpus=8)
    s.team("a")
    return s


# --- hold / release -----------------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_a_held_job_is_never_placed_and_blocks_nobody(preset):
    s = _scene()
    s.submit("held", gpus=4, at=1.0)
    s.submit("next", gpus=4, at=2.0)
    s.apply(ev.JobHeld(at=3.0, job_id="held", user="alice", reason="data not ready"))
    out = s.cycle(preset, now=4.0)
    assert set(grants(out)) == {"next"}  # even strict FIFO: a held head does not block
    job = s.state.jobs["held"]
    assert job.state == "pending" and job.pending_why == Held("alice: data not ready")
    assert "held by alice: data not ready" in job.pending_reason
    s.apply(ev.JobHeld(at=5.0, job_id="held", held=False, user="alice"))
    assert s.state.jobs["held"].hold is None
    assert set(grants(s.cycle(preset, now=6.0))) == {"held"}


def test_hold_of_a_running_job_changes_nothing_in_the_fold():
    s = _scene()
    s.run("r", [f"r0n0/{i}" for i in range(2)], at=1.0)
    s.apply(ev.JobHeld(at=2.0, job_id="r", user="alice"))
    assert s.state.jobs["r"].hold is None


def test_a_held_job_is_never_preempted_for():
    s = _scene()
    s.run("low", [f"r0n0/{i}" for i in range(8)], at=1.0, priority="low", preemptible=True)
    s.submit("urgent", gpus=8, at=2.0, priority="interactive")
    s.apply(ev.JobHeld(at=2.5, job_id="urgent"))
    out = s.cycle("full", now=3.0)
    assert not [e for e in out if isinstance(e, ev.PreemptionRequested)]


# --- update -------------------------------------------------------------------------------------

def test_update_changes_priority_and_the_queue_reorders():
    s = _scene()
    s.run("busy", [f"r0n0/{i}" for i in range(8)], at=0.5, time_limit_s=100.0)
    s.submit("first", gpus=8, at=1.0)
    s.submit("second", gpus=8, at=2.0, time_limit_s=50.0)
    s.cycle("preempt", now=3.0)  # builds the queue index: first is ahead
    s.apply(ev.JobUpdated(at=4.0, job_id="second", priority="high", time_limit_s=30.0))
    job = s.state.jobs["second"]
    assert (job.spec.priority, job.spec.time_limit_s, job.updates) == ("high", 30.0, 1)
    s.finish("busy", at=5.0)
    assert set(grants(s.cycle("preempt", now=6.0))) == {"second"}


def test_update_of_a_job_that_started_is_a_no_op_in_the_fold():
    s = _scene()
    s.run("r", ["r0n0/0"], at=1.0)
    s.apply(ev.JobUpdated(at=2.0, job_id="r", priority="high"))
    assert s.state.jobs["r"].spec.priority == "normal"


# --- dependencies -------------------------------------------------------------------------------

def _dep(kind: str, job: str) -> list[Dependency]:
    return [Dependency(kind, job)]  # type: ignore[arg-type]


def test_afterok_waits_for_success_then_starts():
    s = _scene()
    s.run("pre", ["r0n0/0"], at=1.0)
    s.submit("post", gpus=1, at=2.0, dependency=_dep("afterok", "pre"))
    assert "post" not in grants(s.cycle("full", now=3.0))
    job = s.state.jobs["post"]
    assert job.pending_why == DependencyWait(["afterok:pre"])
    assert job.pending_blockers == ["pre"]
    s.finish("pre", at=4.0)
    assert "post" in grants(s.cycle("full", now=5.0))


@pytest.mark.parametrize("end", ["failed", "cancelled"])
def test_afterok_on_a_job_that_did_not_succeed_can_never_start(end):
    s = _scene()
    s.submit("pre", gpus=1, at=1.0, command=["x"])
    s.apply(ev.JobHeld(at=1.5, job_id="pre"))
    s.submit("post", gpus=1, at=2.0, dependency=_dep("afterok", "pre"))
    s.submit("any", gpus=1, at=2.0, dependency=_dep("afterany", "pre"))
    if end == "failed":
        s.apply(ev.JobHeld(at=2.5, job_id="pre", held=False))
        s.cycle("full", now=3.0)
        s.apply(ev.JobFailed(at=3.5, job_id="pre", attempt=1, reason="exit code 1"))
    else:
        s.apply(ev.JobCancelled(at=3.5, job_id="pre"))
    out = s.cycle("full", now=4.0)
    assert set(grants(out)) == {"any"}  # afterany: ended any way is enough
    post = s.state.jobs["post"]
    assert post.state == "pending" and post.pending_why == DependencyNever([f"pre {end}"])
    assert "can never be satisfied" in post.pending_reason


def test_a_dependent_job_gets_no_reservation_and_backfill_is_unchanged():
    s = _scene()
    s.run("big", [f"r0n0/{i}" for i in range(6)], at=1.0, time_limit_s=100.0)
    s.submit("dep", gpus=8, at=2.0, dependency=_dep("afterany", "big"))
    s.submit("small", gpus=2, at=3.0)
    out = s.cycle("full", now=4.0)
    assert set(grants(out)) == {"small"}  # not held back behind a reservation for "dep"
    assert s.state.jobs["dep"].pending_why == DependencyWait(["afterany:big"])


def test_an_unreached_job_gets_its_own_reason_in_the_tail():
    s = _scene()
    s.run("all", [f"r0n0/{i}" for i in range(8)], at=1.0)
    for i in range(30):
        s.submit(f"q{i}", gpus=8, at=2.0 + i)
    s.submit("h", gpus=1, at=50.0)
    s.apply(ev.JobHeld(at=51.0, job_id="h"))
    s.cycle("full", now=52.0)
    assert isinstance(s.state.jobs["q29"].pending_why, NoRoom)
    assert s.state.jobs["h"].pending_why == Held("admin")


# --- admission: hold/update/time limits/dependencies ---------------------------------------------

def _admission_state():
    s = _scene()
    s.apply(ev.TeamQuotaSet(at=0.0, team="b", quota=TeamQuota(default_time_limit_s=600.0, max_time_limit_s=3600.0)))
    s.submit("pa", gpus=1, at=1.0)
    s.submit("pb", gpus=1, at=1.0, team="b")
    s.run("ra", ["r0n0/7"], at=1.0)
    return s.state


def _admit(state, cmd, caller=ADMIN):
    return admit(state, cmd, 10.0, AdmissionConfig(placeholders="any"), Capacity(), caller=caller)


def test_hold_release_and_update_are_for_pending_jobs_of_ones_own_team():
    st = _admission_state()
    d = _admit(st, HoldJob(request_id="h1", job_id="pa", reason="wait"), Caller("alice", "a"))
    assert d.reply.ok and d.event == ev.JobHeld(at=10.0, job_id="pa", reason="wait", user="alice")
    assert d.msg_id == "hold-a/alice/h1"  # request ids are scoped by team and user
    d = _admit(st, HoldJob(request_id="h2", job_id="pb"), Caller("alice", "a"))
    assert not d.reply.ok and "belongs to team 'b'" in d.reply.error and d.event is None
    assert _admit(st, HoldJob(request_id="h3", job_id="pb")).reply.ok  # admin: any team
    d = _admit(st, HoldJob(request_id="h4", job_id="ra"))
    assert d.reply.error == "cannot hold job ra: it is running, not pending"
    assert _admit(st, HoldJob(request_id="h5", job_id="pa", hold=False)).reply.error == "job pa is not held"
    assert _admit(st, HoldJob(request_id="h6", job_id="nope")).reply.error == "unknown job 'nope'"
    d = _admit(st, UpdateJob(request_id="u1", job_id="pa", priority="high"), Caller("alice", "a"))
    assert d.reply.ok and d.event == ev.JobUpdated(at=10.0, job_id="pa", priority="high", user="alice")
    assert _admit(st, UpdateJob(request_id="u2", job_id="ra", priority="high")).reply.error == (
        "cannot update job ra: it is running, not pending")
    assert _admit(st, UpdateJob(request_id="u3", job_id="pa")).reply.error.startswith("nothing to update")
    d = _admit(st, UpdateJob(request_id="u4", job_id="pb", time_limit_s=7200.0))
    assert d.reply.error == "spec.time_limit_s (7200 s) exceeds the team's maximum time limit (3600 s)"


def test_team_time_limits_default_and_maximum_at_submit():
    st = _admission_state()
    d = _admit(st, SubmitJob(request_id="s1", spec=JobSpec(team="b", gpus=1)))
    assert d.reply.ok and d.event.spec.time_limit_s == 600.0  # the team's default
    d = _admit(st, SubmitJob(request_id="s2", spec=JobSpec(team="b", gpus=1, time_limit_s=3600.0)))
    assert d.reply.ok and d.event.spec.time_limit_s == 3600.0
    d = _admit(st, SubmitJob(request_id="s3", spec=JobSpec(team="b", gpus=1, time_limit_s=3601.0)))
    assert d.reply.error == "spec.time_limit_s (3601 s) exceeds the team's maximum time limit (3600 s)"
    assert isinstance(d.event, ev.JobRejected)
    d = _admit(st, SubmitJob(request_id="s4", spec=JobSpec(team="a", gpus=1)))
    assert d.reply.ok and d.event.spec.time_limit_s is None  # no team default: unchanged
    d = _admit(st, SetTeamQuota(request_id="q1", team="b", quota=TeamQuota(default_time_limit_s=7200.0),
                                only=["default_time_limit_s"]))
    assert d.reply.error == "quota.default_time_limit_s (7200) exceeds quota.max_time_limit_s (3600)"
    d = _admit(st, SetTeamQuota(request_id="q2", team="b", quota=TeamQuota(max_time_limit_s=60.0),
                                only=["max_time_limit_s"]))
    assert not d.reply.ok
    d = _admit(st, SetTeamQuota(request_id="q3", team="b", quota=TeamQuota(default_time_limit_s=None),
                                only=["default_time_limit_s"]))
    assert d.reply.ok and d.event.quota == TeamQuota(max_time_limit_s=3600.0)
    st.apply(d.event)
    d = _admit(st, SubmitJob(request_id="s5", spec=JobSpec(team="b", gpus=1)))
    assert "no default: give spec.time_limit_s" in d.reply.error


def test_dependencies_must_name_known_jobs():
    st = _admission_state()
    spec = JobSpec(team="a", gpus=1, dependency=[Dependency("afterok", "pa"), Dependency("afterany", "ghost")])
    d = _admit(st, SubmitJob(request_id="d1", spec=spec))
    assert d.reply.error == "spec.dependency: unknown job 'ghost' (afterany:ghost)"
    d = _admit(st, SubmitJob(request_id="d2", spec=JobSpec(team="a", gpus=1, dependency=_dep("afterok", "pa"))))
    assert d.reply.ok


def test_submit_parses_slurm_style_dependencies():
    from gpusched.cli.commands import dependencies_from_arg

    assert dependencies_from_arg("afterok:j-1:j-2,afterany:j-3") == [
        {"kind": "afterok", "job": "j-1"}, {"kind": "afterok", "job": "j-2"}, {"kind": "afterany", "job": "j-3"}]
    with pytest.raises(SystemExit, match="is not afterok:JOB or afterany:JOB"):
        dependencies_from_arg("after:j-1")


# --- `gpusched show` ------------------------------------------------------------------------------

def test_show_explains_held_and_dependency_waits():
    from gpusched.cli.render import _why_lines
    from gpusched.policy.explain import explain_pending

    s = _scene()
    s.run("pre", ["r0n0/0"], at=1.0)
    s.submit("held", gpus=1, at=2.0)
    s.apply(ev.JobHeld(at=2.5, job_id="held", user="alice", reason="data not ready"))
    s.submit("post", gpus=1, at=3.0, dependency=_dep("afterok", "pre"))
    s.cycle("full", now=4.0)
    x = explain_pending(s.state, "held", 4.0)
    assert x["summary"] == "held by alice: data not ready (`gpusched release JOB` lets it start)"
    assert x["unblock"][0].startswith("`gpusched release JOB`") and x["eta_s"] is None
    assert x["policy"]["why"] == {"kind": "held", "by": "alice: data not ready"}
    y = explain_pending(s.state, "post", 4.0)
    assert y["summary"] == "dependency not satisfied yet: waiting for afterok:pre"
    assert y["dependency"] == ["afterok:pre (running)"]
    lines = _why_lines(y, {"submitted_at": 3.0}, 4.0)
    assert any("dependencies: afterok:pre (running)" in line for line in lines)
    assert "held by alice" in " ".join(_why_lines(x, {"submitted_at": 2.0}, 4.0))
    s.apply(ev.JobFailed(at=5.0, job_id="pre", attempt=1, reason="exit code 1"))
    s.cycle("full", now=6.0)
    z = explain_pending(s.state, "post", 6.0)
    assert z["summary"] == "dependency can never be satisfied: pre failed (cancel the job)"


# --- GPU type and node labels -----------------------------------------------------------------------

def _mixed() -> Scenario:
    """Two nodes: r0n0 with A100s, r0n1 with H100s labelled zone=b."""
    from gpusched.core.model import GpuInfo

    s = Scenario(racks=0)
    for name, model in (("r0n0", "NVIDIA A100-SXM4-80GB"), ("r0n1", "NVIDIA H100 80GB HBM3")):
        s.apply(ev.NodeRegistered(at=0.0, node=name, rack="r0", nvlink="all",
                                  gpus=[GpuInfo(index=i, uuid=f"{name}-{i}", model=model) for i in range(8)]))
    s.apply(ev.NodeLabeled(at=0.0, node="r0n1", labels={"zone": "b", "x": "1"}, remove=["x"]))
    s.team("a")
    return s


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_gpu_type_and_constraints_place_only_on_matching_nodes(preset):
    s = _mixed()
    assert s.state.nodes["r0n1"].labels == {"zone": "b"}
    s.submit("h", gpus=2, at=1.0, gpu_type="h100")
    s.submit("z", gpus=2, at=1.0, constraints={"zone": "b"})
    s.submit("a", gpus=2, at=1.0, gpu_type="A100")
    g = grants(s.cycle(preset, now=2.0))
    assert {n.split("/")[0] for n in g["h"] + g["z"]} == {"r0n1"}
    assert {n.split("/")[0] for n in g["a"]} == {"r0n0"}


def test_a_constrained_job_waits_for_its_nodes_and_a_job_nobody_matches_says_so():
    from gpusched.core.reasons import NoMatchingNode

    s = _mixed()
    s.run("busy", [f"r0n1/{i}" for i in range(8)], at=1.0, time_limit_s=100.0)
    s.submit("h", gpus=4, at=2.0, gpu_type="H100")
    s.submit("never", gpus=1, at=2.0, constraints={"zone": "c"})
    s.submit("big", gpus=9, at=2.0, gpu_type="H100")
    s.submit("free", gpus=4, at=3.0, time_limit_s=1000.0)
    out = s.cycle("full", now=4.0)
    g = grants(out)
    assert "h" not in g and "never" not in g  # 8 A100s free, but it asked for H100s
    assert {n.split("/")[0] for n in g["free"]} == {"r0n0"}
    assert s.state.jobs["h"].pending_reason.startswith("waiting for 4 H100 GPUs; 0 free")  # free on its nodes
    assert s.state.jobs["h"].pending_reason.endswith("; A100 not accepted")
    assert s.state.jobs["never"].pending_why == NoMatchingNode("zone=c", 1)
    assert s.state.jobs["never"].pending_reason == "no node matches constraint zone=c with 1 GPUs"
    assert s.state.jobs["big"].pending_why == NoMatchingNode("gpu_type=H100", 9)
    s.finish("busy", at=5.0)
    assert "h" in grants(s.cycle("full", now=6.0))


def test_the_reservation_of_a_constrained_head_is_on_its_nodes():
    s = _mixed()
    s.run("a-job", [f"r0n0/{i}" for i in range(8)], at=1.0, time_limit_s=50.0)
    s.run("h-job", [f"r0n1/{i}" for i in range(8)], at=1.0, time_limit_s=500.0)
    s.submit("head", gpus=8, at=2.0, gpu_type="H100")
    s.cycle("full", now=3.0)
    assert s.state.jobs["head"].pending_blockers == ["h-job"]  # not the A100 job that ends sooner
    s.finish("a-job", at=60.0)
    s.submit("short", gpus=8, at=60.0, time_limit_s=100.0)
    assert "short" in grants(s.cycle("full", now=61.0))  # the A100s are not reserved for the head


def test_admission_labels_nodes_and_refuses_constraints_nobody_matches():
    from gpusched.core.commands import LabelNode

    st = _mixed().state
    d = _admit(st, LabelNode(request_id="l1", node="r0n0", labels={"zone": "a"}, remove=["old"]))
    assert d.reply.ok and d.event == ev.NodeLabeled(at=10.0, node="r0n0", labels={"zone": "a"}, remove=["old"])
    assert _admit(st, LabelNode(request_id="l2", node="ghost", labels={"k": "v"})).reply.error == "unknown node 'ghost'"
    d = _admit(st, LabelNode(request_id="l3", node="r0n0", labels={"k": "v"}), Caller("alice", "a"))
    assert d.reply.error == "LabelNode needs the admin role"
    d = _admit(st, SubmitJob(request_id="s1", spec=JobSpec(team="a", gpus=1, gpu_type="V100")))
    assert d.reply.error.startswith("no node matches constraint gpu_type=V100 with 1 GPUs")
    assert _admit(st, SubmitJob(request_id="s2", spec=JobSpec(team="a", gpus=8, gpu_type="H100",
                                                               constraints={"zone": "b"}))).reply.ok


# --- job arrays ----------------------------------------------------------------------------------

def test_an_array_folds_into_tasks_with_their_index_and_runs_at_most_max_at_once():
    from gpusched.core.model import ArraySpec
    from gpusched.core.reasons import ArrayLimit

    s = _scene()
    s.apply(ev.JobSubmitted(at=1.0, job_id="arr", request_id="r1",
                            spec=JobSpec(team="a", gpus=1, env={"A": "1"}, array=ArraySpec(0, 5, 2))))
    tasks = [f"arr_{i}" for i in range(6)]
    assert list(s.state.pending) == tasks and s.state.requests["r1"] == "arr"
    t3 = s.state.jobs["arr_3"]
    assert (t3.array_job, t3.spec.env["GPUSCHED_ARRAY_INDEX"], t3.spec.env["SLURM_ARRAY_TASK_ID"],
            t3.spec.env["A"]) == ("arr", "3", "3", "1")
    assert set(grants(s.cycle("full", now=2.0))) == {"arr_0", "arr_1"}  # 8 GPUs free, at most 2 running
    assert s.state.jobs["arr_2"].pending_why == ArrayLimit("arr", 2)
    assert s.state.jobs["arr_2"].pending_reason == "array arr has 2 tasks running, its limit"
    s.finish("arr_0", at=3.0)
    assert set(grants(s.cycle("full", now=4.0))) == {"arr_2"}


def test_array_parsing_and_admission_bounds():
    from gpusched.cli.commands import array_from_arg
    from gpusched.core.model import ArraySpec

    assert array_from_arg("0-99%10") == {"first": 0, "last": 99, "max_running": 10}
    assert array_from_arg("7") == {"first": 7, "last": 7}
    with pytest.raises(SystemExit, match="is not FIRST-LAST"):
        array_from_arg("a-b")
    st = _admission_state()
    d = _admit(st, SubmitJob(request_id="a1", spec=JobSpec(team="a", gpus=1, array=ArraySpec(5, 1))))
    assert d.reply.error == "spec.array: first index 5 is after the last 1"
    d = _admit(st, SubmitJob(request_id="a2", spec=JobSpec(team="a", gpus=1, array=ArraySpec(0, 1000))))
    assert d.reply.error == "spec.array has 1001 tasks; at most 1000"
    d = _admit(st, SubmitJob(request_id="a3", spec=JobSpec(team="a", gpus=1, array=ArraySpec(0, 9, 3))))
    assert d.reply.ok and d.event.spec.array == ArraySpec(0, 9, 3)


def test_the_job_read_model_shows_the_features():
    from gpusched import readmodel

    s = _mixed()
    s.submit("pre", gpus=1, at=1.0)
    s.submit("j", gpus=1, at=1.0, gpu_type="H100", constraints={"zone": "b"}, dependency=_dep("afterok", "pre"))
    s.apply(ev.JobHeld(at=2.0, job_id="j", user="bob"))
    doc = readmodel.job_doc(s.state, s.state.jobs["j"])
    assert (doc["held"], doc["dependency"], doc["gpu_type"], doc["constraints"], doc["array_job"]) == (
        "bob", ["afterok:pre"], "H100", {"zone": "b"}, None)
    assert readmodel.node_doc(s.state, "r0n1")["labels"] == {"zone": "b"}


def test_the_writers_recheck_refuses_a_grant_to_a_job_held_meanwhile():
    from gpusched.core.rules import BatchCheck

    s = _scene()
    s.submit("j", gpus=1, at=1.0)
    grant = ev.GpusGranted(at=2.0, job_id="j", attempt=1, gpus=["r0n0/0"])
    assert BatchCheck(s.state).problem(grant) is None
    s.apply(ev.JobHeld(at=2.0, job_id="j", user="alice"))
    assert BatchCheck(s.state).problem(grant) == "grant to a held job (alice)"


def test_cancelling_an_array_id_cancels_its_live_tasks_once_and_only_for_its_team():
    from gpusched.core.commands import CancelJob
    from gpusched.core.model import ArraySpec

    st = _admission_state()
    st.apply(ev.JobSubmitted(at=1.0, job_id="arr", request_id="r1", spec=JobSpec(team="a", gpus=1, array=ArraySpec(0, 3))), 90)
    st.apply(ev.JobCancelled(at=2.0, job_id="arr_1"), 91)
    d = _admit(st, CancelJob(request_id="c1", job_id="arr", reason="wrong data"))
    facts = [d.event, *(e for e, _ in d.more)]
    assert d.reply.ok and [e.job_id for e in facts] == ["arr_0", "arr_2", "arr_3"]
    assert {e.reason for e in facts} == {"wrong data"}
    assert [d.msg_id, *(m for _, m in d.more)] == ["cancel-/admin/c1-arr_0", "cancel-/admin/c1-arr_2", "cancel-/admin/c1-arr_3"]
    other = admit(st, CancelJob(request_id="c2", job_id="arr"), 3.0, AdmissionConfig(), Capacity(), caller=Caller("eve", "b"))
    assert not other.reply.ok and other.reply.error.endswith("these credentials act for 'b'")
    assert _admit(st, CancelJob(request_id="c3", job_id="nope")).reply.error == "unknown job 'nope'"
