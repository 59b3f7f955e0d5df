"""Admission while the log cannot take an append (a frozen server stands in for a JetStream
leader election): it retries with the same message id, so a submit succeeds exactly once; an
admission that runs out of patience says the log is unavailable, and the client's retry with
the same request id names the same job without doubling it."""

from __future__ import annotations

import asyncio
import signal

import msgspec

from gpusched.bus import subjects
from gpusched.bus.log import EventLog
from gpusched.core import events as ev
from gpusched.core.commands import SubmitJob
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.services.admission import Admission, AdmissionConfig
from gpusched.services.runtime import FoldedLog

FREEZE_S = 6.5  # longer than a JetStream publish's 5 s timeout: the first attempt fails


def _submit(request_id: str) -> tuple[str, bytes]:
    cmd = SubmitJob(request_id=request_id, spec=JobSpec(team="a", gpus=1))
    return subjects.command_subject("submit", "a", "alice"), msgspec.json.encode(cmd)


async def test_submit_survives_a_frozen_log(nats_server, nats_url):
    setup = await EventLog.open(nats_url, name="setup")
    await setup.append(ev.NodeRegistered(at=1.0, node="node00", rack="r0",
                                         gpus=[GpuInfo(index=i, uuid=f"u{i}") for i in range(2)]))
    folded = await FoldedLog.open(nats_url, name="adm")
    config = AdmissionConfig(auto_create_teams=True, placeholders="any")
    patient, impatient = Admission(folded, config), Admission(folded, config)
    impatient.append_patience_s = 0.5
    # patient enough for two publish timeouts past the freeze: with the default 10 s, a loaded
    # machine's reconnect after SIGCONT could lose the retry that spans it (a CI rehearsal)
    patient.append_patience_s = 30.0
    try:
        for _ in range(50):
            if "node00" in folded.state.nodes:
                break
            await asyncio.sleep(0.1)
        nats_server.proc.send_signal(signal.SIGSTOP)
        try:
            first = asyncio.create_task(patient.handle(*_submit("r-patient")))
            second = asyncio.create_task(impatient.handle(*_submit("r-impatient")))
            await asyncio.sleep(FREEZE_S)
        finally:
            nats_server.proc.send_signal(signal.SIGCONT)
        ok = await asyncio.wait_for(first, 15)
        assert ok.ok, ok.error
        refused = await asyncio.wait_for(second, 15)
        assert not refused.ok
        assert "event log unavailable" in refused.error and "same request id" in refused.error
        again = await impatient.handle(*_submit("r-impatient"))
        assert again.ok, again.error
        submitted: dict[str, list[str]] = {}
        async for rec in setup.records(1):
            if isinstance(rec.event, ev.JobSubmitted):
                submitted.setdefault(rec.event.request_id, []).append(rec.event.job_id)
        assert submitted == {"r-patient": [ok.job_id], "r-impatient": [again.job_id]}
    finally:
        await folded.close()
        await setup.close()
