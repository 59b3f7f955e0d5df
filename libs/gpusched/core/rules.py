"""The legality rules of scheduling decisions, written once.

The fold records a broken rule as a violation (`ClusterState`), the policies ask the same
questions before deciding (`policy/`), and a writer re-checks its batch with `BatchCheck` after
a compare-and-set conflict (`services/`): as Nomad's planner and plan applier share `AllocsFit`,
deciding, verifying and auditing cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from . import events as ev
from .model import GpuId, JobSpec, TeamQuota
from .pools import canonical_model

if TYPE_CHECKING:
    from .state import ClusterState, Job


def gpu_healthy(state: ClusterState, g: GpuId) -> bool:
    """A GPU may be held at all: known, not quarantined, no stray processes, on a usable node."""
    rec = state.gpus.get(g)
    return (rec is not None and rec.quarantined is None and rec.zombie_pids is None
            and state.nodes[rec.node].usable)


def gpu_placeable(state: ClusterState, g: GpuId) -> bool:
    """A GPU may be granted: healthy and held by nobody (the fold keeps each node's `free`
    set equal to its placeable GPUs)."""
    rec = state.gpus.get(g)
    return (rec is not None and rec.holder is None and not rec.shares and gpu_healthy(state, g)
            and not state.nodes[rec.node].partitioned)


#: Shares of one GPU sum to at most 1; this much slack absorbs float rounding of the sum.
SHARE_SLACK = 1e-9


def share_problem(state: ClusterState, g: GpuId, share: float | None, load: float | None = None) -> str | None:
    """Why a fractional job may not take `share` of GPU `g` (None: it may): the GPU must be
    healthy, not held whole, and keep its shares' sum at most 1 (`load`: its shares' sum as the
    caller sees it; default the fold's). A free GPU takes its first share; a share never lands
    beside a whole-GPU job ("never mixed")."""
    rec = state.gpus.get(g)
    if rec is None:
        return "unknown GPU"
    if share is None:
        return f"its memory ({rec.memory_mb} MiB) cannot hold the job's ask"
    if rec.holder is not None:
        return f"held whole by {rec.holder}"
    if not gpu_healthy(state, g) or state.nodes[rec.node].partitioned:
        return "not placeable"
    used = rec.shared_load if load is None else load
    if used + share > 1.0 + SHARE_SLACK:
        return f"over its capacity: {used:g} shared, {share:g} more asked"
    return None


def _unshared_placeable(state: ClusterState, g: GpuId) -> bool:
    """Placeable but for its shares (a batch released them all)."""
    rec = state.gpus[g]
    return rec.holder is None and gpu_healthy(state, g) and not state.nodes[rec.node].partitioned


def gang_floor(spec: JobSpec, elastic: bool) -> int:
    """The fewest GPUs a job may start with: its minimum when elastic jobs may start small."""
    return spec.gang_min if elastic else spec.gpus


def gang_size_ok(spec: JobSpec, n: int) -> bool:
    """A job holds all of its gang or none: between its minimum and its size."""
    return spec.gang_min <= n <= spec.gpus


def limit_room(quota: TeamQuota | None, held: float, pool: str | None = None) -> float | None:
    """GPUs a team holding `held` may still take before its hard limit (None: no limit): its
    total limit, or given `pool` (then `held` is its holding there), its per-model limit on
    that GPU pool (`TeamQuota.models`, issue 30)."""
    if quota is None:
        return None
    if pool is None:
        limit = quota.limit
    else:
        m = quota.models.get(pool)
        limit = None if m is None else m.limit
    return None if limit is None else limit - held


def over_limit(quota: TeamQuota | None, held: float, pool: str | None = None) -> bool:
    room = limit_room(quota, held, pool)
    return room is not None and room < -SHARE_SLACK


def broken_limit(quota: TeamQuota | None, held: float | None, pool_held: Mapping[str, float],
                 pools: Iterable[str]) -> tuple[str | None, float, int] | None:
    """The hard limit a team breaks after taking GPUs of `pools`, holding `held` GPUs in all
    (None: its total is not in question) and `pool_held` per pool: (None: its total limit, or
    the pool of its per-model limit; what it holds there; the limit), or None: it breaks
    neither. The fold and the writer's re-check ask this; placement asks `limit_room`."""
    if held is not None and over_limit(quota, held):
        assert quota is not None and quota.limit is not None
        return None, held, quota.limit
    if quota is None or not quota.models:
        return None
    for p in dict.fromkeys(pools):
        m, h = quota.models.get(p), pool_held.get(p, 0)
        if m is not None and m.limit is not None and over_limit(quota, h, p):
            return p, h, m.limit
    return None


