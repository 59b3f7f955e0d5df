"""CPUs and memory as resources: a job's `cpus` and `memory_mb` are what it needs on *each* node
it uses (as Slurm's `--cpus-per-task`/`--mem` per node), and a node offers what it registered
(`NodeRegistered.cpus`/`memory_mb`: the agent's host, or `--cpus`/`--mem`).

The rule for a gang is the simplest exact one: a node is usable for a job only if its free CPUs
and memory hold the job's per-node amounts. The GPU search then runs on the usable nodes alone,
so whatever set it picks, every node of the set can hold the job: a gang over k nodes takes its
amounts k times, once on each. (A node that could hold it only if the gang used fewer of its
GPUs elsewhere does not exist: the amounts do not depend on how many GPUs of a node it takes.)

What counts, per node: the fold's `cpus_used`/`memory_used_mb` (the jobs holding its GPUs) and
what this cycle has granted or released there (`Pool.res`, kept by `hold`). A node that declared
no amount (0) is not counted for it; a job that asks for none is never filtered. Quotas stay on
GPUs. Elastic jobs grow only onto nodes that can hold them (`elastic.grow_gpus`); shrinking a job
off a node in a what-if does not free its CPUs there (conservative: it never overbooks). A job
whose GPUs fit but whose CPUs do not preempts by `preemption.choose_cpu_victims`.
"""

from __future__ import annotations

from ..core.model import JobSpec
from ..core.reasons import NoFreeCpuMem, NoNodeCpuMem
from ..core.state import ClusterState
from .placement import Pool

_EPS = 1e-6  # CPUs are floats: 0.1 + 0.2 must fit in 0.3


def need(spec: JobSpec) -> tuple[float, int]:
    """(CPUs, MiB) the job needs on each node it uses."""
    return spec.cpus or 0.0, spec.memory_mb or 0


def asks(spec: JobSpec) -> bool:
    return bool(spec.cpus or spec.memory_mb)


class _Declared:
    """The nodes that declared CPUs or memory, for the last state (by identity) and node change."""

    state: ClusterState | None = None
    key: int = -1
    names: list[str] = []
    never: dict[tuple, NoNodeCpuMem | None] = {}  # `never_fits` of jobs alike, on every node


def declared(state: ClusterState) -> list[str]:
    """The nodes that declared CPUs or memory, in node order (cached until a node registers)."""
    if _Declared.state is not state or _Declared.key != state.label_changes:
        _Declared.state, _Declared.key = state, state.label_changes
        _Declared.names = [n for n, node in state.nodes.items() if node.cpus or node.memory_mb]
        _Declared.never = {}
    return _Declared.names


def free_on(pool: Pool, name: str) -> tuple[float, float]:
    """(CPUs, MiB) free on a node as the cycle sees it (inf where it declared none)."""
    node = pool.state.nodes[name]
    dc, dm = pool.res.get(name, (0.0, 0))
    cpus = node.cpus - node.cpus_used - dc if node.cpus else float("inf")
    mem = node.memory_mb - node.memory_used_mb - dm if node.memory_mb else float("inf")
    return cpus, mem


def room_on(pool: Pool, name: str, spec: JobSpec) -> bool:
    """Whether the node's free CPUs and memory hold the job's per-node amounts."""
    cpus, mem = need(spec)
    if not (cpus or mem):
        return True
    free_cpus, free_mem = free_on(pool, name)
    return cpus <= free_cpus + _EPS and mem <= free_mem


def short_nodes(pool: Pool, spec: JobSpec) -> list[str]:
    """The nodes with free GPUs in `pool` that cannot hold the job's per-node CPUs and memory
    now (one pass over the declared nodes: the placement of every job that asks pays it)."""
    cpus, mem = need(spec)
    if not (cpus or mem):
        return []
    nodes, res, count = pool.state.nodes, pool.res, pool.n_free
    out = []
    for n in declared(pool.state):
        node = nodes[n]
        dc, dm = res.get(n, (0.0, 0)) if res else (0.0, 0)
        if (cpus and node.cpus and cpus > node.cpus - node.cpus_used - dc + _EPS
                or mem and node.memory_mb and mem > node.memory_mb - node.memory_used_mb - dm) and count(n) > 0:
            out.append(n)
    return out


def by_resources(pool: Pool, spec: JobSpec, now: float | None) -> Pool:
    """Not the nodes without the job's per-node CPUs and memory free (the filter of `FILTERS`)."""
    key = need(spec)
    if not (key[0] or key[1]) or not declared(pool.state):
        return pool
    # Kept in the pool while it is unchanged (no free count moved, `Pool.changes`, and the same
    # holds): a queue of jobs alike costs one filter, and their failures are remembered on the
    # one filtered pool (`Pool.fails`).
    stamp = (pool.changes, tuple(pool.res.items()), pool.state.label_changes)
    hit = pool.narrowed.get(("resources", *key))
    if hit is not None and hit[0] == stamp:
        return hit[1]
    short = short_nodes(pool, spec)
    out = pool.without_nodes(short) if short else pool
    pool.narrowed[("resources", *key)] = (stamp, out)
    return out


def hold(pool: Pool, spec: JobSpec, gpus, sign: int = 1) -> None:
    """This cycle grants (1) or releases (-1) `gpus` of a job: its per-node amounts count (or
    stop counting) on each of their nodes in `pool`."""
    cpus, mem = need(spec)
    if not (cpus or mem) or not gpus:
        return
    gi, res = pool.state.gpus, pool.res
    for n in dict.fromkeys(gi[g].node for g in gpus):
        c, m = res.get(n, (0.0, 0))
        res[n] = (c + sign * cpus, m + sign * mem)


def never_fits(state: ClusterState, spec: JobSpec, candidates: list[str] | None = None) -> NoNodeCpuMem | None:
    """The job asks more CPUs or memory per node than enough registered nodes have, even empty:
    the nodes that could hold it (of `candidates`, default every node) have fewer GPUs than its
    gang minimum, on one node when its topology must stay within one."""
    if not asks(spec) or not state.gpus or not declared(state):
        return None
    if candidates is None:
        key = (*need(spec), spec.gang_min, spec.topology.required)
        if key not in _Declared.never:
            _Declared.never[key] = never_fits(state, spec, list(state.nodes))
        return _Declared.never[key]
    cpus, mem = need(spec)
    nodes = state.nodes
    names = candidates
    ok = [n for n in names if (not cpus or not nodes[n].cpus or cpus <= nodes[n].cpus + _EPS)
          and (not mem or not nodes[n].memory_mb or mem <= nodes[n].memory_mb)]
    within_node = spec.topology.required in ("nvlink", "node")
    sizes = [len(nodes[n].gpus) for n in ok]
    if (max(sizes, default=0) if within_node else sum(sizes)) >= spec.gang_min:
        return None
    return NoNodeCpuMem(cpus, mem, spec.gang_min, max((nodes[n].cpus for n in names), default=0.0),
                        max((nodes[n].memory_mb for n in names), default=0))


def busy_reason(spec: JobSpec, gang: int) -> NoFreeCpuMem:
    """Why a job that would fit on the free GPUs waits: no node it could use has its CPUs or memory free."""
    cpus, mem = need(spec)
    return NoFreeCpuMem(cpus, mem, gang)


__all__ = ["asks", "busy_reason", "by_resources", "declared", "free_on", "hold", "need", "never_fits", "room_on",
           "short_nodes"]
