"""Accounting from the log, like Slurm's `sacct`: per job who, how many GPUs, how long it waited
and ran, the GPU-hours it used, how it ended, and the work it lost; and per team and period.

Pure: a `Ledger` watches a fold (`observe(state, event)` after each `state.apply`) and keeps the
intervals in which each job held GPUs (split wherever the count changed: grants, resizes,
releases, ends, lost nodes). Times are the events' own `at`, so the same log gives the same
bill in `gpusched history`, the simulator and the tests. `account(records)` does the whole fold.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from .core.events import Event
from .core.pools import canonical_model
from .core.state import TERMINAL, ClusterState, Job


@dataclass(frozen=True)
class Held:
    """`gpus` GPUs held by `job_id` (of `team`) from `start` to `end` (None: still held); a
    fractional job's `gpus` is its share of its one GPU (docs/gpu-sharing.md)."""

    job_id: str
    team: str
    gpus: int | float
    start: float
    end: float | None = None
    #: The GPU pool (canonical model, core/pools.py) of its GPUs; pools joined by "+" if several.
    pool: str = ""

    def seconds(self, now: float) -> float:
        return max(0.0, (self.end if self.end is not None else now) - self.start)


@dataclass
class Ledger:
    """The GPU-holding intervals of every job, kept in step with a fold."""

    closed: list[Held] = field(default_factory=list)
    open: dict[str, Held] = field(default_factory=dict)
    #: (at, team, GPU-seconds) of work lost, as each loss was recorded
    lost: list[tuple[float, str, float]] = field(default_factory=list)
    _lost_seen: dict[str, float] = field(default_factory=dict)

    def observe(self, state: ClusterState, event: Event) -> None:
        """Call after `state.apply(event)`: close or open intervals whose GPU count changed."""
        job_id = getattr(event, "job_id", None)
        touched = [job_id] if job_id else list(self.open)  # node-wide events: every holder
        for jid in touched:
            job = state.jobs.get(jid) if jid else None
            if job is not None:
                self._sync(job, event.at, state)

    def _sync(self, job: Job, at: float, state: ClusterState) -> None:
        held = job.weight if job.holding else 0  # a fractional job is billed its share
        current = self.open.get(job.job_id)
        if current is not None and current.gpus != held:  # (a resize that keeps the count keeps the pool)
            self.closed.append(Held(current.job_id, current.team, current.gpus, current.start, at, current.pool))
            del self.open[job.job_id]
            current = None
        if current is None and held:
            pool = "+".join(sorted({canonical_model(state.gpus[g].model) for g in job.gpus}))
            self.open[job.job_id] = Held(job.job_id, job.spec.team, held, at, pool=pool)
        lost = job.lost_gpu_s - self._lost_seen.get(job.job_id, 0.0)
        if lost > 0:
            self.lost.append((at, job.spec.team, lost))
            self._lost_seen[job.job_id] = job.lost_gpu_s

    def intervals(self) -> list[Held]:
        return self.closed + list(self.open.values())

    def per_job(self, now: float) -> dict[str, tuple[float, float]]:
        """job id -> (seconds with GPUs, GPU-seconds) up to `now`."""
        out: dict[str, tuple[float, float]] = {}
        for h in self.intervals():
            run, gpu_s = out.get(h.job_id, (0.0, 0.0))
            out[h.job_id] = (run + h.seconds(now), gpu_s + h.gpus * h.seconds(now))
        return out


def gpu_hours_by_pool(ledger: Ledger, now: float) -> dict[str, dict[str, float]]:
    """GPU pool -> team -> GPU-hours held there, up to `now` (docs/gpu-pools.md)."""
    out: dict[str, dict[str, float]] = {}
    for h in ledger.intervals():
        per = out.setdefault(h.pool, {})
        per[h.team] = per.get(h.team, 0.0) + h.gpus * h.seconds(now) / 3600.0
    return {p: {t: round(v, 4) for t, v in sorted(per.items())} for p, per in sorted(out.items())}


def gpu_hours_by_team(ledger: Ledger, now: float) -> dict[str, float]:
    """GPU-hours each team held, up to `now`."""
    out: dict[str, float] = {}
    for h in ledger.intervals():
        out[h.team] = out.get(h.team, 0.0) + h.gpus * h.seconds(now) / 3600.0
    return {team: round(v, 4) for team, v in sorted(out.items())}


def account(records: Iterable[tuple[int, Event]], state: ClusterState | None = None) -> tuple[ClusterState, Ledger]:
    """Fold `(seq, event)` pairs and keep the ledger beside the fold."""
    state = state or ClusterState()
    ledger = Ledger()
    for seq, event in records:
        state.apply(event, seq)
        ledger.observe(state, event)
    return state, ledger


def _wait(job: Job, now: float) -> float:
    start = job.first_started_at
    if start is None:
        start = job.finished_at if job.state in TERMINAL and job.finished_at is not None else now
    return max(0.0, start - job.submitted_at)


