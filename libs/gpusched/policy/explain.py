"""Why a job waits, in full: the policy's reason plus what the state says about it.

The cycle records a typed reason (`core/reasons.py`) with `JobPending` when it changes; this is
what `policy` and `summary` report, as the running policy decided it (no second copy of the
policy here). Around it, this pure function looks at the same `ClusterState` and says more: how many GPUs are free where the job could run (per
rack and node, within its topology constraint), what its team holds against its guarantee and
limit, which running jobs hold the GPUs (by team, preemptible or not), who is ahead in the
queue, what would unblock it, and an estimated start. `gpusched show`, the dashboard and the
simulator all call it. It never reads a clock: `now` defaults to the fold's time.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

import msgspec

from ..core import rules
from ..core.model import LEVEL_RANK, PRIORITY_RANK
from ..core.reasons import (
    ArrayLimit,
    BehindReservation,
    BeyondGuarantee,
    NoFreeCpuMem,
    NoNodeCpuMem,
    QueuedBehind,
)
from ..core.state import ClusterState, Job
from .backfill import expected_end
from .config import DEFAULT, PolicyConfig
from .eligibility import not_eligible
from .guarantee import Firm
from .memo import Indexes
from .ordering import ordered
from .pools import choices, pool_of_gpus, pool_rows
from .predict import Estimate
from .preemption import VictimSearch, back_off_s, takeable, too_young

#: How many holders / domains an explanation lists (the rest are summed up).
TOP = 8



def _held_on(state: ClusterState, nodes: list[str]) -> dict[str, int]:
    """GPUs each job holds on these nodes."""
    held: dict[str, int] = {}
    for n in nodes:
        for g in state.nodes[n].gpus:
            h = state.gpus[g].holder
            if h is not None:
                held[h] = held.get(h, 0) + 1
    return held

def _domain_keys(state: ClusterState, required: str) -> tuple[str, dict[str, list[str]]]:
    """The topology domains a job with this constraint must fit in: name -> its nodes."""
    rank = LEVEL_RANK[required]
    if rank <= LEVEL_RANK["node"]:
        return "node", {n: [n] for n in state.nodes}
    if required == "rack":
        racks: dict[str, list[str]] = {}
        for n, node in state.nodes.items():
            racks.setdefault(node.rack, []).append(n)
        return "rack", racks
    if required == "block":
        blocks: dict[str, list[str]] = {}
        for n, node in state.nodes.items():
            blocks.setdefault(node.block or node.rack, []).append(n)
        return "block", blocks
    return "cluster", {"cluster": list(state.nodes)}


def _out_of_service(state: ClusterState, nodes: list[str]) -> list[str]:
    """The nodes that take no new work, each as 'node N drained' (or lost, partitioned)."""
    out = []
    for n in nodes:
        node = state.nodes[n]
        why = "lost" if node.lost else "drained" if node.drained else "partitioned" if node.partitioned else None
        if why is not None:
            out.append(f"node {n} {why}")
    return out


def _in_service(state: ClusterState, nodes: list[str]) -> list[str]:
    return [n for n in nodes if state.nodes[n].usable and not state.nodes[n].partitioned]


def _nvlink_free(state: ClusterState, node: str) -> int:
    """The most free GPUs in one NVLink domain of a node."""
    per: dict[int, int] = {}
    for g in state.nodes[node].free:
        d = state.gpus[g].nvlink_domain
        per[d] = per.get(d, 0) + 1
    return max(per.values(), default=0)


def queue_order(state: ClusterState, now: float | None = None, config: PolicyConfig = DEFAULT) -> list[str]:
    """Pending jobs in the order the policy `config` considers them (pass the running one)."""
    now = state.now if now is None else now
    return [j.job_id for j in ordered(state, now, config)]


def estimate_start(state: ClusterState, job: Job, now: float, config: PolicyConfig = DEFAULT) -> float | None:
    """When enough GPUs should be free in some allowed domain, and the team under its limit, if
    running jobs end on time (their time limit, or a preemption deadline), or sooner where the
    policy preempts them for it: by priority once they ran `min_runtime_s`, to reclaim its
    team's guarantee once they ran their back-off (`_freed_at`). None when unknown."""
    room_at = _limit_room_at(state, job, now, config)
    if room_at is not None and not job.spec.preemptible and config.fairshare and config.preemption:
        firm_at = _firm_room_at(state, job, now, config)
        room_at = None if firm_at is None else max(room_at, firm_at)
    if room_at is None:
        return None
    fit_at = _fit_at(state, job, now, config)
    return None if fit_at is None else max(room_at, fit_at)


