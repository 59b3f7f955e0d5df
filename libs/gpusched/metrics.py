"""Prometheus metrics: cluster-wide ones from exactly one process, per-service ones from each.

- Cluster metrics (queue length, GPUs held, grants, preemptions, lost work, ...) live in their
  own registry, `CLUSTER`, computed from a fold: gauges from a `ClusterState` (`observe_state`),
  counters from the records it applies (`FoldMetrics`). Only the process that calls
  `export_cluster()` serves them (the projector): summing over scrape targets counts each once.
- Per-service metrics (`gpusched_log_seq`, decision time, handled commands and events,
  compare-and-set conflicts) carry a `service` label and come from every service.
- Per-GPU metrics from node heartbeats under gpusched's own names (`gpusched_gpu_*`, never
  DCGM_FI_*: NVIDIA's dcgm-exporter owns those on a real cluster) with node, gpu, UUID, job_id
  and team labels: served by the reconciler, the one consumer of heartbeats (`GpuMetrics`).
  Join dcgm-exporter's series to jobs by the shared `UUID` label:
  `DCGM_FI_DEV_POWER_USAGE * on(UUID) group_left(job_id, team) gpusched_gpu_healthy`.
- No label is called `job` (Prometheus's own target label: ours would become `exported_job`):
  a job's id is `job_id`.

    metrics.start_metrics_server(9101)            # once per process (idempotent per port)
    metrics.attach(folded)                         # per-service listener (+ cluster, if exported)
    with metrics.decision_timer("placement"):      # around one decide() cycle
        events = cycle(state, now, config)

Counters count the log from its start (a restarted service replays them); use `rate()`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from gpusched import health
from gpusched.core import events as ev
from gpusched.core.model import PRIORITY_RANK

#: Cluster-wide metrics: served only by the process that calls `export_cluster()`.
CLUSTER = CollectorRegistry(auto_describe=True)
_R = CLUSTER

QUEUE_LENGTH = Gauge("gpusched_queue_length", "Jobs waiting, by team and priority", ["team", "priority"], registry=_R)
QUEUE_GPUS = Gauge("gpusched_queue_gpus", "GPUs asked for by waiting jobs, by team", ["team"], registry=_R)
QUEUE_OLDEST = Gauge("gpusched_queue_oldest_submitted_timestamp_seconds",
                     "Submission time of the oldest waiting job, by team (0: none waits); age = time() - this",
                     ["team"], registry=_R)
GPUS_HELD = Gauge("gpusched_gpus_held", "GPUs held by running jobs, by team", ["team"], registry=_R)
TEAM_GUARANTEED = Gauge("gpusched_team_guaranteed_gpus", "Guaranteed GPUs of a team", ["team"], registry=_R)
TEAM_LIMIT = Gauge("gpusched_team_limit_gpus", "Hard GPU limit of a team (-1: none)", ["team"], registry=_R)
GPUS = Gauge("gpusched_gpus", "GPUs of the cluster by status", ["status"], registry=_R)
NODES = Gauge("gpusched_nodes", "Nodes by status (ok, lost, drained)", ["status"], registry=_R)
JOBS = Gauge("gpusched_jobs", "Jobs by state", ["state"], registry=_R)
DEGRADED = Gauge("gpusched_placement_degraded", "1 while naive placement has taken over", registry=_R)
VIOLATIONS = Gauge("gpusched_invariant_violations", "Broken invariants seen in the log", registry=_R)
GPUS_IDLE = Gauge("gpusched_gpus_idle", "GPUs held by jobs the reconciler reports idle, by team", ["team"], registry=_R)
TEAM_HELD_S = Gauge("gpusched_team_gpu_seconds_held", "GPU-seconds a team held (undecayed)", ["team"], registry=_R)
TEAM_BUSY_S = Gauge("gpusched_team_gpu_seconds_busy", "GPU-seconds a team held while not idle", ["team"], registry=_R)
TEAM_EFFICIENCY = Gauge("gpusched_team_gpu_efficiency", "Busy / held GPU-seconds of a team (seff-like)", ["team"],
                        registry=_R)
JOB_EFFICIENCY = Gauge("gpusched_job_gpu_efficiency", "Busy / held GPU-seconds of a running job", ["job_id", "team"],
                       registry=_R)

GRANTS = Counter("gpusched_grants", "Gang grants appended to the log", ["placer", "level"], registry=_R)
GRANTED_GPUS = Counter("gpusched_granted_gpus", "GPUs granted", ["team"], registry=_R)
PREEMPTIONS = Counter("gpusched_preemptions", "Preemptions requested, by victim team", ["team"], registry=_R)
RELEASES = Counter("gpusched_releases", "GPUs released back to the queue, by reason", ["reason"], registry=_R)
LOST_WORK = Counter("gpusched_lost_gpu_seconds", "GPU-seconds of work lost to preemption or failure", ["team"], registry=_R)
FINISHED = Counter("gpusched_jobs_finished", "Jobs that reached a terminal state", ["state"], registry=_R)
NODE_LOST = Counter("gpusched_nodes_lost", "Nodes declared lost (silent)", registry=_R)
QUARANTINED = Counter("gpusched_gpus_quarantined", "GPUs quarantined as unhealthy", registry=_R)
DEGRADATIONS = Counter("gpusched_placement_degradations", "Times the fallback took over placement (lease lapsed)",
                       registry=_R)
IDLE_TIMEOUTS = Counter("gpusched_idle_timeouts", "Idle jobs asked to yield by their idle timeout", ["team"],
                        registry=_R)

QUEUE_WAIT = Histogram(
    "gpusched_queue_wait_seconds", "From submission (or requeue) to grant, by priority", ["priority"], registry=_R,
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 14400),
)

# --- per service (every process, `service` label) ----------------------------------------------

LOG_SEQ = Gauge("gpusched_log_seq", "Last log sequence this service's fold applied", ["service"], registry=REGISTRY)
DECISION_SECONDS = Histogram(
    "gpusched_decision_seconds", "Time of one decision cycle of a service", ["service"], registry=REGISTRY,
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
HANDLED = Counter("gpusched_handled", "Commands and events a service handled", ["service", "kind", "outcome"],
                  registry=REGISTRY)
CONFLICTS = Counter("gpusched_append_conflicts", "Compare-and-set appends that lost and were retried", ["service"],
                    registry=REGISTRY)

# --- per GPU, from heartbeats (the reconciler), gpusched's names, dcgm-exporter's `UUID` label ------

GPU_LABELS = ["node", "gpu", "UUID", "job_id", "team"]
MIB = 1024 * 1024
GPU_UTIL = Gauge("gpusched_gpu_utilization_ratio", "GPU utilization the node daemon reported (0-1)", GPU_LABELS,
                 registry=REGISTRY)
GPU_FB_USED = Gauge("gpusched_gpu_memory_used_bytes", "GPU memory used", GPU_LABELS, registry=REGISTRY)
GPU_FB_FREE = Gauge("gpusched_gpu_memory_free_bytes", "GPU memory free", GPU_LABELS, registry=REGISTRY)
GPU_TEMP = Gauge("gpusched_gpu_temperature_celsius", "GPU temperature", GPU_LABELS, registry=REGISTRY)
GPU_XID = Gauge("gpusched_gpu_last_xid", "Value of the last XID error seen (0: none)", GPU_LABELS, registry=REGISTRY)
GPU_XID_COUNT = Counter("gpusched_gpu_xid_errors", "XID errors seen in heartbeats (a new XID value counts once)",
                        ["node", "gpu", "UUID"], registry=REGISTRY)
GPU_HEALTHY = Gauge("gpusched_gpu_healthy", "1 while the node daemon reports the GPU healthy", GPU_LABELS,
                    registry=REGISTRY)

_cluster_view: Any = None


class _ClusterView:
    """Puts the `CLUSTER` registry's metrics on this process's /metrics."""

    def collect(self):
        return CLUSTER.collect()


def export_cluster() -> None:
    """Serve the cluster-wide metrics from this process (exactly one process should: the projector)."""
    global _cluster_view
    if _cluster_view is None:
        _cluster_view = _ClusterView()
        REGISTRY.register(_cluster_view)


def exporting_cluster() -> bool:
    return _cluster_view is not None


_servers: dict[int, Any] = {}


def start_metrics_server(port: int, addr: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY) -> int:
    """Serve `/metrics`, and the probes `/healthz` and `/readyz` (`gpusched.health`), on `port`
    (0: any free port) in a daemon thread; idempotent per port. Returns the port."""
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: no access log
            pass

    if port and port in _servers:
        return port
    server = make_server(addr, port, health.wsgi(make_wsgi_app(registry)), ThreadingWSGIServer, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, name=f"metrics-{port}", daemon=True).start()
    bound = server.server_address[1]
    _servers[bound] = server
    return bound


def stop_metrics_servers() -> None:
    for server in _servers.values():
        server.shutdown()
    _servers.clear()


@contextlib.contextmanager
def decision_timer(service: str) -> Iterator[None]:
    """Observe the duration of one decision cycle."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        DECISION_SECONDS.labels(service).observe(time.perf_counter() - t0)


