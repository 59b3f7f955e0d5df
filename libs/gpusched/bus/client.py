"""The request/reply client of the control plane: what the CLI, the dashboard and the demo use
to send commands to admission and to read the quota ledger's standings.

Every command carries a client request id; sending the same command again (a retry after a
timeout) is safe: admission answers with the job it already created (`duplicate=True`).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from gpusched import telemetry
from gpusched.core.commands import CancelJob, Command, CommandReply, DrainNode, SetTeamQuota, SubmitJob
from gpusched.core.model import JobSpec, TeamQuota

from . import subjects
from .log import connect

#: Which subject answers which command.
COMMAND_SUBJECTS: dict[type[Command], str] = {
    SubmitJob: subjects.CMD_SUBMIT,
    CancelJob: subjects.CMD_CANCEL,
    SetTeamQuota: subjects.CMD_QUOTA,
    DrainNode: subjects.CMD_DRAIN,
}

_reply_decoder = msgspec.json.Decoder(CommandReply)


class ControlPlaneUnavailable(Exception):
    """Nobody answered: admission (or the quota ledger) is not running or not reachable."""


def new_request_id() -> str:
    return uuid.uuid4().hex


class Client:
    """Commands to admission over NATS request/reply. Use `async with Client.connect(url)`."""

    def __init__(self, nc: NATS, timeout: float = 5.0, owns_connection: bool = False):
        self.nc = nc
        self.timeout = timeout
        self._owns = owns_connection

    @classmethod
    async def connect(cls, url: str | None = None, timeout: float = 5.0, name: str = "gpusched-client") -> Client:
        return cls(await connect(url, name=name), timeout, owns_connection=True)

    async def close(self) -> None:
        if self._owns:
            await self.nc.drain()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def request_raw(self, subject: str, payload: bytes, timeout: float | None = None) -> bytes:
        try:
            msg = await self.nc.request(subject, payload, timeout=timeout or self.timeout,
                                        headers=telemetry.inject() or None)
        except NoRespondersError as err:
            raise ControlPlaneUnavailable(f"no service answers on {subject}: is `gpusched up` running?") from err
        except NatsTimeout as err:
            raise ControlPlaneUnavailable(f"no reply on {subject} within {timeout or self.timeout}s") from err
        return msg.data

    async def send(self, command: Command, timeout: float | None = None) -> CommandReply:
        """Send any command to its subject and return admission's reply."""
        data = await self.request_raw(COMMAND_SUBJECTS[type(command)], msgspec.json.encode(command), timeout)
        return _reply_decoder.decode(data)

    async def submit(self, spec: JobSpec, request_id: str | None = None) -> CommandReply:
        return await self.send(SubmitJob(request_id=request_id or new_request_id(), spec=spec))

    async def cancel(self, job_id: str, reason: str = "cancelled by user", request_id: str | None = None) -> CommandReply:
        return await self.send(CancelJob(request_id=request_id or new_request_id(), job_id=job_id, reason=reason))

    async def set_quota(self, team: str, quota: TeamQuota, request_id: str | None = None,
                        only: list[str] | None = None) -> CommandReply:
        """Set a team's quota; with `only`, change just those fields (the rest stay as they are)."""
        return await self.send(SetTeamQuota(request_id=request_id or new_request_id(), team=team, quota=quota,
                                            only=only or []))  # type: ignore[arg-type]

    async def drain(self, node: str, drain: bool = True, reason: str = "", request_id: str | None = None) -> CommandReply:
        return await self.send(DrainNode(request_id=request_id or new_request_id(), node=node, drain=drain,
                                         reason=reason))

    async def shares(self, timeout: float | None = None) -> dict[str, Any]:
        """The quota ledger's standings: `{"seq": ..., "at": ..., "teams": {team: {...}}}`."""
        return msgspec.json.decode(await self.request_raw(subjects.Q_SHARES, b"", timeout))
