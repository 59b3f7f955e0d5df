"""The read models: plain JSON documents derived from a `ClusterState`.

One pure function per document (a job, a node, a team, the queue, an event line). The projector
stores them in Redis; the CLI and the dashboard print them, reading either Redis or a fold of the
log: both paths go through these functions, so the two can never disagree on a field.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:  # the fold's types: a client that only prints documents never loads the fold
    from .core import events as ev
    from .core.state import ClusterState, Job
    from .core.topology import Gpu

_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple:
    """Sort key that orders numbers inside names by value: rack2 < rack10 < rack100."""
    return tuple(int(part) if part.isdigit() else part for part in _DIGITS.split(name))


def gpu_ref(g: str) -> dict[str, Any]:
    from .core.model import split_gpu_id  # here: a client that only prints documents never loads the model

    node, index = split_gpu_id(g)
    return {"gpu": g, "node": node, "index": index}


def job_doc(state: ClusterState, job: Job) -> dict[str, Any]:
    from .core.records import gpu_count

    spec = job.spec
    doc: dict[str, Any] = {
        "job_id": job.job_id,
        "name": spec.name,
        "team": spec.team,
        "user": job.user,
        "via": job.via or None,  # the platform that submitted it on behalf of `user` (None: the user itself)
        "state": job.state,
        "priority": spec.priority,
        "gpus_requested": spec.gpus,
        "min_gpus": spec.gang_min,
        "preemptible": spec.preemptible,
        "required": spec.topology.required,
        "gpus": [gpu_ref(g) for g in job.gpus],
        "gpu_fraction": spec.gpu_fraction, "gpu_memory_mb": spec.gpu_memory_mb,  # a share of one GPU (asked)
        "gpu_share": job.share if spec.partial and job.gpus else None,  # ... and held (a share, or slices' charge)
        "mig": spec.mig, "mig_count": spec.mig_count if spec.mig else None,  # MIG slices (asked)
        "mig_slices": list(job.slices) if spec.mig and job.gpus else None,  # ... and held (indices)
        "placer": job.placer,
        "level": job.level,
        "backfill": job.backfill,
        "attempt": job.attempt,
        "submitted_at": job.submitted_at,
        "started_at": job.started_at,
        "first_started_at": job.first_started_at,
        "finished_at": job.finished_at,
        "nodes_started": list(job.nodes_started),
        "preemptions": job.preemptions,
        "restarts": job.restarts,
        "lost_gpu_s": round(job.lost_gpu_s, 3),
        "end_reason": job.end_reason,
        "pending_reason": job.pending_reason,
        "pending_blockers": list(job.pending_blockers),
        "pending_eta_s": job.pending_eta_s,
        "pending_eta_range": None if job.pending_eta_range is None else list(job.pending_eta_range),
        "held": job.hold,  # who held it and why (`gpusched hold`), None when not held
        "array_job": job.array_job or None,
        "dependency": [f"{d.kind}:{d.job}" for d in spec.dependency],
        "gpu_type": spec.gpu_type,
        "constraints": dict(spec.constraints),
        "cpus": spec.cpus, "memory_mb": spec.memory_mb,  # per node (None: asks none)
        "checkpoint": msgspec.to_builtins(job.checkpoint) if job.checkpoint else None,
        "preemption": msgspec.to_builtins(job.preemption) if job.preemption else None,
        "checkpoint_mode": spec.checkpoint,
        "workdir": spec.workdir,
        "image": spec.image,
        "generation": job.generation,
        "unhealthy_gpus": [gpu_ref(g) for g in job.unhealthy],
        "unhealthy_reason": job.unhealthy_reason,
        "logs": [{"attempt": r.attempt, "generation": r.generation, "rank": r.rank, "node": r.node, "path": r.path}
                 for r in job.logs],
        "idle": msgspec.to_builtins(job.idle) if job.idle else None,
        "idle_requeues": job.idle_requeues,
        "yielded_idle": job.yielded_idle,
        "gpu_s": _gpu_s(*job.gpu_seconds(state.now), state.now, gpu_count(job.weight),  # a share, a slice: its part
                        gpu_count(job.weight) if job.idle is not None else 0),
    }
    return doc


def _gpu_s(held: float, busy: float, at: float, gpus: int | float, idle_gpus: int | float) -> dict[str, Any]:
    """Held and busy GPU-seconds as of `at`, and what accrues after it (`accounting` extrapolates)."""
    return {"held": round(held, 3), "busy": round(busy, 3), "at": at, "gpus": gpus, "idle_gpus": idle_gpus}


def accounting(doc: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """GPU-hours held and busy (seff-like efficiency) of a job or team document, as of `now`: a
    stored document is extended by what its GPUs held since it was written."""
    g = doc["gpu_s"]
    dt = 0.0 if now is None else max(0.0, now - g["at"])
    held = g["held"] + g["gpus"] * dt
    busy = g["busy"] + (g["gpus"] - g["idle_gpus"]) * dt
    return {"gpu_hours_held": round(held / 3600, 4), "gpu_hours_busy": round(busy / 3600, 4),
            "efficiency": round(busy / held, 4) if held > 0 else None}


def gpu_status(state: ClusterState, g: str) -> str:
    rec = state.gpus[g]
    node = state.nodes[rec.node]
    if rec.holder is not None:
        return "held"
    if rec.shares:
        return "shared"  # by fractional jobs (docs/gpu-sharing.md)
    if rec.slices:
        return "sliced"  # MIG slices held (docs/gpu-sharing.md#mig-slices)
    if rec.geometry and not (node.lost or node.partitioned or node.drained or rec.quarantined or rec.zombie_pids):
        return "mig"  # partitioned into MIG slices, all free: not placeable whole
    if node.lost:
        return "lost"
    if node.partitioned:
        return "partitioned"
    if node.drained:
        return "drained"
    if rec.quarantined is not None:
        return "quarantined"
    if rec.zombie_pids is not None:
        return "zombie"
    return "free"


def _mig_doc(rec: Gpu) -> dict[str, Any]:
    """A GPU's MIG mode, profiles, geometry and slices. A geometry can exist without the MIG info
    of a registration (an operator's own MigGeometrySet for a GPU that registered none: the fold
    keeps it, admission would have refused it): mode and pending are then unknown (None)."""
    info = rec.mig
    return {"mode": info.mode if info is not None else None, "pending": info.pending if info is not None else None,
            "profiles": [p.name for p in info.profiles] if info is not None else [], "geometry": list(rec.geometry),
            "slices": {str(i): j for i, j in sorted(rec.slices.items())}}


def node_doc(state: ClusterState, name: str) -> dict[str, Any]:
    node = state.nodes[name]
    gpus = []
    for g in node.gpus:
        rec = state.gpus[g]
        holder = state.jobs.get(rec.holder) if rec.holder else None
        gpus.append({
            "gpu": g, "index": rec.index, "model": rec.model, "memory_mb": rec.memory_mb,
            "nvlink_domain": rec.nvlink_domain, "status": gpu_status(state, g),
            "job_id": rec.holder, "team": holder.spec.team if holder else None,
            "priority": holder.spec.priority if holder else None,
            "quarantined": rec.quarantined, "zombie_pids": rec.zombie_pids,
            "idle": holder is not None and holder.idle is not None,
            "shares": dict(rec.shares),
            **({"mig": _mig_doc(rec)} if rec.mig is not None or rec.geometry else {}),
        })
    return {
        "node": name, "rack": node.rack, "block": node.block, "nvlink": node.nvlink, "address": node.address,
        "labels": dict(node.labels),
        "cpus": node.cpus, "cpus_used": node.cpus_used, "memory_mb": node.memory_mb,  # 0: not declared
        "memory_used_mb": node.memory_used_mb,
        "lost": node.lost, "drained": node.drained, "partitioned": node.partitioned, "total": len(node.gpus), "free": len(node.free),
        "held": sum(1 for x in gpus if x["status"] in ("held", "shared", "sliced")), "gpus": gpus,
    }


def team_doc(state: ClusterState, name: str) -> dict[str, Any]:
    from .policy.pools import pool_rows

    t = state.teams[name]
    total = state.total_gpus or 1
    pending = [state.jobs[j] for j in state.pending if state.jobs[j].spec.team == name]
    running = [state.jobs[j] for j in state.running if state.jobs[j].spec.team == name]
    return {
        "team": name, "held": t.held, "guaranteed": t.quota.guaranteed, "limit": t.quota.limit,
        "weight": t.quota.weight, "usage_gpu_s": round(state.team_usage(name), 3),
        "share": round(t.held / total, 4), "entitled_share": round(t.quota.guaranteed / total, 4),
        "under_guarantee": t.held < t.quota.guaranteed,
        "pending_jobs": len(pending), "pending_gpus": sum(j.spec.gang_min for j in pending),
        "running_jobs": len(running), "idle_gpus": t.idle_gpus,
        "gpu_s": _gpu_s(*state.team_gpu_seconds(name), state.now, t.held, t.idle_gpus),
        "pools": pool_rows(state, name),  # per GPU pool (docs/gpu-pools.md); {} on a one-model cluster
    }


def cluster_totals(state: ClusterState) -> dict[str, Any]:
    """The whole cluster's totals beside the teams' rows (`gpusched teams`): sizes, not other
    teams' work, so a tenant may read them too. The reader answers them, the projector writes
    them in its meta, a fold of the log computes them: the same figures whoever asks."""
    return {"total_gpus": state.total_gpus, "free_gpus": state.free_count,
            "held_gpus": sum(t.held for t in state.teams.values()), "nodes": len(state.nodes),
            "teams": len(state.teams), "pending_jobs": len(state.pending), "running_jobs": len(state.running)}


def queue_docs(state: ClusterState, config=None) -> list[dict[str, Any]]:
    """Pending jobs in the order the running policy (`config`, a PolicyConfig; default: the
    default preset) considers them, with the reason it recorded."""
    from .policy.config import DEFAULT
    from .policy.explain import queue_order

    out = []
    for pos, job_id in enumerate(queue_order(state, None, config or DEFAULT), 1):
        job = state.jobs[job_id]
        out.append({
            "position": pos, "job_id": job_id, "team": job.spec.team, "user": job.user or None,
            "state": job.state, "priority": job.spec.priority,
            "gpus": job.spec.gang_min, "submitted_at": job.submitted_at,
            "waiting_s": round(max(0.0, state.now - job.submitted_at), 3),
            "reason": job.pending_reason, "blockers": list(job.pending_blockers), "eta_s": job.pending_eta_s,
            "eta_range": None if job.pending_eta_range is None else list(job.pending_eta_range),
            "why": None if job.pending_why is None else msgspec.to_builtins(job.pending_why),
            "preemptions": job.preemptions,
        })
    return out


def health_doc(state: ClusterState) -> dict[str, Any]:
    s = state.summary()
    return {"placement_degraded": state.placement_degraded, "last_seq": state.last_seq, "time": state.now,
            "jobs": s["jobs"], "gpus": s["gpus"], "nodes": s["nodes"], "violations": len(state.broken)}


#: One human line per event kind (the event tail).
_LINES: dict[str, Any] = {
    "JobSubmitted": lambda e: f"{e.job_id} submitted by {e.spec.team}{'/' + e.user if e.user else ''}{' via ' + e.via if e.via else ''}: {e.spec.gpus} GPU(s), {e.spec.priority}" + (" preemptible" if e.spec.preemptible else ""),
    "GpusGranted": lambda e: (f"{e.job_id} granted {len(e.gpus)} GPU(s) ({e.level}, {e.placer}"
                              f"{', backfill' if e.backfill else ''}"
                              f"{', handed over: GPUs a preemption freed for it' if e.handover else ''})"),
    "JobPending": lambda e: f"{e.job_id} pending: {e.reason}",
    "JobStarted": lambda e: f"{e.job_id} started on {e.node} (attempt {e.attempt})",
    "PreemptionRequested": lambda e: f"{e.job_id} preempted for {e.for_job}: {e.reason}",
    "CheckpointSaved": lambda e: f"{e.job_id} checkpoint step {e.step} (rank {e.rank})",
    "JobTimedOut": lambda e: f"{e.job_id} timed out: time limit of {e.limit_s:g} s",
    "ProcessesEnded": lambda e: (f"{e.job_id} processes ended on {e.node} ({attempt_text(e.attempt, e.generation)})"
                                 + (f": {e.reason}" if e.reason else "")),
    "JobOnUnhealthyGpu": lambda e: f"{e.job_id} runs on unhealthy GPU(s) {', '.join(e.gpus)}: {e.reason}",
    "GpusReleased": lambda e: f"{e.job_id} released GPUs ({e.reason}{', forced' if e.forced else ''}, lost {e.lost_gpu_s:.0f} GPU-s)",
    "JobResized": lambda e: f"{e.job_id} resized +{len(e.added)} -{len(e.removed)} {e.reason}".rstrip(),
    "JobCompleted": lambda e: f"{e.job_id} completed (exit {e.exit_code})",
    "JobFailed": lambda e: f"{e.job_id} failed: {e.reason}",
    "JobCancelled": lambda e: f"{e.job_id} cancelled: {e.reason}",
    "JobRejected": lambda e: f"submission of {e.team} rejected: {e.reason}",
    "NodeRegistered": lambda e: f"node {e.node} registered in {e.rack} with {len(e.gpus)} GPU(s)",
    "NodeLost": lambda e: f"node {e.node} lost: {e.reason}",
    "PartitionDeclared": lambda e: f"partition declared: {len(e.nodes)} nodes ({e.reason})",
    "PartitionEnded": lambda e: f"partition ended: {len(e.nodes)} nodes ({e.reason})",
    "NodeDrained": lambda e: (f"node {e.node} maintenance window {e.start or e.at:.0f}..{e.until:.0f} {e.reason}" if e.until is not None
                              else f"node {e.node} {'drained' if e.drain else 'undrained'} {e.reason}").rstrip(),
    "ZombieDetected": lambda e: f"zombie on {e.gpu}: pids {e.pids}",
    "ZombieReclaimed": lambda e: f"zombie on {e.gpu} reclaimed",
    "FoldSettingsSet": lambda e: (f"fold settings: usage half-life {_span(e.settings.half_life_s)}, finished jobs "
                                  f"kept whole {_span(e.settings.forget_after_s)}" + (f" ({e.reason})" if e.reason else "")),
    "TeamQuotaSet": lambda e: (f"team {e.team} quota: guaranteed {e.quota.guaranteed}, weight {e.quota.weight}, "
                                f"limit {e.quota.limit}" + "".join(f", {p}: guaranteed {m.guaranteed} limit {m.limit}"
                                                                     for p, m in e.quota.models.items())),
    "PlacementDegraded": lambda e: f"placement DEGRADED: {e.reason}",
    "PlacementRecovered": lambda e: f"placement recovered {e.reason}".rstrip(),
    "GpuQuarantined": lambda e: f"GPU {e.gpu} quarantined: {e.reason}",
    "GpuRestored": lambda e: f"GPU {e.gpu} restored: {e.reason}",
    "SnapshotTaken": lambda e: f"snapshot of the state at seq {e.seq} sealed",
}


def _span(seconds: float | None) -> str:
    if seconds is None:
        return "for ever"
    for unit, size in (("d", 86_400), ("h", 3600)):
        if seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def attempt_text(attempt: int, generation: int = 0) -> str:
    """`attempt 2`, or `attempt 2, restart 3` when its processes were restarted in place: two
    integers, never the `2.3` that reads as a fraction."""
    return f"attempt {int(attempt)}" + (f", restart {int(generation)}" if generation else "")


def describe(event: ev.Event) -> str:
    """One human line per event (the event tail)."""
    k = type(event).__name__
    if k in ("JobIdle", "JobBusy") or getattr(event, "cause", "") == "idle":
        return _describe_idle(event)
    line = _LINES.get(k)
    return k if line is None else line(event)


def _describe_idle(e: Any) -> str:
    if type(e).__name__ == "JobIdle":
        return (f"{e.job_id} idle: GPUs under {e.threshold_pct:g}% for {e.window_s:.0f} s "
                f"(mean {e.util_pct:.1f}%, max {e.util_pct_max:.1f}%, {e.memory_mb:.0f} MB per GPU)")
    if type(e).__name__ == "JobBusy":
        return f"{e.job_id} busy again ({e.gpu} at {e.util_pct:.0f}%)"
    return f"{e.job_id} asked to checkpoint and yield: {e.reason}"


def event_line(seq: int, event: ev.Event) -> dict[str, Any]:
    return {"seq": seq, "at": event.at, "type": type(event).__name__, "job_id": getattr(event, "job_id", None),
            "text": describe(event)}


__all__ = ["natural_key", "accounting", "job_doc", "node_doc", "team_doc", "cluster_totals", "queue_docs", "health_doc", "event_line", "describe", "attempt_text", "gpu_ref"]
