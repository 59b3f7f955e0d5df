"""Which GPUs a gang gets: all of them or none, the tightest set, then the least fragmenting.

`place` is topology-aware: it tries each level from NVLink domain up to the job's required
level and takes the first that fits; within a level it picks the fewest nodes/racks, then best
fit (the candidate whose free count is the smallest that fits, so whole nodes and whole racks
stay free for the next big gang), ties going to the rack with the least free GPUs. `first_free`
is the naive baseline and the fallback.

Both work on a `Pool`: the fold's incremental per-node free sets seen through a small overlay of
what this cycle already granted or released, so one cycle never double-books and never mutates
the state. The pool keeps its nodes indexed by free count (built on a pool's second placement,
then moved as GPUs are taken and released), so a placement within one node looks only at the
nodes that can hold it, not at every node; the static shape of the cluster (node -> rack -> block, NVLink
domain sizes) is indexed once per state and reused until a node registers.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from msgspec import Struct

from ..core.model import LEVEL_RANK, GpuId
from ..core.reasons import Topology as Topology_
from ..core.state import ClusterState

if TYPE_CHECKING:
    from .pools import PoolIndex

#: NVLink domain size of the standard layouts (None: the whole node; 0: read the GPU records).
_DOMAIN_SIZE = {"all": None, "pairs": 2, "quads": 4, "none": 1}

#: Nodes of one free count, by rack: rack index -> node indices (see `Pool.by_count`).
Group = Mapping[int, Collection[int]]


class Placement(Struct, frozen=True):
    gpus: list[GpuId]
    level: str
    why: str


class Topology:
    """The static shape of a cluster, by node index in registration order."""

    __slots__ = ("nodes", "names", "index", "rack_of", "racks", "rack_members", "block_of_rack",
                 "dom_cap", "all_layout", "only_all_layout", "any_all_layout", "max_node", "node_matches",
                 "pool_index")

    def __init__(self, state: ClusterState) -> None:
        self.nodes = state.nodes
        self.names = list(state.nodes)
        self.index = {n: i for i, n in enumerate(self.names)}
        racks: dict[str, int] = {}
        self.rack_of: list[int] = []
        self.rack_members: list[list[int]] = []
        self.block_of_rack: list[str | None] = []
        self.dom_cap: list[int] = []
        for i, (name, node) in enumerate(state.nodes.items()):
            r = racks.get(node.rack)
            if r is None:
                r = racks[node.rack] = len(self.rack_members)
                self.rack_members.append([])
                self.block_of_rack.append(node.block)
            self.rack_of.append(r)
            self.rack_members[r].append(i)
            size = _DOMAIN_SIZE.get(node.nvlink, 0)
            if size is None:
                size = len(node.gpus)
            elif not size:
                per: dict[int, int] = {}
                for g in node.gpus:
                    d = state.gpus[g].nvlink_domain
                    per[d] = per.get(d, 0) + 1
                size = max(per.values(), default=0)
            self.dom_cap.append(size)
        self.racks = list(racks)
        self.all_layout = [node.nvlink == "all" for node in state.nodes.values()]
        #: every node is one NVLink domain: a node's free GPUs are its best domain
        self.only_all_layout = all(self.all_layout)
        self.any_all_layout = any(self.all_layout)
        self.max_node = max((len(n.gpus) for n in state.nodes.values()), default=0)
        #: The nodes matching each constraint, as `eligibility.matching` found them (its memo:
        #: it lives as long as this topology, with whoever owns it, e.g. `memo.Indexes`).
        self.node_matches: dict[tuple, tuple[list[str], list[str]]] = {}
        #: The GPUs of each GPU pool, as `pools.pool_index` built them (its memo, likewise).
        self.pool_index: PoolIndex | None = None


class Pool:
    """Placeable GPUs as one cycle sees them: the fold's free sets, less the GPUs this cycle has
    granted (`take`), plus the GPUs it has released (`add`). Never mutates the state.

    `fails` remembers the placement questions that found no room in this pool (keys chosen by
    the caller, e.g. size and topology levels). Feasibility only shrinks as GPUs leave the pool,
    so a failure stays valid across `take`/`remove` and copies; `add` (the pool grows) forgets
    them all. It lets a long queue of jobs alike cost one placement, not one each."""

    __slots__ = ("state", "topo", "taken", "added", "delta", "count", "_cnt", "_rack", "_by_count", "_scanned",
                 "fails", "res", "changes", "narrowed")

    def __init__(self, state: ClusterState, topo: Topology | None = None) -> None:
        self.state = state
        self.topo = topo if topo is not None else Topology(state)
        self.taken: set[GpuId] = set()
        self.added: dict[str, list[GpuId]] = {}  # node -> GPUs released this cycle, in order
        self.delta: dict[str, int] = {}  # node -> change of its free count
        self.count = state.free_count
        self._cnt: list[int] | None = None  # free count per node index, built on first use
        self._rack: list[int] | None = None  # free count per rack index, built on first use
        self._by_count: list[dict[int, set[int]]] | None = None  # see `by_count`, built on second use
        self._scanned = False  # answered one `fitting` question by a scan (the next builds the index)
        self.fails: set = set()
        #: node -> (CPUs, MiB) this cycle granted there less what it released (`resources.hold`)
        self.res: dict[str, tuple[float, int]] = {}
        self.changes = 0  # every change of a free count (`_bump`): what a memo of this pool checks
        #: Copies of this pool narrowed by a filter (`eligibility.restrict`, `resources.by_resources`),
        #: by the filter's key, with the stamp of what they were narrowed on: the filter's memo.
        self.narrowed: dict[tuple, tuple[tuple, Pool]] = {}

    def copy(self) -> Pool:
        p = Pool.__new__(Pool)
        p.state, p.topo, p.count = self.state, self.topo, self.count
        p.taken, p.delta = set(self.taken), dict(self.delta)
        p.added = {k: list(v) for k, v in self.added.items()}
        p._cnt = None if self._cnt is None else list(self._cnt)
        p._rack = None if self._rack is None else list(self._rack)
        p._by_count, p._scanned = None, False  # rebuilt from the counts if the copy places within a node
        p.fails = set(self.fails)
        p.res, p.changes, p.narrowed = dict(self.res), 0, {}
        return p

    # counts

    def node_counts(self) -> list[int]:
        """Free GPUs per node index (one pass on first use, then kept up to date)."""
        if self._cnt is None:
            cnt = [len(node.free) for node in self.state.nodes.values()]
            index = self.topo.index
            for name, d in self.delta.items():
                cnt[index[name]] += d
            self._cnt = cnt
        return self._cnt

    def rack_counts(self) -> list[int]:
        if self._rack is None:
            cnt = self.node_counts()
            self._rack = [sum(map(cnt.__getitem__, m)) for m in self.topo.rack_members]
        return self._rack

    def fitting(self, n: int) -> list[Group]:
        """The nodes with n or more free GPUs, grouped by free count, fewest first, each group
        by rack (rack index -> node indices, in any order). The first question of a pool is
        answered by a scan of the counts (a pool that places once, e.g. a what-if copy, pays no
        more than that); from the second on, from the index `by_count`, which costs about three
        scans to build and then looks only at the nodes that can hold n."""
        if self._by_count is None and not self._scanned:
            self._scanned = True
            cnt, rack_of = self.node_counts(), self.topo.rack_of
            groups: dict[int, dict[int, list[int]]] = {}
            for i in [i for i, k in enumerate(cnt) if k >= n]:
                groups.setdefault(cnt[i], {}).setdefault(rack_of[i], []).append(i)
            return [groups[k] for k in sorted(groups)]
        return [group for group in self.by_count()[n:] if group]

    def by_count(self) -> list[dict[int, set[int]]]:
        """Nodes by free count, then rack: `by_count()[k][r]` holds the nodes of rack r with
        exactly k free GPUs (k from 0 to the largest node's size; a rack without such a node
        has no entry). One pass over the counts on first use, then each change of a node's
        count moves it between two sets. By rack because best fit breaks ties by the rack's
        free count: the racks of a group are fewer than its nodes."""
        if self._by_count is None:
            cnt, rack_of = self.node_counts(), self.topo.rack_of
            top = self.topo.max_node
            out: list[dict[int, set[int]]] = [{} for _ in range(top + 1)]
            for i, k in enumerate(cnt):
                out[min(max(k, 0), top)].setdefault(rack_of[i], set()).add(i)
            self._by_count = out
        return self._by_count

    def counts(self) -> dict[str, int]:
        """Free count of every node by name, in node order (zeros included)."""
        return dict(zip(self.topo.names, self.node_counts()))

    def n_free(self, name: str) -> int:
        return len(self.state.nodes[name].free) + self.delta.get(name, 0)

    def free_on(self, name: str) -> list[GpuId]:
        """The free GPUs of one node, in the fold's order, then those released this cycle."""
        node = self.state.nodes[name]
        taken = self.taken
        out = [g for g in node.free if g not in taken] if taken else list(node.free)
        extra = self.added.get(name)
        if extra:
            out.extend(g for g in extra if g not in taken)
        return out

    # changes

    def _bump(self, node: str, d: int) -> None:
        self.changes += 1
        self.delta[node] = self.delta.get(node, 0) + d
        self.count += d
        if self._cnt is not None:
            i = self.topo.index[node]
            k = self._cnt[i]
            self._cnt[i] = k + d
            if self._rack is not None:
                self._rack[self.topo.rack_of[i]] += d
            if self._by_count is not None:
                self._move(i, k, k + d)

    def _move(self, i: int, was: int, now: int) -> None:
        """Node i's free count went from `was` to `now`: move it in the index."""
        by_count = self._by_count
        assert by_count is not None
        top, r = len(by_count) - 1, self.topo.rack_of[i]
        group = by_count[min(max(was, 0), top)]
        nodes = group.get(r)
        if nodes is not None:
            nodes.discard(i)
            if not nodes:
                del group[r]
        by_count[min(max(now, 0), top)].setdefault(r, set()).add(i)

    def take(self, gpus: list[GpuId]) -> None:
        gi = self.state.gpus
        per_node: dict[str, int] = {}  # a gang takes several GPUs of a node: one count change each
        for g in gpus:
            node = gi[g].node
            extra = self.added.get(node)
            if extra and g in extra:
                extra.remove(g)
            else:
                self.taken.add(g)
            per_node[node] = per_node.get(node, 0) + 1
        for node, k in per_node.items():
            self._bump(node, -k)

    def add(self, gpus: list[GpuId]) -> None:
        """GPUs released this cycle; only those the fold will make placeable again, once each."""
        st = self.state
        count = self.count
        per_node: dict[str, int] = {}  # a gang frees several GPUs of a node: one count change each
        for g in gpus:
            rec = st.gpus[g]
            node = st.nodes[rec.node]
            if rec.quarantined is not None or rec.zombie_pids is not None or not node.usable:
                continue
            if g in self.taken:
                self.taken.discard(g)
            elif g in node.free:
                continue  # already free: adding twice must not count twice
            else:
                extra = self.added.setdefault(rec.node, [])
                if g in extra:
                    continue
                extra.append(g)
            per_node[rec.node] = per_node.get(rec.node, 0) + 1
        for name, k in per_node.items():
            self._bump(name, k)
        if self.count != count and self.fails:
            self.fails.clear()  # the pool grew: what did not fit may fit now

    def remove(self, gpus) -> None:
        """Make `gpus` unplaceable in this pool (those it does not hold are ignored)."""
        gi, nodes = self.state.gpus, self.state.nodes
        for g in gpus:
            node = gi[g].node
            extra = self.added.get(node)
            if extra and g in extra:
                extra.remove(g)
            elif g in self.taken or g not in nodes[node].free:
                continue
            else:
                self.taken.add(g)
            self._bump(node, -1)

    def without_nodes(self, names) -> Pool:
        """A copy that cannot place on any GPU of these nodes: one count change per node, not
        one per GPU (a filter barring hundreds of nodes)."""
        p = self.copy()
        nodes, taken = p.state.nodes, p.taken
        for name in names:
            extra = p.added.pop(name, None) or []  # released this cycle, never in `taken`
            own = [g for g in nodes[name].free if g not in taken] if taken else list(nodes[name].free)
            if own or extra:
                taken.update(own)
                p._bump(name, -(len(own) + len(extra)))
        return p

    def without(self, gpus) -> Pool:
        """A copy that cannot place on `gpus` (e.g. a reservation)."""
        p = self.copy()
        p.remove(gpus)
        return p


