"""The dashboard in a real browser: it loads, reflects a new grant within 2 s, and its controls
reach the control plane (a submit through admission, placement stop through the supervisor's
control subject). A screenshot lands in tests/artifacts/dashboard.png."""

from __future__ import annotations

import argparse
import asyncio
import time

import pytest

from gpusched.bus.log import EventLog
from gpusched.bus.servers import free_port
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec, TeamQuota
from gpusched.services import dashboard
from gpusched.services.dashboard import control
from gpusched.services.dashboard.guard import Guard

pytestmark = pytest.mark.browser


T0 = time.time() - 300  # the log's clock: five minutes of history before the test acts


def _cluster() -> list[ev.Event]:
    out: list[ev.Event] = []
    for i in range(4):
        gpus = [GpuInfo(index=g, uuid=f"u{i}-{g}", model="SIM-H100", nvlink_domain=g // 4) for g in range(8)]
        out.append(ev.NodeRegistered(at=T0 + 30, node=f"node-{i:03d}", rack=f"rack-{i // 2:02d}", gpus=gpus))
    out += [
        ev.TeamQuotaSet(at=T0 + 30, team="vision", quota=TeamQuota(guaranteed=12, limit=24)),
        ev.TeamQuotaSet(at=T0 + 30, team="nlp", quota=TeamQuota(guaranteed=12, limit=24)),
        ev.TeamQuotaSet(at=T0 + 30, team="interactive", quota=TeamQuota(guaranteed=8, limit=16)),
        ev.JobSubmitted(at=T0 + 60, job_id="train-a", spec=JobSpec(team="vision", gpus=8, preemptible=True)),
        ev.GpusGranted(at=T0 + 75, job_id="train-a", attempt=1, gpus=[f"node-000/{g}" for g in range(8)], level="nvlink"),
        ev.JobSubmitted(at=T0 + 90, job_id="train-b", spec=JobSpec(team="nlp", gpus=4)),
        ev.GpusGranted(at=T0 + 105, job_id="train-b", attempt=1, gpus=[f"node-002/{g}" for g in range(4)], level="nvlink"),
        ev.JobSubmitted(at=T0 + 120, job_id="big", spec=JobSpec(team="nlp", gpus=32)),
        ev.JobPending(at=T0 + 120, job_id="big", reason="waiting for 32 free GPUs", blockers=["train-a", "train-b"]),
    ]
    return out


async def test_dashboard_live_and_controls(nats_url, browser, artifacts):
    log = await EventLog.open(nats_url, name="test")
    for e in _cluster():
        await log.append(e)

    stop = asyncio.Event()
    # the real admission service answers the page's submit
    from gpusched.services import admission

    adm = asyncio.create_task(admission.serve(argparse.Namespace(nats=nats_url, redis=None, auto_create_teams=True, placeholders="bounded"), stop))
    # the supervisor's side of the placement control (what `gpusched up` wires to its child)
    actions: list[str] = []
    await control.serve_controls(log.nc, {"placement": lambda a: actions.append(a) or a != "stop"})

    port = free_port()
    ready = asyncio.Event()
    guard = Guard("test-login-token", port)
    dash = asyncio.create_task(dashboard.run(nats_url, None, "127.0.0.1", port, stop, ready, guard=guard))
    await asyncio.wait_for(ready.wait(), 15)
    page = await browser.new_page(viewport={"width": 1500, "height": 900})
    try:
        await page.goto(f"http://127.0.0.1:{port}/?token=test-login-token")  # as `gpusched up` prints it
        assert page.url == f"http://127.0.0.1:{port}/"  # the token leaves the address bar for a cookie
        await page.wait_for_selector('.gpu[data-gpu="node-000/0"][data-job="train-a"]', timeout=10_000)
        assert await page.locator(".gpu").count() == 32
        assert "waiting for 32 free GPUs" in await page.locator("#queue").inner_text()

        # a new grant shows within 2 s
        await log.append(ev.JobSubmitted(at=T0 + 150, job_id="fresh", spec=JobSpec(team="vision", gpus=2)))
        t0 = time.monotonic()
        await log.append(ev.GpusGranted(at=T0 + 165, job_id="fresh", attempt=1, gpus=["node-001/0", "node-001/1"], level="nvlink"))
        await page.wait_for_selector('.gpu[data-gpu="node-001/1"][data-job="fresh"]', timeout=2_000)
        assert time.monotonic() - t0 < 2.0

        # hovering a GPU shows its job
        await page.hover('.gpu[data-gpu="node-000/3"]')
        tip = await page.locator("#tooltip").inner_text()
        assert "train-a" in tip and "vision" in tip

        # control: submit a job through admission; it appears in the queue
        await page.fill("#submit-team", "nlp")
        await page.fill("#submit-gpus", "3")
        await page.click("#submit-button")
        await page.wait_for_function(
            "() => document.querySelector('#toast').textContent.startsWith('submitted')", timeout=5_000)
        await page.wait_for_function(
            "() => [...document.querySelectorAll('#queue tr[data-job]')].length >= 2", timeout=3_000)

        # control: stop placement through the supervisor's control subject
        await page.click("#placement-stop")
        await page.wait_for_function(
            "() => document.querySelector('#toast').textContent === 'placement stopped'", timeout=5_000)
        assert actions == ["stop"]

        # the degraded flag shows
        await log.append(ev.PlacementDegraded(at=T0 + 180, reason="placement lease lapsed"))
        await page.wait_for_function(
            "() => document.querySelector('#placement-badge').dataset.state === 'degraded'", timeout=2_000)
        await page.mouse.move(5, 5)
        await page.wait_for_timeout(300)
        await page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)
    finally:
        await page.close()
        stop.set()
        await asyncio.wait_for(asyncio.gather(dash, adm, return_exceptions=True), 15)
        await log.close()
