"""The fold: table-driven scenarios for each rule, and properties over random legal logs."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings

from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec, ModelQuota, TeamQuota
from gpusched.core.state import ClusterState, fold

from .fold_gen import legal_events


def node(name: str, gpus: int = 4, rack: str = "r0") -> ev.NodeRegistered:
    return ev.NodeRegistered(at=0, node=name, rack=rack, gpus=[GpuInfo(index=i, uuid=f"{name}-{i}") for i in range(gpus)])


def submit(job: str, team: str = "a", gpus: int = 2, **kw) -> ev.JobSubmitted:
    return ev.JobSubmitted(at=1, job_id=job, spec=JobSpec(team=team, gpus=gpus, **kw), request_id=f"req-{job}")


def grant(job: str, *gpus: str, attempt: int = 1) -> ev.GpusGranted:
    return ev.GpusGranted(at=2, job_id=job, attempt=attempt, gpus=list(gpus))


# name -> (events, rules expected in violations())
CASES: dict[str, tuple[list[ev.Event], list[str]]] = {
    "a legal gang grant": ([node("n0"), submit("j1"), grant("j1", "n0/0", "n0/1")], []),
    "double booking": ([node("n0"), submit("j1"), submit("j2"), grant("j1", "n0/0", "n0/1"),
                        grant("j2", "n0/1", "n0/2")], ["double_booking"]),
    "grant beyond the team limit": ([node("n0"), ev.TeamQuotaSet(at=0, team="a", quota=TeamQuota(limit=2)),
                                     submit("j1", gpus=3), grant("j1", "n0/0", "n0/1", "n0/2")], ["over_limit"]),
    "partial gang": ([node("n0"), submit("j1", gpus=3), grant("j1", "n0/0")], ["gang_size"]),
    "elastic job within its range": ([node("n0"), submit("j1", gpus=4, min_gpus=2), grant("j1", "n0/0", "n0/1")], []),
    "shrink below the gang minimum": ([node("n0"), submit("j1", gpus=4, min_gpus=2), grant("j1", "n0/0", "n0/1"),
                                       ev.JobResized(at=3, job_id="j1", removed=["n0/1"])], ["below_gang_min"]),
    "grant on a quarantined GPU": ([node("n0"), ev.GpuQuarantined(at=0, gpu="n0/0", reason="XID 48"), submit("j1", gpus=1),
                                    grant("j1", "n0/0")], ["unplaceable_gpu"]),
    "grant of an unknown GPU": ([node("n0"), submit("j1", gpus=1), grant("j1", "n9/0")], ["unknown_gpu"]),
    "grant to a running job": ([node("n0"), submit("j1", gpus=1), grant("j1", "n0/0"), grant("j1", "n0/1")],
                               ["grant_to_non_pending"]),
    "preemption of a team under its guarantee for a team over its own": (
        [node("n0"), ev.TeamQuotaSet(at=0, team="a", quota=TeamQuota(guaranteed=2)),
         submit("v", team="a", gpus=2, preemptible=True), grant("v", "n0/0", "n0/1"),
         submit("x", team="b", gpus=2), grant("x", "n0/2", "n0/3"), submit("y", team="b", gpus=2),
         ev.PreemptionRequested(at=3, job_id="v", for_job="y", reason="priority", deadline=10)],
        ["unfair_preemption"]),
    "reclaim by a team under its guarantee is fair": (
        [node("n0"), ev.TeamQuotaSet(at=0, team="b", quota=TeamQuota(guaranteed=2)),
         submit("v", team="a", gpus=4, preemptible=True), grant("v", "n0/0", "n0/1", "n0/2", "n0/3"),
         submit("y", team="b", gpus=2),
         ev.PreemptionRequested(at=3, job_id="v", for_job="y", reason="reclaim", deadline=10)], []),
    "preemption of a non-preemptible job": (
        [node("n0"), submit("v", gpus=2), grant("v", "n0/0", "n0/1"), submit("y", gpus=2),
         ev.PreemptionRequested(at=3, job_id="v", for_job="y", reason="priority", deadline=10)], ["non_preemptible"]),
    "preemption serving nobody": ([node("n0"), submit("v", gpus=2, preemptible=True), grant("v", "n0/0", "n0/1"),
                                   ev.PreemptionRequested(at=3, job_id="v", for_job="ghost", reason="?", deadline=10)],
                                  ["preemption_without_beneficiary"]),
}

# Per-model terms (issue 30): node h0 has 4 H100, a0 4 A100.
H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
SPLIT = TeamQuota(guaranteed=4, models={"H100": ModelQuota(guaranteed=2), "A100": ModelQuota(guaranteed=2)})


def typed_node(name: str, model: str) -> ev.NodeRegistered:
    return ev.NodeRegistered(at=0, node=name, rack="r0", gpus=[GpuInfo(index=i, uuid=f"{name}-{i}", model=model)
                                                              for i in range(4)])


def pools(*quotas: tuple[str, TeamQuota]) -> list[ev.Event]:
    return [typed_node("h0", H100), typed_node("a0", A100)] + [ev.TeamQuotaSet(at=0, team=t, quota=q) for t, q in quotas]


CASES.update({
    "a grant beyond a per-model limit": (
        pools(("a", TeamQuota(models={"H100": ModelQuota(limit=2)}))) + [
            submit("j1", gpus=2), grant("j1", "h0/0", "h0/1"), submit("j2", gpus=1), grant("j2", "h0/2")],
        ["over_limit"]),
    "a grant on another pool than the limited one": (
        pools(("a", TeamQuota(models={"H100": ModelQuota(limit=2)}))) + [
            submit("j1", gpus=2), grant("j1", "h0/0", "h0/1"), submit("j2", gpus=3), grant("j2", "a0/0", "a0/1", "a0/2")],
        []),
    "a growth beyond a per-model limit": (
        pools(("a", TeamQuota(models={"H100": ModelQuota(limit=2)}))) + [
            submit("e", gpus=4, min_gpus=1), grant("e", "h0/0", "h0/1"), ev.JobResized(at=3, job_id="e", added=["h0/2"])],
        ["over_limit"]),
    "reclaim of H100s from a team over its H100 guarantee, though under its total, is fair": (
        pools(("a", SPLIT), ("b", TeamQuota(guaranteed=4, models={"A100": ModelQuota(guaranteed=4)}))) + [
            submit("mine", gpus=4), grant("mine", "a0/0", "a0/1", "a0/2", "a0/3"),
            submit("v", team="b", gpus=2, preemptible=True), grant("v", "h0/0", "h0/1"), submit("y", gpus=2),
            ev.PreemptionRequested(at=3, job_id="v", for_job="y", reason="reclaim", deadline=10)], []),
    "preemption of a team at its H100 guarantee for a team at its own, though under its total, is unfair": (
        pools(("a", SPLIT), ("b", SPLIT)) + [
            submit("mine", gpus=2), grant("mine", "h0/0", "h0/1"),
            submit("v", team="b", gpus=2, preemptible=True), grant("v", "h0/2", "h0/3"), submit("y", gpus=2),
            ev.PreemptionRequested(at=3, job_id="v", for_job="y", reason="priority", deadline=10)],
        ["unfair_preemption"]),
})


@pytest.mark.parametrize("name", list(CASES))
def test_fold_rules(name):
    events, rules = CASES[name]
    state = fold(events)
    assert [v.rule for v in state.violations()] == rules


def test_lifecycle_and_accounting():
    state = fold([node("n0"), submit("j1", gpus=2, preemptible=True), grant("j1", "n0/0", "n0/1")])
    assert state.jobs["j1"].state == "starting" and state.free_count == 2
    state.apply(ev.JobStarted(at=3, job_id="j1", attempt=1, node="n0", pids=[7]))
    assert state.jobs["j1"].state == "running"
    state.apply(ev.CheckpointSaved(at=10, job_id="j1", attempt=1, path="/c/1", step=5))
    state.apply(ev.GpusReleased(at=12, job_id="j1", reason="preempted", lost_gpu_s=4.0))
    job = state.jobs["j1"]
    assert (job.state, job.gpus, job.preemptions, job.lost_gpu_s) == ("pending", [], 1, 4.0)
    assert job.service_gpu_s == pytest.approx(2 * 10)  # held 2 GPUs from t=2 to t=12
    assert job.checkpoint.path == "/c/1" and state.free_count == 4 and state.teams["a"].held == 0
    state.apply(grant("j1", "n0/2", "n0/3", attempt=2))
    state.apply(ev.JobCompleted(at=20, job_id="j1", attempt=1))  # a stale exit of attempt 1: ignored
    assert state.jobs["j1"].state == "starting"
    state.apply(ev.JobCompleted(at=20, job_id="j1", attempt=2))
    assert state.jobs["j1"].state == "completed" and state.free_count == 4 and not state.violations()


def test_node_lost_requeues_its_jobs_from_their_checkpoint():
    state = fold([node("n0"), node("n1", rack="r1"), submit("j1", gpus=2), grant("j1", "n0/0", "n1/0"),
                  ev.CheckpointSaved(at=5, job_id="j1", attempt=1, path="/c", step=1),
                  ev.NodeLost(at=9, node="n1", reason="heartbeats stopped")])
    job = state.jobs["j1"]
    assert job.state == "pending" and job.gpus == [] and job.checkpoint.path == "/c"
    assert job.lost_gpu_s == pytest.approx(2 * (9 - 5))
    assert state.free_count == 4  # n1's GPUs are gone from placement, n0's are back
    assert state.gpu_blocker("n1/0") == "node n1 lost"


def test_team_usage_decays_with_half_life():
    state = ClusterState(half_life_s=100.0)
    for e in [node("n0"), submit("j1", gpus=2), ev.GpusGranted(at=0, job_id="j1", attempt=1, gpus=["n0/0", "n0/1"]),
              ev.JobCompleted(at=100, job_id="j1", attempt=1)]:
        state.apply(e)
    used = state.team_usage("a", at=100)
    assert 100 < used < 200  # 200 GPU-s used, decayed
    assert state.team_usage("a", at=200) == pytest.approx(used / 2)


def test_request_ids_map_to_jobs():
    state = fold([submit("j1"), submit("j2")])
    assert state.requests == {"req-j1": "j1", "req-j2": "j2"}


@settings(max_examples=150, deadline=None)
@given(legal_events())
def test_random_legal_logs_keep_every_invariant(events):
    state = fold(events)
    assert state.violations() == []
    holders = [g.holder for g in state.gpus.values() if g.holder]
    assert sum(len(state.jobs[j].gpus) for j in state.running) == len(holders)
    for job_id in state.running:
        job = state.jobs[job_id]
        assert job.spec.gang_min <= len(job.gpus) <= job.spec.gpus
    for team in state.teams.values():
        assert team.quota.limit is None or team.held <= team.quota.limit
    assert state.free_count == sum(len(n.free) for n in state.nodes.values())


@settings(max_examples=50, deadline=None)
@given(legal_events())
def test_replaying_the_same_log_twice_gives_identical_state(events):
    wire = [ev.decode_event(ev.encode_event(e)) for e in events]
    a, b = fold(events), fold(wire)
    assert msgspec.msgpack.encode(a) == msgspec.msgpack.encode(b)
    assert ClusterState.restore(a.snapshot()).summary() == a.summary()


# --- the fence: at most one live attempt per job ------------------------------------------------

def _started(attempt: int, node: str = "n0", generation: int = 0) -> ev.JobStarted:
    return ev.JobStarted(at=5, job_id="j", attempt=attempt, node=node, generation=generation)


def _ended(attempt: int, node: str = "n0", generation: int = 0) -> ev.ProcessesEnded:
    return ev.ProcessesEnded(at=5, job_id="j", attempt=attempt, node=node, generation=generation)


_RELEASE = ev.GpusReleased(at=4, job_id="j", reason="preempted")
FENCE = {
    "the next attempt after its daemon confirmed the end": (
        [grant("j", "n0/0"), _started(1), _RELEASE, _ended(1), grant("j", "n1/0", attempt=2), _started(2, "n1")], []),
    "the next attempt while the first may still run": (
        [grant("j", "n0/0"), _started(1), _RELEASE, grant("j", "n1/0", attempt=2), _started(2, "n1")],
        ["two_live_attempts"]),
    "a node declared lost fences what it ran": (
        [grant("j", "n0/0"), _started(1), ev.NodeLost(at=4, node="n0", reason="silent"),
         grant("j", "n1/0", attempt=2), _started(2, "n1")], []),
    "granted but never reported started still counts as maybe running": (
        [grant("j", "n0/0"), _RELEASE, grant("j", "n1/0", attempt=2), _started(2, "n1")], ["two_live_attempts"]),
    "a resize restarts every rank: the new generation waits for the old": (
        [grant("j", "n0/0", "n1/0"), _started(1), _started(1, "n1"),
         ev.JobResized(at=4, job_id="j", removed=["n1/0"]), _ended(1), _started(1, "n0", 1)],
        ["two_live_attempts"]),
    "a resize after every old rank ended": (
        [grant("j", "n0/0", "n1/0"), _started(1), _started(1, "n1"),
         ev.JobResized(at=4, job_id="j", removed=["n1/0"]), _ended(1), _ended(1, "n1"), _started(1, "n0", 1)], []),
}


@pytest.mark.parametrize("events, broken", FENCE.values(), ids=FENCE.keys())
def test_at_most_one_live_attempt(events, broken):
    state = fold([node("n0"), node("n1"), submit("j", gpus=2, min_gpus=1), *events])
    assert [v.rule for v in state.violations()] == broken


def _saved(rank: int, step: int, at: float = 6, generation: int = 0) -> ev.CheckpointSaved:
    return ev.CheckpointSaved(at=at, job_id="j", attempt=1, path=f"/c/{step}-{rank}", step=step, rank=rank,
                              generation=generation)


CHECKPOINTS = {
    "rank0: rank 0's save is the checkpoint": ("rank0", [_saved(0, 10)], (10, ["/c/10-0"])),
    "rank0: other ranks' saves do not count": ("rank0", [_saved(1, 10)], None),
    "all: one rank is only a partial checkpoint": ("all", [_saved(0, 10)], None),
    "all: complete once both saved the same step": ("all", [_saved(0, 10), _saved(1, 10)],
                                                    (10, ["/c/10-0", "/c/10-1"])),
    "all: different steps never complete": ("all", [_saved(0, 10), _saved(1, 11)], None),
    "all: an older step never replaces a newer one": (
        "all", [_saved(0, 20), _saved(1, 20), _saved(0, 10), _saved(1, 10)], (20, ["/c/20-0", "/c/20-1"])),
}


@pytest.mark.parametrize("mode, saves, want", CHECKPOINTS.values(), ids=CHECKPOINTS.keys())
def test_collective_checkpoints(mode, saves, want):
    state = fold([node("n0"), node("n1"), submit("j", gpus=2, checkpoint=mode), grant("j", "n0/0", "n1/0"), *saves])
    ck = state.jobs["j"].checkpoint
    assert (None if ck is None else (ck.step, ck.paths)) == want
