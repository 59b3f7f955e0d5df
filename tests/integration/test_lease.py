"""The placement lease in the NATS key-value bucket, through a real nats-server with auth on.

Before, the lease was a Redis key: anyone with the one Redis password (which `ps` showed) ran
`SET gpusched:lease:placement attacker PX 120000` and placement stopped. Now only placement's
credential may write its key; a tenant, a node, another service, the fallback (for placement's
key) and no credential at all cannot forge, delete or purge it. Expiry goes by the key's revision
standing still, timed by the observer: no host's wall clock decides it.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from nats.errors import Error as NatsError
from nats.js.kv import KeyValue

from gpusched.bus import subjects
from gpusched.bus.log import connect
from gpusched.services.lease import PLACEMENT_LEASE_KEY, Lease, Watch, open_bucket, owner_id

from ..verdicts import Attacker

TTL_MS = 400
ATTACKERS = {"alice": ("tenant", ["nlp"], None), "gpu01": ("node", [], "node01")}


@pytest.fixture(scope="module")
def creds(trust):
    for name, (role, teams, node) in ATTACKERS.items():
        if trust.get(name) is None:
            trust.add(name, role, teams=teams, node=node)
    return lambda name: str(trust.creds(name))


async def bucket_as(url: str, creds: str | None):
    nc = await connect(url, name="lease-test", creds=creds)
    return nc, await open_bucket(nc)


def raw_bucket(nc) -> KeyValue:
    """The bucket without asking for its info first (an attacker needs no permission for that):
    writes go straight to the key's subject."""
    return KeyValue(name=subjects.LEASE_BUCKET, stream=subjects.LEASE_STREAM, pre=f"$KV.{subjects.LEASE_BUCKET}.",
                    js=nc.jetstream(timeout=0.5), direct=True)


async def test_a_lease_is_taken_renewed_kept_from_others_and_taken_over_once_it_stands_still(nats_url, creds):
    nc1, kv1 = await bucket_as(nats_url, creds("placement"))
    nc2, kv2 = await bucket_as(nats_url, creds("placement"))
    try:
        one = Lease(kv1, PLACEMENT_LEASE_KEY, owner_id("placement"), TTL_MS)
        two = Lease(kv2, PLACEMENT_LEASE_KEY, owner_id("placement"), TTL_MS)
        assert await one.tick() and not await two.tick()
        for _ in range(6):  # renewed well inside its TTL: the other never gets it
            await asyncio.sleep(TTL_MS / 3000)
            assert await one.tick() and not await two.tick()
        assert await Watch(kv2, PLACEMENT_LEASE_KEY, TTL_MS).holder() == one.owner

        stopped = time.monotonic()  # one stops renewing (as if killed): its key stays, its revision stands still
        while not await two.tick():
            await asyncio.sleep(0.02)
        took = time.monotonic() - stopped
        assert TTL_MS / 1000 <= took < TTL_MS / 1000 + 0.5, took
        assert not one.held  # its belief ran out before the other took it
        assert not await one.tick() and one.revision is None  # a compare-and-set on the old revision fails
        assert await Watch(kv1, PLACEMENT_LEASE_KEY, TTL_MS).holder() == two.owner

        await two.release()  # an orderly stop hands it over at once
        assert await one.tick()
    finally:
        await nc1.close()
        await nc2.close()


@pytest.mark.parametrize("who", ["alice", "gpu01", "admission", "fallback", "dashboard"])
async def test_no_other_credential_can_forge_delete_or_purge_the_placement_lease(who, nats_url, creds):
    holder_nc, kv = await bucket_as(nats_url, creds("placement"))
    try:
        lease = Lease(kv, PLACEMENT_LEASE_KEY, owner_id("placement"), 60_000)
        assert await lease.tick()
        forged = json.dumps({"owner": "placement@evil:1:abcdef", "ttl_ms": 120_000}).encode()
        key = f"$KV.{subjects.LEASE_BUCKET}.{PLACEMENT_LEASE_KEY}"
        attempts = {
            "put": (key, lambda b, nc: b.put(PLACEMENT_LEASE_KEY, forged)),
            "update": (key, lambda b, nc: b.update(PLACEMENT_LEASE_KEY, forged, last=lease.revision)),
            "delete": (key, lambda b, nc: b.delete(PLACEMENT_LEASE_KEY)),
            "purge": (key, lambda b, nc: b.purge(PLACEMENT_LEASE_KEY)),
            "read by body": (f"$JS.API.DIRECT.GET.{subjects.LEASE_STREAM}",
                             lambda b, nc: nc.request(f"$JS.API.DIRECT.GET.{subjects.LEASE_STREAM}",
                                                      b'{"last_by_subj": "%s"}' % key.encode(), timeout=5)),
        }
        for api in ("PURGE", "DELETE", "MSG.DELETE", "UPDATE"):
            subject = f"$JS.API.STREAM.{api}.{subjects.LEASE_STREAM}"
            attempts[api] = (subject, lambda b, nc, s=subject: nc.request(s, b"{}", timeout=5))
        attacker = Attacker(nats_url, creds(who))
        allowed = [name for name, (subject, act) in attempts.items()
                   if not await attacker.refused(subject, lambda nc, act=act: act(raw_bucket(nc), nc))]
        assert allowed == []
        assert await Watch(kv, PLACEMENT_LEASE_KEY, 60_000).holder() == lease.owner
        assert await lease.tick() and (await kv.get(PLACEMENT_LEASE_KEY)).revision == lease.revision
    finally:
        await holder_nc.close()


async def test_without_a_credential_there_is_no_connection_at_all(nats_url, monkeypatch):
    monkeypatch.delenv("GPUSCHED_CREDS")
    with pytest.raises((PermissionError, NatsError, OSError)):
        await connect(nats_url, name="nobody", max_reconnect_attempts=0, allow_reconnect=False)