# --- helpers --------------------------------------------------------------------------------


def _fill(items: list[tuple[int, int]], n: int) -> list[tuple[int, int]] | None:
    """Fewest containers, best fit for the last: take the largest until the rest fits in one,
    then the smallest that holds the rest. `items` are (key, free); returns (key, how many)."""
    order = sorted((it for it in items if it[1] > 0), key=lambda it: -it[1])  # stable: ties keep order
    chosen: list[tuple[int, int]] = []
    rest = n
    i = 0
    while rest > 0:
        if i >= len(order):
            return None
        best = -1
        j = i
        while j < len(order) and order[j][1] >= rest:
            best = j
            j += 1
        if best >= 0:
            chosen.append((order[best][0], rest))
            return chosen
        chosen.append(order[i])
        rest -= order[i][1]
        i += 1
    return chosen


def _nodes_needed(counts: list[int], n: int) -> int:
    total = 0
    for i, k in enumerate(sorted(counts, reverse=True)):
        total += k
        if total >= n:
            return i + 1
    return 1 << 30


def _domains(pool: Pool, name: str) -> dict[int, list[GpuId]]:
    gi = pool.state.gpus
    out: dict[int, list[GpuId]] = {}
    for g in pool.free_on(name):
        out.setdefault(gi[g].nvlink_domain, []).append(g)
    return out


