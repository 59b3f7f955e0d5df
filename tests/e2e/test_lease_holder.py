"""The placement lease is where only placement can write it. Before, it was a Redis key:
`SET gpusched:lease:placement attacker PX 120000` (anyone with the Redis password, which `ps`
showed) stopped placement and kept the fallback from taking over: an interactive job waited
over 85 s with 8 GPUs free. Now that key means nothing, and a tenant's forged lease in the NATS
bucket is refused by the server. Real admission and fallback processes, real NATS and Redis."""

from __future__ import annotations

import json

import pytest
import redis.asyncio as aioredis

from gpusched.bus import subjects
from gpusched.core import events as ev

from ..verdicts import Attacker
from .harness import LEASE_TTL_MS, harness  # noqa: F401


@pytest.fixture
def mallory(trust):
    """A tenant, added before the test's server starts (it renders the keyring)."""
    if trust.get("mallory") is None:
        trust.add("mallory", "tenant", teams=["a"])
    return trust.creds("mallory")


async def test_a_forged_placement_lease_does_not_stop_the_fallback(mallory, harness, redis_url):  # noqa: F811
    h = harness
    r = aioredis.Redis.from_url(redis_url)
    try:
        assert await r.set("gpusched:lease:placement", "placement@host:1:abcdef", px=120_000)  # the old attack
    finally:
        await r.aclose()
    lease = f"$KV.{subjects.LEASE_BUCKET}.placement"
    forged = json.dumps({"owner": "placement@evil:1:abcdef", "ttl_ms": 120_000}).encode()
    assert await Attacker(h.nats_url, str(mallory)).refused(lease, lambda nc: nc.request(lease, forged, timeout=5))
    h.start("admission")
    h.start("fallback", "--grace-ms", str(LEASE_TTL_MS))
    await h.ready("admission", "fallback")
    await h.nodes(1, 8)
    job = await h.submit(team="a", gpus=2, priority="interactive")
    await h.wait_for("placed by the fallback", lambda s: h.holding(job), timeout=10)
    assert h.state.jobs[job].placer == "naive" and h.state.placement_degraded
    assert "absent or lapsed" in h.events(ev.PlacementDegraded)[0].reason
