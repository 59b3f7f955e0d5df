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
from gpusched.core.commands import (
    CancelJob,
    Command,
    CommandReply,
    DrainNode,
    HoldJob,
    LabelNode,
    RestoreGpu,
    SetFoldSettings,
    SetMigGeometry,
    SetTeamQuota,
    SubmitJob,
    UpdateJob,
)
from gpusched.core.model import FoldSettings, JobSpec, TeamQuota

from . import connection, subjects
from .log import connect, identity_of

#: Which subject answers which command (admin's form; `Client.subject` adds team and user).
COMMAND_SUBJECTS: dict[type[Command], str] = {
    SubmitJob: subjects.CMD_SUBMIT,
    CancelJob: subjects.CMD_CANCEL,
    SetTeamQuota: subjects.CMD_QUOTA,
    SetFoldSettings: subjects.CMD_FOLD,
    DrainNode: subjects.CMD_DRAIN,
    RestoreGpu: subjects.CMD_RESTORE,
    HoldJob: subjects.CMD_HOLD,
    UpdateJob: subjects.CMD_UPDATE,
    LabelNode: subjects.CMD_LABEL,
    SetMigGeometry: subjects.CMD_MIG,
}
#: Roles that send commands in admin's form (any team): the dashboard acts for a logged-in admin.
ADMIN_FORM = ("admin", "dashboard")

_reply_decoder = msgspec.json.Decoder(CommandReply)


class ControlPlaneUnavailable(Exception):
    """Nobody answered: admission (or the quota ledger) is not running or not reachable."""


class NotPermitted(ControlPlaneUnavailable):
    """These credentials may not send this command (the server would refuse it too)."""


def new_request_id() -> str:
    return uuid.uuid4().hex