def _preempted_by_priority(job: Job, h: Job) -> bool:
    """A holder the policy preempts for `job` by priority: a preemptible job of its own team, of
    lower priority, not yielding already."""
    return (h.spec.preemptible and h.preemption is None and h.spec.team == job.spec.team
            and PRIORITY_RANK[h.spec.priority] < PRIORITY_RANK[job.spec.priority])


def _freed_at(job: Job, h: Job, now: float, config: PolicyConfig, reclaims: bool) -> tuple[float, str]:
    """When holder `h`'s GPUs may be taken for `job`, and how: "end" (its expected end),
    "priority" (the policy preempts it for the job by priority, its own team's and lower, once it
    has run `min_runtime_s`), or "reclaim" (`reclaims`: the job reclaims its guarantee from
    another team's preemptible job once that has run its back-off, if its team is still over
    its guarantee then: `_fit_at` checks)."""
    end = expected_end(h, now, config)
    started = h.started_at if h.started_at is not None else now
    if config.preemption and config.priority and _preempted_by_priority(job, h):
        protected_until = started + config.min_runtime_s
        if protected_until < end:
            return max(now, protected_until), "priority"
    if reclaims and h.spec.preemptible and h.preemption is None and h.spec.team != job.spec.team:
        protected_until = started + _back_off(h, config)
        if protected_until < end:
            return max(now, protected_until), "reclaim"
    return end, "end"


def _back_off(h: Job, config: PolicyConfig) -> float:
    """How long `h` runs before another team may take it (`preemption.back_off_s`; without a
    cap, `min_runtime_s` alone, as `_Rule.backed_off`)."""
    return back_off_s(h, config.min_runtime_s, config.preempt_backoff_max_s or config.min_runtime_s)


def _reclaims_within(state: ClusterState, job: Job, config: PolicyConfig) -> bool:
    """Whether the policy reclaims for `job` whatever the clock says, across teams: its team is
    under its guarantee and stays within it once the job starts (`preemption._Rule.within`),
    judged on the teams' totals (no per-model terms), with reclaim as soon as a team is short
    (no fairness horizon) and no run-time predictions that may leave a victim to finish."""
    t = state.teams.get(job.spec.team)
    return (config.fairshare and config.preemption and config.fair_owed_after_s is None and not config.preempt_predicted
            and t is not None and not t.quota.models and t.held + job.spec.gang_min <= t.quota.guaranteed)


def _limit_room_at(state: ClusterState, job: Job, now: float, config: PolicyConfig) -> float | None:
    """When the team's own running jobs will have freed enough of its limit for this job."""
    t = state.teams.get(job.spec.team)
    if t is None or t.quota.limit is None:
        return now
    excess = t.held + job.spec.gang_min - t.quota.limit
    if excess <= 0:
        return now
    if job.spec.gang_min > t.quota.limit:
        return None
    ends = sorted((expected_end(state.jobs[j], now, config), len(state.jobs[j].gpus)) for j in state.running
                  if state.jobs[j].spec.team == job.spec.team)
    for at, count in ends:
        if not math.isfinite(at):
            return None
        excess -= count
        if excess <= 0:
            return at
    return None