def _pick_on_node(pool: Pool, name: str, n: int) -> list[GpuId]:
    """n GPUs of one node: fewest NVLink domains, best fit for the last one."""
    if pool.state.nodes[name].nvlink == "all":
        return pool.free_on(name)[:n]
    doms = _domains(pool, name)
    plan = _fill([(d, len(gs)) for d, gs in doms.items()], n)
    assert plan is not None
    out: list[GpuId] = []
    for d, k in plan:
        out.extend(doms[d][:k])  # type: ignore[index]
    return out


def _pick_on_nodes(pool: Pool, members: list[int], n: int) -> list[GpuId]:
    cnt, names = pool.node_counts(), pool.topo.names
    plan = _fill([(i, cnt[i]) for i in members], n)
    assert plan is not None
    out: list[GpuId] = []
    for i, k in plan:
        out.extend(_pick_on_node(pool, names[i], k))
    return out


def _across_racks(pool: Pool, racks: list[int], n: int) -> list[GpuId]:
    rc, members = pool.rack_counts(), pool.topo.rack_members
    plan = _fill([(r, rc[r]) for r in racks], n)
    assert plan is not None
    out: list[GpuId] = []
    for r, k in plan:
        out.extend(_pick_on_nodes(pool, members[r], k))
    return out


# --- topology-aware placement --------------------------------------------------------------


