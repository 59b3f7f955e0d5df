"""Which team goes next: a team below its guaranteed share first, then the least weighted
usage beyond the guarantee (`borrowed`).

Usage is the fold's decayed GPU-seconds (`state.team_usage`); a team's current holding counts as
`fairshare_horizon_s` of future usage, so GPUs granted earlier in the same cycle move a team down
the order at once. Priority only orders work *within* a team (see ordering.py).

A team's name never decides anything. Among teams below their guarantee, the lowest fraction of
its guarantee goes first, and at the same fraction the team further below it in GPUs (vision at
0 of 8 before nlp at 0 of 4: issue 12). Teams whose ranks still tie are ordered by their queues'
head jobs (`ordering.QueueIndex`), and a preemption across teams that would only tie the
victim's team with the beneficiary's is not made (`preemption._Rule.keeps_order`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..core import rules
from ..core.model import TeamQuota
from ..core.state import ClusterState
from .config import PolicyConfig


def team_rank(state: ClusterState, team: str, held: float, usage: float, config: PolicyConfig,
              on: rules.Standing | None = None, owed: bool = True, level: float = 0.0) -> tuple:
    """Lower sorts first. `held` is the team's holding as this cycle sees it; `on`: the standing
    its guarantee is judged by instead of its totals (on one GPU pool, `standing`). The rank
    holds no name: equal ranks are ties for the caller to break (see the module docstring).

    With `fair_owed_after_s` (fairness over a horizon) a team below its guarantee goes first only
    when `owed` (its oldest waiting job waited that long: `QueueIndex.owed`); every other team
    ranks by `level`, the LAS level of its next job (short jobs of any team first), then by its
    decayed usage relative to its entitlement (`entitlement`): Slurm's fair-share factor."""
    t = state.teams.get(team)
    q = t.quota if t is not None else None
    h, guaranteed = on if on is not None else (held, q.guaranteed if q is not None else 0)
    if 0 < guaranteed and h < guaranteed and (owed or config.fair_owed_after_s is None):
        return (0, h / guaranteed, h - guaranteed)
    used = usage + held * config.fairshare_horizon_s
    if config.fair_owed_after_s is not None:
        return (1, level, used / entitlement(q))
    if config.fairshare_by == "borrowed":
        used = borrowed(state, q, usage, held, config)
    return (1, used / (q.weight if q is not None else 1.0), 0)


def borrowed(state: ClusterState, quota, usage: float, held: float, config: PolicyConfig) -> float:
    """A team's decayed usage beyond its guarantee, and its holding beyond it as
    `fairshare_horizon_s` of future usage: what teams at or over their guarantee share by weight
    (the entitlement's water-filling of what guarantees leave). A team's guaranteed GPUs cost it
    nothing in the order: counted, they put a big team's borrowing behind every small team's,
    and on saturated clusters teams guaranteed nothing took the GPUs gangs could not use, at
    4.75x their entitlement (issue 26). The guarantee's own usage is its steady state (held
    for ever, decayed: `guaranteed * half_life / ln 2`); without decay nothing is credited."""
    g = quota.guaranteed if quota is not None else 0
    credit = g * state.half_life_s / math.log(2) if state.half_life_s is not None else 0.0
    return max(0.0, usage - credit) + max(0.0, held - g) * config.fairshare_horizon_s


def entitlement(quota) -> float:
    """What a team's usage is measured against over the horizon: its guaranteed GPUs, or (a team
    guaranteed none) its weight, as one GPU per unit of weight."""
    if quota is None:
        return 1.0
    return float(quota.guaranteed) if quota.guaranteed > 0 else max(quota.weight, 1e-9)


def fair_shares(capacity: float, demand: Mapping[str, float], quotas: Mapping[str, TeamQuota]) -> dict[str, float]:
    """Each team's fair share of `capacity` now (KAI's fair share, Kueue's with borrowing): its
    guarantee first, capped by its demand (the GPUs its unfinished jobs ask for), then what
    guarantees leave, water-filled by weight, capped by demand and hard limit. The entitlement
    `docs/results.md` measures Jain against, and what `reclaim_to="share"` reclaims to."""
    default = TeamQuota()
    cap = {}
    for team, d in demand.items():
        if d > 0:
            q = quotas.get(team, default)
            cap[team] = min(d, q.limit if q.limit is not None else capacity)
    give = {team: float(min(c, quotas.get(team, default).guaranteed)) for team, c in cap.items()}
    left = capacity - sum(give.values())
    active = sorted(t for t in cap if give[t] < cap[t])
    while left > 1e-9 and active:
        weights = {t: quotas.get(t, default).weight for t in active}
        total_w = sum(weights.values())
        sated = [t for t in active if cap[t] - give[t] <= left * weights[t] / total_w]
        if not sated:
            for t in active:
                give[t] += left * weights[t] / total_w
            break
        for t in sated:
            left -= cap[t] - give[t]
            give[t] = float(cap[t])
        active = [t for t in active if t not in sated]
    return give


def takes_share(shares: Mapping[str, float], team: str, after: float, victim_team: str, before: float) -> bool:
    """(`reclaim_to="share"`) Whether `team`, holding `after` once it gains the GPUs, may take
    from `victim_team`, holding `before`: the victim's team holds more than its fair share, and
    more of it, as a ratio, than the taking team will (Kueue's fair-sharing preemption,
    LessThanInitialShare). Ratios, because Jain and users judge a team by its share's fraction:
    a team owed 0.4 GPU holding one is at 2.5x, one owed 90 holding 91 at 1.01x. The larger
    ratio of the two only falls, so no GPU ping-pongs between them. A share counts as at least
    one GPU: a team owed 0.4 is never over it for holding its first GPU (GPUs come whole), else
    the teams owed less than one would wait for every other team's last waiting job."""
    mine, theirs = max(shares.get(team, 0.0), 1.0), max(shares.get(victim_team, 0.0), 1.0)
    return before > theirs and mine > 0 and after * theirs < before * mine


def over_share(state: ClusterState, team: str, held: float) -> float:
    """How many GPUs a team holds beyond its guaranteed share (negative: below it)."""
    t = state.teams.get(team)
    return held - (t.quota.guaranteed if t is not None else 0)


def limit_room(state: ClusterState, team: str, held: float) -> float | None:
    """GPUs a team may still take before its hard limit (None: no limit)."""
    t = state.teams.get(team)
    return rules.limit_room(t.quota if t is not None else None, held)


def standing(state: ClusterState, team: str, held: float, pool: str | None = None, on_pool: float = 0.0) -> rules.Standing:
    """What the team's guarantee is judged by (`rules.judged_on`), holding `held` in all and
    `on_pool` of GPU pool `pool` (None: totals) as this cycle sees them."""
    t = state.teams.get(team)
    return rules.judged_on(t.quota if t is not None else None, held, {} if pool is None else {pool: on_pool}, pool)


def may_preempt(state: ClusterState, victim_team: str, victim_held: float, for_team: str, for_held: float) -> bool:
    """The fold's fairness rule (`rules.fair_between`) on the teams' totals. `*_held` are the
    holdings when the request is applied."""
    return rules.fair_between(victim_team, standing(state, victim_team, victim_held),
                                 for_team, standing(state, for_team, for_held))
