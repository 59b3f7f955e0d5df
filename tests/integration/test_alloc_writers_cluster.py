"""Every writer of the alloc tree appends with a compare-and-set, so that on a NATS cluster no
grant is stored after a change its writer never saw.

A clustered stream's leader checks `Nats-Expected-Last-Subject-Sequence` against the messages it
has applied. A plain append to the alloc tree that it has proposed and not yet applied is
invisible to that check: nats-server tracks in-flight messages by their literal subject, and the
check's subject is the wildcard `gpusched.evt.alloc.>`. So a plain cancel or registration could
be stored between a grant's view and the grant, and `replay --verify` found `reordered: decided
at alloc sequence 38, stored after 39` after the lab's heal (2 of 5 CI rehearsals). On a single
server the check and the store are one step, which is why only the cluster showed it.

On a real 3-server cluster at R3, admission's cancels go out at the same moment as another
writer's compare-and-sets (placement's path, `append_cas`), and node daemons register again after
`NodeLost` while that writer churns: the audit of the log must find no reordered fact, every
cancel and registration must land, and the leader's refusal while another check is in flight
(err_code 10164) must come back as a `Conflict`, not an error."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from nats.js.errors import APIError

from gpusched.bus import subjects
from gpusched.bus.cas import append_cas
from gpusched.bus.log import EventLog
from gpusched.bus.servers import seed_urls, start_nats_cluster
from gpusched.core import events as ev
from gpusched.core.commands import CancelJob, SubmitJob
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.security.audit import Audit
from gpusched.security.bootstrap import create_streams_sync
from gpusched.services.admission import Admission, AdmissionConfig
from gpusched.services.runtime import FoldedLog, cancel_tasks

from .node_helpers import Cluster

ROUND_S = 0.002  # between the churning writer's rounds
JOBS = 40


@pytest.fixture(scope="module")
def cluster_url(trust):
    servers = start_nats_cluster(3, trust=trust)
    try:
        url = seed_urls(servers)
        create_streams_sync(url, trust.creds("admin"), replicas=3)
        yield url
    finally:
        for server in servers:
            server.stop()


class Churn:
    """Another writer's compare-and-sets over the alloc tree, one every few milliseconds (a busy
    placement's rounds): a spare node drained and undrained, each against its own fold's view."""

    def __init__(self, folded: FoldedLog, node: str):
        self.folded, self.node, self.landed = folded, node, 0
        self.errors: list[str] = []  # refusals that were not a `Conflict` (the leader's "check in flight" was one)
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        drain = True
        while True:
            fact = ev.NodeDrained(at=time.time(), node=self.node, drain=drain, reason="churn")
            try:
                _, conflicted = await append_cas(self.folded, [fact])
            except APIError as err:
                self.errors.append(f"{err.err_code}: {err.description}")
                conflicted = True
            if not conflicted:
                drain, self.landed = not drain, self.landed + 1
            await asyncio.sleep(ROUND_S)

    async def stop(self) -> None:
        await cancel_tasks([self._task])


async def register(folded: FoldedLog, node: str) -> None:
    """A node for the other writer's facts (drained, undrained)."""
    fact = ev.NodeRegistered(at=time.time(), node=node, rack="r9", gpus=[GpuInfo(index=0, uuid=node)])
    assert (await append_cas(folded, [fact]))[0] == 1


async def start_churn(url: str, node: str) -> tuple[FoldedLog, Churn]:
    folded = await FoldedLog.open(url, name="churn")
    await register(folded, node)
    return folded, Churn(folded, node)


async def reordered(url: str, trust) -> list[str]:
    log = await EventLog.open(url, name="audit")
    try:
        audit = Audit(trust.ring())
        async for msg in log.raw():
            audit.feed(msg)
    finally:
        await log.close()
    return [f"seq {f.seq}: {f.detail}" for f in audit.findings if f.rule == "reordered"]


def command(kind: str, cmd) -> tuple[str, bytes]:
    return subjects.command_subject(kind, "a", "alice"), msgspec.json.encode(cmd)


async def test_admission_cancels_never_slip_under_another_writers_check(cluster_url, trust):
    """Each cancel goes out at the moment another writer's compare-and-set does, both writers
    caught up (on the old code a third of such pairs stored the compare-and-set after the cancel)."""
    churn = await FoldedLog.open(cluster_url, name="churn")
    await register(churn, "spare-a")
    adm_fold = await FoldedLog.open(cluster_url, name="adm")
    adm = Admission(adm_fold, AdmissionConfig(auto_create_teams=True, placeholders="any"))
    try:
        submitted = [await adm.handle(*command("submit", SubmitJob(request_id=f"s{i}", spec=JobSpec(team="a", gpus=1))))
                     for i in range(3 * JOBS)]
        assert all(r.ok for r in submitted), [r.error for r in submitted if not r.ok]
        cancels, landed = [], 0
        for i, job in enumerate(submitted):
            await churn.catch_up()
            await adm_fold.catch_up()
            drain = ev.NodeDrained(at=time.time(), node="spare-a", drain=i % 2 == 0, reason="churn")
            cancel = adm.handle(*command("cancel", CancelJob(request_id=f"c{job.job_id}", job_id=job.job_id)))
            cas = append_cas(churn, [drain])
            # Each writer starts first in every other pair: which one the leader stores first
            # then varies with the pair, not with how fast this machine runs one path (a CI
            # run whose cancels always went out first never tried the other order: 0 of 40).
            if i % 2:
                (appended, _), reply = await asyncio.gather(cas, cancel)
            else:
                reply, (appended, _) = await asyncio.gather(cancel, cas)
            cancels.append(reply)
            landed += appended
            if i + 1 >= JOBS and landed:
                break  # (up to 3 x JOBS pairs, until the other writer's compare-and-set won one)
        assert 0 < landed  # the other writer's compare-and-set won some pairs
    finally:
        await adm_fold.close()
        await churn.close()
    assert [r.error for r in cancels if not r.ok] == []
    assert await reordered(cluster_url, trust) == []


async def test_node_registrations_never_slip_under_another_writers_check(cluster_url, trust, tmp_path):
    folded, churn = await start_churn(cluster_url, "spare-b")
    names = ["rejoin-0", "rejoin-1"]
    try:
        async with Cluster(cluster_url, tmp_path) as c:
            await c.start_nodes(names, gpus=2, heartbeat_s=0.05, rejoin_heartbeats=1)  # registers as churn runs
            for _ in range(8):  # lost, and back at the next heartbeat (the lab's heal)
                for name in names:
                    lost = ev.NodeLost(at=time.time(), node=name, reason="test")
                    while (await append_cas(c.watch, [lost]))[1]:
                        pass
                await c.wait(lambda s: all(not s.nodes[n].lost for n in names), "nodes registered again")
            assert churn.landed > 0
    finally:
        await churn.stop()
        await folded.close()
    assert await reordered(cluster_url, trust) == []
    assert churn.errors == []
