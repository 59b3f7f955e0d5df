"""The pool's index of nodes by free count gives the placements a scan of every node gives.

`_scan_within_node` is the placement within one node as it was before the index (a pass over
every node's free count per placement), kept here as the reference. Random clusters mixing
NVLink layouts, partly filled, are changed through the pool (take, add, remove, copies) and
every size is placed both ways after every change: same GPUs, same level, same reason.
"""

from __future__ import annotations

import random

import pytest

from gpusched.core.model import LEVEL_RANK
from gpusched.policy import placement
from gpusched.policy.placement import Pool, place

from .policy_helpers import Scenario

LAYOUTS = ("all", "pairs", "quads", "none")


def _scan_best_domain(pool: Pool, dom_cands: list[int], n: int):
    topo, cnt, rc = pool.topo, pool.node_counts(), pool.rack_counts()
    rack_of = topo.rack_of
    best = None
    fast = [i for i in dom_cands if topo.all_layout[i]]
    if fast:
        kmin = min(cnt[i] for i in fast)
        i = min((i for i in fast if cnt[i] == kmin), key=lambda i: rc[rack_of[i]])
        best = ((kmin, kmin, rc[rack_of[i]], i), i, None)
    for i in dom_cands:
        if topo.all_layout[i]:
            continue
        for d, gs in placement._domains(pool, topo.names[i]).items():
            if len(gs) >= n:
                key = (len(gs), cnt[i], rc[rack_of[i]], i)
                if best is None or key < best[0]:
                    best = (key, i, d)
    return None if best is None else (best[1], best[2])


def _scan_within_node(pool: Pool, n: int, limit: int):
    topo, cnt = pool.topo, pool.node_counts()
    names = topo.names
    cands = [i for i, k in enumerate(cnt) if k >= n]
    if not cands:
        return None
    rc, rack_of = pool.rack_counts(), topo.rack_of
    best_dom = _scan_best_domain(pool, [i for i in cands if topo.dom_cap[i] >= n], n)
    if best_dom is not None:
        i, d = best_dom
        gpus = pool.free_on(names[i])[:n] if d is None else placement._domains(pool, names[i])[d][:n]
        return gpus, "nvlink", f"one NVLink domain on {names[i]}"
    if limit < LEVEL_RANK["node"]:
        return ()
    kmin = min(cnt[i] for i in cands)
    i = min((i for i in cands if cnt[i] == kmin), key=lambda i: rc[rack_of[i]])
    return placement._pick_on_node(pool, names[i], n), "node", f"one node {names[i]}"


def _cluster(rng: random.Random, layouts: tuple[str, ...]) -> Scenario:
    s = Scenario(racks=0)
    for r in range(rng.randint(1, 4)):
        for k in range(rng.randint(1, 6)):
            s.node(f"r{r}n{k}", f"r{r}", rng.choice((4, 8)), rng.choice(layouts))
    job = 0
    for node in list(s.state.nodes.values()):  # partly filled, unevenly
        free = list(node.free)
        rng.shuffle(free)
        held = free[:rng.randint(0, len(free))]
        if held:
            s.run(f"fill{job}", held)
            job += 1
    return s


def _assert_same(pool: Pool) -> int:
    """Every size, every level bound: the index and the scan agree. Returns how many placed."""
    placed = 0
    for n in range(1, pool.topo.max_node + 1):
        for limit in (LEVEL_RANK["nvlink"], LEVEL_RANK["node"], LEVEL_RANK["cluster"]):
            want = _scan_within_node(pool, n, limit)
            assert placement._within_node(pool, n, limit) == want, (n, limit)
            placed += bool(want)
    return placed


@pytest.mark.parametrize("layouts", [("all",), LAYOUTS, ("quads", "pairs")], ids=["all", "mixed", "no-all"])
def test_index_places_as_a_scan_of_every_node_does(layouts):
    rng = random.Random(13)
    placed = 0
    for _ in range(30):
        s = _cluster(rng, layouts)
        pool = Pool(s.state)
        held = [g for node in s.state.nodes.values() for g in node.gpus if g not in node.free]
        for _ in range(12):
            placed += _assert_same(pool)
            step = rng.random()
            if step < 0.45:  # grant a placement, as a cycle does
                p = place(pool, rng.randint(1, pool.topo.max_node))
                if p is not None:
                    pool.take(p.gpus)
            elif step < 0.7 and held:  # a running job ends
                gone = rng.sample(held, rng.randint(1, min(8, len(held))))
                pool.add(gone)
            elif step < 0.85:  # a reservation: the copy must not place on these
                node = rng.choice(list(s.state.nodes.values()))
                pool = pool.without(node.gpus[:rng.randint(1, len(node.gpus))])
            else:  # a what-if (preemption's): a copy places; the pool itself is unchanged
                what_if = pool.copy()
                p = place(what_if, rng.randint(1, pool.topo.max_node))
                if p is not None:
                    what_if.take(p.gpus)
                placed += _assert_same(what_if)
    assert placed > 1000  # the comparison covered real placements, not only "no fit"


def test_index_follows_the_pool_through_take_and_add():
    s = Scenario(racks=1, nodes=3)
    s.run("x", [f"r0n1/{i}" for i in range(5)])
    pool = Pool(s.state)
    assert pool.by_count() == [{}, {}, {}, {0: {1}}, {}, {}, {}, {}, {0: {0, 2}}]
    pool.take(["r0n0/0", "r0n0/1"])
    pool.add(["r0n1/0"])
    assert pool.by_count() == [{}, {}, {}, {}, {0: {1}}, {}, {0: {0}}, {}, {0: {2}}]
    assert place(pool, 4).gpus == ["r0n1/5", "r0n1/6", "r0n1/7", "r0n1/0"]  # best fit: 4 free on r0n1