def _firm_room_at(state: ClusterState, job: Job, now: float, config: PolicyConfig) -> float | None:
    """When the non-preemptible jobs running now have freed enough for this non-preemptible one
    to keep every guarantee reclaimable (`guarantee.Firm.room`, the rule `plan.job_room`
    applies where reclaim exists), as they end on time."""
    capacity = state.free_count + sum(len(state.jobs[j].gpus) for j in state.running)
    firm = Firm(state, [], capacity)
    need = job.spec.gang_min
    if not firm.active or firm.never_fits(job.spec.team, need) or need <= firm.room(job.spec.team):
        return now
    ends = sorted((expected_end(h, now, config), h.job_id) for h in (state.jobs[j] for j in state.running)
                  if not h.spec.preemptible)
    for at, jid in ends:
        if not math.isfinite(at):
            return None
        h = state.jobs[jid]
        firm.held[h.spec.team] -= min(len(h.gpus), h.spec.gang_min)
        if need <= firm.room(job.spec.team):
            return at
    return None


def _fit_at(state: ClusterState, job: Job, now: float, config: PolicyConfig) -> float | None:
    need = job.spec.gang_min
    grace = config.checkpoint_grace_s if config.checkpoint else 0.0
    level, domains = _domain_keys(state, job.spec.topology.required)
    reclaims = _reclaims_within(state, job, config)
    teams_held = _held_not_leaving(state) if reclaims else {}
    best: float | None = None
    for nodes in domains.values():
        held = dict(teams_held)
        usable = _in_service(state, nodes)
        free = sum(len(state.nodes[n].free) for n in usable)
        if free >= need:
            return now
        capacity = sum(len(state.nodes[n].gpus) for n in usable)
        if capacity < need:
            continue
        ends = [(*_freed_at(job, state.jobs[h], now, config, reclaims), count, h)
                for h, count in _held_on(state, usable).items()]
        heapq.heapify(ends)
        preempts = False
        while ends:
            at, how, count, h = heapq.heappop(ends)
            if not math.isfinite(at):
                break
            if how == "reclaim":  # taken only while its team stays over its guarantee
                team = state.jobs[h].spec.team
                if not _taken_on_totals(state, team, held.get(team, 0.0)):  # (an unknown team: never)
                    heapq.heappush(ends, (expected_end(state.jobs[h], now, config), "end", count, h))
                    continue
                held[team] -= len(state.jobs[h].gpus)
            free += count
            preempts |= how != "end"
            if free >= need:
                if preempts and at <= now:
                    break  # it could preempt for it now and did not: something else holds it back
                # the policy preempts once that completes the set; the victims yield within the grace
                at += grace if preempts else 0.0
                best = at if best is None else min(best, at)
                break
    return best


def _protected(state: ClusterState, job: Job, now: float, config: PolicyConfig, out: dict[str, Any]) -> list[str]:
    """The holders the policy will preempt for the job once their protection ends (priority:
    `min_runtime_s`; reclaim: the back-off), soonest first: what it waits out, and until when."""
    if out["topology"]["fits_now_in"] or "impossible" in out["topology"]:
        return []
    reclaims = _reclaims_within(state, job, config)
    waits = []
    for jid in state.running:
        h = state.jobs[jid]
        at, how = _freed_at(job, h, now, config, reclaims)
        if how == "end" or at <= now or (how == "reclaim" and not _taken_on_totals(state, h.spec.team)):
            continue
        waits.append((at, jid, how, h))
    lines = []
    for at, jid, how, h in sorted(waits)[:TOP]:
        if how == "priority":
            lines.append(f"{jid} ({h.spec.priority}, team {h.spec.team}) is preempted for it once it has run "
                         f"min_runtime_s ({config.min_runtime_s:g} s): in {at - now:.0f} s")
        else:
            lines.append(f"{jid} (team {h.spec.team}, over its guarantee) is reclaimed for it once it has run its "
                         f"back-off ({_back_off(h, config):g} s since its start), if team {h.spec.team} "
                         f"is still over its guarantee then: in {at - now:.0f} s")
    return lines


def _held_not_leaving(state: ClusterState) -> dict[str, float]:
    """Each team's GPUs less those of its jobs already asked to yield (their ends are their
    deadlines)."""
    held = {name: float(t.held) for name, t in state.teams.items()}
    for jid in state.running:
        j = state.jobs[jid]
        if j.preemption is not None and j.spec.team in held:
            held[j.spec.team] -= len(j.gpus)
    return held


