"""Every metric docs/operating.md documents moves when the code that drives it runs: a fold of a
real log (cluster gauges and counters), a compare-and-set conflict, a decision cycle, and a node
heartbeat (per-GPU metrics under gpusched_gpu_* names)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from prometheus_client import REGISTRY

from gpusched import metrics, telemetry
from gpusched.bus.cas import append_cas
from gpusched.core import events as ev
from gpusched.core.heartbeat import GpuSample, Heartbeat
from gpusched.core.model import GpuInfo, JobSpec, TeamQuota
from gpusched.services.runtime import FoldedLog

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operating.md"


def documented() -> set[str]:
    text = DOCS.read_text()
    section = text[text.index("## Metrics"):]
    section = section[:section.index("\n## ", 4)] if "\n## " in section[4:] else section
    return set(re.findall(r"`(gpusched_[A-Za-z0-9_]+)`", section))


def _samples() -> dict[str, float]:
    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        for s in family.samples:
            out[s.name] = max(out.get(s.name, 0.0), abs(s.value))
    return out


def _moved(name: str, samples: dict[str, float]) -> bool:
    return any(samples.get(name + suffix, 0.0) > 0 for suffix in ("", "_total", "_count"))


def _scene(t: float) -> list:
    gpus = [GpuInfo(index=i, uuid=f"mv-u{i}") for i in range(4)]
    return [
        ev.NodeRegistered(at=t, node="mv0", rack="r0", gpus=gpus),
        ev.NodeRegistered(at=t, node="mv1", rack="r0", gpus=[GpuInfo(index=0, uuid="mv1-u0")]),
        ev.TeamQuotaSet(at=t, team="mv-a", quota=TeamQuota(guaranteed=2, limit=4)),
        ev.JobSubmitted(at=t + 1, job_id="mv-1", spec=JobSpec(team="mv-a", gpus=2, preemptible=True)),
        ev.JobSubmitted(at=t + 1, job_id="mv-2", spec=JobSpec(team="mv-b", gpus=1)),
        ev.JobSubmitted(at=t + 1, job_id="mv-3", spec=JobSpec(team="mv-b", gpus=8)),
        ev.GpusGranted(at=t + 2, job_id="mv-1", attempt=1, gpus=["mv0/0", "mv0/1"], level="nvlink"),
        ev.PreemptionRequested(at=t + 3, job_id="mv-1", for_job="mv-3", reason="priority", deadline=t + 9),
        ev.GpusReleased(at=t + 4, job_id="mv-1", reason="preempted", forced=True, lost_gpu_s=6.0),
        ev.GpusGranted(at=t + 5, job_id="mv-2", attempt=1, gpus=["mv0/2"], level="nvlink"),
        ev.JobCompleted(at=t + 6, job_id="mv-2", attempt=1),
        ev.GpusGranted(at=t + 7, job_id="mv-1", attempt=2, gpus=["mv0/0", "mv0/1"], level="nvlink"),
        ev.GpusGranted(at=t + 7, job_id="mv-2x", attempt=1, gpus=["mv0/0"], level="nvlink"),  # broken: held
        ev.JobIdle(at=t + 7.5, job_id="mv-1", attempt=2, since=t + 7, window_s=0.5, threshold_pct=5),
        ev.PreemptionRequested(at=t + 7.5, job_id="mv-1", for_job="mv-1", reason="idle", deadline=t + 9, cause="idle"),
        ev.NodeLost(at=t + 8, node="mv1", reason="silent"),
        ev.GpuQuarantined(at=t + 8, gpu="mv0/3", reason="XID 79"),
        ev.PlacementDegraded(at=t + 9, reason="lease lapsed"),
    ]


async def test_every_documented_metric_moves(event_log):
    names = documented()
    assert len(names) >= 20, names
    metrics.export_cluster()
    telemetry.set_service("mv-svc")
    folded = FoldedLog(event_log)
    metrics.attach(folded, "mv-svc")
    folded.listeners.append(metrics.FoldMetrics(gauge_interval_s=0.0))
    await folded.start()
    for e in _scene(time.time()):  # dated now and a few seconds on (within AT_LEAD_S): the fold runs on store time
        await event_log.append(e)
    await folded.catch_up()
    with metrics.decision_timer("mv-svc"):
        stale = folded.alloc_seq - 1  # a view from before the last ownership change
        _, conflicted = await append_cas(folded, [ev.GpusGranted(at=2000.0, job_id="mv-3", attempt=1,
                                                                 gpus=["mv0/2"])], view=stale)
    assert conflicted
    metrics.observe_state(folded.state)
    hb = Heartbeat(node="mv0", at=1010.0, agent_id="a", seq=1, backend="sim", gpus=[
        GpuSample(index=0, uuid="mv-u0", memory_used_mb=1000, memory_total_mb=80000, utilization_pct=97.0,
                  temperature_c=71.0, healthy=False, health="XID 79", xid=79),
        GpuSample(index=2, uuid="mv-u2", memory_total_mb=80000)])
    metrics.GpuMetrics().observe(hb, folded.state)
    await folded.stop()
    samples = _samples()
    still = sorted(n for n in names if not _moved(n, samples))
    assert still == [], f"documented metrics that never moved: {still}"
    gpu = REGISTRY.get_sample_value("gpusched_gpu_utilization_ratio", {"node": "mv0", "gpu": "0", "UUID": "mv-u0",
                                                                       "job_id": "mv-1", "team": "mv-a"})
    assert gpu == 0.97