def handled(service: str, kind: str, outcome: str = "ok") -> None:
    HANDLED.labels(service, kind, outcome).inc()


def observe_state(state: Any) -> None:
    """Set the cluster gauges from a fold (`ClusterState`)."""
    queue: dict[tuple[str, str], int] = {}
    queue_gpus: dict[str, int] = {}
    oldest: dict[str, float] = {}
    for job_id in state.pending:
        job = state.jobs[job_id]
        key = (job.spec.team, job.spec.priority)
        queue[key] = queue.get(key, 0) + 1
        queue_gpus[job.spec.team] = queue_gpus.get(job.spec.team, 0) + job.spec.gang_min
        oldest[job.spec.team] = min(oldest.get(job.spec.team, job.submitted_at), job.submitted_at)
    teams = sorted(state.teams)
    for team in teams:
        for prio in PRIORITY_RANK:
            QUEUE_LENGTH.labels(team, prio).set(queue.get((team, prio), 0))
        QUEUE_GPUS.labels(team).set(queue_gpus.get(team, 0))
        QUEUE_OLDEST.labels(team).set(oldest.get(team, 0.0))
        t = state.teams[team]
        GPUS_HELD.labels(team).set(t.held)
        TEAM_GUARANTEED.labels(team).set(t.quota.guaranteed)
        TEAM_LIMIT.labels(team).set(-1 if t.quota.limit is None else t.quota.limit)
    held = state.held_gpus
    GPUS.labels("held").set(held)
    GPUS.labels("free").set(state.free_count)
    GPUS.labels("unavailable").set(state.total_gpus - held - state.free_count)
    for name, count in state.job_counts().items():
        JOBS.labels(name).set(count)
    lost = sum(1 for n in state.nodes.values() if n.lost)
    drained = sum(1 for n in state.nodes.values() if n.drained and not n.lost)
    NODES.labels("lost").set(lost)
    NODES.labels("drained").set(drained)
    NODES.labels("ok").set(len(state.nodes) - lost - drained)
    DEGRADED.set(1 if state.placement_degraded else 0)
    VIOLATIONS.set(len(state.broken))
    observe_efficiency(state)


