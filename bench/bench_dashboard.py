"""The dashboard at 1,000 nodes x 8 GPUs: bytes and time per update, whole model vs delta.

A log with N simulated nodes (as `up --nodes` registers them), 240 running 8-GPU jobs and a
queue; then `--updates` grants, one at a time. Per update it measures, in the same run:
- server: the whole model (what every page got on every update before deltas) against the delta
  (`services/dashboard/delta.py`): bytes, and the time to build it (model + diff + encode);
- browser (Chromium via Playwright, skip with `--no-browser`): the page's load (navigation to all
  cells drawn), a whole render (what each update cost the page before) against applying a delta.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import deque

import msgspec

from gpusched import readmodel
from gpusched.bus.log import EventLog
from gpusched.bus.servers import free_port, start_nats
from gpusched.cli.stack import simulated_nodes
from gpusched.core import events as ev
from gpusched.core.model import JobSpec, TeamQuota
from gpusched.core.state import ClusterState
from gpusched.services.dashboard.app import Series, page_model
from gpusched.services.dashboard.delta import Versions

T0 = time.time() - 600


def cluster(nodes: int) -> list[ev.Event]:
    out: list[ev.Event] = list(simulated_nodes(nodes, 8, 4, "quads", at=T0))
    out.append(ev.TeamQuotaSet(at=T0, team="vision", quota=TeamQuota(guaranteed=nodes * 2)))
    for i in range(min(240, nodes // 2)):
        out.append(ev.JobSubmitted(at=T0 + 1, job_id=f"run-{i}", spec=JobSpec(team="vision", gpus=8)))
        out.append(ev.GpusGranted(at=T0 + 2, job_id=f"run-{i}", attempt=1, gpus=[f"node{2 * i:03d}/{g}" for g in range(8)]))
    out += [ev.JobSubmitted(at=T0 + 3, job_id=f"wait-{i}", spec=JobSpec(team="nlp", gpus=64)) for i in range(20)]
    return out


def grant(i: int, nodes: int) -> list[ev.Event]:
    node = nodes - 1 - 2 * i
    return [ev.JobSubmitted(at=T0 + 100 + i, job_id=f"new-{i}", spec=JobSpec(team="speech", gpus=8)),
            ev.GpusGranted(at=T0 + 100 + i, job_id=f"new-{i}", attempt=1, gpus=[f"node{node:03d}/{g}" for g in range(8)])]


def server_side(nodes: int, updates: int) -> None:
    state, tail, series = ClusterState(), deque(maxlen=120), Series()
    seq = 0

    def feed(events):
        nonlocal seq
        for e in events:
            seq += 1
            state.apply(e, seq)
            tail.append(readmodel.event_line(seq, e))
            series.observe(state)

    feed(cluster(nodes))
    versions = Versions()
    versions.publish(page_model(state, seq, {}, list(series.points), list(tail)))
    full_b, delta_b, full_s, delta_s = [], [], [], []
    for i in range(updates):
        feed(grant(i, nodes))
        t = time.perf_counter()
        model = page_model(state, seq, {}, list(series.points), list(tail))
        versions.publish(model)
        delta_s.append(time.perf_counter() - t)
        delta_b.append(len(versions.deltas[-1][2]))
        t = time.perf_counter()
        whole = msgspec.json.encode(page_model(state, seq, {}, list(series.points), list(tail)))
        full_s.append(time.perf_counter() - t)
        full_b.append(len(whole))
    fb, db = statistics.median(full_b), statistics.median(delta_b)
    fs, ds = statistics.median(full_s), statistics.median(delta_s)
    print(f"{nodes} nodes x 8 GPUs, {updates} updates (one grant each), medians:")
    print(f"bytes per update: whole model {fb / 1e6:.2f} MB (before), delta {db / 1e3:.1f} kB (after); "
          f"ratio {db / fb:.4f} ({fb / db:.0f}x fewer); whole model gzipped for a load: {len(versions.gzipped()) / 1e3:.0f} kB")
    print(f"server time per update: whole model build+encode {fs * 1000:.0f} ms; build+diff+encode {ds * 1000:.0f} ms; "
          f"ratio {ds / fs:.2f}")


async def browser_side(nodes: int, updates: int) -> None:
    from playwright.async_api import async_playwright

    from gpusched.services import dashboard
    from gpusched.services.dashboard.guard import Guard

    server = start_nats()
    stop = asyncio.Event()
    try:
        log = await EventLog.open(server.url, name="bench-dashboard")
        events = cluster(nodes)
        for i in range(0, len(events), 500):
            await log.append_batch(events[i:i + 500])
        port, ready = free_port(), asyncio.Event()
        task = asyncio.create_task(dashboard.run(server.url, None, "127.0.0.1", port, stop, ready,
                                                 guard=Guard("bench", port)))
        await asyncio.wait_for(ready.wait(), 60)
        async with async_playwright() as pw:
            import shutil
            b = await pw.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium",
                                         args=["--headless", "--no-sandbox", "--disable-gpu"], headless=True)
            page = await b.new_page(viewport={"width": 1920, "height": 1080})
            t = time.perf_counter()
            await page.goto(f"http://127.0.0.1:{port}/?token=bench")
            await page.wait_for_function(f"() => document.querySelectorAll('#cluster .gpu').length === {nodes * 8}",
                                         timeout=60_000)
            load = time.perf_counter() - t
            full_ms = (await page.evaluate("window.gpuschedStats"))["fullRenderMs"]
            delta_ms, latency = [], []
            for i in range(updates):
                t = time.perf_counter()
                await log.append_batch(grant(i, nodes))
                node = nodes - 1 - 2 * i
                await page.wait_for_selector(f'.gpu[data-gpu="node{node:03d}/7"][data-job="new-{i}"]', timeout=10_000)
                latency.append(time.perf_counter() - t)
                delta_ms.append((await page.evaluate("window.gpuschedStats"))["lastDeltaMs"])
            await b.close()
        dm = statistics.median(delta_ms)
        print(f"browser: load {load:.2f} s (all {nodes * 8} cells drawn); whole render {full_ms:.0f} ms (before: every update); "
              f"delta apply+render {dm:.1f} ms (after); ratio {dm / full_ms:.3f}; grant to page p50 "
              f"{statistics.median(latency) * 1000:.0f} ms, max {max(latency) * 1000:.0f} ms")
        stop.set()
        await asyncio.wait_for(task, 15)
        await log.close()
    finally:
        stop.set()
        server.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000, help="simulated 8-GPU nodes")
    ap.add_argument("--updates", type=int, default=10, help="grants measured")
    ap.add_argument("--no-browser", action="store_true", help="server side only")
    a = ap.parse_args()
    server_side(a.nodes, a.updates)
    if not a.no_browser:
        asyncio.run(browser_side(a.nodes, a.updates))
