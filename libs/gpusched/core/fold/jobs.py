"""A job's lifecycle: submitted (or an array's tasks), pending with the policy's reason,
granted GPUs, resized, started on its nodes, asked to yield, checkpointed, released and
requeued, ended; held and updated while it waits.

Functions of the state (`st`): each reducer moves a job between `pending` and `running` and
settles what its GPUs change (holdings, the fence, its team's usage) together, so that no
index of `ClusterState` drifts from the jobs. An illegal fact is applied as far as is safe and
recorded (`violate`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from .. import events as ev
from .. import rules
from ..records import (
    TERMINAL,
    Checkpoint,
    Job,
    JobStatus,
    Live,
    LogRef,
    Preemption,
    account,
    checkpoint_ranks,
    gpu_count,
    job_node_order,
)
from .arrays import submit_array
from .checks import violate
from .fence import add_live, may_run
from .holdings import give_back, give_back_all, reserve, take, take_share
from .slices import take_slices
from .teams import check_limit, end_idle, pool_held, standing, team_held, team_idle

if TYPE_CHECKING:
    from ..state import ClusterState

#: Partial checkpoints kept per job (steps some but not all ranks saved), newest last.
PARTIAL_CHECKPOINTS = 8
#: The state each terminal fact leaves a job in.
_END_STATE: dict[type, JobStatus] = {ev.JobCompleted: "completed", ev.JobFailed: "failed", ev.JobCancelled: "cancelled",
                                     ev.JobTimedOut: "timeout"}


def on_submitted(st: ClusterState, e: ev.JobSubmitted) -> None:
    if e.spec.array is not None:
        return submit_array(st, e)
    if e.job_id in st.jobs or e.job_id in st.forgotten:
        violate(st, "duplicate_job", f"job {e.job_id} submitted twice", [e.job_id])
        return
    st.jobs[e.job_id] = Job(e.job_id, e.spec, e.at, held_since=e.at, request_id=e.request_id, user=e.user, via=e.via)
    st.pending[e.job_id] = None
    if e.request_id:
        st.requests[e.request_id] = e.job_id
    st.team(e.spec.team)


def on_pending(st: ClusterState, e: ev.JobPending) -> None:
    job = st.jobs.get(e.job_id)
    if job is not None:
        job.pending_reason, job.pending_blockers, job.pending_eta_s = e.reason, list(e.blockers), e.eta_s
        low, high = e.eta_low_s, e.eta_high_s
        job.pending_eta_range = None if low is None or high is None else (low, high)
        job.pending_at = e.at
        job.pending_why = e.why


def on_held(st: ClusterState, e: ev.JobHeld) -> None:
    """Only a pending job is held or released (admission refuses the rest; a late one is a no-op)."""
    job = st.jobs.get(e.job_id)
    if job is not None and job.state == "pending":
        job.hold = (f"{e.user or 'admin'}: {e.reason}" if e.reason else (e.user or "admin")) if e.held else None


def on_updated(st: ClusterState, e: ev.JobUpdated) -> None:
    """A pending job's spec changes; it moves to the end of `pending` so that the queue index
    (which finds changed jobs there) re-sorts it."""
    job = st.jobs.get(e.job_id)
    if job is None or job.state != "pending":
        return
    changes: dict[str, object] = {}
    if e.priority is not None:
        changes["priority"] = e.priority
    if e.time_limit_s is not None:
        changes["time_limit_s"] = e.time_limit_s
    job.spec = msgspec.structs.replace(job.spec, **changes)
    job.updates += 1
    del st.pending[job.job_id]
    st.pending[job.job_id] = None


def on_granted(st: ClusterState, e: ev.GpusGranted) -> None:
    job = st.jobs.get(e.job_id)
    if job is None or job.state != "pending":
        state = st.job_status(e.job_id) or "unknown"
        violate(st, "grant_to_non_pending", f"grant to {state} job {e.job_id}", [e.job_id], e.gpus)
        return
    spec = job.spec
    if not rules.gang_size_ok(spec, len(e.gpus)):
        violate(
            st,
            "gang_size",
            f"job {e.job_id} granted {len(e.gpus)} GPUs, gang needs {spec.gang_min}..{spec.gpus}",
            [e.job_id],
            e.gpus,
        )
    job.share, job.slices = 1.0, []
    granted = (take_slices(st, job, e) if spec.sliced else take_share(st, job, e.gpus) if spec.shared
               else take(st, e.job_id, e.gpus, e.at))
    reserve(st, spec, granted, 1)
    if st.handover:
        st.handover.clear()  # the grants after a release are decided: the hand-over had its turn
    del st.pending[e.job_id]
    st.running[e.job_id] = None
    job.state, job.attempt, job.gpus = "starting", e.attempt, granted
    job.placer, job.level, job.backfill = e.placer, e.level, e.backfill
    job.started_at, job.held_since, job.nodes_started = e.at, e.at, []
    job.generation, job.resized_at, job.partial, job.unhealthy, job.unhealthy_reason = 0, None, {}, [], ""
    may_run(st, job, e.gpus)
    job.yielded_idle, job.idle, job.idle_at = False, None, e.at
    if job.first_started_at is None:
        job.first_started_at = e.at
    job.pending_reason, job.pending_blockers, job.pending_eta_s = "", [], None
    job.pending_eta_range = None
    job.pending_why = None
    team_held(st, spec.team, job.weight, e.at)
    pool_held(st, spec.team, granted, job.share)
    check_limit(st, spec.team, e.job_id, granted)


def on_resized(st: ClusterState, e: ev.JobResized) -> None:
    job = st.jobs.get(e.job_id)
    if job is None or not job.holding:
        violate(st, "resize_of_idle_job", f"resize of job {e.job_id} that holds nothing", [e.job_id])
        return
    account(job, e.at)
    job.prev_nodes = len(job_node_order(job))
    not_held = [g for g in e.removed if g not in job.gpus]
    if not_held:
        violate(st, "release_not_held", f"job {e.job_id} releases GPUs it does not hold", [e.job_id], not_held)
    removed = [g for g in e.removed if g in job.gpus]
    give_back(st, removed)
    added = take(st, e.job_id, e.added, e.at)
    before = job.gpus
    job.gpus = [g for g in job.gpus if g not in removed] + added
    reserve(st, job.spec, job.gpus, 1, before)
    team_held(st, job.team, len(added) - len(removed), e.at)
    pool_held(st, job.team, removed, -1)
    pool_held(st, job.team, added, 1)
    if job.idle is not None:
        team_idle(st, job.team, len(added) - len(removed), e.at)
    if len(job.gpus) < job.spec.gang_min:
        violate(
            st,
            "below_gang_min",
            f"job {e.job_id} holds {len(job.gpus)} GPUs, gang minimum is {job.spec.gang_min}",
            [e.job_id],
            job.gpus,
        )
    if added:
        check_limit(st, job.team, e.job_id, added)
    # Every rank restarts with the new world size (checkpoint, stop all, start all).
    job.generation += 1
    job.resized_at, job.partial = e.at, {}
    job.unhealthy = [g for g in job.unhealthy if g in job.gpus]
    may_run(st, job, job.gpus)


def on_started(st: ClusterState, e: ev.JobStarted) -> None:
    job = st.jobs.get(e.job_id)
    if job is None:
        return
    others = [x for x in job.live if (x.attempt, x.generation) != (e.attempt, e.generation)]
    if others:
        violate(st, "two_live_attempts",
                f"job {e.job_id} attempt {e.attempt}.{e.generation} started on {e.node} while "
                + ", ".join(f"attempt {x.attempt}.{x.generation} may run on {x.node}" for x in others),
                [e.job_id])
    if not any(x.node == e.node and (x.attempt, x.generation) == (e.attempt, e.generation) for x in job.live):
        add_live(st, job, Live(e.node, e.attempt, e.generation))
    if e.log and len(job.logs) < 256:
        job.logs = [*job.logs, LogRef(e.attempt, e.generation, e.rank, e.node, e.log)]
    if not job.holding or job.attempt != e.attempt:
        return  # a late report from an attempt that already ended
    job.state = "running"
    if e.node not in job.nodes_started:
        job.nodes_started = [*job.nodes_started, e.node]


def on_unhealthy(st: ClusterState, e: ev.JobOnUnhealthyGpu) -> None:
    job = st.jobs.get(e.job_id)
    if job is not None and job.holding and job.attempt == e.attempt:
        job.unhealthy = [g for g in dict.fromkeys([*job.unhealthy, *e.gpus]) if g in job.gpus]
        job.unhealthy_reason = e.reason


def on_preemption(st: ClusterState, e: ev.PreemptionRequested) -> None:
    job = st.jobs.get(e.job_id)
    if job is None or not job.holding:
        return
    if e.cause == "idle":  # the idle timeout serves the queue, not one job, and any class
        job.preemption = Preemption(e.for_job, e.reason, e.deadline, e.at, "idle")
        st.idle_jobs[job.job_id] = None
        return
    beneficiary = st.jobs.get(e.for_job)
    if beneficiary is None:
        violate(st, "preemption_without_beneficiary", f"preemption of {e.job_id} serves no known job", [e.job_id])
    elif job.team != beneficiary.team:
        # judged on the victim's GPU pool where per-model terms apply, else on totals (issue 30)
        pool = rules.pool_of(st, job.gpus)
        vs, fs = standing(st, job.team, pool), standing(st, beneficiary.team, pool)
        if not rules.fair_between(job.team, vs, beneficiary.team, fs):
            on_v, on_f = (_on(st, t, pool) for t in (job.team, beneficiary.team))
            violate(
                st,
                "unfair_preemption",
                f"team {job.team} (holds {gpu_count(vs[0])}{on_v} <= guaranteed {vs[1]}) "
                f"preempted for team {beneficiary.team} (holds {gpu_count(fs[0])}{on_f} >= guaranteed {fs[1]})",
                [e.job_id, e.for_job],
            )
    if not job.spec.preemptible:
        violate(st, "non_preemptible", f"job {e.job_id} is not preemptible", [e.job_id, e.for_job])
    job.preemption = Preemption(e.for_job, e.reason, e.deadline, e.at)


def _on(st: ClusterState, team: str, pool: str | None) -> str:
    """' H100' where the team is judged on that pool (`rules.judged_on`), "" on its totals."""
    return f" {pool}" if pool is not None and st.team(team).quota.models else ""


def on_checkpoint(st: ClusterState, e: ev.CheckpointSaved) -> None:
    """A rank's save completes a checkpoint once every rank that must save has saved that
    step in this attempt and generation; earlier or partial saves never replace it."""
    job = st.jobs.get(e.job_id)
    if job is None:
        return
    if not job.holding or job.attempt != e.attempt:
        # A rank-0 save that lands after its attempt ended is complete in rank0 mode.
        newer = job.checkpoint is None or e.step > job.checkpoint.step
        if e.attempt == job.attempt and e.rank == 0 and job.spec.checkpoint == "rank0" and newer:
            _set_checkpoint(job, Checkpoint(e.path, e.step, e.at, e.attempt, [e.path], e.sha256))
        return
    if e.generation == job.generation:
        ranks = checkpoint_ranks(job)
    elif e.generation == job.generation - 1:  # the ranks draining for a resize save for it
        ranks = list(range(max(1, job.prev_nodes))) if job.spec.checkpoint == "all" else [0]
    else:
        return
    ck = job.checkpoint
    if e.rank not in ranks or (ck is not None and ck.attempt == e.attempt and e.step < ck.step):
        return  # not a saving rank, or older than the attempt's complete checkpoint
    saved = dict(job.partial.get(e.step, {}))
    saved[e.rank] = e.path
    if all(r in saved for r in ranks):
        paths = [saved[r] for r in sorted(saved)]
        sha = e.sha256 if e.rank == 0 or len(ranks) == 1 else ""
        _set_checkpoint(job, Checkpoint(saved.get(0, paths[0]), e.step, e.at, e.attempt, paths, sha))
        job.partial = {s: p for s, p in job.partial.items() if s > e.step}
    else:
        partial = {**job.partial, e.step: saved}
        job.partial = dict(sorted(partial.items())[-PARTIAL_CHECKPOINTS:])


def _set_checkpoint(job: Job, ck: Checkpoint) -> None:
    """`ck` is the job's newest complete checkpoint; the one before stays as the fallback."""
    if job.checkpoint is not None and job.checkpoint.path != ck.path:
        job.previous_checkpoint = job.checkpoint
    job.checkpoint = ck


