"""`gpusched.client.Gpusched`, the typed client a platform imports: submit, watch the job's
lifecycle as an async iterator until it ends, cancel, show; a refusal raises with its reason."""

from __future__ import annotations

import asyncio

import pytest

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