def explain_pending(state: ClusterState, job_id: str, now: float | None = None,
                    config: PolicyConfig = DEFAULT, indexes: Indexes | None = None) -> dict[str, Any]:
    """A structured explanation of why `job_id` waits (see the module docstring), under the
    running policy `config`. `indexes`: the caller's indexes of `state`, kept across calls (the
    reader's), so that the run-time predictor is not learned again from every completed job."""
    now = state.now if now is None else now
    job = state.jobs[job_id]
    spec = job.spec
    need = spec.gang_min
    out: dict[str, Any] = {
        "job_id": job_id,
        "state": job.state,
        "team": spec.team,
        "priority": spec.priority,
        "needs": {"gpus": spec.gpus, "min_gpus": need, "required": spec.topology.required,
                  "preferred": spec.topology.preferred},
        "policy": {"reason": job.pending_reason, "blockers": _still_blocking(state, job.pending_blockers),
                   "eta_s": job.pending_eta_s,
                   "why": None if job.pending_why is None else msgspec.to_builtins(job.pending_why)},
        "waiting_s": round(max(0.0, now - job.submitted_at), 3),
    }
    if job.state != "pending":
        out["summary"] = f"job is {job.state}, not pending"
        return out

    out["held"] = job.hold
    out["last_attempt"] = _last_attempt(state, job)
    out["dependency"] = [f"{d.kind}:{d.job} ({state.job_status(d.job) or 'unknown'})"
                         for d in spec.dependency]
    out["team_quota"] = _team_standing(state, job)
    out["pools"] = _pools_standing(state, job)
    out["topology"] = _where(state, job)
    out.update(_holders(state, job, now, config, out["pools"], indexes or Indexes()))
    out["queue"] = _ahead(state, job_id, now, config)
    out["unblock"] = _unblock(state, job, out) + _protected(state, job, now, config, out)
    eta, span = _policy_eta(job, now)
    if eta is None and not isinstance(job.pending_why, _NOT_GPUS) and out["queue"]["ahead_jobs"] == 0:
        # First in the policy's order: when its holders end (or are preempted for it), if
        # nothing behind takes the GPUs first (strict FIFO and a reservation make that a bound).
        # Behind other jobs, who starts first is the policy's plan (`policy/forecast.py`).
        start = estimate_start(state, job, now, config)
        eta = None if start is None else max(0.0, start - now)
    out["eta_s"] = None if eta is None else round(eta, 3)
    out["eta_range"] = span
    out["summary"] = _summary(out)
    barred = not_eligible(state, job, now)
    if barred is not None:  # held or waiting on dependencies: room is not the question yet
        out["unblock"] = [_UNBAR.get(type(barred).__name__, barred.text)]
        out["eta_s"] = out["eta_range"] = None
        out["summary"] = barred.text
    return out


def _last_attempt(state: ClusterState, job: Job) -> str | None:
    """Where its last attempt ran, when a node of it is lost now (the loss that requeued it: the
    policy's reason since then is about its next start)."""
    lost = [n for n in dict.fromkeys(job.nodes_started) if n in state.nodes and state.nodes[n].lost]
    if job.attempt == 0 or not lost:
        return None
    return f"attempt {job.attempt} ran on {', '.join(f'node {n} lost' for n in lost)} (requeued from its checkpoint)"


def _still_blocking(state: ClusterState, blockers: list[str]) -> list[str]:
    """The policy's blockers as of now: a job it named that holds no GPUs any more is left out
    (the reason is said again only when it changes, not when a named holder ends)."""
    return [b for b in blockers if b not in state.jobs or state.jobs[b].holding]


def _policy_eta(job: Job, now: float) -> tuple[float | None, list[float] | None]:
    """The policy's ETA and range, from `now` (it said them at `pending_at`); none once overdue
    (the start it foresaw came and the job still waits: the estimate was wrong)."""
    if job.pending_eta_s is None:
        return None, None
    gone = max(0.0, now - job.pending_at)
    left = job.pending_eta_s - gone
    if left < 0.0 or (left == 0.0 and gone > 0.0):
        return None, None
    span = job.pending_eta_range
    return left, None if not span else [round(max(0.0, span[0] - gone), 3), round(max(0.0, span[1] - gone), 3)]