def pool_of(state: ClusterState, gpus: Iterable[GpuId]) -> str | None:
    """The one GPU pool `gpus` lie in (None: none, or several)."""
    found = {canonical_model(state.gpus[g].model) for g in gpus if g in state.gpus}
    return next(iter(found)) if len(found) == 1 else None


#: What a team's guarantee is judged by: (its holding, its guarantee).
Standing = tuple[float, int]


def judged_on(quota: TeamQuota | None, held: float, pool_held: Mapping[str, float], pool: str | None) -> Standing:
    """What a team's guarantee is judged by where GPUs of `pool` are at stake (issue 30): for a
    team with per-model terms, its holding on that pool and its per-model guarantee there (0
    for a pool outside its terms); otherwise, or across pools (None), its totals, as before
    pools. So a team under its H100 guarantee may reclaim H100s from a team over its own H100
    guarantee whatever their totals say, and no A100 is taken on account of an H100 deficit."""
    if pool is not None and quota is not None and quota.models:
        m = quota.models.get(pool)
        return pool_held.get(pool, 0), 0 if m is None else m.guaranteed
    return held, quota.guaranteed if quota is not None else 0


def fair_between(victim_team: str, victim: Standing, for_team: str, beneficiary: Standing) -> bool:
    """A team at or under its guaranteed share is never preempted for a team at or over its own
    (their standings, `judged_on`, at the moment the request is applied)."""
    if victim_team == for_team:
        return True
    return not (victim[0] <= victim[1] and beneficiary[0] >= beneficiary[1])


def work_since_checkpoint(job: Job, at: float) -> float:
    """GPU-seconds a job loses if it stops at `at`: since its last checkpoint of this attempt,
    or its start."""
    since = job.started_at if job.started_at is not None else at
    ck = job.checkpoint
    if ck is not None and ck.attempt == job.attempt:
        since = max(since, ck.at)
    return job.weight * max(0.0, at - since)