def place(pool: Pool, n: int, required: str = "cluster", preferred: str = "nvlink") -> Placement | None:
    """The tightest feasible set of `n` GPUs no wider than `required`, or None: each level from
    one NVLink domain up to `required`, the first that fits."""
    if n <= 0 or n > pool.count:
        return None
    limit = LEVEL_RANK[required]
    found = _within_node(pool, n, limit) if n <= pool.topo.max_node else None
    if found is None and limit >= LEVEL_RANK["rack"]:
        found = _in_rack(pool, n)
        if found is None and limit >= LEVEL_RANK["block"]:
            found = _in_block(pool, n)
            if found is None and limit >= LEVEL_RANK["cluster"]:
                found = _across_cluster(pool, n)
    if not found:  # None, or (): nothing fits within one node and nothing wider is allowed
        return None
    gpus, level, why = found
    if LEVEL_RANK[level] > LEVEL_RANK[preferred]:
        why += f" (preferred {preferred} not available)"
    return Placement(gpus, level, why)


_Found = tuple[list[GpuId], str, str]


def _within_node(pool: Pool, n: int, limit: int) -> _Found | tuple[()] | None:
    """1. one NVLink domain: best fit domain, then node, then rack; 2. one node: best fit node,
    ties to the rack with the least free. `()`: a node-bound job that cannot fit."""
    fits = pool.fitting(n)
    if not fits:
        return None
    names = pool.topo.names
    best_dom = _best_domain(pool, fits, n)
    if best_dom is not None:
        i, d = best_dom
        gpus = pool.free_on(names[i])[:n] if d is None else _domains(pool, names[i])[d][:n]
        return gpus, "nvlink", f"one NVLink domain on {names[i]}"
    if limit < LEVEL_RANK["node"]:
        return ()
    i = _least_rack(pool, fits[0])  # best fit: the fewest free GPUs that hold n
    return _pick_on_node(pool, names[i], n), "node", f"one node {names[i]}"


def _least_rack(pool: Pool, group: Group) -> int:
    """The node of `group` whose rack has the least free GPUs; ties to the first registered."""
    if len(group) == 1:
        return min(next(iter(group.values())))
    rc = pool.rack_counts()
    least = min(rc[r] for r in group)
    return min(min(nodes) for r, nodes in group.items() if rc[r] == least)


