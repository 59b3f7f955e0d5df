"""Metrics come from the fold: gauges from the state, counters from the records."""

from __future__ import annotations

import urllib.request

from prometheus_client import REGISTRY

from gpusched import metrics
from gpusched.bus.log import Record
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec, TeamQuota
from gpusched.core.state import ClusterState


def _value(name, **labels):
    return metrics.CLUSTER.get_sample_value(name, labels) or 0.0


def test_fold_drives_gauges_and_counters():
    state = ClusterState()
    listener = metrics.FoldMetrics(gauge_interval_s=0.0)
    before_grants = _value("gpusched_grants_total", placer="topo", level="node")
    before_lost = _value("gpusched_lost_gpu_seconds_total", team="m-a")
    events = [
        ev.NodeRegistered(at=1, node="m0", rack="r0", gpus=[GpuInfo(index=i, uuid=f"u{i}", nvlink_domain=i // 2) for i in range(4)]),
        ev.TeamQuotaSet(at=1, team="m-a", quota=TeamQuota(guaranteed=2, limit=4)),
        ev.JobSubmitted(at=2, job_id="mj1", spec=JobSpec(team="m-a", gpus=4, preemptible=True)),
        ev.JobSubmitted(at=2, job_id="mj2", spec=JobSpec(team="m-b", gpus=2, priority="high")),
        ev.GpusGranted(at=3, job_id="mj1", attempt=1, gpus=["m0/0", "m0/1", "m0/2", "m0/3"], level="node"),
        ev.PreemptionRequested(at=4, job_id="mj1", for_job="mj2", reason="priority", deadline=10),
        ev.GpusReleased(at=5, job_id="mj1", reason="preempted", lost_gpu_s=8.0),
        ev.PlacementDegraded(at=6, reason="lease lapsed"),
    ]
    for seq, e in enumerate(events, 1):
        state.apply(e, seq)
        listener(Record(seq, e, "s", None), state)
    assert _value("gpusched_grants_total", placer="topo", level="node") == before_grants + 1
    assert _value("gpusched_lost_gpu_seconds_total", team="m-a") == before_lost + 8.0
    assert _value("gpusched_queue_length", team="m-a", priority="normal") == 1
    assert _value("gpusched_queue_length", team="m-b", priority="high") == 1
    assert _value("gpusched_gpus_held", team="m-a") == 0
    assert _value("gpusched_team_limit_gpus", team="m-a") == 4
    assert _value("gpusched_placement_degraded") == 1
    assert _value("gpusched_gpus", status="free") == 4


def test_metrics_endpoint_serves_text():
    port = metrics.start_metrics_server(0)
    with metrics.decision_timer("unit"):
        pass
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'gpusched_decision_seconds_count{service="unit"}' in body


def test_cluster_metrics_are_not_served_by_every_service():
    """Only a process that exports the cluster's metrics serves them: summing over scrape
    targets counts each once."""
    names = {m.name for m in REGISTRY.collect()}
    if not metrics.exporting_cluster():
        assert "gpusched_gpus" not in names and "gpusched_grants" not in names
    assert {"gpusched_log_seq", "gpusched_decision_seconds", "gpusched_gpu_utilization_ratio"} <= names
    assert "gpusched_gpus" in {m.name for m in metrics.CLUSTER.collect()}


def test_efficiency_gauges_per_team_and_running_job():
    state = ClusterState()
    listener = metrics.FoldMetrics(gauge_interval_s=0.0)
    before = _value("gpusched_idle_timeouts_total", team="e-a")
    events = [
        ev.NodeRegistered(at=0, node="e0", rack="r0", gpus=[GpuInfo(index=i, uuid=f"e{i}") for i in range(4)]),
        ev.JobSubmitted(at=0, job_id="ej1", spec=JobSpec(team="e-a", gpus=2, priority="interactive")),
        ev.JobSubmitted(at=0, job_id="ej2", spec=JobSpec(team="e-a", gpus=2)),
        ev.GpusGranted(at=0, job_id="ej1", attempt=1, gpus=["e0/0", "e0/1"]),
        ev.GpusGranted(at=0, job_id="ej2", attempt=1, gpus=["e0/2", "e0/3"]),
        ev.JobIdle(at=100, job_id="ej1", attempt=1, since=0, window_s=100, threshold_pct=5),
        ev.PreemptionRequested(at=100, job_id="ej1", for_job="ej1", reason="idle", deadline=100, cause="idle"),
    ]
    for seq, e in enumerate(events, 1):
        state.apply(e, seq)
        listener(Record(seq, e, "s", None), state)
    assert _value("gpusched_team_gpu_seconds_held", team="e-a") == 400.0
    assert _value("gpusched_team_gpu_seconds_busy", team="e-a") == 200.0
    assert _value("gpusched_team_gpu_efficiency", team="e-a") == 0.5
    assert _value("gpusched_gpus_idle", team="e-a") == 2
    assert _value("gpusched_job_gpu_efficiency", job_id="ej1", team="e-a") == 0.0
    assert _value("gpusched_job_gpu_efficiency", job_id="ej2", team="e-a") == 1.0
    assert _value("gpusched_idle_timeouts_total", team="e-a") == before + 1
    e = ev.GpusReleased(at=101, job_id="ej1", reason="preempted", forced=True)
    state.apply(e, 8)
    listener(Record(8, e, "s", None), state)
    assert metrics.CLUSTER.get_sample_value("gpusched_job_gpu_efficiency", {"job_id": "ej1", "team": "e-a"}) is None