class BatchCheck:
    """The writer's re-check of a batch against the fold plus the batch's own earlier
    decisions: `problem(event)` names the first rule it breaks (None: legal), and a legal event
    is then counted in the overlay. The compare-and-set checks freshness, not content: this is
    what keeps an illegal decision out of the log."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.holder: dict[GpuId, str | None] = {}  # GPU -> holder after this batch
        self.job_gpus: dict[str, list[GpuId]] = {}  # job -> its GPUs after this batch
        self.team_delta: dict[str, float] = {}
        self.pool_delta: dict[tuple[str, str], float] = {}  # (team, GPU pool) -> change after this batch
        self.load: dict[GpuId, float] = {}  # GPU -> the sum of its shares after this batch
        self.granted: set[str] = set()
        self.released: set[str] = set()
        self.node_res: dict[str, tuple[float, int]] = {}  # node -> (CPUs, MiB) this batch reserved there

    def placeable(self, g: GpuId) -> bool:
        if self.load.get(g, 0.0) > SHARE_SLACK:
            return False
        if g not in self.holder:
            return gpu_placeable(self.state, g) or (g in self.load and _unshared_placeable(self.state, g))
        return self.holder[g] is None and gpu_healthy(self.state, g)

    def _share_problem(self, job: Job, gpus: list[GpuId]) -> str | None:
        """A fractional grant: one GPU, not held whole after this batch, with room for its share."""
        if len(gpus) != 1:
            return f"a fractional job takes a share of one GPU, not {len(gpus)}"
        g = gpus[0]
        rec = self.state.gpus.get(g)
        if rec is None:
            return "grant of GPUs that are not free"
        if self.holder.get(g, rec.holder) is not None:
            return "grant of a share of a GPU held whole"
        share = job.spec.share_on(rec.memory_mb)
        problem = share_problem(self.state, g, share, self.load.get(g, rec.shared_load))
        beyond = self._beyond(job.team, share, [g]) if problem is None and share is not None else None
        if beyond is not None:
            return f"grant beyond team {job.team}'s {beyond}"
        return None if problem is None else f"grant of a share of {g}: {problem}"

    def gpus_of(self, job_id: str) -> list[GpuId]:
        return self.job_gpus[job_id] if job_id in self.job_gpus else list(self.state.jobs[job_id].gpus)

    def _beyond(self, team: str, amount: float, added: list[GpuId], removed: list[GpuId] = ()) -> str | None:  # type: ignore[assignment]
        """Which hard limit of the team taking `added` and giving back `removed` (`amount` per
        GPU: a share, or 1) breaks after this batch: "limit", "per-model limit on H100", or None
        (`broken_limit`). As the fold, a net loss is never beyond the total limit."""
        t = self.state.teams.get(team)
        if t is None or not added:
            return None
        add = amount * (len(added) - len(removed))
        per = self._pool_change(added, removed, amount)
        held = t.held + self.team_delta.get(team, 0) + add if add > 0 else None
        pool_held = {p: t.pool_held.get(p, 0) + self.pool_delta.get((team, p), 0) + n for p, n in per.items()}
        broken = broken_limit(t.quota, held, pool_held, [p for p, n in per.items() if n > 0])
        if broken is None:
            return None
        return "limit" if broken[0] is None else f"per-model limit on {broken[0]}"

    def _pool_change(self, added: Iterable[GpuId], removed: Iterable[GpuId], amount: float) -> dict[str, float]:
        per: dict[str, float] = {}
        for g, sign in [(g, 1) for g in added] + [(g, -1) for g in removed]:
            rec = self.state.gpus.get(g)
            if rec is not None:
                p = canonical_model(rec.model)
                per[p] = per.get(p, 0) + sign * amount
        return per

    def _count(self, team: str, amount: float, added: list[GpuId], removed: list[GpuId]) -> None:
        """The team's holdings after this batch: `amount` per GPU added, less per GPU removed."""
        self.team_delta[team] = self.team_delta.get(team, 0) + amount * (len(added) - len(removed))
        for p, n in self._pool_change(added, removed, amount).items():
            self.pool_delta[(team, p)] = self.pool_delta.get((team, p), 0) + n

    def problem(self, e: ev.Event) -> str | None:
        check = _CHECKS.get(type(e))
        return None if check is None else check(self, e)

    def _grant(self, e: ev.GpusGranted) -> str | None:
        job = self.state.jobs.get(e.job_id)
        if job is None or job.state != "pending" or e.job_id in self.granted:
            return f"grant to a job that is not pending ({job.state if job else 'unknown'})"
        if job.hold is not None:
            return f"grant to a held job ({job.hold})"
        if job.spec.shared:
            problem = self._share_problem(job, list(e.gpus))
            if problem is None:
                g = e.gpus[0]
                share = job.spec.share_on(self.state.gpus[g].memory_mb) or 0.0
                self.load[g] = self.load.get(g, self.state.gpus[g].shared_load) + share
                self._count(job.team, share, [g], [])
                self.job_gpus[e.job_id] = [g]
                self.granted.add(e.job_id)
            return problem
        if len(set(e.gpus)) != len(e.gpus) or not all(self.placeable(g) for g in e.gpus):
            return "grant of GPUs that are not free"
        if not gang_size_ok(job.spec, len(e.gpus)):
            return f"grant of {len(e.gpus)} GPUs, gang needs {job.spec.gang_min}..{job.spec.gpus}"
        beyond = self._beyond(job.team, 1, list(e.gpus))
        if beyond is not None:
            return f"grant beyond team {job.team}'s {beyond}"
        short = self._short(job.spec, _nodes(e.gpus))
        if short:
            return f"grant {short}"
        self._hold(job.team, e.job_id, [], list(e.gpus))
        self.granted.add(e.job_id)
        return None

    def _resize(self, e: ev.JobResized) -> str | None:
        job = self.state.jobs.get(e.job_id)
        if job is None or not (job.holding or e.job_id in self.granted):
            return "resize of a job that holds nothing"
        current = self.gpus_of(e.job_id)
        if not set(e.removed) <= set(current):
            return "shrink of GPUs the job does not hold"
        if len(set(e.added)) != len(e.added) or not all(self.placeable(g) for g in e.added):
            return "grow into GPUs that are not free"
        if not gang_size_ok(job.spec, len(current) - len(e.removed) + len(e.added)):
            return "resize outside the gang's range"
        beyond = self._beyond(job.team, 1, list(e.added), list(e.removed))
        if beyond is not None:
            return f"grow beyond team {job.team}'s {beyond}"
        kept = _nodes([g for g in current if g not in set(e.removed)])
        short = self._short(job.spec, [n for n in _nodes(e.added) if n not in kept])
        if short:
            return f"grow {short}"
        self._hold(job.team, e.job_id, list(e.removed), list(e.added))
        return None

    def _release(self, e: ev.GpusReleased | ev.JobFailed | ev.JobTimedOut) -> str | None:
        job = self.state.jobs.get(e.job_id)
        if job is None or not job.holding:
            return "release of a job that holds nothing"
        if job.spec.shared:
            for g in job.gpus:
                self.load[g] = self.load.get(g, self.state.gpus[g].shared_load) - job.share
            self._count(job.team, job.share, [], list(job.gpus))
            self.job_gpus[e.job_id] = []
            self.released.add(e.job_id)
            return None
        self._hold(job.team, e.job_id, self.gpus_of(e.job_id), [])
        self.released.add(e.job_id)
        return None

    def _preempt(self, e: ev.PreemptionRequested) -> str | None:
        """The fold's rules for a request (a holder, a known beneficiary, preemptible, fair by the
        teams' holdings after this batch's earlier decisions); an idle-timeout request serves the
        queue, not one job."""
        job = self.state.jobs.get(e.job_id)
        if job is None or not job.holding or e.job_id in self.released:
            return "preemption of a job that holds nothing"
        if e.cause == "idle":
            return None
        beneficiary = self.state.jobs.get(e.for_job)
        if beneficiary is None:
            return "preemption that serves no known job"
        if not job.spec.preemptible:
            return "preemption of a job that is not preemptible"
        pool = pool_of(self.state, self.gpus_of(e.job_id))
        if not fair_between(job.team, self._standing(job.team, pool),
                            beneficiary.team, self._standing(beneficiary.team, pool)):
            return f"unfair preemption of team {job.team} for team {beneficiary.team}"
        return None

    def _standing(self, team: str, pool: str | None) -> Standing:
        """What the team's guarantee is judged by after this batch's earlier decisions (`judged_on`)."""
        t = self.state.teams.get(team)
        if t is None:
            return judged_on(None, self.team_delta.get(team, 0), {}, pool)
        held = t.held + self.team_delta.get(team, 0)
        on = {} if pool is None else {pool: t.pool_held.get(pool, 0) + self.pool_delta.get((team, pool), 0)}
        return judged_on(t.quota, held, on, pool)

    def _short(self, spec: JobSpec, nodes: list[str]) -> str | None:
        """A node of `nodes` without the job's per-node CPUs or memory free (fold plus batch)."""
        cpus, mem = spec.cpus or 0.0, spec.memory_mb or 0
        for n in nodes if (cpus or mem) else ():
            node = self.state.nodes.get(n)
            if node is None:
                continue
            dc, dm = self.node_res.get(n, (0.0, 0))
            if cpus and node.cpus and cpus > node.cpus - node.cpus_used - dc + 1e-6:
                return f"of {cpus:g} CPUs on node {n} with {node.cpus - node.cpus_used - dc:g} free"
            if mem and node.memory_mb and mem > node.memory_mb - node.memory_used_mb - dm:
                return f"of {mem} MiB on node {n} with {node.memory_mb - node.memory_used_mb - dm} free"
        return None

    def _hold(self, team: str, job_id: str, removed: list[GpuId], added: list[GpuId]) -> None:
        for g in removed:
            self.holder[g] = None
        for g in added:
            self.holder[g] = job_id
        gone = set(removed)
        before = _nodes(self.gpus_of(job_id))
        self.job_gpus[job_id] = [g for g in self.gpus_of(job_id) if g not in gone] + added
        self._count(team, 1, added, removed)
        job = self.state.jobs.get(job_id)
        if job is not None and (job.spec.cpus or job.spec.memory_mb):
            after = _nodes(self.job_gpus[job_id])
            cpus, mem = job.spec.cpus or 0.0, job.spec.memory_mb or 0
            for n, sign in [(n, -1) for n in before if n not in after] + [(n, 1) for n in after if n not in before]:
                dc, dm = self.node_res.get(n, (0.0, 0))
                self.node_res[n] = (dc + sign * cpus, dm + sign * mem)


