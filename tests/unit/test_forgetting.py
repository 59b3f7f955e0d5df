"""The fold forgets finished jobs past a horizon of log time: only a tombstone stays, every
replica (and a snapshot + tail) forgets the same jobs, and what refers to old jobs still works."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings

from gpusched.core import events as ev
from gpusched.core.fold.arrays import array_tasks
from gpusched.core.model import Dependency, GpuInfo, JobSpec, TeamQuota
from gpusched.core.state import ClusterState, Tombstone
from gpusched.policy.eligibility import dependency_reason

from .fold_gen import legal_events

DAY = 24 * 3600.0


def node(at: float = 0.0) -> ev.NodeRegistered:
    return ev.NodeRegistered(at=at, node="n0", rack="r0", gpus=[GpuInfo(index=k, uuid=f"G-{k}") for k in range(4)])


def life(job: str, at: float, end: type = ev.JobCompleted, fenced: bool = True, **spec) -> list[ev.Event]:
    """Submit, grant, start, end (and the node's report that the processes are gone)."""
    out: list[ev.Event] = [
        ev.JobSubmitted(at=at, job_id=job, spec=JobSpec(team="a", gpus=1, **spec), request_id=f"r-{job}"),
        ev.GpusGranted(at=at, job_id=job, attempt=1, gpus=["n0/0"]),
        ev.JobStarted(at=at, job_id=job, attempt=1, node="n0", pids=[1]),
        ev.JobFailed(at=at + 10, job_id=job, attempt=1, node="n0", reason="exit code 1") if end is ev.JobFailed
        else end(at=at + 10, job_id=job, attempt=1, node="n0"),
    ]
    if fenced:
        out.append(ev.ProcessesEnded(at=at + 10, job_id=job, attempt=1, node="n0"))
    return out


def tick(at: float) -> ev.Event:
    """Any later fact moves the fold's clock."""
    return ev.TeamQuotaSet(at=at, team="a", quota=TeamQuota())


def fold(events, horizon: float | None) -> ClusterState:
    st = ClusterState(forget_after_s=horizon)
    for e in events:
        st.apply(e)
    return st


def test_a_finished_job_past_the_horizon_keeps_only_its_tombstone():
    events = [node(), *life("old", 0.0), *life("new", 20 * DAY)]
    st = fold(events, 10 * DAY)
    assert "old" not in st.jobs and "new" in st.jobs
    assert st.forgotten["old"] == Tombstone("completed", 10.0, "r-old", "a", "")
    assert st.job_status("old") == "completed" and st.knows("old") and not st.knows("never")
    assert st.job_counts()["completed"] == 2  # forgotten jobs still count
    assert st.requests["r-old"] == "old"  # a retried submit is still answered with its job
    whole = fold(events, None)
    assert set(whole.jobs) == {"old", "new"} and not whole.forgotten
    assert st.violations() == whole.violations() == []
    assert len(st.snapshot()) < len(whole.snapshot())


def test_the_horizon_is_log_time():
    st = fold([node(), *life("a", 0.0), tick(10 * DAY)], 10 * DAY)
    assert "a" in st.jobs  # ended at 10 s: not yet 10 days before the latest event
    st.apply(tick(10 * DAY + 10))
    assert "a" in st.forgotten


def test_a_job_whose_processes_may_still_run_is_not_forgotten_until_they_end():
    st = fold([node(), *life("a", 0.0, fenced=False), tick(3 * DAY)], DAY)
    assert "a" in st.jobs and st.node_live == {"n0": {"a": None}}  # the fence still needs it
    st.apply(ev.ProcessesEnded(at=3 * DAY, job_id="a", attempt=1, node="n0"))
    st.apply(tick(3 * DAY))
    assert "a" in st.forgotten and not st.node_live


def test_a_forgotten_id_cannot_be_submitted_again():
    st = fold([node(), *life("a", 0.0), tick(3 * DAY)], DAY)
    st.apply(ev.JobSubmitted(at=3 * DAY, job_id="a", spec=JobSpec(team="a", gpus=1)))
    assert [v.rule for v in st.violations()] == ["duplicate_job"]


def test_dependencies_on_forgotten_jobs_keep_their_end_state():
    events = [node(), *life("ok", 0.0), *life("bad", 100.0, end=ev.JobFailed), tick(3 * DAY)]
    st = fold(events, DAY)
    assert {"ok", "bad"} <= set(st.forgotten)
    for deps, reason in (([Dependency(kind="afterok", job="ok")], None),
                         ([Dependency(kind="afterany", job="bad")], None),
                         ([Dependency(kind="afterok", job="bad")], "DependencyNever")):
        st.apply(ev.JobSubmitted(at=3 * DAY, job_id=f"w{len(st.jobs)}", spec=JobSpec(team="a", gpus=1, dependency=deps)))
        job = st.jobs[f"w{len(st.jobs) - 1}"]
        got = dependency_reason(st, job)
        assert (None if got is None else type(got).__name__) == reason


def test_a_snapshot_and_its_tail_forget_exactly_what_the_whole_fold_forgets():
    events = [node()] + [e for i in range(40) for e in life(f"j{i}", i * DAY)]
    whole = fold(events, 5 * DAY)
    for cut in (1, 37, 90, len(events) - 3):
        st = ClusterState.restore(fold(events[:cut], 5 * DAY).snapshot())
        for e in events[cut:]:
            st.apply(e)
        assert st.snapshot() == whole.snapshot()
    assert len(whole.jobs) == 5  # j34 ended exactly 5 days before j39
    assert len(whole.forgotten) == 15 and len(whole.retired) == 20  # and j19 exactly 20 days before


def test_the_queue_of_finished_jobs_is_compacted():
    events = [node()] + [e for i in range(3000) for e in life(f"j{i}", i * 100.0)]
    st = fold(events, 1000.0)
    assert len(st.finished) - st.finished_head < 20 and len(st.finished) < 2100
    assert len(st.retiring) - st.retiring_head < 50 and len(st.retiring) < 2100
    assert len(st.forgotten) < 50 and len(st.retired) > 2940


@settings(max_examples=60, deadline=None)
@given(legal_events(max_steps=80))
def test_forgetting_never_changes_an_invariant_verdict_or_a_live_job(events):
    whole, short = fold(events, None), fold(events, 50.0)
    assert [(v.seq, v.rule) for v in short.violations()] == [(v.seq, v.rule) for v in whole.violations()]
    assert set(short.jobs) | set(short.forgotten) <= set(whole.jobs)
    for job_id, job in whole.jobs.items():
        assert short.knows(job_id)
        if job_id in short.jobs:
            assert msgspec.to_builtins(short.jobs[job_id]) == msgspec.to_builtins(job)
        elif job_id in short.forgotten:
            assert job.state == short.forgotten[job_id].state and not job.live
        else:  # retired: only its id is kept
            assert job.finished_at is not None and job.finished_at <= short.now - 4 * 50.0 and not job.live
    assert short.job_counts() == whole.job_counts()
    assert (short.gpus, short.nodes, short.node_live) == (whole.gpus, whole.nodes, whole.node_live)


def test_admission_answers_about_forgotten_jobs_from_their_tombstones():
    from gpusched.core.commands import CancelJob, SubmitJob
    from gpusched.services.admission import AdmissionConfig, Caller, Capacity, admit, job_id_for

    reused = job_id_for("a/alice/fresh", ClusterState())
    st = fold([node(), *life("old", 0.0), *life(reused, 20.0), tick(3 * DAY)], DAY)
    assert {"old", reused} <= set(st.forgotten)

    def decide(cmd, caller=Caller("alice", "a")):
        return admit(st, cmd, 3 * DAY, AdmissionConfig(placeholders="any"), Capacity(), caller=caller).reply

    retry = decide(SubmitJob(request_id="r-old", spec=JobSpec(team="a", gpus=1)))
    assert retry.ok and retry.duplicate and retry.job_id == "old"
    other_team = decide(SubmitJob(request_id="r-old", spec=JobSpec(team="b", gpus=1)), Caller("bob", "b"))
    assert not other_team.duplicate and "unknown team 'b'" in other_team.error  # decided as its own request
    after = decide(SubmitJob(request_id="w1", spec=JobSpec(team="a", gpus=1,
                                                           dependency=[Dependency(kind="afterok", job="old")])))
    assert after.ok, after.error
    fresh = decide(SubmitJob(request_id="fresh", spec=JobSpec(team="a", gpus=1)))
    assert fresh.ok and fresh.job_id != reused  # a forgotten id is never handed out again
    cancel = decide(CancelJob(request_id="c1", job_id="old"))
    assert not cancel.ok and "already completed" in cancel.error and "horizon" in cancel.error


def test_an_array_is_found_by_its_index_whole_forgotten_or_from_an_old_snapshot():
    from gpusched.core.commands import CancelJob, HoldJob, SubmitJob
    from gpusched.core.model import ArraySpec
    from gpusched.services.admission import AdmissionConfig, Caller, Capacity, admit

    arr = ev.JobSubmitted(at=0.0, job_id="arr", request_id="r-arr", spec=JobSpec(team="a", gpus=1, array=ArraySpec(2, 4)))
    ends = [ev.JobCancelled(at=5.0, job_id=f"arr_{i}") for i in (2, 3, 4)]
    live = fold([node(), arr, *ends[:2], tick(DAY)], 10 * DAY)
    gone = fold([node(), arr, *ends, tick(3 * DAY)], DAY)
    assert array_tasks(live, "arr") == array_tasks(gone, "arr") == ["arr_2", "arr_3", "arr_4"]
    assert set(gone.forgotten) == {"arr_2", "arr_3", "arr_4"} and array_tasks(live, "nope") == []

    def cancel(st: ClusterState):
        return admit(st, CancelJob(request_id="c", job_id="arr"), 3 * DAY, AdmissionConfig(), Capacity(),
                     caller=Caller("alice", "a"))

    assert [e.job_id for e in [cancel(live).event]] == ["arr_4"]
    assert not cancel(gone).reply.ok and "ended long ago" in cancel(gone).reply.error
    on_array = admit(live, SubmitJob(request_id="w", spec=JobSpec(team="a", gpus=1, dependency=[
        Dependency(kind="afterok", job="arr")])), DAY, AdmissionConfig(placeholders="any"), Capacity(), caller=Caller("alice", "a"))
    assert not on_array.reply.ok and on_array.reply.error == "spec.dependency: arr is a job array; name one of its tasks (arr_INDEX)"
    hold = admit(live, HoldJob(request_id="h", job_id="arr"), DAY, AdmissionConfig(), Capacity(), caller=Caller("alice", "a"))
    assert not hold.reply.ok and hold.reply.error == "arr is a job array; name one of its tasks (arr_INDEX)"
    from gpusched.cli.reads import _not_a_job
    assert _not_a_job(live, "arr") == "arr is a job array: show one of its tasks, arr_2 .. arr_4"
    assert "only its id is kept" not in _not_a_job(gone, "arr") and _not_a_job(live, "nope").startswith("no job nope")
    assert live.knows("arr") and live.knows("arr_4") and not live.knows("arr_5")  # never handed out as a job id
    for odd in ("arr_²", "arr_٣", "arr_03", "arr_", "arr_-1"):  # not a task's id, and no error either
        assert not live.knows(odd), odd
        hostile = admit(live, SubmitJob(request_id=f"w-{odd}", spec=JobSpec(team="a", gpus=1, dependency=[
            Dependency(kind="afterok", job=odd)])), DAY, AdmissionConfig(placeholders="any"), Capacity(),
            caller=Caller("alice", "a"))
        assert not hostile.reply.ok and hostile.reply.error == f"spec.dependency: unknown job {odd!r} (afterok:{odd})"
    for st in (live, gone):  # a snapshot written before the index existed has no `arrays`
        raw = msgspec.msgpack.decode(st.snapshot())
        del raw["arrays"]
        assert ClusterState.restore(msgspec.msgpack.encode(raw)).arrays == {"arr": (2, 4)}


def test_past_the_second_horizon_only_the_id_stays_and_it_is_never_handed_out_again():
    from gpusched.cli.reads import retired_note
    from gpusched.core.commands import CancelJob, SubmitJob
    from gpusched.core.fold.forgetting import RETIRE_AFTER_HORIZONS
    from gpusched.services.admission import AdmissionConfig, Caller, Capacity, admit, job_id_for

    old = job_id_for("a/alice/first", ClusterState())  # an id admission makes: kept in 4 bytes
    events = [node(), *life(old, 0.0), *life("other", 1.0)]
    forgotten = fold([*events, tick(RETIRE_AFTER_HORIZONS * DAY)], DAY)
    assert {old, "other"} <= set(forgotten.forgotten)  # ended 10 s after the second horizon's start
    st = fold([*events, tick(RETIRE_AFTER_HORIZONS * DAY + 20)], DAY)
    assert not st.forgotten and old in st.retired and "other" in st.retired and len(st.retired) == 2
    assert st.knows(old) and st.job_status(old) is None and st.job_counts()["completed"] == 2
    assert f"r-{old}" not in st.requests  # request-id dedupe ends with the tombstone
    assert st.retired.runs == [bytes.fromhex(old[2:])[::-1]]  # little-endian uint32

    def decide(cmd):
        return admit(st, cmd, st.now, AdmissionConfig(placeholders="any"), Capacity(), caller=Caller("alice", "a")).reply

    again = decide(SubmitJob(request_id="first", spec=JobSpec(team="a", gpus=1)))
    assert again.ok and not again.duplicate and again.job_id not in (old, "")  # the id is never reused
    after = decide(SubmitJob(request_id="w", spec=JobSpec(team="a", gpus=1, dependency=[Dependency(kind="afterok", job=old)])))
    assert not after.ok and "only its id is kept" in after.error
    cancel = decide(CancelJob(request_id="c", job_id=old))
    assert not cancel.ok and "only its id is kept" in cancel.error
    assert "only its id is kept" in retired_note(st, old)
    restored = ClusterState.restore(st.snapshot())
    assert restored.knows(old) and restored.snapshot() == st.snapshot()


def test_show_of_a_forgotten_job_says_so_and_where_its_history_is():
    from gpusched.cli.reads import forgotten_doc

    st = fold([node(), *life("old", 0.0), tick(3 * DAY)], DAY)
    doc = forgotten_doc(st, "old")["forgotten"]
    assert (doc["state"], doc["team"], doc["request_id"], doc["finished_at"]) == ("completed", "a", "r-old", 10.0)
    assert "GPUSCHED_FORGET_AFTER_S=none gpusched show old" in doc["history"] and "--from-file" in doc["history"]


def test_the_horizon_is_a_fact_of_the_log_and_a_reader_may_only_keep_everything(monkeypatch):
    import pytest

    from gpusched.core.model import FoldSettings
    from gpusched.core.state import FORGET_AFTER_S
    from gpusched.store import fold_horizon, new_fold

    monkeypatch.delenv("GPUSCHED_FORGET_AFTER_S", raising=False)
    assert fold_horizon() == FORGET_AFTER_S == new_fold().forget_after_s  # before any fact: the one default
    fold = new_fold()
    fold.apply(ev.FoldSettingsSet(at=1.0, settings=FoldSettings(forget_after_s=3600.0)))
    assert fold.forget_after_s == 3600.0
    monkeypatch.setenv("GPUSCHED_FORGET_AFTER_S", "none")  # a reader wanting every job's whole history
    whole = new_fold()
    whole.apply(ev.FoldSettingsSet(at=1.0, settings=FoldSettings(forget_after_s=3600.0)))
    assert fold_horizon() is None and whole.forget_after_s is None and whole.keep_whole
    for bad in ("3600", "soon", "-5"):  # a number would make this process's fold another cluster's
        monkeypatch.setenv("GPUSCHED_FORGET_AFTER_S", bad)
        with pytest.raises(SystemExit, match="gpusched fold-settings"):
            fold_horizon()