#: Policy reasons that keep a job waiting whatever GPUs free up first (its place in the queue,
#: its array's limit): no start follows from GPUs freeing alone. (The guarantee rule,
#: `BeyondGuarantee`, lifts as non-preemptible jobs end: `_firm_room_at`.)
_NOT_GPUS = (QueuedBehind, BehindReservation, ArrayLimit)


_UNBAR = {"Held": "`gpusched release JOB` (its owner's team or an admin)",
          "DependencyWait": "its dependencies end (afterok: successfully)",
          "DependencyNever": "nothing: an afterok dependency did not succeed; cancel it and resubmit",
          "MaintenanceWindow": "a maintenance window ends, or `gpusched update JOB --time-limit` to end before one",
          "NoMatchingNode": "a node that matches registers or is labelled; or `gpusched update` the constraint"}


def _team_standing(state: ClusterState, job: Job) -> dict[str, Any]:
    spec, need = job.spec, job.spec.gang_min
    team = state.teams.get(spec.team)
    quota = team.quota if team is not None else None
    held = team.held if team is not None else 0
    guaranteed = quota.guaranteed if quota else 0
    limit = quota.limit if quota else None
    team_info: dict[str, Any] = {"held": held, "guaranteed": guaranteed, "limit": limit, "weight": quota.weight if quota else 1.0,
                 "under_guarantee": held < guaranteed,
                 "pending_jobs": sum(1 for j in state.pending if state.jobs[j].spec.team == spec.team)}
    limit_blocks = limit is not None and held + need > limit
    team_info["limit_blocks"] = limit_blocks
    return team_info


def _pools_standing(state: ClusterState, job: Job) -> dict[str, Any] | None:
    """On a mixed cluster: each GPU pool's free GPUs, the pools the job accepts in order and
    those it does not, and its team's holding and terms per pool (docs/gpu-pools.md)."""
    rows = pool_rows(state, job.spec.team)
    if not rows:
        return None
    order = choices(state, job.spec, lambda p: rows[p]["held"], always=True)
    accepts = list(dict.fromkeys(p for _, p in order)) if order is not None else []
    t = state.teams.get(job.spec.team)
    terms = t is not None and bool(t.quota.models)
    tried = accepts or list(rows)
    need = job.spec.gang_min
    return {"rows": rows, "accepts": accepts, "not_accepted": [p for p in rows if accepts and p not in accepts],
            "terms": terms,
            # the pools the job is tried on where its team's per-model limit leaves no room for it,
            # and those where its team is under its per-model guarantee (it may reclaim there)
            "at_limit": [p for p in tried if t is not None and rules.over_limit(t.quota, rows[p]["held"] + need, p)],
            "under_guarantee": [p for p in tried if terms and rows[p]["held"] < rows[p]["guaranteed"]]}


def _where(state: ClusterState, job: Job) -> dict[str, Any]:
    """The domains at the job's required level: free and total GPUs, who holds them."""
    spec, need = job.spec, job.spec.gang_min
    level, domains = _domain_keys(state, spec.topology.required)
    considered: list[dict[str, Any]] = []
    for name, nodes in domains.items():
        usable = _in_service(state, nodes)
        free = sum(len(state.nodes[n].free) for n in usable)
        total = sum(len(state.nodes[n].gpus) for n in nodes)
        held_here = _held_on(state, usable)
        considered.append({"domain": name, "level": level, "free": free, "total": total,
                           "in_service": sum(len(state.nodes[n].gpus) for n in usable),
                           "out_of_service": _out_of_service(state, nodes),
                           "unavailable": total - free - sum(held_here.values()),
                           "fits": free >= need, "short": max(0, need - free),
                           "top_holders": sorted(held_here.items(), key=lambda kv: (-kv[1], kv[0]))[:3]})
    # where it could start once holders end first: a domain that nodes out of service leave too small is no "best"
    considered.sort(key=lambda d: (d["in_service"] < need, -d["free"], d["domain"]))
    fits_now = [d["domain"] for d in considered if d["fits"]]
    best = considered[0] if considered else None
    topology: dict[str, Any] = {
        "level": level, "domains_considered": len(considered), "fits_now_in": fits_now[:TOP],
        "best": best, "domains": considered[:TOP],
        "free_total": state.free_count, "gpus_total": state.total_gpus,
        "nvlink_best_free": max((_nvlink_free(state, n) for n in state.nodes if state.nodes[n].usable), default=0),
    }
    if not considered or max(d["total"] for d in considered) < need:
        topology["impossible"] = (
            f"no {level} has {need} GPUs at all" if considered else "no nodes registered"
        )
    elif max(d["in_service"] for d in considered) < need:
        # it fits the cluster as built, not as it is: name the nodes whose return would let it
        fewest = min((d for d in considered if d["total"] >= need), key=lambda d: (len(d["out_of_service"]), d["domain"]))
        topology["out_of_service"] = fewest["out_of_service"]
    return topology


