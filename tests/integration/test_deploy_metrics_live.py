"""The projector's real /metrics follows the state at once: the last event of a burst shows
within one scrape (PlacementRecovered -> gpusched_placement_degraded 0, all jobs done ->
gpusched_jobs{state="running"} 0) with no further event, and no series carries a `job` label."""

from __future__ import annotations

import asyncio
import re
import urllib.request

from gpusched import metrics
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.services import projector

SCRAPE_INTERVAL_S = 1.5  # well under any Prometheus scrape interval (15 s by default)


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _value(body: str, sample: str) -> float | None:
    m = re.search(rf"^{re.escape(sample)} (\S+)$", body, re.M)
    return None if m is None else float(m.group(1))


async def _until(port: int, sample: str, want: float, within_s: float) -> float | None:
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        seen = _value(await asyncio.to_thread(_scrape, port), sample)
        if seen == want or asyncio.get_running_loop().time() > deadline:
            return seen
        await asyncio.sleep(0.1)


async def test_gauges_follow_the_last_event_of_a_burst(event_log, nats_url, redis_url):
    metrics._attached.clear()  # an earlier test's fold in this process may hold the cluster listener
    port = metrics.start_metrics_server(0)
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(nats_url, redis_url, stop))
    try:
        t = 5000.0
        for e in [ev.NodeRegistered(at=t, node="fr0", rack="r0", gpus=[GpuInfo(index=0, uuid="fr-u0")]),
                  ev.JobSubmitted(at=t, job_id="fr-1", spec=JobSpec(team="fr", gpus=1)),
                  ev.GpusGranted(at=t + 1, job_id="fr-1", attempt=1, gpus=["fr0/0"]),
                  ev.JobStarted(at=t + 1, job_id="fr-1", attempt=1, node="fr0")]:
            await event_log.append(e)
        assert await _until(port, 'gpusched_jobs{state="running"}', 1.0, 10.0) == 1.0
        assert await _until(port, "gpusched_placement_degraded", 0.0, 5.0) == 0.0
        # One burst, faster than the gauges' throttle: its last events must still show.
        for e in [ev.PlacementDegraded(at=t + 2, reason="lease lapsed"),
                  ev.PlacementRecovered(at=t + 2.1),
                  ev.JobCompleted(at=t + 3, job_id="fr-1", attempt=1)]:
            await event_log.append(e)
        assert await _until(port, 'gpusched_jobs{state="running"}', 0.0, SCRAPE_INTERVAL_S) == 0.0
        body = _scrape(port)
        assert _value(body, "gpusched_placement_degraded") == 0.0
        assert _value(body, 'gpusched_jobs{state="completed"}') == 1.0
        assert _value(body, "gpusched_placement_degradations_total") is not None
        assert not re.search(r'[{,]job="', body), "a `job` label becomes exported_job on scrape"
        assert "DCGM_FI_" not in body, "DCGM_FI_* names are dcgm-exporter's"
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
