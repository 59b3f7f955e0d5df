"""A generator of random *legal* event sequences, driven by the fold itself (used by property
tests): each step looks at the current state and picks one event that keeps every invariant."""

from __future__ import annotations

from hypothesis import strategies as st

from gpusched.core import events as ev
from gpusched.core import rules
from gpusched.core.model import GpuInfo, JobSpec, TeamQuota, nvlink_domains
from gpusched.core.state import ClusterState, stale_live

TEAMS = ("alpha", "beta", "gamma")
#: Weighted: the job lifecycle dominates, node and GPU failures are rarer.
ACTIONS = (["submit"] * 4 + ["grant"] * 6 + ["start", "checkpoint", "complete", "preempt", "release", "resize"] * 2
           + ["fail", "cancel", "node", "drain", "quarantine", "restore", "zombie", "lost"])


def _node(i: int, at: float, gpus: int = 4) -> ev.NodeRegistered:
    domains = nvlink_domains("pairs", gpus)
    return ev.NodeRegistered(at=at, node=f"n{i}", rack=f"r{i // 2}", nvlink="pairs",
                             gpus=[GpuInfo(index=k, uuid=f"GPU-{i}-{k}", nvlink_domain=domains[k]) for k in range(gpus)])


def _free(state: ClusterState) -> list[str]:
    return [g for node in state.nodes.values() for g in node.free]


def _legal_preemption(state: ClusterState, victim, beneficiary) -> bool:
    v, b = state.teams[victim.team], state.teams[beneficiary.team]
    pool = rules.pool_of(state, victim.gpus)
    return rules.fair_between(victim.team, rules.judged_on(v.quota, v.held, v.pool_held, pool),
                              beneficiary.team, rules.judged_on(b.quota, b.held, b.pool_held, pool))


def _room(state: ClusterState, team_name: str, free: int) -> int:
    team = state.teams[team_name]
    room = rules.limit_room(team.quota, team.held)
    return free if room is None else min(free, room)


# Each action: (draw, state, t, emit) -> None; it emits one legal event, or none when the state
# offers no legal one of its kind. The legality questions are the core's (`core/rules.py`).

def _submit(draw, state, t, emit):
    gpus = draw(st.integers(1, 6))
    spec = JobSpec(team=draw(st.sampled_from(TEAMS)), gpus=gpus,
                   min_gpus=draw(st.integers(1, gpus)), preemptible=draw(st.booleans()))
    n = len(state.jobs)
    emit(ev.JobSubmitted(at=t, job_id=f"j{n}", spec=spec, request_id=f"r{n}"))


def _grant(draw, state, t, emit):
    pending = [state.jobs[j] for j in state.pending]
    if not pending:
        return
    job = draw(st.sampled_from(pending))
    free = _free(state)
    room = _room(state, job.team, len(free))
    if room >= job.spec.gang_min:
        n = draw(st.integers(job.spec.gang_min, min(room, job.spec.gpus)))
        gpus = draw(st.permutations(free))[:n]
        emit(ev.GpusGranted(at=t, job_id=job.job_id, attempt=job.attempt + 1, gpus=gpus, level=state.span(gpus)))


def _on_running(make):
    """An action on one running job (none when nothing runs)."""
    def act(draw, state, t, emit):
        running = [state.jobs[j] for j in state.running]
        if running:
            make(draw, state, t, emit, draw(st.sampled_from(running)))
    return act


def _start(draw, state, t, emit, job):
    for x in stale_live(job):  # a daemon starts an attempt only once the earlier one is gone
        emit(ev.ProcessesEnded(at=t, job_id=job.job_id, attempt=x.attempt, node=x.node, generation=x.generation))
    emit(ev.JobStarted(at=t, job_id=job.job_id, attempt=job.attempt, node=state.gpus[job.gpus[0]].node,
                       pids=[1000 + state.events], generation=job.generation))


def _checkpoint(draw, state, t, emit, job):
    emit(ev.CheckpointSaved(at=t, job_id=job.job_id, attempt=job.attempt, path=f"/ckpt/{job.job_id}",
                            step=state.events))