class Client:
    """Commands to admission over NATS request/reply. Use `async with Client.connect(url)`."""

    def __init__(self, nc: NATS, timeout: float = 5.0, owns_connection: bool = False, team: str | None = None):
        self.nc = nc
        self.timeout = timeout
        self._owns = owns_connection
        #: For a platform (several teams): the team its cancels act for (default: its first).
        self.team = team

    @classmethod
    async def connect(cls, url: str | None = None, timeout: float = 5.0, name: str = "gpusched-client",
                      creds: str | None = None, team: str | None = None) -> Client:
        return cls(await connect(url, name=name, creds=creds), timeout, owns_connection=True, team=team)

    def subject(self, command: Command, on_behalf_of: str | None = None, team: str | None = None) -> str:
        """Where this connection's identity may send the command: admin's form for admin (and
        the dashboard), else the tenant form naming the team and user the server allows;
        `on_behalf_of` (a platform's submit): the form naming the platform and that user; `team`:
        the one a platform's command about a job acts for (default `self.team`, else its first)."""
        if on_behalf_of is not None:
            return self._on_behalf(command, on_behalf_of)
        base = COMMAND_SUBJECTS[type(command)]
        ident = identity_of(self.nc)
        if ident is None or ident.role not in ("tenant", "platform"):
            return base if ident is None or ident.role not in ADMIN_FORM else f"{base}.{ident.name}"
        kind = base.rsplit(".", 1)[1]
        team = command.spec.team if isinstance(command, SubmitJob) else (team or self.team or ident.team)
        # the server would drop these silently (a permissions violation has no reply): say why now
        if kind not in subjects.TENANT_COMMANDS:
            raise NotPermitted(f"{type(command).__name__} needs the admin role; {ident.name} is a {ident.role}")
        if team not in ident.teams:
            raise NotPermitted(f"{ident.name} acts for team(s) {', '.join(ident.teams)}, not {team!r}")
        return subjects.command_subject(kind, team, ident.name)

    def _on_behalf(self, command: Command, user: str) -> str:
        from gpusched.security.identity import check_name

        ident = identity_of(self.nc)
        if not isinstance(command, SubmitJob) or ident is None or ident.role != "platform":
            who = "this connection" if ident is None else f"{ident.name} is a {ident.role}"
            raise NotPermitted(f"only a platform submits on behalf of a user ({who})")
        if command.spec.team not in ident.teams:
            raise NotPermitted(f"{ident.name} acts for team(s) {', '.join(ident.teams)}, not {command.spec.team!r}")
        return subjects.on_behalf_subject(command.spec.team, ident.name, check_name("user", user))

    async def close(self) -> None:
        if self._owns:
            await connection.close(self.nc)

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

    async def send(self, command: Command, timeout: float | None = None,
                   on_behalf_of: str | None = None, team: str | None = None) -> CommandReply:
        """Send any command to its subject and return admission's reply."""
        data = await self.request_raw(self.subject(command, on_behalf_of, team), msgspec.json.encode(command), timeout)
        return _reply_decoder.decode(data)

    async def submit(self, spec: JobSpec, request_id: str | None = None,
                     on_behalf_of: str | None = None) -> CommandReply:
        """`on_behalf_of`: a platform's submit for one of `spec.team`'s users (recorded as that
        user's job, `via` the platform)."""
        return await self.send(SubmitJob(request_id=request_id or new_request_id(), spec=spec),
                               on_behalf_of=on_behalf_of)

    async def hold(self, job_id: str, hold: bool = True, reason: str = "",
                   request_id: str | None = None) -> CommandReply:
        """Hold a pending job (`hold=False`: release it)."""
        return await self.send(HoldJob(request_id=request_id or new_request_id(), job_id=job_id, hold=hold,
                                       reason=reason))

    async def update(self, job_id: str, priority: str | None = None, time_limit_s: float | None = None,
                     request_id: str | None = None) -> CommandReply:
        """Change a pending job's priority class and/or time limit."""
        return await self.send(UpdateJob(request_id=request_id or new_request_id(), job_id=job_id,
                                         priority=priority, time_limit_s=time_limit_s))  # type: ignore[arg-type]

    async def label_node(self, node: str, labels: dict[str, str] | None = None, remove: list[str] | None = None,
                         request_id: str | None = None) -> CommandReply:
        """Set and/or remove labels of a node (admin)."""
        return await self.send(LabelNode(request_id=request_id or new_request_id(), node=node,
                                         labels=labels or {}, remove=remove or []))

    async def cancel(self, job_id: str, reason: str = "cancelled by user", request_id: str | None = None,
                     team: str | None = None) -> CommandReply:
        """`team`: the job's, for a platform of several teams (admission refuses a cancel sent for
        another of them)."""
        return await self.send(CancelJob(request_id=request_id or new_request_id(), job_id=job_id, reason=reason),
                               team=team)

    async def set_quota(self, team: str, quota: TeamQuota, request_id: str | None = None,
                        only: list[str] | None = None) -> CommandReply:
        """Set a team's quota; with `only`, change just those fields (the rest stay as they are)."""
        return await self.send(SetTeamQuota(request_id=request_id or new_request_id(), team=team, quota=quota,
                                            only=only or []))  # type: ignore[arg-type]

    async def set_fold_settings(self, settings: FoldSettings, reason: str = "",
                                request_id: str | None = None) -> CommandReply:
        """Admin: the fold's settings from now on (a `FoldSettingsSet` fact)."""
        return await self.send(SetFoldSettings(request_id=request_id or new_request_id(), settings=settings,
                                               reason=reason))

    async def set_mig_geometry(self, node: str, gpu: int, profiles: list[str], reason: str = "",
                               request_id: str | None = None) -> CommandReply:
        """Admin: GPU `gpu` of `node` in these MIG slices ([]: whole again), only while it is idle."""
        return await self.send(SetMigGeometry(request_id=request_id or new_request_id(), node=node, gpu=gpu,
                                              profiles=profiles, reason=reason))

    async def drain(self, node: str, drain: bool = True, reason: str = "", request_id: str | None = None,
                    at: float | None = None, until: float | None = None) -> CommandReply:
        """Drain (or undrain) `node`; with `until` (and `at`), a maintenance window instead."""
        return await self.send(DrainNode(request_id=request_id or new_request_id(), node=node, drain=drain,
                                         reason=reason, at=at, until=until))

    async def restore_gpu(self, gpu: str, reason: str = "", request_id: str | None = None) -> CommandReply:
        return await self.send(RestoreGpu(request_id=request_id or new_request_id(), gpu=gpu, reason=reason))

    async def shares(self, timeout: float | None = None) -> dict[str, Any]:
        """The quota ledger's standings: `{"seq": ..., "at": ..., "teams": {team: {...}}}`."""
        return msgspec.json.decode(await self.request_raw(subjects.Q_SHARES, b"", timeout))
