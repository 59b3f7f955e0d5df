"""The Grafana dashboard and the Prometheus alert rules in deploy/ name only metrics the code
exports, and the alerts the operators rely on exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

from gpusched import metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NAME = re.compile(r"\b(gpusched_[a-z0-9_]+|DCGM_FI_[A-Z0-9_]+)\b")


def exported() -> set[str]:
    """Every sample name this code can expose (counters with _total, histograms with _bucket, ...)."""
    names: set[str] = set()
    for registry in (REGISTRY, metrics.CLUSTER):
        for family in registry.collect():
            names.add(family.name)
            kind = family.type
            if kind == "counter":
                names.add(family.name + "_total")
            elif kind == "histogram":
                names.update(family.name + s for s in ("_bucket", "_count", "_sum"))
    return names


def _exprs_grafana() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "gpusched.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def _exprs_alerts() -> dict[str, str]:
    import yaml

    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def test_dashboard_and_alerts_name_only_exported_metrics():
    known = exported()
    used = {n for e in _exprs_grafana() + list(_exprs_alerts().values()) for n in NAME.findall(e)}
    assert used, "no metric found in deploy/"
    assert sorted(used - known) == []


def test_the_alerts_operators_rely_on_exist():
    alerts = _exprs_alerts()
    for wanted in ("GpuschedPlacementDegraded", "GpuschedQueueAgeHigh", "GpuschedNodeLost", "GpuschedGpuQuarantined",
                   "GpuschedPlacementLeaseFlapping"):
        assert wanted in alerts
    assert "gpusched_queue_oldest_submitted_timestamp_seconds" in alerts["GpuschedQueueAgeHigh"]


def test_no_label_named_job_and_no_dcgm_names():
    """`job` is Prometheus's target label (ours would be renamed `exported_job`), and DCGM_FI_*
    belong to NVIDIA's dcgm-exporter on a real cluster."""
    collectors = {*REGISTRY._names_to_collectors.values(), *metrics.CLUSTER._names_to_collectors.values()}
    ours = [c for c in collectors if hasattr(c, "_labelnames")]
    assert len(ours) >= 30
    assert sorted(c._name for c in ours if "job" in c._labelnames) == []
    assert sorted(c._name for c in ours if c._name.startswith("DCGM_")) == []
    assert "job_id" in metrics.GPU_HEALTHY._labelnames and "UUID" in metrics.GPU_HEALTHY._labelnames