def job_record(job: Job, run_s: float, gpu_s: float, now: float, by_pool: dict[str, float] | None = None) -> dict[str, Any]:
    """One job's line of the bill (`by_pool`: its GPU-seconds per GPU pool)."""
    spec = job.spec
    rec: dict[str, Any] = {
        "job_id": job.job_id, "name": spec.name, "team": spec.team, "user": job.user or None,
        "via": job.via or None, "priority": spec.priority, "gpus": spec.gpus, "min_gpus": spec.gang_min, "state": job.state,
        "submitted_at": job.submitted_at, "started_at": job.first_started_at, "finished_at": job.finished_at,
        "wait_s": round(_wait(job, now), 3), "run_s": round(run_s, 3), "gpu_s": round(gpu_s, 3),
        "gpu_hours": round(gpu_s / 3600.0, 4), "attempts": job.attempt, "preemptions": job.preemptions,
        "restarts": job.restarts, "lost_gpu_s": round(job.lost_gpu_s, 3), "end_reason": job.end_reason,
    }
    if by_pool:
        rec["gpu_hours_by_pool"] = {p: round(v / 3600.0, 4) for p, v in sorted(by_pool.items())}
    if spec.partial:
        rec["gpu_share"] = job.share  # billed by its share of its one GPU (MIG: its compute slices / 7)
    if spec.mig is not None:
        rec["mig"] = f"{spec.mig_count}x{spec.mig}"
    seconds = getattr(job, "gpu_seconds", None)  # held vs busy GPU-seconds, where the fold keeps them
    if callable(seconds):
        held, busy = seconds(now)
        rec["held_gpu_s"], rec["busy_gpu_s"] = round(held, 3), round(busy, 3)
        rec["idle_gpu_s"] = round(max(0.0, held - busy), 3)
    return rec


def job_records(state: ClusterState, ledger: Ledger, now: float | None = None) -> list[dict[str, Any]]:
    """Every job of the fold, in submission order, with its accounting up to `now` (default:
    the fold's latest event time)."""
    now = state.now if now is None else now
    per = ledger.per_job(now)
    pools: dict[str, dict[str, float]] = {}
    for h in ledger.intervals():
        if h.pool:
            mine = pools.setdefault(h.job_id, {})
            mine[h.pool] = mine.get(h.pool, 0.0) + h.gpus * h.seconds(now)
    jobs = sorted(state.jobs.values(), key=lambda j: (j.submitted_at, j.job_id))
    return [job_record(j, *per.get(j.job_id, (0.0, 0.0)), now, pools.get(j.job_id)) for j in jobs]


def period_start(t: float, by: str) -> float:
    """Start (UTC) of the day or ISO week (Monday) holding `t`."""
    day = datetime.fromtimestamp(t, timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    if by == "week":
        day -= timedelta(days=day.weekday())
    elif by != "day":
        raise ValueError(f"period {by!r}: use day or week")
    return day.timestamp()


def _periods(start: float, end: float, by: str) -> Iterable[tuple[float, float]]:
    step = 86400.0 if by == "day" else 7 * 86400.0
    p = period_start(start, by)
    while p < end:
        yield p, p + step
        p += step


def period_report(state: ClusterState, ledger: Ledger, by: str = "day", now: float | None = None,
                  jobs: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Per period and team: GPU-hours used (intervals split at period bounds), jobs submitted and
    ended, median wait of the jobs that started, GPU-hours of work lost. `jobs` limits the report
    to those job ids (the filters of `gpusched history`)."""
    now = state.now if now is None else now
    keep = None if jobs is None else set(jobs)
    rows: dict[tuple[float, str], dict[str, Any]] = {}

    def row(t: float, team: str) -> dict[str, Any]:
        key = (period_start(t, by), team)
        if key not in rows:
            rows[key] = {"period": datetime.fromtimestamp(key[0], timezone.utc).strftime("%Y-%m-%d"), "team": team,
                         "gpu_hours": 0.0, "submitted": 0, "started": 0, "ended": 0, "waits": [], "lost_gpu_hours": 0.0}
        return rows[key]

    for h in ledger.intervals():
        if keep is not None and h.job_id not in keep:
            continue
        end = h.end if h.end is not None else now
        for p0, p1 in _periods(h.start, end, by):
            overlap = min(end, p1) - max(h.start, p0)
            if overlap > 0:
                row(max(h.start, p0), h.team)["gpu_hours"] += h.gpus * overlap / 3600.0
    for job in state.jobs.values():
        if keep is not None and job.job_id not in keep:
            continue
        row(job.submitted_at, job.spec.team)["submitted"] += 1
        if job.first_started_at is not None:
            r = row(job.first_started_at, job.spec.team)
            r["started"] += 1
            r["waits"].append(job.first_started_at - job.submitted_at)
        if job.state in TERMINAL and job.finished_at is not None:
            row(job.finished_at, job.spec.team)["ended"] += 1
    for at, team, lost in ledger.lost:
        row(at, team)["lost_gpu_hours"] += lost / 3600.0
    out = []
    for key in sorted(rows):
        r = rows[key]
        waits = r.pop("waits")
        r["median_wait_s"] = round(statistics.median(waits), 3) if waits else None
        r["gpu_hours"], r["lost_gpu_hours"] = round(r["gpu_hours"], 4), round(r["lost_gpu_hours"], 4)
        out.append(r)
    return out


__all__ = ["Held", "Ledger", "account", "gpu_hours_by_team", "job_record", "job_records", "period_report", "period_start"]
