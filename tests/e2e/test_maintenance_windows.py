"""A maintenance window through real admission and placement on NATS: `drain --at --until`
keeps a job whose time limit would run into the window off the node, lets one that ends before
it use the node, and the node takes work again once the window is over, with no further event."""

from __future__ import annotations

import time

from gpusched.core import events as ev

from .harness import harness  # noqa: F401


async def test_a_window_shapes_placement_and_ends_by_itself(harness):
    h = harness
    await h.scheduler(3, 8, "--tick-ms", "300")
    first, second, third = sorted((await h.sync()).nodes)
    c = h.client
    now = time.time()
    assert (await c.drain(first, at=now + 100, until=now + 200, reason="firmware")).ok
    assert "before it starts" in (await c.drain(first, at=now + 300, until=now + 200)).error
    assert "needs an end" in (await c.drain(first, at=now + 300)).error
    end = time.time() + 3.0
    assert (await c.drain(third, until=end, reason="reboot")).ok  # from now
    st = await h.wait_for("windows folded", lambda s: len(s.windows) == 2 and s)
    assert st.windows[first] == [(now + 100, now + 200)] and not st.nodes[first].drained

    long = await h.submit(team="a", gpus=8, time_limit_s=1000.0)
    st = await h.wait_for("long placed", lambda s: h.holding(long) and s)
    assert {g.split("/")[0] for g in st.jobs[long].gpus} == {second}  # crosses the first's window, inside the third's
    short = await h.submit(team="a", gpus=8, time_limit_s=50.0)
    st = await h.wait_for("short placed", lambda s: h.holding(short) and s)
    assert {g.split("/")[0] for g in st.jobs[short].gpus} == {first}  # ends before the window starts
    after = await h.submit(team="a", gpus=8)
    st = await h.wait_for("placed after the window", lambda s: h.holding(after) and s, timeout=15.0)
    assert {g.split("/")[0] for g in st.jobs[after].gpus} == {third}
    grant = next(e for e in h.events(ev.GpusGranted) if e.job_id == after)
    assert grant.at >= end
    assert len(h.events(ev.NodeDrained)) == 2  # the two windows: no event ended the third's
