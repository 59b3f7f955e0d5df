"""The fallback goes by who holds the placement lease, not by whether the key exists. Before,
`SET gpusched:lease:placement attacker PX 120000` (anyone with the Redis password, which `ps`
showed) stopped placement and kept the fallback from taking over: an interactive job waited
over 85 s with 8 GPUs free. Real admission and fallback processes, a real Redis."""

from __future__ import annotations

import redis.asyncio as aioredis

from gpusched.services.lease import PLACEMENT_LEASE_KEY

from .harness import LEASE_TTL_MS, harness  # noqa: F401


async def test_a_lease_key_written_by_no_placement_does_not_stop_the_fallback(harness, redis_url):  # noqa: F811
    h = harness
    r = aioredis.Redis.from_url(redis_url)
    try:
        for forged in ("attacker", "placement@evil", "placement@host:1:zzzzzz\n"):
            assert await r.set(PLACEMENT_LEASE_KEY, forged, px=120_000)
        h.start("admission")
        h.start("fallback", "--grace-ms", str(LEASE_TTL_MS))
        await h.ready("admission", "fallback")
        await h.nodes(1, 8)
        job = await h.submit(team="a", gpus=2, priority="interactive")
        await h.wait_for("placed by the fallback", lambda s: h.holding(job), timeout=10)
        assert h.state.jobs[job].placer == "naive" and h.state.placement_degraded
        assert await r.get(PLACEMENT_LEASE_KEY) == b"placement@host:1:zzzzzz\n"  # it took nothing over
    finally:
        await r.aclose()
    assert "placement_lease_foreign_holder" in h.service_log("fallback")