_job_labels: set[tuple[str, str]] = set()


def observe_efficiency(state: Any) -> None:
    """Used versus held: per team and per running job, busy / held GPU-seconds as of the fold's
    time (a job's labels go when it stops running, so the series stay bounded)."""
    for team in sorted(state.teams):
        held, busy = state.team_gpu_seconds(team)
        TEAM_HELD_S.labels(team).set(held)
        TEAM_BUSY_S.labels(team).set(busy)
        TEAM_EFFICIENCY.labels(team).set(busy / held if held > 0 else 1.0)
        GPUS_IDLE.labels(team).set(state.teams[team].idle_gpus)
    live = set()
    for job_id in state.running:
        job = state.jobs[job_id]
        held, busy = job.gpu_seconds(state.now)
        key = (job_id, job.spec.team)
        live.add(key)
        JOB_EFFICIENCY.labels(*key).set(busy / held if held > 0 else 1.0)
    for key in _job_labels - live:
        try:
            JOB_EFFICIENCY.remove(*key)
        except KeyError:
            pass
    _job_labels.clear()
    _job_labels.update(live)


class FoldMetrics:
    """A `FoldedLog` listener: counters from the records, gauges at most every `gauge_interval_s`
    of wall time (the fold moves fast during replay) and, so that they follow the state at once,
    once more at the end of a throttled burst (the last event of a burst, say PlacementRecovered,
    is never left unshown) and every `refresh_s` on a timer (nothing else moves them when the log
    is quiet). The timers run on the event loop that folds, so no scrape sees a half-applied event."""

    def __init__(self, gauge_interval_s: float = 0.5, refresh_s: float = 5.0):
        self.gauge_interval_s = gauge_interval_s
        self.refresh_s = refresh_s
        self._last_gauges = 0.0
        self._queued_at: dict[str, float] = {}
        self._state: Any = None
        self._trailing: Any = None  # the pending end-of-burst refresh (an asyncio handle)
        self._ticking = False
        self.folded: Any = None  # the FoldedLog it listens to: the timer stops with it

    def __call__(self, record: Any, state: Any) -> None:
        e = record.event
        if isinstance(e, ev.GpusGranted):
            GRANTS.labels(e.placer, e.level).inc()
            job = state.jobs.get(e.job_id)
            if job is not None:
                GRANTED_GPUS.labels(job.spec.team).inc(len(e.gpus))
                since = self._queued_at.pop(e.job_id, job.submitted_at)
                QUEUE_WAIT.labels(job.spec.priority).observe(max(0.0, e.at - since))
        elif isinstance(e, ev.PreemptionRequested):
            job = state.jobs.get(e.job_id)
            (IDLE_TIMEOUTS if e.cause == "idle" else PREEMPTIONS).labels(job.spec.team if job else "unknown").inc()
        elif isinstance(e, ev.GpusReleased):
            RELEASES.labels(e.reason).inc()
            job = state.jobs.get(e.job_id)
            if job is not None:
                self._queued_at[e.job_id] = e.at
                if e.lost_gpu_s:
                    LOST_WORK.labels(job.spec.team).inc(e.lost_gpu_s)
        elif isinstance(e, ev.NodeLost):
            NODE_LOST.inc()
        elif isinstance(e, ev.GpuQuarantined):
            QUARANTINED.inc()
        elif isinstance(e, ev.PlacementDegraded):
            DEGRADATIONS.inc()
        elif isinstance(e, (ev.JobCompleted, ev.JobFailed, ev.JobCancelled, ev.JobTimedOut)):
            FINISHED.labels({ev.JobCompleted: "completed", ev.JobFailed: "failed", ev.JobTimedOut: "timeout",
                             ev.JobCancelled: "cancelled"}[type(e)]).inc()
            self._queued_at.pop(e.job_id, None)
        self._state = state
        wait = self.gauge_interval_s - (time.monotonic() - self._last_gauges)
        if wait <= 0:
            self.refresh(state)
        elif self._trailing is None:
            self._trailing = _call_later(wait, self._refresh_trailing)
        if not self._ticking and self.folded is not None:
            self._ticking = _call_later(self.refresh_s, self._tick) is not None

    def refresh(self, state: Any) -> None:
        self._last_gauges = time.monotonic()
        observe_state(state)

    def _refresh_trailing(self) -> None:
        self._trailing = None
        if self._state is not None:
            self.refresh(self._state)

    def _tick(self) -> None:
        """The timer: refresh, and go on while the fold it listens to does."""
        task = getattr(self.folded, "_task", None)
        if task is None or task.done():
            self._ticking = False
            return
        if self._state is not None:
            self.refresh(self._state)
        _call_later(self.refresh_s, self._tick)