def _holders(state: ClusterState, job: Job, now: float, config: PolicyConfig,
             pools: dict[str, Any] | None, indexes: Indexes) -> dict[str, Any]:
    """Who holds GPUs (biggest first), per team, and how many the policy may reclaim for it."""
    holders: list[dict[str, Any]] = []
    by_team: dict[str, int] = {}
    for jid in state.running:
        h = state.jobs[jid]
        if not h.gpus:
            continue
        by_team[h.spec.team] = by_team.get(h.spec.team, 0) + len(h.gpus)
        holders.append({
            "job_id": jid, "team": h.spec.team, "gpus": len(h.gpus), "priority": h.spec.priority,
            "preemptible": h.spec.preemptible, "since": h.started_at,
            "expected_end": None if not math.isfinite(end := expected_end(h, now, config)) else end,
            "preempting": h.preemption is not None,
        })
    holders.sort(key=lambda h: (-h["gpus"], h["job_id"]))
    taken: dict[str, int] = {}
    for v in _takeable(state, job, now, config, pools, indexes):
        taken[v.spec.team] = taken.get(v.spec.team, 0) + len(v.gpus)
    return {"holders": holders[:TOP], "held_by_team": dict(sorted(by_team.items(), key=lambda kv: (-kv[1], kv[0]))),
            "reclaimable_gpus": sum(taken.values()),
            "reclaimable_by_team": dict(sorted(taken.items(), key=lambda kv: (-kv[1], kv[0])))}


def _takeable(state: ClusterState, job: Job, now: float, config: PolicyConfig,
              pools: dict[str, Any] | None, indexes: Indexes) -> list[Job]:
    """The running jobs the policy's preemption rules would take for `job` now
    (`preemption.takeable`), as a cycle's candidates (`steps/victims`): preemptible whole-GPU
    jobs not yielding already, not `too_young`, holding GPUs of a pool the job is tried on;
    teams' holdings less what is already asked to yield. None without preemption."""
    if not config.preemption:
        return []
    accepts = set(pools["accepts"]) if pools is not None and pools["accepts"] else None
    cands = [h for h in (state.jobs[j] for j in state.running)
             if h.gpus and h.spec.preemptible and not h.spec.partial and h.preemption is None
             and not too_young(h, now, config.min_runtime_s)
             and (accepts is None or not accepts.isdisjoint(pool_of_gpus(state, h.gpus)))]
    if not cands:
        return []
    leaving: dict[Any, float] = {}  # team, and (team, GPU pool) -> GPUs of its jobs asked to yield
    for jid in state.running:
        y = state.jobs[jid]
        if y.preemption is not None:
            leaving[y.spec.team] = leaving.get(y.spec.team, 0) + len(y.gpus)
            for p, n in pool_of_gpus(state, y.gpus).items():
                leaving[(y.spec.team, p)] = leaving.get((y.spec.team, p), 0) + n

    def pool_view(team: str, pool: str) -> tuple[float, float, int]:
        t = state.teams.get(team)
        return (t.pool_held.get(pool, 0) if t is not None else 0), leaving.get((team, pool), 0), 0

    owed = config.fair_owed_after_s is None or indexes.queue(state, config).owed(job.spec.team, now)
    left = None
    if config.preempt_predicted:
        def left(v: Job) -> Estimate:  # the predictor learns the completed jobs only if asked
            return indexes.predictor(state).estimate(v, now)
    search = VictimSearch(state, job, now, config, lambda t: state.teams[t].held, lambda _: True,
                          {k: n for k, n in leaving.items() if isinstance(k, str)}, left=left,
                          pool_view=pool_view, owed=owed,
                          shares=indexes.reclaim_shares(state, config))
    return takeable(search, cands)