def _nodes(gpus: Iterable[GpuId]) -> list[str]:
    return list(dict.fromkeys(g.rpartition("/")[0] for g in gpus))


_CHECKS: dict[type, Any] = {ev.GpusGranted: BatchCheck._grant, ev.JobResized: BatchCheck._resize,
           ev.GpusReleased: BatchCheck._release, ev.JobFailed: BatchCheck._release,
           ev.JobTimedOut: BatchCheck._release, ev.PreemptionRequested: BatchCheck._preempt}


def freed_by(state: ClusterState, events: Iterable[ev.Event]) -> set[GpuId]:
    """GPUs the events free (releases, ends, shrinks)."""
    out: set[GpuId] = set()
    for e in events:
        if isinstance(e, (ev.GpusReleased, ev.JobFailed, ev.JobTimedOut)) and e.job_id in state.jobs:
            out.update(state.jobs[e.job_id].gpus)
        elif isinstance(e, ev.JobResized):
            out.update(e.removed)
    return out


__all__ = ["SHARE_SLACK", "BatchCheck", "Standing", "broken_limit", "fair_between", "freed_by", "gang_floor",
           "gang_size_ok", "gpu_healthy", "gpu_placeable", "judged_on", "limit_room", "over_limit", "pool_of",
           "share_problem", "work_since_checkpoint"]
