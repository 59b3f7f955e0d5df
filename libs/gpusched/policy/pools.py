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

from collections.abc import Callable

from ..core.model import GpuId, JobSpec
from ..core.pools import accepted, canonical_model, has_models, model_guaranteed, model_room, type_matches
from ..core.state import ClusterState
from .placement import Pool

#: (a GPU type the job named, or None: any; a pool) in the order the job is tried on them.
Choice = tuple[str | None, str]


class _Pools:
    """Each pool's GPUs, per state (held and compared by identity), rebuilt when a node registers."""

    state: ClusterState | None = None
    size = -1
    gpus: dict[str, list[GpuId]] = {}
    others: dict[Choice, list[GpuId]] = {}


def pools(state: ClusterState) -> dict[str, list[GpuId]]:
    """Pool (canonical model) -> its GPUs, pools in name order."""
    if _Pools.state is not state or _Pools.size != len(state.gpus):
        per: dict[str, list[GpuId]] = {}
        for g, rec in state.gpus.items():
            per.setdefault(canonical_model(rec.model), []).append(g)
        _Pools.state, _Pools.size, _Pools.others = state, len(state.gpus), {}
        _Pools.gpus = dict(sorted(per.items()))
    return _Pools.gpus


def choices(state: ClusterState, spec: JobSpec, held_on: Callable[[str], int],
            always: bool = False) -> list[Choice] | None:
    """The (type, pool) pairs the job is tried on, in order; None: placed as before (see the
    module docstring; `always`: also a job of one type, for its reason). `held_on(pool)`: its
    team's GPUs there as the cycle sees them."""
    t = state.teams.get(spec.team)
    quota = t.quota if t is not None else None
    types = accepted(spec)
    if len(types) <= 1 and not has_models(quota) and not (always and types):
        return None
    gpus, known = pools(state), state.gpus
    if types:
        return [(w, p) for w in types for p, members in gpus.items()
                if any(type_matches(w, known[g].model) for g in members)]
    assert quota is not None
    named = [p for p in quota.models if p in gpus]
    under = [p for p in named if held_on(p) < model_guaranteed(quota, p)]
    order = under + [p for p in named if p not in under] + [p for p in gpus if p not in quota.models]
    return [(None, p) for p in order]


def room_on(state: ClusterState, team: str, pool: str, held: int) -> int | None:
    """GPUs of `pool` the team may still take under its per-model limit (None: no limit)."""
    t = state.teams.get(team)
    return model_room(t.quota if t is not None else None, pool, held)


def restrict_to(pool: Pool, choice: Choice) -> Pool:
    """The pool less every GPU outside the choice's pool or not of its type."""
    state = pool.state
    per = pools(state)
    other = _Pools.others.get(choice)
    if other is None:
        want, name = choice
        other = _Pools.others[choice] = [g for p, members in per.items() for g in members
                                         if p != name or (want is not None and not type_matches(want, state.gpus[g].model))]
    return pool.without(other) if other else pool


def pool_rows(state: ClusterState, team: str | None = None) -> dict[str, dict]:
    """Each pool's GPUs, free GPUs and (given `team`) the team's holding and per-model terms
    there, for `teams`, `show` and the dashboard; empty on a cluster of one pool with no terms."""
    per = pools(state)
    t = state.teams.get(team) if team is not None else None
    if len(per) < 2 and (t is None or not t.quota.models):
        return {}
    out: dict[str, dict] = {}
    for name, members in per.items():
        row: dict[str, int | None] = {"gpus": len(members), "free": sum(1 for g in members if g in state.nodes[state.gpus[g].node].free)}
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


__all__ = ["Choice", "choices", "pool_of_gpus", "pool_rows", "pools", "restrict_to", "room_on"]
