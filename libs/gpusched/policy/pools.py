"""Which GPU pools a job is tried on, in which order, within which room (issue 30).

As Kueue's flavor fungibility: a job that names several GPU types (`--gpu-type H100,A100`) is
placed on the first pool with room for it, each whole gang on one pool; a team with per-model
terms (`TeamQuota.models`) has each of its jobs placed on one pool, within its per-model limit
there, its untyped jobs on the pools where it is under its per-model guarantee first. Only
free GPUs are tried here: the walk tries every accepted pool before reclaim may preempt for the
job (Kueue's default `whenCanPreempt: TryNextFlavor`), so a job falls back to a free A100
rather than evict someone from an H100 (docs/gpu-pools.md says why).

A job with one type (or none) of a team without per-model terms is placed as before:
`choices` returns None and the placer's constraint filter alone applies.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..core import rules
from ..core.model import GpuId, JobSpec
from ..core.pools import accepted, canonical_model, has_models, model_guaranteed, type_matches
from ..core.state import ClusterState
from .placement import Pool, Topology

#: (a GPU type the job named, or None: any; a pool) in the order the job is tried on them.
Choice = tuple[str | None, str]


class PoolIndex:
    """Each GPU pool's GPUs in one cluster shape, and what placement questions learn from them
    (the pools a GPU type matches, each choice's GPUs outside it). Kept by the cluster's
    `Topology` (so with whoever owns it, e.g. `memo.Indexes`), rebuilt when a GPU registers."""

    __slots__ = ("size", "gpus", "typed", "others")

    def __init__(self, state: ClusterState) -> None:
        per: dict[str, list[GpuId]] = {}
        for g, rec in state.gpus.items():
            per.setdefault(canonical_model(rec.model), []).append(g)
        self.size = len(state.gpus)
        self.gpus = dict(sorted(per.items()))  # pool (canonical model) -> its GPUs, pools in name order
        self.typed: dict[str, list[str]] = {}  # GPU type -> the pools it matches
        self.others: dict[Choice, dict[str, list[GpuId]]] = {}  # choice -> node -> its GPUs outside the choice


def pool_index(state: ClusterState, topo: Topology | None = None) -> PoolIndex:
    """The pools of `state`, kept in `topo` (its topology); without one, built for a one-off
    question (`show`, `teams`)."""
    if topo is None or topo.nodes is not state.nodes:
        return PoolIndex(state)
    index = topo.pool_index
    if index is None or index.size != len(state.gpus):
        index = topo.pool_index = PoolIndex(state)
    return index


def pools(state: ClusterState, topo: Topology | None = None) -> dict[str, list[GpuId]]:
    """Pool (canonical model) -> its GPUs, pools in name order."""
    return pool_index(state, topo).gpus


def choices(state: ClusterState, spec: JobSpec, held_on: Callable[[str], float],
            always: bool = False, topo: Topology | None = None) -> list[Choice] | None:
    """The (type, pool) pairs the job is tried on, in order; None: placed as before (see the
    module docstring; `always`: also a job of one type, for its reason). `held_on(pool)`: its
    team's GPUs there as the cycle sees them; `topo`: the topology that keeps the pools."""
    t = state.teams.get(spec.team)
    quota = t.quota if t is not None else None
    types = accepted(spec)
    if len(types) <= 1 and not has_models(quota) and not (always and types):
        return None
    index = pool_index(state, topo)
    gpus = index.gpus
    if types:
        return [(w, p) for w in types for p in _typed(state, index, w)]
    assert quota is not None
    named = [p for p in quota.models if p in gpus]
    under = [p for p in named if held_on(p) < model_guaranteed(quota, p)]
    order = under + [p for p in named if p not in under] + [p for p in gpus if p not in quota.models]
    return [(None, p) for p in order]


def _typed(state: ClusterState, index: PoolIndex, want: str) -> list[str]:
    """The pools with a GPU whose model matches `want` (kept in the index)."""
    hit = index.typed.get(want)
    if hit is None:
        known = state.gpus
        hit = index.typed[want] = [p for p, members in index.gpus.items()
                                   if any(type_matches(want, known[g].model) for g in members)]
    return hit


def limit_left(state: ClusterState, team: str, pool: str, held: float) -> float | None:
    """GPUs of `pool`, shares included, a team holding `held` of them may still take under its
    per-model limit (None: no limit; the rule: `rules.limit_room`)."""
    t = state.teams.get(team)
    return rules.limit_room(t.quota if t is not None else None, held, pool)


def room_on(state: ClusterState, team: str, pool: str, held: float) -> int | None:
    """Whole GPUs of `pool` a team holding `held` of them may still take under its per-model limit."""
    room = limit_left(state, team, pool, held)
    return None if room is None else math.floor(room + rules.SHARE_SLACK)


def within_limits(state: ClusterState, team: str, gpus: list[GpuId], held_on: Callable[[str], float]) -> list[GpuId]:
    """`gpus` (in order) less those that would take the team past its per-model limit on their
    pool (an elastic job's growth, `steps/grow`). `held_on(pool)`: its GPUs there as the cycle
    sees them."""
    t = state.teams.get(team)
    if t is None or not t.quota.models:
        return gpus
    left: dict[str, int | None] = {}
    out = []
    for g in gpus:
        p = canonical_model(state.gpus[g].model)
        r = left[p] if p in left else room_on(state, team, p, held_on(p))
        if r is None or r > 0:
            out.append(g)
            r = None if r is None else r - 1
        left[p] = r
    return out


def restrict_to(pool: Pool, choice: Choice) -> Pool:
    """The pool less every GPU outside the choice's pool or not of its type, kept in the pool
    while neither it (`Pool.changes`) nor the fold changes: a long queue of jobs alike asks the
    same question, and the copy keeps the failures it learns (`Pool.fails`)."""
    state = pool.state
    key = ("gpu pool", choice)
    at = (pool.changes, state.last_seq)
    hit = pool.narrowed.get(key)
    if hit is not None and hit[0] == at:
        return hit[1]
    index = pool_index(state, pool.topo)
    by_node = index.others.get(choice)
    if by_node is None:
        want, name = choice
        by_node = index.others[choice] = {}
        for p, members in index.gpus.items():
            for g in members:
                if p != name or (want is not None and not type_matches(want, state.gpus[g].model)):
                    by_node.setdefault(state.gpus[g].node, []).append(g)
    other = [g for n, gpus in by_node.items() if pool.n_free(n) > 0 for g in gpus]  # busy nodes: nothing to remove
    out = pool.without(other) if other else pool
    pool.narrowed[key] = (at, out)
    return out


class PoolFirm:
    """`guarantee.Firm` per GPU pool: on a pool where teams hold per-model guarantees, the GPUs
    non-preemptible jobs hold there beyond their teams' guarantees must fit in the pool's slack
    (its GPUs nobody is guaranteed), so each per-model guarantee stays reclaimable. Built once
    per cycle from the running jobs; the cycle's grants are added as they are made."""

    def __init__(self, state: ClusterState, started: list, topo: Topology | None = None) -> None:
        self.state, self.topo = state, topo
        self.guaranteed: dict[str, dict[str, int]] = {}  # pool -> team -> its guarantee there
        for name, t in state.teams.items():
            for p, m in t.quota.models.items():
                if m.guaranteed:
                    self.guaranteed.setdefault(p, {})[name] = m.guaranteed
        self.held: dict[tuple[str, str], int] = {}  # (team, pool) -> non-preemptible GPUs there
        if not self.guaranteed:
            return
        for jid in state.running:
            j = state.jobs[jid]
            if not j.spec.preemptible:
                self.add(j.team, j.gpus, j.spec.gang_min)
        for j, gpus in started:
            if not j.spec.preemptible:
                self.add(j.team, gpus, j.spec.gang_min)

    def add(self, team: str, gpus: list[GpuId], gang_min: int) -> None:
        """Only a job's minimum counts: an elastic job's extras can be shrunk (as `Firm`)."""
        left = gang_min
        for p, n in pool_of_gpus(self.state, gpus).items():
            k = min(n, left)
            left -= k
            self.held[(team, p)] = self.held.get((team, p), 0) + k

    def _slack(self, pool: str, g: dict[str, int]) -> int:
        return max(0, len(pools(self.state, self.topo).get(pool, [])) - sum(g.values()))

    def never_fits(self, team: str, pool: str, need: int) -> bool:
        """A job of `need` GPUs the rule could never let onto `pool`."""
        g = self.guaranteed.get(pool)
        return g is not None and need > g.get(team, 0) + self._slack(pool, g)

    def room(self, team: str, pool: str, need: int, exempt: bool) -> int | None:
        """GPUs of `pool` the team's non-preemptible jobs may still take (None: unbounded: no
        guarantee on the pool, or `exempt`: a job the rule could never let onto any pool it
        accepts, which is not barred for ever, as with `Firm.never_fits`)."""
        g = self.guaranteed.get(pool)
        if not g or exempt:
            return None
        slack = self._slack(pool, g)
        mine = g.get(team, 0)
        excess = sum(max(0, n - g.get(t, 0)) for (t, p), n in self.held.items() if p == pool and t != team)
        return mine + max(0, slack - excess) - self.held.get((team, pool), 0)


def pool_rows(state: ClusterState, team: str | None = None) -> dict[str, dict]:
    """Each pool's GPUs, free GPUs and (given `team`) the team's holding and per-model terms
    there, for `teams`, `show` and the dashboard; empty on a cluster of one pool with no terms."""
    per = pools(state)
    t = state.teams.get(team) if team is not None else None
    if len(per) < 2 and (t is None or not t.quota.models):
        return {}
    out: dict[str, dict] = {}
    for name, members in per.items():
        row: dict[str, float | None] = {"gpus": len(members), "free": sum(1 for g in members if g in state.nodes[state.gpus[g].node].free)}
        if t is not None:
            m = t.quota.models.get(name)
            row.update(held=t.pool_held.get(name, 0), guaranteed=0 if m is None else m.guaranteed,
                       limit=None if m is None else m.limit)
        out[name] = row
    return out


def pool_of_gpus(state: ClusterState, gpus: list[GpuId]) -> dict[str, int]:
    """How many of `gpus` are in each pool."""
    out: dict[str, int] = {}
    for g in gpus:
        p = canonical_model(state.gpus[g].model)
        out[p] = out.get(p, 0) + 1
    return out


__all__ = ["Choice", "PoolFirm", "PoolIndex", "choices", "limit_left", "pool_index", "pool_of_gpus", "pool_rows", "pools", "restrict_to", "room_on",
           "within_limits"]