def on_released(st: ClusterState, e: ev.GpusReleased) -> None:
    job = st.jobs.get(e.job_id)
    if job is None or not job.holding:
        return  # two observers may report the same loss; the first one counts
    idle = e.reason == "preempted" and job.preemption is not None and job.preemption.cause == "idle"
    if idle:
        job.idle_requeues += 1
    elif e.reason == "preempted":
        job.preemptions += 1
        _nominate(st, job)
    elif e.reason in ("no_process", "process_failed"):
        job.restarts += 1
    job.lost_gpu_s += e.lost_gpu_s
    requeue(st, job, e.at, "requeued: idle timeout" if idle else f"requeued: {e.reason}")
    job.yielded_idle = idle


def _nominate(st: ClusterState, victim: Job) -> None:
    """A victim releases for another job: that job's turn to take the freed GPUs first, until
    the next grant (policy/steps/handover.py; a job moved for itself is nobody's beneficiary)."""
    p = victim.preemption
    if p is not None and p.for_job != victim.job_id:
        st.handover[p.for_job] = None


def on_terminal(st: ClusterState, e: ev.JobCompleted | ev.JobFailed | ev.JobCancelled | ev.JobTimedOut) -> None:
    job = st.jobs.get(e.job_id)
    if job is None or job.state in TERMINAL:
        return
    attempt = getattr(e, "attempt", None)
    if (job.holding and attempt not in (None, job.attempt)) or (not job.holding and getattr(e, "node", None)):
        return  # a late exit of an attempt already released (a node's report of a waiting job is one)
    if job.holding:
        release_all(st, job, e.at)
        del st.running[job.job_id]
    else:
        del st.pending[job.job_id]
    job.state = _END_STATE[type(e)]
    job.finished_at = e.at
    job.preemption = None
    if isinstance(e, ev.JobTimedOut):
        job.end_reason = f"time limit of {e.limit_s:g} s exceeded"
    else:
        job.end_reason = getattr(e, "reason", "") or f"exit code {getattr(e, 'exit_code', 0)}"
    if st.forget_after_s is not None:
        st.finished.append(job.job_id)


def release_all(st: ClusterState, job: Job, at: float) -> None:
    """The job gives back every GPU (and share) it holds, settling its and its team's usage."""
    account(job, at)
    if job.idle is not None:
        end_idle(st, job, at)
    st.idle_jobs.pop(job.job_id, None)
    give_back_all(st, job)
    team_held(st, job.team, -job.weight, at)
    pool_held(st, job.team, job.gpus, -job.share)
    job.gpus, job.slices = [], []


def requeue(st: ClusterState, job: Job, at: float, reason: str) -> None:
    """The job releases everything and waits again, with `reason` as its pending reason."""
    release_all(st, job, at)
    del st.running[job.job_id]
    st.pending[job.job_id] = None
    job.state, job.preemption, job.started_at = "pending", None, None
    job.pending_reason, job.pending_blockers, job.pending_eta_s = reason, [], None
    job.pending_eta_range = None
    job.pending_why = None