def _ahead(state: ClusterState, job_id: str, now: float, config: PolicyConfig) -> dict[str, Any]:
    """Its place in the running policy's order, and what is ahead of it."""
    order = queue_order(state, now, config)
    pos = order.index(job_id) if job_id in order else len(order)
    ahead = [state.jobs[j] for j in order[:pos]]
    return {"position": pos + 1, "of": len(order), "ahead_jobs": len(ahead),
                    "ahead_gpus": sum(j.spec.gang_min for j in ahead),
                    "ahead": [j.job_id for j in ahead[:TOP]]}


def _unblock(state: ClusterState, job: Job, out: dict[str, Any]) -> list[str]:
    """What would let it start, from the sections already worked out."""
    spec, need = job.spec, job.spec.gang_min
    tq, topo = out["team_quota"], out["topology"]
    held, limit, limit_blocks = tq["held"], tq["limit"], tq["limit_blocks"]
    level, best, fits_now = topo["level"], topo["best"], topo["fits_now_in"]
    ahead_jobs = out["queue"]["ahead_jobs"]
    unblock: list[str] = []
    if limit_blocks and limit is not None:
        unblock.append(f"team {spec.team} holds {held} of its limit {limit}: {held + need - limit} of its GPUs "
                       f"must free up, or the limit be raised to {held + need}")
    for p in _limited_everywhere(out):
        r = out["pools"]["rows"][p]
        unblock.append(f"team {spec.team} holds {r['held']:g} of its per-model limit {r['limit']} on {p}: "
                       f"{r['held'] + need - r['limit']:g} of its {p} GPUs must free up, or that limit be raised "
                       f"to {math.ceil(r['held'] + need)}")
    if "impossible" in out["topology"]:
        unblock.append(f"it can never fit: {out['topology']['impossible']} (lower its size or relax "
                       f"topology.required={spec.topology.required})")
    elif spec.sliced:
        unblock.append(_slices_unblock(state, job))
    elif "out_of_service" in topo:
        unblock.append(f"{', '.join(topo['out_of_service'])} back in service: without them no {level} has {need} GPUs")
    elif not fits_now and best is not None:
        short = best["short"]
        where = "" if level == "cluster" else f" in {level} {best['domain']}"
        names = ", ".join(f"{j} ({c})" for j, c in best["top_holders"])
        unblock.append(f"{short} more GPU(s) free{where}" + (f": held by {names}" if names else ""))
        if out["reclaimable_gpus"] >= short:
            unblock.append(f"preempting {short} of {out['reclaimable_gpus']} reclaimable GPU(s) (preemptible "
                           f"jobs of over-share teams, or of its own team at lower priority)")
    elif isinstance(job.pending_why, (NoFreeCpuMem, NoNodeCpuMem)):  # its GPUs fit: CPUs or memory do not
        unblock.append(job.pending_why.text + (": it starts when jobs on nodes with free GPUs end and free them" if
                                               isinstance(job.pending_why, NoFreeCpuMem) else ""))
    elif fits_now and isinstance(job.pending_why, BeyondGuarantee):
        unblock.append(f"team {spec.team}'s own non-preemptible jobs end (it may not borrow GPUs other teams "
                       f"are guaranteed), or it is resubmitted --preemptible")
    elif fits_now and not limit_blocks:
        if ahead_jobs:
            unblock.append(f"{ahead_jobs} job(s) ahead of it in the queue are placed first "
                           f"({out['queue']['ahead_gpus']} GPUs)")
        else:
            unblock.append("nothing: it fits now and should start on the next placement cycle")
    if state.placement_degraded:
        unblock.append("placement is degraded: the naive fallback places first-free GPUs")
    return unblock


