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

Commands go to admission (`gpusched.bus.control_client.Client`, which puts them on the subject the
credentials may use). `watch` and `show` read the log as admin (or an auditor); a tenant's or a
platform's credentials read through the reader service instead (`services/reader.py`), which
answers for their own teams' jobs only: the same documents and events. A refusal raises
`Refused` with admission's (or the reader's) reason.

A platform submits on behalf of one of its teams' users with `submit(spec, on_behalf_of="alice")`:
the job is alice's (`user`), and the log records the platform that sent it (`via`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from .bus.control_client import Client
from .bus.log import EventLog, identity_of
from .core.events import Event
from .core.model import JobSpec
from .core.state import TERMINAL, ClusterState


class Refused(Exception):
    """Admission said no; the message is its reason."""


#: How often `watch` asks the reader for a job's new events (tenants and platforms).
WATCH_POLL_S = 0.5


class Gpusched:
    """One connection for commands and one for reading (the log, or the reader), as one identity."""

    def __init__(self, commands: Client, log: EventLog | None):
        self.commands, self.log = commands, log

    @classmethod
    async def connect(cls, url: str | None = None, creds: str | None = None, team: str | None = None,
                      timeout: float = 5.0) -> Gpusched:
        """`url`, `creds`: as everywhere (explicit > environment > the client config); `team`: a
        platform's team for commands that name none (cancel; default: each job's own)."""
        commands = await Client.connect(url, timeout=timeout, creds=creds, team=team, name="gpusched-py")
        if self_scoped(commands):
            return cls(commands, None)
        try:
            log = await EventLog.open(url, name="gpusched-py-read", creds=creds, signer=None)
        except BaseException:
            await commands.close()
            raise
        return cls(commands, log)

    async def close(self) -> None:
        await self.commands.close()
        if self.log is not None:
            await self.log.close()

    async def __aenter__(self) -> Gpusched:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def submit(self, spec: JobSpec, request_id: str | None = None, on_behalf_of: str | None = None) -> str:
        """The new job's id (the same id again for a repeated `request_id`). `on_behalf_of`: a
        platform's user of `spec.team` whose job it is (a platform identity only)."""
        reply = await self.commands.submit(spec, request_id=request_id, on_behalf_of=on_behalf_of)
        if not reply.ok or reply.job_id is None:
            raise Refused(reply.error or "no job id in the reply")
        return reply.job_id

    async def cancel(self, job_id: str, reason: str = "cancelled by its platform") -> None:
        """A platform of several teams (and no `team` at connect) sends it for the job's own team,
        which the reader names; admission refuses one sent for another of them."""
        team = None
        ident = identity_of(self.commands.nc)
        if self.commands.team is None and ident is not None and ident.role == "platform" and len(ident.teams) > 1:
            try:
                team = (await self._read("show", {"job_id": job_id}))["job"]["team"]
            except KeyError:  # none of its teams' jobs: admission says why
                pass
        reply = await self.commands.cancel(job_id, reason=reason, team=team)
        if not reply.ok:
            raise Refused(reply.error)

    async def _fold(self) -> ClusterState:
        """The state folded from the log (callers read it only where the client has one)."""
        from .store import fold_log

        assert self.log is not None
        return await fold_log(self.log, None)

    async def _read(self, kind: str, request: dict[str, Any]) -> Any:
        """The reader's answer for this identity's first team that holds the job."""
        from .cli import scoped

        ident = identity_of(self.commands.nc)
        last: Exception | None = None
        for team in ident.teams:  # type: ignore[union-attr]
            try:
                data = await scoped.ask(self.commands.nc, ident, kind, team, request)  # type: ignore[arg-type]
            except scoped.ReadFailed as err:
                last = err
                continue
            if not (isinstance(data, dict) and "error" in data and "job" not in data):
                return data
            last = KeyError(data["error"])
        raise last if last is not None else KeyError(request.get("job_id"))

    async def show(self, job_id: str) -> dict[str, Any]:
        """The job's document, as `gpusched show --json` prints it under "job"; KeyError if the
        log holds no such job (or, for a tenant or platform, none of its teams' does)."""
        from . import readmodel

        if self.log is None:
            return (await self._read("show", {"job_id": job_id}))["job"]
        state = await self._fold()
        return readmodel.job_doc(state, state.jobs[job_id])

    async def watch(self, job_id: str, start: int = 1) -> AsyncIterator[Event]:
        """The job's events in log order, from `start`, as they are appended; ends after the one
        that ends the job (completed, failed, cancelled, timeout)."""
        if self.log is None:
            async for event in self._watch_read(job_id, start):
                yield event
            return
        state = ClusterState()
        async for rec in self.log.records(start, follow=True):
            state.apply(rec.event, rec.seq, rec.time, rec.position)
            if getattr(rec.event, "job_id", None) != job_id:
                continue
            yield rec.event
            job = state.jobs.get(job_id)
            if job is not None and job.state in TERMINAL:
                return


    async def _watch_read(self, job_id: str, start: int) -> AsyncIterator[Event]:
        """`watch` through the reader: its new events, polled, until the reader says it ended."""
        from .core.events import decode_event

        after = start - 1
        while True:
            data = await self._read("events", {"job_id": job_id, "after": after})
            for seq, raw in data["events"]:
                after = seq
                yield decode_event(raw.encode())
            if data["ended"] and not data["events"]:
                return
            if not data["ended"]:
                await asyncio.sleep(WATCH_POLL_S)


def self_scoped(commands: Client) -> bool:
    """Whether this identity reads through the reader (a tenant or platform)."""
    ident = identity_of(commands.nc)
    return ident is not None and ident.role in ("tenant", "platform")


__all__ = ["Gpusched", "Refused"]