def _call_later(delay: float, callback: Any) -> Any:
    """`loop.call_later` on the running loop; None outside one (a plain fold: no timer)."""
    import asyncio

    try:
        return asyncio.get_running_loop().call_later(delay, callback)
    except RuntimeError:
        return None


class ServiceFold:
    """A `FoldedLog` listener for the per-service metrics: the sequence this service has
    applied and the events it folded."""

    def __init__(self, service: str):
        self.service = service
        self._seq = LOG_SEQ.labels(service)

    def __call__(self, record: Any, state: Any) -> None:
        self._seq.set(record.seq)
        HANDLED.labels(self.service, type(record.event).__name__, "folded").inc()


class GpuMetrics:
    """Per-GPU gauges from heartbeats, labelled with the job and team holding the GPU in the fold.
    A GPU's old series is removed when its job or team changes (no stale series)."""

    def __init__(self) -> None:
        self._labels: dict[tuple[str, int], tuple[str, ...]] = {}
        self._xid: dict[tuple[str, int], int | None] = {}

    def observe(self, hb: Any, state: Any) -> None:
        for g in hb.gpus:
            holder = state.gpus.get(f"{hb.node}/{g.index}") if state is not None else None
            job_id = getattr(holder, "holder", None) or ""
            job = state.jobs.get(job_id) if job_id else None
            labels = (hb.node, str(g.index), g.uuid, job_id, job.spec.team if job else "")
            key = (hb.node, g.index)
            old = self._labels.get(key)
            if old is not None and old != labels:
                for gauge in _GPU_GAUGES:
                    with contextlib.suppress(KeyError):
                        gauge.remove(*old)
            self._labels[key] = labels
            GPU_UTIL.labels(*labels).set(g.utilization_pct / 100.0)
            GPU_FB_USED.labels(*labels).set(g.memory_used_mb * MIB)
            GPU_FB_FREE.labels(*labels).set(max(0, g.memory_total_mb - g.memory_used_mb) * MIB)
            temperature = getattr(g, "temperature_c", None)
            if temperature is not None:
                GPU_TEMP.labels(*labels).set(temperature)
            GPU_XID.labels(*labels).set(g.xid or 0)
            GPU_HEALTHY.labels(*labels).set(1 if g.healthy else 0)
            if g.xid and self._xid.get(key) != g.xid:
                GPU_XID_COUNT.labels(hb.node, str(g.index), g.uuid).inc()
            self._xid[key] = g.xid


