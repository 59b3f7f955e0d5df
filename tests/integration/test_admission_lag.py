"""Admission never refuses on a fold that lags the log: before a refusal it folds the log up
to its head and decides again, so a node registered a moment ago (or a job just submitted) is
found even when admission's fold is behind (starved of CPU, catching up after a restart)."""

from __future__ import annotations

import asyncio

import msgspec

from gpusched.bus import subjects
from gpusched.bus.log import EventLog
from gpusched.core import events as ev
from gpusched.core.commands import LabelNode
from gpusched.core.model import GpuInfo
from gpusched.services.admission import Admission, AdmissionConfig
from gpusched.services.runtime import FoldedLog


async def test_a_refusal_is_decided_on_the_log_as_of_the_command(nats_url):
    setup = await EventLog.open(nats_url, name="setup")
    folded = await FoldedLog.open(nats_url, name="adm")
    admission = Admission(folded, AdmissionConfig(auto_create_teams=True, placeholders="any"))
    subject = subjects.command_subject("label")  # admin's

    def label(request_id: str) -> bytes:
        return msgspec.json.encode(LabelNode(request_id=request_id, node="node00", labels={"zone": "b"}))

    resumed: list[asyncio.Task] = []
    try:
        refused = await admission.handle(subject, label("r-1"))
        assert refused.error == "unknown node 'node00'"  # no such node yet: refused, rightly
        await folded.stop()  # the fold lags from here ...
        await setup.append(ev.NodeRegistered(at=1.0, node="node00", rack="r0",
                                             gpus=[GpuInfo(index=i, uuid=f"u{i}") for i in range(2)]))

        async def read_on_later() -> None:  # ... and reads on half a second later
            await asyncio.sleep(0.5)
            resumed.append(asyncio.create_task(folded._follow(0)))

        later = asyncio.create_task(read_on_later())
        reply = await admission.handle(subject, label("r-2"))
        await later
        assert reply.ok, reply.error
        await folded.wait_seq(reply.seq)
        assert folded.state.nodes["node00"].labels == {"zone": "b"}
    finally:
        for task in resumed:
            task.cancel()
        await folded.log.close()
        await setup.close()
