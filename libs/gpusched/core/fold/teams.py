"""Teams and usage: quotas and limits, the GPUs each team holds (in all, and per GPU pool),
its decayed usage (fair share's half-life) and undecayed GPU-seconds, and the idle accounting
of held GPUs that do no work (the reconciler's `JobIdle`/`JobBusy`).

Functions of the state (`st`): a grant, resize or release (`core/fold/jobs.py`) settles its
team here, and the fold's settings change the half-life every team decays with.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .. import events as ev
from .. import rules
from ..model import GpuId
from ..pools import canonical_model
from ..records import IdleStatus, Job, TeamUsage, account, gpu_count
from .checks import violate

if TYPE_CHECKING:
    from ..state import ClusterState


def team_held(st: ClusterState, name: str, delta: float, at: float) -> None:
    t = st.team(name)
    t.held_gpu_s += t.held * max(0.0, at - t.usage_at)
    t.usage_gpu_s = decayed_usage(st, t, at)
    t.usage_at = max(t.usage_at, at)
    t.held = gpu_count(t.held + delta)


def decayed_usage(st: ClusterState, t: TeamUsage, at: float) -> float:
    dt = max(0.0, at - t.usage_at)
    if st.half_life_s is None:
        return t.usage_gpu_s + t.held * dt
    decay = math.exp(-math.log(2) * dt / st.half_life_s)
    return t.usage_gpu_s * decay + t.held * st.half_life_s / math.log(2) * (1 - decay)


def check_limit(st: ClusterState, team: str, job_id: str, gpus: list[GpuId]) -> None:
    """A grant or growth of `gpus` took the team past its limit, or past its per-model limit on
    one of their pools (`rules.broken_limit`, the rule placement and the writer ask)."""
    t = st.teams[team]
    broken = rules.broken_limit(t.quota, t.held, t.pool_held,
                                [canonical_model(st.gpus[g].model) for g in gpus if g in st.gpus])
    if broken is None:
        return
    pool, held, limit = broken
    detail = (f"team {team} holds {t.held} GPUs, limit {limit}" if pool is None
              else f"team {team} holds {gpu_count(held)} {pool} GPUs, per-model limit {limit}")
    violate(st, "over_limit", detail, [job_id], gpus)


def standing(st: ClusterState, team: str, pool: str | None) -> rules.Standing:
    """What the team's guarantee is judged by where GPUs of `pool` are at stake (`rules.judged_on`)."""
    t = st.team(team)
    return rules.judged_on(t.quota, t.held, t.pool_held, pool)


def pool_held(st: ClusterState, name: str, gpus: list[GpuId], amount: float) -> None:
    """Per-pool holdings of a team (per-model quotas, `teams`), kept beside `held`: `amount`
    per GPU (a fractional job's share); replaced whole, never edited (a forecast's fork shares
    it, `policy/forecast.fork`)."""
    if not gpus:
        return
    t = st.team(name)
    per = dict(t.pool_held)
    for g in gpus:
        pool = canonical_model(st.gpus[g].model)
        per[pool] = per.get(pool, 0) + amount
        if abs(per[pool]) < 1e-9:
            del per[pool]
    t.pool_held = per


def on_quota(st: ClusterState, e: ev.TeamQuotaSet) -> None:
    # Lowering a limit below current use is legal: running jobs finish, no new ones start.
    st.team(e.team).quota = e.quota


def on_fold_settings(st: ClusterState, e: ev.FoldSettingsSet) -> None:
    """Usage up to this fact decays with the old half-life (each team settled at it), after
    it with the new; a `keep_whole` fold (a reader's) forgets nothing whatever it says."""
    for name in st.teams:
        team_held(st, name, 0, st.now)
    st.half_life_s = e.settings.half_life_s
    if not st.keep_whole:
        st.forget_after_s = e.settings.forget_after_s


# --- idle GPUs (JobIdle/JobBusy): held-but-unused accounting ---

def on_idle(st: ClusterState, e: ev.JobIdle) -> None:
    job = st.jobs.get(e.job_id)
    if job is None or not job.holding or job.attempt != e.attempt:
        return  # a late report about an attempt that already ended
    status = IdleStatus(e.since, e.at, e.window_s, e.threshold_pct, e.util_pct, e.util_pct_max, e.memory_mb)
    if job.idle is None:
        # the GPUs were idle since `since` (the evidence window): that time was not busy
        since = min(e.at, max(e.since, job.started_at if job.started_at is not None else e.since))
        back = job.weight * max(0.0, e.at - since)
        job.idle_gpu_s += back
        team_idle(st, job.team, job.weight, e.at, back)
        job.idle_at = e.at
    job.idle = status
    st.idle_jobs[job.job_id] = None


def on_busy(st: ClusterState, e: ev.JobBusy) -> None:
    job = st.jobs.get(e.job_id)
    if job is None or not job.holding or job.attempt != e.attempt or job.idle is None:
        return
    end_idle(st, job, e.at)
    if job.preemption is None or job.preemption.cause != "idle":
        st.idle_jobs.pop(job.job_id, None)


def end_idle(st: ClusterState, job: Job, at: float) -> None:
    account(job, at)
    team_idle(st, job.team, -job.weight, at)
    job.idle = None


def team_idle(st: ClusterState, name: str, delta: float, at: float, back: float = 0.0) -> None:
    t = st.team(name)
    t.idle_gpu_s += t.idle_gpus * max(0.0, at - t.idle_at) + back
    t.idle_at = max(t.idle_at, at)
    t.idle_gpus = gpu_count(t.idle_gpus + delta)