_GPU_GAUGES = (GPU_UTIL, GPU_FB_USED, GPU_FB_FREE, GPU_TEMP, GPU_XID, GPU_HEALTHY)

_attached: set[int] = set()
#: Set by a service started with --metrics-port: `FoldedLog.start` then attaches itself.
ENABLED = False


def attach(folded: Any, service: str | None = None) -> FoldMetrics:
    """Make a `FoldedLog` drive this process's metrics: its service's own (every time), and the
    cluster's when this process exports them (`export_cluster`; once per process, or several
    folds in one process would count every event twice)."""
    from gpusched import telemetry

    name = service or telemetry.current_service()
    if not any(isinstance(x, ServiceFold) and x.service == name for x in folded.listeners):
        folded.listeners.append(ServiceFold(name))
    listener = FoldMetrics()
    listener.folded = folded
    if exporting_cluster() and not _attached:
        _attached.add(id(folded))
        folded.listeners.append(listener)
    return listener


__all__ = [
    "start_metrics_server", "stop_metrics_servers", "decision_timer", "handled", "observe_state",
    "FoldMetrics", "ServiceFold", "GpuMetrics", "attach", "export_cluster", "exporting_cluster", "CLUSTER",
    "DECISION_SECONDS", "CONFLICTS", "HANDLED", "QUEUE_WAIT", "LOG_SEQ", "observe_efficiency",
]
