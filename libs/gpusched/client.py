"""The typed Python client for platforms and scripts: submit a job, follow its lifecycle, cancel
it, read where it stands, with the schemas the bus uses (`JobSpec`, the events of
`gpusched.core.events`).

    from gpusched.client import Gpusched
    from gpusched.core.model import JobSpec

    async with await Gpusched.connect(creds="ci.nk") as g:
        job_id = await g.submit(JobSpec(team="nlp", gpus=8, command=["python", "train.py"]))
        async for event in g.watch(job_id):      # JobSubmitted, GpusGranted, JobStarted, ...
            print(type(event).__name__, event.at)
        print((await g.show(job_id))["state"])     # "completed", "failed", ...

Commands go to admission (`gpusched.bus.client.Client`, which puts them on the subject the
credentials may use); `watch` and `show` read the log, so they need an identity that may read it
(admin, auditor, the services: a tenant's or a platform's read permission is issue 29's open
part). A refusal raises `Refused` with admission's reason.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from .bus.client import Client
from .bus.log import EventLog
from .core.events import Event
from .core.model import JobSpec
from .core.state import TERMINAL, ClusterState


class Refused(Exception):
    """Admission said no; the message is its reason."""


class Gpusched:
    """One connection for commands and one for reading the log, as one identity."""

    def __init__(self, commands: Client, log: EventLog):
        self.commands, self.log = commands, log

    @classmethod
    async def connect(cls, url: str | None = None, creds: str | None = None, team: str | None = None,
                      timeout: float = 5.0) -> Gpusched:
        """`url`, `creds`: as everywhere (explicit > environment > the client config); `team`: a
        platform's team for commands that name none (cancel)."""
        commands = await Client.connect(url, timeout=timeout, creds=creds, team=team, name="gpusched-py")
        try:
            log = await EventLog.open(url, name="gpusched-py-read", creds=creds, signer=None)
        except BaseException:
            await commands.close()
            raise
        return cls(commands, log)

    async def close(self) -> None:
        await self.commands.close()
        await self.log.close()

    async def __aenter__(self) -> Gpusched:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def submit(self, spec: JobSpec, request_id: str | None = None) -> str:
        """The new job's id (the same id again for a repeated `request_id`)."""
        reply = await self.commands.submit(spec, request_id=request_id)
        if not reply.ok or reply.job_id is None:
            raise Refused(reply.error or "no job id in the reply")
        return reply.job_id

    async def cancel(self, job_id: str, reason: str = "cancelled by its platform") -> None:
        reply = await self.commands.cancel(job_id, reason=reason)
        if not reply.ok:
            raise Refused(reply.error)

    async def _fold(self) -> ClusterState:
        from .store import fold_log

        return await fold_log(self.log, None)

    async def show(self, job_id: str) -> dict[str, Any]:
        """The job's document, as `gpusched show --json` prints it under "job"; KeyError if the
        log holds no such job."""
        from . import readmodel

        state = await self._fold()
        return readmodel.job_doc(state, state.jobs[job_id])

    async def watch(self, job_id: str, start: int = 1) -> AsyncIterator[Event]:
        """The job's events in log order, from `start`, as they are appended; ends after the one
        that ends the job (completed, failed, cancelled, timeout)."""
        state = ClusterState()
        async for rec in self.log.records(start, follow=True):
            state.apply(rec.event, rec.seq, rec.time, rec.position)
            if getattr(rec.event, "job_id", None) != job_id:
                continue
            yield rec.event
            job = state.jobs.get(job_id)
            if job is not None and job.state in TERMINAL:
                return


__all__ = ["Gpusched", "Refused"]