def _best_domain(pool: Pool, fits: list[Group], n: int) -> tuple[int, int | None] | None:
    """(node index, NVLink domain; None: the whole node) of the best fitting domain, among the
    nodes that can hold n (`fits`: by free count, fewest first). Key: (domain's free GPUs,
    node's free GPUs, rack's free GPUs, node index), smallest wins. A node that is one NVLink
    domain ("all") has its free count as its domain's, so the best of those is in the first
    group holding one; a node of several domains is looked at domain by domain."""
    topo = pool.topo
    if topo.only_all_layout:
        return _least_rack(pool, fits[0]), None
    cnt, rc, rack_of = pool.node_counts(), pool.rack_counts(), topo.rack_of
    best: tuple[tuple[int, int, int, int], int, int | None] | None = None
    all_layout, dom_cap = topo.all_layout, topo.dom_cap
    for group in fits if topo.any_all_layout else ():
        fast = [i for nodes in group.values() for i in nodes if all_layout[i] and dom_cap[i] >= n]
        if fast:
            i = min(fast, key=lambda i: (rc[rack_of[i]], i))
            best = ((cnt[i], cnt[i], rc[rack_of[i]], i), i, None)
            break
    for group in fits:
        for i in (i for nodes in group.values() for i in nodes):
            if all_layout[i] or dom_cap[i] < n:
                continue
            for d, gs in _domains(pool, topo.names[i]).items():
                if len(gs) >= n:
                    key = (len(gs), cnt[i], rc[rack_of[i]], i)
                    if best is None or key < best[0]:
                        best = (key, i, d)
    return None if best is None else (best[1], best[2])


def _in_rack(pool: Pool, n: int) -> _Found | None:
    """3. one rack: fewest nodes, then best fit rack."""
    topo, cnt, rc = pool.topo, pool.node_counts(), pool.rack_counts()
    members = topo.rack_members
    best = None
    for r, total in enumerate(rc):
        if total < n:
            continue
        key = (_nodes_needed([cnt[i] for i in members[r]], n), total, r)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    r = best[2]
    return _pick_on_nodes(pool, members[r], n), "rack", f"one rack {topo.racks[r]}, {best[0]} nodes"


def _in_block(pool: Pool, n: int) -> _Found | None:
    """4. one block: fewest racks, then best fit block."""
    rc = pool.rack_counts()
    block_racks: dict[str, list[int]] = {}
    for r, b in enumerate(pool.topo.block_of_rack):
        if b is not None and rc[r] > 0:
            block_racks.setdefault(b, []).append(r)
    bbest: tuple[tuple[int, int], str] | None = None
    for b, racks in block_racks.items():
        total = sum(rc[r] for r in racks)
        if total < n:
            continue
        key = (_nodes_needed([rc[r] for r in racks], n), total)
        if bbest is None or key < bbest[0]:
            bbest = (key, b)
    if bbest is None:
        return None
    b = bbest[1]
    return _across_racks(pool, block_racks[b], n), "block", f"one block {b}, {bbest[0][0]} racks"


def _across_cluster(pool: Pool, n: int) -> _Found:
    """5. across racks: fewest racks, best fit for the last one."""
    topo, rc = pool.topo, pool.rack_counts()
    gpus = _across_racks(pool, [r for r, k in enumerate(rc) if k > 0], n)
    used = {topo.rack_of[topo.index[pool.state.gpus[g].node]] for g in gpus}
    level = pool.state.span(gpus)  # "block" when the racks happen to share one
    return gpus, level, f"across {len(used)} racks"


# --- every candidate, in the search's order (for scorers) -----------------------------------