def _slices_unblock(state: ClusterState, job: Job) -> str:
    """What frees a MIG job's slices: a job on slices of its profile ending, or the admin laying
    out such slices on an idle GPU (placement never changes a geometry)."""
    spec = job.spec
    holders = sorted({j for rec in state.gpus.values() for i, j in rec.slices.items()
                      if i < len(rec.geometry) and rec.geometry[i] == spec.mig})
    held = f": held by {', '.join(holders[:5])}" if holders else ""
    return (f"{spec.mig_count} free {spec.mig} slice(s) on one GPU{held}, or an admin's `gpusched mig set` "
            f"with {spec.mig} slices on an idle MIG GPU")


def _over_share(state: ClusterState, team: str, held: float | None = None) -> bool:
    """Whether the team, holding `held` (default: what it holds), is over its guarantee."""
    t = state.teams.get(team)
    return t is not None and (t.held if held is None else held) > t.quota.guaranteed


def _taken_on_totals(state: ClusterState, team: str, held: float | None = None) -> bool:
    """Whether reclaim may take from the team as the explanation foresees it: over its guarantee
    on the totals (a team with per-model terms is judged per pool, where no ETA is worked out)."""
    t = state.teams.get(team)
    return t is not None and not t.quota.models and _over_share(state, team, held)


def _limited_everywhere(x: dict[str, Any]) -> list[str]:
    """The pools barred by the team's per-model limits, when they bar every pool the job is tried on."""
    pools = x.get("pools")
    if not pools or not pools["at_limit"]:
        return []
    tried = pools["accepts"] or list(pools["rows"])
    return pools["at_limit"] if set(tried) <= set(pools["at_limit"]) else []


def _summary(x: dict[str, Any]) -> str:
    if x["policy"]["reason"]:
        return x["policy"]["reason"]
    if x["team_quota"]["limit_blocks"]:
        tq = x["team_quota"]
        return f"team {x['team']} at its limit {tq['limit']} (holds {tq['held']})"
    if limited := _limited_everywhere(x):
        return f"team {x['team']} at its per-model limit on {', '.join(limited)}"
    topo = x["topology"]
    if "impossible" in topo:
        return f"can never fit: {topo['impossible']}"
    if not topo["fits_now_in"]:
        scope = "" if topo["level"] == "cluster" else f" within one {topo['level']}"
        return f"waiting for {x['needs']['min_gpus']} free GPUs{scope} ({topo['best']['free'] if topo['best'] else 0} free at best)"
    return "fits now; waiting for the next placement cycle"


def explain_preemptions(history: list[tuple[int, Any]]) -> list[dict[str, Any]]:
    """Each preemption of a job, from its history ((seq, event) pairs in log order): which job
    it served, when, the deadline, the checkpoint it saved, and the work lost."""
    out: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    last_ckpt: dict[str, Any] | None = None
    for seq, e in history:
        kind = type(e).__name__
        if kind == "CheckpointSaved":
            last_ckpt = {"path": e.path, "step": e.step, "at": e.at, "seq": seq}
            if current is not None:
                current["checkpoint"] = {**last_ckpt, "on_request": True}
        elif kind == "PreemptionRequested":
            current = {"seq": seq, "at": e.at, "for_job": e.for_job, "reason": e.reason, "deadline": e.deadline,
                       "cause": e.cause, "checkpoint": None, "released_at": None, "forced": None, "lost_gpu_s": None}
            out.append(current)
        elif kind == "GpusReleased" and current is not None and current["released_at"] is None:
            # the job resumes from its latest checkpoint, saved on request or earlier
            current.update(released_at=e.at, forced=e.forced, lost_gpu_s=e.lost_gpu_s, release_reason=e.reason)
            if current["checkpoint"] is None and last_ckpt is not None:
                current["checkpoint"] = {**last_ckpt, "on_request": False}
            current = None
    return out


__all__ = ["explain_pending", "explain_preemptions", "estimate_start", "queue_order"]
