"""Placement as a stack (Nomad's `stack.go`, KAI's node-order plugins): feasibility filters
decide which GPUs may hold a job, weighted scorers which of the sets that fit is best.

`Placer.place(pool, spec, n)` is the one entry point every step of a cycle calls: it narrows
the pool through `FILTERS`, then picks the best set of `n` GPUs by `SCORERS`. The topology
requirement bounds the search itself (no set wider than `spec.topology.required` is ever a
candidate). Least fragmentation is the order the search yields candidates in (best fit first,
`placement.candidates`): it breaks ties between equal scores, so with no soft preference the
answer is the search's first (`placement.place`, the fast path, taken without building the
candidates).

Adding a hard requirement is one filter and one line in `FILTERS`; adding a preference is one
scorer and one line in `SCORERS`. A scorer only ranks sets that passed every filter, so a soft
preference can change which GPUs a job gets, never whether it gets any.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

from ..core.model import LEVEL_RANK, JobSpec
from .eligibility import barred_nodes, constrained, restrict
from .placement import Placement, Pool, candidates, first_free, place
from .pools import choices, restrict_to, room_on
from .resources import by_resources

#: A feasibility filter: the pool less the GPUs that may not hold this job (at `now`).
Filter = Callable[[Pool, JobSpec, float | None], Pool]


def by_constraints(pool: Pool, spec: JobSpec, now: float | None) -> Pool:
    """Only the nodes of the job's GPU model (`--gpu-type`) carrying its labels (`--constraint`)."""
    return restrict(pool, spec) if constrained(spec) else pool


def by_windows(pool: Pool, spec: JobSpec, now: float | None) -> Pool:
    """Not the nodes whose maintenance window the job's time limit would run into."""
    if now is None or not pool.state.windows:
        return pool
    barred = barred_nodes(pool.state, spec, now)
    if not barred:
        return pool
    nodes = pool.state.nodes
    return pool.without([g for n in barred for g in nodes[n].gpus])


#: The hard requirements, applied in order. `by_resources`: only nodes with the job's per-node
#: CPUs and memory free, so every node of a gang can hold it (`policy/resources.py`).
FILTERS: list[Filter] = [by_constraints, by_windows, by_resources]


class Scorer(NamedTuple):
    """A soft preference: `score(pool, spec, set)` in [0, 1] per unit of `weight`; `wants(spec)`
    says whether it can tell this job's candidates apart (else it is skipped). What a job
    prefers lives in `spec.prefer`: a job without it takes the search's answer directly."""

    name: str
    weight: float
    score: Callable[[Pool, JobSpec, Placement], float]
    wants: Callable[[JobSpec], bool]


def tightness(pool: Pool, spec: JobSpec, p: Placement) -> float:
    """1 for one NVLink domain down to 0 for a set across the cluster."""
    return 1.0 - LEVEL_RANK[p.level] / 4.0


def _share(pool: Pool, p: Placement, good: Callable[[str], bool]) -> float:
    """The share of the set's GPUs on nodes for which `good(node)` holds."""
    gi = pool.state.gpus
    return sum(1 for g in p.gpus if good(gi[g].node)) / len(p.gpus)


def gpu_model(pool: Pool, spec: JobSpec, p: Placement) -> float:
    """The share of the set on the preferred GPU model (`--prefer gpu-type=MODEL`)."""
    assert spec.prefer is not None and spec.prefer.gpu_type is not None
    want, st = spec.prefer.gpu_type.lower(), pool.state
    return _share(pool, p, lambda n: any(want in st.gpus[g].model.lower() for g in st.nodes[n].gpus))


def labels(pool: Pool, spec: JobSpec, p: Placement) -> float:
    """The share of the set on nodes carrying every preferred label (`--prefer label=K=V`)."""
    assert spec.prefer is not None
    want, nodes = spec.prefer.labels.items(), pool.state.nodes
    return _share(pool, p, lambda n: all(nodes[n].labels.get(k) == v for k, v in want))


def spread(pool: Pool, spec: JobSpec, p: Placement) -> float:
    """The share of its nodes left free after the set is taken, on its fullest node
    (`--prefer spread`: the emptiest nodes first, the opposite of best fit)."""
    gi, nodes = pool.state.gpus, pool.state.nodes
    per: dict[str, int] = {}
    for g in p.gpus:
        per[gi[g].node] = per.get(gi[g].node, 0) + 1
    return min((pool.n_free(n) - k) / max(1, len(nodes[n].gpus)) for n, k in per.items())