def candidates(pool: Pool, n: int, required: str = "cluster") -> list[Placement]:
    """Every set `place` would weigh, no wider than `required`: each NVLink domain, node, rack
    and block that holds `n`, then the cluster-wide set; tightest level first, and within a
    level best fit first (the search's own keys), so the first is `place`'s answer. Built only
    for a job whose scorers can tell candidates apart (a soft preference): `place` stays the
    fast path for the rest."""
    if n <= 0 or n > pool.count:
        return []
    limit, topo = LEVEL_RANK[required], pool.topo
    cnt, rc, names, rack_of = pool.node_counts(), pool.rack_counts(), topo.names, topo.rack_of
    out: list[Placement] = []
    if n <= topo.max_node:
        fit = [i for i, k in enumerate(cnt) if k >= n]
        doms: list[tuple[tuple[int, int, int, int], list[GpuId]]] = []
        for i in fit:
            for gs in (_domains(pool, names[i]).values() if not topo.all_layout[i] else [pool.free_on(names[i])]):
                if len(gs) >= n:
                    doms.append(((len(gs), cnt[i], rc[rack_of[i]], i), gs[:n]))
        doms.sort(key=lambda d: d[0])
        out += [Placement(gs, "nvlink", f"one NVLink domain on {names[k[3]]}") for k, gs in doms]
        if limit >= LEVEL_RANK["node"]:
            fit.sort(key=lambda i: (cnt[i], rc[rack_of[i]], i))
            out += [Placement(_pick_on_node(pool, names[i], n), "node", f"one node {names[i]}") for i in fit]
    if limit >= LEVEL_RANK["rack"]:
        members = topo.rack_members
        racks = sorted((_nodes_needed([cnt[i] for i in members[r]], n), t, r) for r, t in enumerate(rc) if t >= n)
        out += [Placement(_pick_on_nodes(pool, members[r], n), "rack", f"one rack {topo.racks[r]}, {k} nodes")
                for k, _, r in racks]
    if limit >= LEVEL_RANK["block"]:
        block_racks: dict[str, list[int]] = {}
        for r, b in enumerate(topo.block_of_rack):
            if b is not None and rc[r] > 0:
                block_racks.setdefault(b, []).append(r)
        blocks = sorted(((_nodes_needed([rc[r] for r in rs], n), sum(rc[r] for r in rs)), j, b)
                        for j, (b, rs) in enumerate(block_racks.items()) if sum(rc[r] for r in rs) >= n)
        out += [Placement(_across_racks(pool, block_racks[b], n), "block", f"one block {b}, {k[0]} racks")
                for k, _, b in blocks]
    if limit >= LEVEL_RANK["cluster"]:
        out.append(Placement(*_across_cluster(pool, n)))
    return out


# --- naive placement ------------------------------------------------------------------------


def first_free(pool: Pool, n: int, required: str = "cluster") -> Placement | None:
    """The first free GPUs in node order: the baseline and the fallback of a dead placement
    service. Still never wider than `required` (the first group of that level with room)."""
    if n <= 0 or n > pool.count:
        return None
    st = pool.state
    delta = pool.delta
    if required == "cluster":
        out: list[GpuId] = []
        for name, node in st.nodes.items():
            if not node.free and delta.get(name, 0) <= 0:
                continue
            for g in pool.free_on(name):
                out.append(g)
                if len(out) == n:
                    return Placement(out, st.span(out), "first free GPUs")
        return None
    groups: dict[object, list[GpuId]] = {}
    for name, node in st.nodes.items():
        if not node.free and delta.get(name, 0) <= 0:
            continue
        for g in pool.free_on(name):
            if required == "nvlink":
                key: object = (name, st.gpus[g].nvlink_domain)
            elif required == "node":
                key = name
            elif required == "rack":
                key = node.rack
            else:
                key = node.block if node.block is not None else ("rack", node.rack)
            grp = groups.setdefault(key, [])
            grp.append(g)
            if len(grp) == n:
                return Placement(grp, st.span(grp), f"first free GPUs within one {required}")
    return None


def no_fit(pool: Pool, n: int, required: str, holders: list[str] | None = None,
           reserved: bool = False) -> Topology_:
    """Why `n` GPUs do not fit now (for the head job): the free counts of the best three
    domains at the required level, the jobs whose end would let it start, and whether the GPUs
    are reserved for it."""
    domains: list[tuple[str, int]] = []
    if required != "cluster":
        level = "node" if required in ("nvlink", "node") else required
        per: dict[str, int] = {}
        nodes = pool.state.nodes
        for name, k in pool.counts().items():
            if k <= 0:
                continue
            node = nodes[name]
            key = name if level == "node" else node.rack if level == "rack" else (node.block or node.rack)
            per[key] = per.get(key, 0) + k
        domains = sorted(per.items(), key=lambda kv: -kv[1])[:3]
    return Topology_(need=n, required=required, free=pool.count, domains=domains, holders=list(holders or []),
                     reserved=reserved)


def explain_no_fit(pool: Pool, n: int, required: str) -> str:
    """Why `n` GPUs do not fit now, with the free counts that matter (for the head job), e.g.
    "waiting for 16 GPUs within one rack; 9 free in rack r0, 6 in r1"."""
    return no_fit(pool, n, required).text


__all__ = ["Placement", "Pool", "Topology", "candidates", "explain_no_fit", "no_fit", "first_free", "place"]
