"""Whether a pending job may be considered for placement at all, before any question of room:
not held, and its dependencies satisfied. A job that is not eligible is never placed, never
reserved for and never preempted for; its typed reason says why (`gpusched show`).

One small module called from the walk (and its tail), so the queue order, placement and
backfill stay untouched for jobs that use none of these features.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone

from ..core.model import JobSpec
from ..core.pools import accepted, type_matches
from ..core.reasons import ArrayLimit, DependencyNever, DependencyWait, Held, MaintenanceWindow, NoMatchingNode, Reason
from ..core.state import ClusterState, Job
from .placement import Pool, Topology
from .resources import never_fits

#: End states that satisfy each dependency kind.
_SATISFIED = {"afterok": ("completed",), "afterany": ("completed", "failed", "cancelled", "timeout")}
_ENDED = ("completed", "failed", "cancelled", "timeout")


def not_eligible(state: ClusterState, job: Job, now: float | None = None,
                 topo: Topology | None = None) -> Reason | None:
    """Why `job` may not start whatever the room (None: it may). With `now`, also the
    maintenance windows its time limit would run into (admission asks without: they pass);
    `topo`: the topology of `state` that keeps the node matches (`matching`)."""
    if job.hold is not None:
        return Held(job.hold)
    spec = job.spec
    if spec.dependency:
        r = dependency_reason(state, job)
        if r is not None:
            return r
    if (spec.gpu_type is not None or spec.constraints) and state.gpus:
        m = matching(state, spec, topo)
        if not any(len(state.nodes[n].gpus) >= spec.gang_min for n in m) and \
                sum(len(state.nodes[n].gpus) for n in m) < spec.gang_min:
            return NoMatchingNode(wants(spec), spec.gang_min)
    if (spec.cpus or spec.memory_mb) and state.gpus:
        never = never_fits(state, spec, matching(state, spec, topo) if constrained(spec) else None)
        if never is not None:
            return never
    if now is not None and state.windows:
        return window_reason(state, spec, now, topo)
    return None


def barred_nodes(state: ClusterState, spec: JobSpec, now: float) -> list[str]:
    """Nodes with a maintenance window overlapping [now, now + the job's time limit): any window
    not over yet, for a job without a limit. A node inside its window bars every job."""
    if not state.windows:
        return []
    end = now + spec.time_limit_s if spec.time_limit_s else math.inf
    return [n for n, ws in state.windows.items() if n in state.nodes and any(s < end and now < u for s, u in ws)]


def window_reason(state: ClusterState, spec: JobSpec, now: float, topo: Topology | None = None) -> Reason | None:
    """MaintenanceWindow when the nodes outside the windows the job would run into cannot hold
    its gang even empty (a busy cluster is NoRoom's story, not this one)."""
    barred = barred_nodes(state, spec, now)
    if not barred:
        return None
    out = set(barred)
    ok = [n for n in matching(state, spec, topo) if n not in out]
    if any(len(state.nodes[n].gpus) >= spec.gang_min for n in ok) or \
            sum(len(state.nodes[n].gpus) for n in ok) >= spec.gang_min:
        return None
    return MaintenanceWindow([f"{n} {_hm(s)}..{_hm(u)}" for n in sorted(barred) for s, u in state.windows[n]
                              if u > now], spec.gang_min)


def _hm(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%MZ")


def array_full(plan, job: Job) -> Reason | None:
    """A task of an array whose `max_running` tasks hold GPUs (as this cycle sees it: grants of
    this cycle count) waits; `plan` is the cycle's `CyclePlan`."""
    arr = job.spec.array
    if not job.array_job or arr is None or arr.max_running is None:
        return None
    if plan.array_running is None:
        st = plan.ctx.state
        counts: dict[str, int] = {}
        for jid in st.running:
            a = st.jobs[jid].array_job
            if a:
                counts[a] = counts.get(a, 0) + 1
        plan.array_running = counts
    running = plan.array_running.get(job.array_job, 0) + sum(1 for j, _ in plan.started if j.array_job == job.array_job)
    return ArrayLimit(job.array_job, arr.max_running) if running >= arr.max_running else None


def wants(spec: JobSpec) -> str:
    """The job's constraint as the user wrote it: `gpu_type=H100,zone=a` (`gpu_type=H100|A100`
    for an ordered list)."""
    parts = ([f"gpu_type={'|'.join(accepted(spec))}"] if spec.gpu_type is not None else []) + \
        [f"{k}={v}" for k, v in sorted(spec.constraints.items())]
    return ",".join(parts)


def constrained(spec: JobSpec) -> bool:
    return spec.gpu_type is not None or bool(spec.constraints)


def node_matches(state: ClusterState, node: str, spec: JobSpec) -> bool:
    """A node matches when one of its GPUs' model contains one of the job's GPU types
    (case-insensitive) and it carries every label of `constraints`."""
    n = state.nodes[node]
    if any(n.labels.get(k) != v for k, v in spec.constraints.items()):
        return False
    if spec.gpu_type is None:
        return True
    types = accepted(spec)
    return any(type_matches(w, state.gpus[g].model) for g in n.gpus for w in types)


def _split(state: ClusterState, spec: JobSpec, topo: Topology | None) -> tuple[list[str], list[str]]:
    """(matching nodes, the other nodes), kept in `topo` (the topology of `state`) until a node
    registers or is labelled; without one, found afresh."""
    key = (state.label_changes, len(state.nodes), accepted(spec), tuple(sorted(spec.constraints.items())))
    table = topo.node_matches if topo is not None and topo.nodes is state.nodes else {}
    hit = table.get(key)
    if hit is None:
        if len(table) >= 256:
            table.clear()
        yes = [n for n in state.nodes if node_matches(state, n, spec)]
        ok = set(yes)
        hit = table[key] = (yes, [n for n in state.nodes if n not in ok])
    return hit


def matching(state: ClusterState, spec: JobSpec, topo: Topology | None = None) -> list[str]:
    """The nodes that may hold the job (every node when it asks for nothing); `topo`: the
    topology of `state` that keeps the answers (`Topology.node_matches`)."""
    return _split(state, spec, topo)[0] if constrained(spec) else list(state.nodes)


def _restricted(pool: Pool, spec: JobSpec) -> Pool:
    """The pool narrowed to a constraint, kept in the pool while neither it (`Pool.changes`) nor
    the fold changes: a queue of jobs alike narrows once, and the copy keeps what it learned
    (`Pool.fails`)."""
    state = pool.state
    key = ("constraints", accepted(spec), tuple(sorted(spec.constraints.items())))
    at = (pool.changes, state.last_seq)
    hit = pool.narrowed.get(key)
    if hit is not None and hit[0] == at:
        return hit[1]
    nodes = state.nodes  # only the other nodes with a GPU free in this pool need removing
    other = [g for n in _split(state, spec, pool.topo)[1] if pool.n_free(n) > 0 for g in nodes[n].gpus]
    out = pool.without(other) if other else pool
    pool.narrowed[key] = (at, out)
    return out


def restrict(pool: Pool, spec: JobSpec, now: float | None = None) -> Pool:
    """The pool the job may be placed on: the filter of its constraints, and (given `now`) less
    the nodes whose maintenance window its time limit would run into, applied once per placement
    question; the pool itself for a job that asks for nothing on a cluster without windows."""
    if constrained(spec):
        pool = _restricted(pool, spec)
    if now is not None and pool.state.windows:
        barred = barred_nodes(pool.state, spec, now)
        if barred:
            nodes = pool.state.nodes
            pool = pool.without([g for n in barred for g in nodes[n].gpus])
    return pool


def dependency_reason(state: ClusterState, job: Job) -> Reason | None:
    """Unsatisfied dependencies: never (an `afterok` job ended otherwise), or not yet."""
    waiting: list[str] = []
    never: list[str] = []
    for d in job.spec.dependency:
        dep_state = state.job_status(d.job) or "unknown"  # a forgotten job keeps its end state
        if dep_state in _SATISFIED[d.kind]:
            continue
        if dep_state in _ENDED or dep_state == "unknown":
            never.append(f"{d.job} {dep_state}")
        else:
            waiting.append(f"{d.kind}:{d.job}")
    if never:
        return DependencyNever(never)
    if waiting:
        return DependencyWait(waiting)
    return None


__all__ = ["array_full", "barred_nodes", "constrained", "dependency_reason", "matching", "not_eligible", "restrict", "wants"]