def _always(spec: JobSpec) -> bool:
    return True


#: Which set is best, by the sum of weighted scores; ties go to the search's order (least
#: fragmentation). A level of tightness (4.0) outweighs every preference together, so a
#: preference picks among the sets of the tightest level that fits; raise its weight to trade
#: a level for it.
SCORERS: list[Scorer] = [
    Scorer("tightness", 16.0, tightness, _always),
    Scorer("gpu_model", 1.0, gpu_model, lambda s: s.prefer is not None and s.prefer.gpu_type is not None),
    Scorer("labels", 1.0, labels, lambda s: s.prefer is not None and bool(s.prefer.labels)),
    Scorer("spread", 1.0, spread, lambda s: s.prefer is not None and s.prefer.spread),
]


class Placer:
    """The placement of one cycle: the strategy chosen once (topology-aware, or the first free
    GPUs: the baseline and the fallback of a dead placement service), the cycle's `now` for the
    filters that read it, and the filter and scorer lists."""

    __slots__ = ("name", "now", "filters", "scorers")

    def __init__(self, name: Literal["topo", "naive"], now: float | None = None,
                 filters: list[Filter] | None = None, scorers: list[Scorer] | None = None) -> None:
        self.name, self.now = name, now
        self.filters = FILTERS if filters is None else filters
        self.scorers = SCORERS if scorers is None else scorers

    def place(self, pool: Pool, spec: JobSpec, n: int) -> Placement | None:
        """The best set of `n` GPUs for a job of `spec` on `pool`, or None: the one entry point.
        A job tried on GPU pools (`pools.choices`) gets its set on the first pool that holds it,
        within its team's per-model limit there as the fold has it (the walk's `plan.fit` counts
        the cycle's own grants too)."""
        st = pool.state
        t = st.teams.get(spec.team)
        held = t.pool_held if t is not None else {}
        order = choices(st, spec, lambda p: held.get(p, 0), topo=pool.topo)
        if order is None:
            return self.best(self.feasible(pool, spec), spec, n)
        for c in order:
            room = room_on(st, spec.team, c[1], held.get(c[1], 0))
            if room is None or room >= n:
                p = self.best(self.feasible(restrict_to(pool, c), spec), spec, n)
                if p is not None:
                    return p
        return None

    def feasible(self, pool: Pool, spec: JobSpec) -> Pool:
        """The pool less every GPU a filter bars for this job (the pool itself when none does)."""
        for keep in self.filters:
            pool = keep(pool, spec, self.now)
        return pool

    def best(self, pool: Pool, spec: JobSpec, n: int) -> Placement | None:
        """The best set on a pool `feasible` already narrowed for this job."""
        required, preferred = spec.topology.required, spec.topology.preferred
        if self.name == "naive":
            return first_free(pool, n, required)
        if spec.prefer is None:  # soft preferences live in `spec.prefer`: none, nothing to weigh
            return place(pool, n, required, preferred)
        active = [s for s in self.scorers if s.weight and s.name != "tightness" and s.wants(spec)]
        if not active:
            return place(pool, n, required, preferred)
        active += [s for s in self.scorers if s.name == "tightness"]
        found = candidates(pool, n, required)
        if not found:
            return None
        scores = [sum(s.weight * s.score(pool, spec, p) for s in active) for p in found]
        top = max(range(len(found)), key=lambda i: (scores[i], -i))
        p = found[top]
        why = p.why + "".join(f", {s.name} {s.score(pool, spec, p):.2f}" for s in active if s.name != "tightness")
        if LEVEL_RANK[p.level] > LEVEL_RANK[preferred]:
            why += f" (preferred {preferred} not available)"
        return Placement(p.gpus, p.level, why)

    def for_spec(self, spec: JobSpec) -> Callable[..., Placement | None]:
        """`place` for one job, in the (pool, n, required) shape `backfill.reserve` asks with."""
        def place_for(pool: Pool, n: int, required: str | None = None) -> Placement | None:
            return self.place(pool, spec, n)
        return place_for


__all__ = ["FILTERS", "SCORERS", "Filter", "Placer", "Scorer", "by_constraints", "by_resources", "by_windows"]
