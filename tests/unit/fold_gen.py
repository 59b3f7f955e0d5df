"""A generator of random *legal* event sequences, driven by the fold itself (used by property
tests): each step looks at the current state and picks one event that keeps every invariant."""

from __future__ import annotations

from hypothesis import strategies as st

from gpusched.core import events as ev
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
    if victim.team == beneficiary.team:
        return True
    v, b = state.teams[victim.team], state.teams[beneficiary.team]
    return not (v.held <= v.quota.guaranteed and b.held >= b.quota.guaranteed)


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
    next_job = 0
    for _ in range(draw(st.integers(1, max_steps))):
        t += draw(st.floats(0, 100, allow_nan=False))
        pending = [state.jobs[j] for j in state.pending]
        running = [state.jobs[j] for j in state.running]
        action = draw(st.sampled_from(ACTIONS))
        if action == "submit":
            gpus = draw(st.integers(1, 6))
            spec = JobSpec(team=draw(st.sampled_from(TEAMS)), gpus=gpus,
                           min_gpus=draw(st.integers(1, gpus)), preemptible=draw(st.booleans()))
            emit(ev.JobSubmitted(at=t, job_id=f"j{next_job}", spec=spec, request_id=f"r{next_job}"))
            next_job += 1
        elif action == "grant" and pending:
            job = draw(st.sampled_from(pending))
            free = _free(state)
            team = state.teams[job.team]
            room = len(free) if team.quota.limit is None else min(len(free), team.quota.limit - team.held)
            if room >= job.spec.gang_min:
                n = draw(st.integers(job.spec.gang_min, min(room, job.spec.gpus)))
                gpus = draw(st.permutations(free))[:n]
                emit(ev.GpusGranted(at=t, job_id=job.job_id, attempt=job.attempt + 1, gpus=gpus, level=state.span(gpus)))
        elif action == "start" and running:
            job = draw(st.sampled_from(running))
            node = state.gpus[job.gpus[0]].node
            for x in stale_live(job):  # a daemon starts an attempt only once the earlier one is gone
                emit(ev.ProcessesEnded(at=t, job_id=job.job_id, attempt=x.attempt, node=x.node, generation=x.generation))
            emit(ev.JobStarted(at=t, job_id=job.job_id, attempt=job.attempt, node=node, pids=[1000 + len(out)],
                               generation=job.generation))
        elif action == "checkpoint" and running:
            job = draw(st.sampled_from(running))
            emit(ev.CheckpointSaved(at=t, job_id=job.job_id, attempt=job.attempt, path=f"/ckpt/{job.job_id}", step=len(out)))
        elif action == "complete" and running:
            job = draw(st.sampled_from(running))
            emit(ev.JobCompleted(at=t, job_id=job.job_id, attempt=job.attempt))
        elif action == "fail" and running:
            job = draw(st.sampled_from(running))
            emit(ev.JobFailed(at=t, job_id=job.job_id, attempt=job.attempt, reason="exit code 1", exit_code=1))
        elif action == "cancel" and state.jobs:
            job = draw(st.sampled_from(list(state.jobs.values())))
            emit(ev.JobCancelled(at=t, job_id=job.job_id))
        elif action == "preempt" and running and pending:
            victim, beneficiary = draw(st.sampled_from(running)), draw(st.sampled_from(pending))
            if victim.spec.preemptible and victim.preemption is None and _legal_preemption(state, victim, beneficiary):
                emit(ev.PreemptionRequested(at=t, job_id=victim.job_id, for_job=beneficiary.job_id,
                                            reason="test", deadline=t + 30))
        elif action == "release" and running:
            job = draw(st.sampled_from(running))
            emit(ev.GpusReleased(at=t, job_id=job.job_id, reason=draw(st.sampled_from(["preempted", "no_process"])),
                                 forced=draw(st.booleans()), lost_gpu_s=draw(st.floats(0, 1000))))
        elif action == "resize" and running:
            job = draw(st.sampled_from(running))
            free = _free(state)
            team = state.teams[job.team]
            if len(job.gpus) > job.spec.gang_min:
                emit(ev.JobResized(at=t, job_id=job.job_id, removed=job.gpus[-1:], reason="shrink"))
            elif free and len(job.gpus) < job.spec.gpus and (team.quota.limit is None or team.held < team.quota.limit):
                emit(ev.JobResized(at=t, job_id=job.job_id, added=free[:1], reason="grow"))
        elif action == "node":
            emit(_node(len(state.nodes), t))
        elif action == "drain" and state.nodes:
            node = draw(st.sampled_from(list(state.nodes)))
            emit(ev.NodeDrained(at=t, node=node, drain=draw(st.booleans())))
        elif action == "lost" and state.nodes:
            emit(ev.NodeLost(at=t, node=draw(st.sampled_from(list(state.nodes))), reason="heartbeats stopped"))
        elif action == "quarantine" and state.gpus:
            emit(ev.GpuQuarantined(at=t, gpu=draw(st.sampled_from(list(state.gpus))), reason="XID 79"))
        elif action == "restore" and state.gpus:
            emit(ev.GpuRestored(at=t, gpu=draw(st.sampled_from(list(state.gpus)))))
        elif action == "zombie":
            free = _free(state)
            if free:
                gpu = draw(st.sampled_from(free))
                emit(ev.ZombieDetected(at=t, gpu=gpu, pids=[4242]))
                if draw(st.booleans()):
                    emit(ev.ZombieReclaimed(at=t, gpu=gpu, pids=[4242]))
    return out