def _preempt(draw, state, t, emit, victim):
    pending = [state.jobs[j] for j in state.pending]
    if not pending:
        return
    beneficiary = draw(st.sampled_from(pending))
    if victim.spec.preemptible and victim.preemption is None and _legal_preemption(state, victim, beneficiary):
        emit(ev.PreemptionRequested(at=t, job_id=victim.job_id, for_job=beneficiary.job_id,
                                    reason="test", deadline=t + 30))


def _release(draw, state, t, emit, job):
    emit(ev.GpusReleased(at=t, job_id=job.job_id, reason=draw(st.sampled_from(["preempted", "no_process"])),
                         forced=draw(st.booleans()), lost_gpu_s=draw(st.floats(0, 1000))))


def _resize(draw, state, t, emit, job):
    free = _free(state)
    if len(job.gpus) > job.spec.gang_min:
        emit(ev.JobResized(at=t, job_id=job.job_id, removed=job.gpus[-1:], reason="shrink"))
    elif free and len(job.gpus) < job.spec.gpus and _room(state, job.team, 1) >= 1:
        emit(ev.JobResized(at=t, job_id=job.job_id, added=free[:1], reason="grow"))


def _cancel(draw, state, t, emit):
    if state.jobs:
        job = draw(st.sampled_from(list(state.jobs.values())))
        emit(ev.JobCancelled(at=t, job_id=job.job_id))


def _on_node(make):
    def act(draw, state, t, emit):
        if state.nodes:
            emit(make(draw, t, draw(st.sampled_from(list(state.nodes)))))
    return act


def _on_gpu(make):
    def act(draw, state, t, emit):
        if state.gpus:
            emit(make(t, draw(st.sampled_from(list(state.gpus)))))
    return act


def _zombie(draw, state, t, emit):
    free = _free(state)
    if free:
        gpu = draw(st.sampled_from(free))
        emit(ev.ZombieDetected(at=t, gpu=gpu, pids=[4242]))
        if draw(st.booleans()):
            emit(ev.ZombieReclaimed(at=t, gpu=gpu, pids=[4242]))


_ACTIONS = {
    "submit": _submit,
    "grant": _grant,
    "start": _on_running(_start),
    "checkpoint": _on_running(_checkpoint),
    "complete": _on_running(lambda d, s, t, emit, job: emit(ev.JobCompleted(at=t, job_id=job.job_id,
                                                                             attempt=job.attempt))),
    "fail": _on_running(lambda d, s, t, emit, job: emit(ev.JobFailed(at=t, job_id=job.job_id, attempt=job.attempt,
                                                                     reason="exit code 1", exit_code=1))),
    "cancel": _cancel,
    "preempt": _on_running(_preempt),
    "release": _on_running(_release),
    "resize": _on_running(_resize),
    "node": lambda d, state, t, emit: emit(_node(len(state.nodes), t)),
    "drain": _on_node(lambda d, t, node: ev.NodeDrained(at=t, node=node, drain=d(st.booleans()))),
    "lost": _on_node(lambda d, t, node: ev.NodeLost(at=t, node=node, reason="heartbeats stopped")),
    "quarantine": _on_gpu(lambda t, gpu: ev.GpuQuarantined(at=t, gpu=gpu, reason="XID 79")),
    "restore": _on_gpu(lambda t, gpu: ev.GpuRestored(at=t, gpu=gpu)),
    "zombie": _zombie,
}


@st.composite
def legal_events(draw, max_steps: int = 60) -> list[ev.Event]:
    state = ClusterState()
    out: list[ev.Event] = []
    t = 0.0

    def emit(e: ev.Event) -> None:
        out.append(e)
        state.apply(e)

    for i in range(draw(st.integers(1, 3))):
        emit(_node(i, t))
    for team in TEAMS:
        quota = TeamQuota(guaranteed=draw(st.integers(0, 4)), limit=draw(st.sampled_from([None, 4, 8])))
        emit(ev.TeamQuotaSet(at=t, team=team, quota=quota))
    for _ in range(draw(st.integers(1, max_steps))):
        t += draw(st.floats(0, 100, allow_nan=False))
        _ACTIONS[draw(st.sampled_from(ACTIONS))](draw, state, t, emit)
    return out
