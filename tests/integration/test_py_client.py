"""`gpusched.client.Gpusched`, the typed client a platform imports: submit, watch the job's
lifecycle as an async iterator until it ends, cancel, show; a refusal raises with its reason."""

from __future__ import annotations

import asyncio

import pytest

from gpusched.bus.control_client import NotPermitted
from gpusched.client import Gpusched, Refused
from gpusched.core import events as ev
from gpusched.core.model import JobSpec

from ..e2e.harness import harness  # noqa: F401


async def test_submit_watch_cancel_show(harness):  # noqa: F811
    harness.start("admission")
    await harness.ready("admission")
    async with await Gpusched.connect(harness.nats_url) as g:
        job_id = await g.submit(JobSpec(team="ml", gpus=1, name="from-python"))
        seen: list[ev.Event] = []

        async def follow() -> None:
            async for event in g.watch(job_id):
                seen.append(event)

        watching = asyncio.ensure_future(follow())
        doc = await g.show(job_id)
        assert (doc["job_id"], doc["state"], doc["name"]) == (job_id, "pending", "from-python")
        await g.cancel(job_id)
        await asyncio.wait_for(watching, 15)  # it ends by itself with the job
        assert isinstance(seen[0], ev.JobSubmitted) and isinstance(seen[-1], ev.JobCancelled)
        assert all(e.job_id == job_id for e in seen)
        assert (await g.show(job_id))["state"] == "cancelled"
        with pytest.raises(Refused, match="gpus"):
            await g.submit(JobSpec(team="ml", gpus=100_000))


@pytest.fixture
def platform(trust, nats_server):
    """A platform acting for nlp and research, and a tenant of vision."""
    for name, role, teams in (("pc-ci", "platform", ["nlp", "research"]), ("pc-vic", "tenant", ["vision"])):
        if trust.get(name) is None:
            trust.add(name, role, teams=teams)
    nats_server.reload()
    return str(trust.creds("pc-ci")), str(trust.creds("pc-vic"))


async def test_a_platform_submits_for_its_users_and_follows_the_job_through_the_reader(harness, platform):  # noqa: F811
    ci, vic = platform
    harness.start("admission")
    harness.start("reader")
    await harness.ready("admission", "reader")
    async with await Gpusched.connect(harness.nats_url, creds=ci) as g:
        assert g.log is None  # a platform may not read the log: it reads through the reader
        job_id = await g.submit(JobSpec(team="nlp", gpus=1, name="for-dana"), on_behalf_of="dana")
        seen: list[ev.Event] = []

        async def follow() -> None:
            async for event in g.watch(job_id):
                seen.append(event)

        watching = asyncio.ensure_future(follow())
        doc = await g.show(job_id)
        assert (doc["job_id"], doc["user"], doc["via"], doc["team"]) == (job_id, "dana", "pc-ci", "nlp")  # both
        await g.cancel(job_id)
        await asyncio.wait_for(watching, 15)
        assert isinstance(seen[0], ev.JobSubmitted) and isinstance(seen[-1], ev.JobCancelled)
        assert (seen[0].user, seen[0].via) == ("dana", "pc-ci")  # the log records both
        with pytest.raises(NotPermitted, match="acts for team"):  # not one of its teams
            await g.submit(JobSpec(team="vision", gpus=1), on_behalf_of="dana")
        own = await g.submit(JobSpec(team="research", gpus=1))  # its own job: recorded as the platform's
        assert ((shown := await g.show(own))["user"], shown["via"]) == ("pc-ci", None)
        await g.cancel(own)  # its second team's job: sent for research, not for nlp (refused before)
        assert (await g.show(own))["state"] == "cancelled"
    async with await Gpusched.connect(harness.nats_url, creds=vic) as other:
        with pytest.raises(NotPermitted, match="only a platform"):
            await other.submit(JobSpec(team="vision", gpus=1), on_behalf_of="dana")
        with pytest.raises(KeyError):  # another team's job reads as no job at all
            await other.show(job_id)
