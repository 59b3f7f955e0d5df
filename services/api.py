"""The HTTP API (`gpusched service run api`): gpusched for systems that do not speak NATS, with
the same identities, the same permissions and the same schemas (`schemas/openapi.json`).

Every call but `/healthz` and `/v1/openapi.json` names its caller: an identity of the keyring,
by an API token issued for it (`gpusched user token NAME`) or by a proof its own nkey signs over
this very request (`security/httpauth.py`). The API then does what that identity would do over
NATS, on the subject it would use there, and only when the server's permission table for that
identity (`authz.permissions`, the one the NATS server enforces) allows that subject: a tenant
submits to its own team, a platform to its teams (and on behalf of their users), an auditor
reads and submits nothing. Its own NATS identity (role `api`) may publish every command and read
subject, as the dashboard may: it is trusted to act only for the caller it authenticated.

    POST   /v1/jobs                  {"spec": JobSpec, "request_id"?, "on_behalf_of"?} -> 201 {"job_id"}
    DELETE /v1/jobs/{job_id}[?team=] cancel -> 200
    GET    /v1/jobs/{job_id}[?team=] the job, as `gpusched show --json` (through the reader)
    GET    /v1/jobs[?team=]          the caller's jobs, as `gpusched jobs --json` (through the reader)

`?team=` narrows a platform's call to one of its teams; without it a call acts for all of them,
as the CLI and `gpusched.client` do (the listing merged, the job looked up in each team, a cancel
sent for the job's own team).

A refusal is precise: 400 for a body that does not decode (msgspec's path to the bad field),
401 without a valid credential, 403 naming the subject the identity may not use, 422 with
admission's reason, 503 when the control plane does not answer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import msgspec
import structlog
from aiohttp import web

from gpusched.bus import subjects
from gpusched.bus.control_client import ControlPlaneUnavailable, new_request_id
from gpusched.bus.log import connect
from gpusched.bus.memory import subject_matches
from gpusched.core.commands import CancelJob, CommandReply, SubmitJob
from gpusched.openapi import SubmitRequest
from gpusched.security import authz, httpauth, keyring, signing
from gpusched.security.roles import no_such_job_among
from gpusched.services.runtime import notify_ready

log = structlog.get_logger()

REALM = "gpusched-api/v1"
MAX_BODY = 256 * 1024  # a JobSpec is bounded far below this (core/limits.py)


class Caller(msgspec.Struct, frozen=True):
    public_key: str
    principal: keyring.Principal


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"ok": False, "error": message}, status=status)


class Api:
    def __init__(self, nc, keys_path: str, tokens: httpauth.Tokens, timeout: float = 5.0):
        self.nc, self.tokens, self.timeout = nc, tokens, timeout
        self.keys = keyring.Followed(keys_path)  # an identity added or revoked counts at once
        self.verifier = signing.Verifier()

    def caller(self, request: web.Request, body: bytes) -> Caller | None:
        auth = request.headers.get("Authorization", "")
        ring = self.keys.current()
        if ring is None:  # no keyring (yet): nobody is known
            return None
        if auth.startswith("Bearer "):
            name = self.tokens.name_of(auth[7:].strip())
            found = ring.by_name(name) if name else None
            if found is None or found[1].revoked_at is not None:
                return None
            return Caller(found[0], found[1])
        if auth.startswith("Nkey "):
            digest = httpauth.request_digest(request.method, request.path_qs, body)
            proof = auth[5:].strip()
            who = httpauth.nkey_principal(proof, request.host, ring, self.verifier, REALM, digest)
            return None if who is None else Caller(proof.split(".", 1)[0], who)
        return None

    def permitted(self, caller: Caller, subject: str) -> bool:
        """What the NATS server would say to this identity publishing on `subject`."""
        allow = authz.permissions(caller.public_key, caller.principal)["publish"]["allow"]
        return any(subject_matches(pattern, subject) for pattern in allow)

    @staticmethod
    def teams_of(caller: Caller, team: str | None) -> list[str | None]:
        """The teams a call acts for: the one it names (`?team=`), else every team of a tenant or
        a platform; [None] for admin and auditors, whose subjects name no team."""
        p = caller.principal
        if p.role not in ("tenant", "platform"):
            return [None]
        return [team] if team else list(p.teams) or [None]

    @classmethod
    def team_of(cls, caller: Caller, team: str | None) -> str | None:
        """The one team a call acts for (a submit's spec names it; otherwise the caller's first)."""
        return cls.teams_of(caller, team)[0]

    async def find_job(self, caller: Caller, job_id: str, team: str | None) -> tuple[str | None, dict] | web.Response:
        """The first of the call's teams whose reader answers for `job_id`, with that answer (as
        `gpusched show --json`); else the last team's answer, its `error` saying no such job among
        them. A platform of several teams need not name one: admission takes a cancel only on the
        job's own team's subject."""
        found: tuple[str | None, dict] | None = None
        for t in self.teams_of(caller, team):
            data = await self.read(caller, "show", t, {"job_id": job_id})
            if isinstance(data, web.Response):
                return data
            found = (t, data)
            if "error" not in data:
                return found
        assert found is not None
        if found[0] is None:  # admin, auditors: the reader's own word
            return found
        p = caller.principal  # as the CLI says it
        return found[0], {**found[1], "error": no_such_job_among(p.name, p.role, p.teams, job_id)}

    def command_subject(self, caller: Caller, kind: str, team: str | None, on_behalf_of: str | None = None) -> str:
        """The subject the caller uses over NATS (`bus.control_client.Client.subject`): admin's form for
        admin, else the team form naming the caller (and, on behalf, the user)."""
        team = self.team_of(caller, team)
        if team is not None and on_behalf_of:
            return subjects.on_behalf_subject(team, caller.principal.name, on_behalf_of)
        return subjects.command_subject(kind, team, caller.principal.name if team else None)

    def read_subject(self, caller: Caller, kind: str, team: str | None) -> str:
        """The reader's subject the caller asks on over NATS: its team's for a tenant or a
        platform (`services/reader.py` scopes the answer by it), the unscoped one otherwise."""
        team = self.team_of(caller, team)
        return subjects.read_subject(kind, team, caller.principal.name if team else None)

    async def command(self, caller: Caller, subject: str, cmd, ok_status: int) -> web.Response:
        """Admission's reply as the answer: `ok_status`, or 422 with its reason."""
        out = await self.send(caller, subject, msgspec.json.encode(cmd))
        if isinstance(out, web.Response):
            return out
        return web.Response(body=out, status=ok_status if _reply.decode(out).ok else 422,
                            content_type="application/json")

    async def read(self, caller: Caller, kind: str, team: str | None, request: dict) -> dict | web.Response:
        """The reader's `data`, or the refusal as a response."""
        out = await self.send(caller, self.read_subject(caller, kind, team), msgspec.json.encode(request))
        if isinstance(out, web.Response):
            return out
        answer = msgspec.json.decode(out)
        if not answer.get("ok"):
            return _error(422, answer.get("error") or "the reader refused")
        return answer["data"]

    async def send(self, caller: Caller, subject: str, payload: bytes) -> bytes | web.Response:
        if not self.permitted(caller, subject):
            return _error(403, f"{caller.principal.name} (role {caller.principal.role}) may not publish {subject}")
        try:
            msg = await self.nc.request(subject, payload, timeout=self.timeout)
        except Exception as err:  # no responder, timeout: the control plane is not answering
            raise ControlPlaneUnavailable(f"no answer on {subject}: {type(err).__name__}") from None
        return msg.data


async def _body(request: web.Request) -> bytes:
    """The whole body, bounded by the app's `client_max_size` (413 past it, chunked or not)."""
    return await request.read()


def _authenticated(handler):
    async def wrapped(request: web.Request) -> web.StreamResponse:
        api: Api = request.app[API]
        body = await _body(request)
        caller = api.caller(request, body)
        if caller is None:
            return _error(401, "no valid credential: send `Authorization: Bearer TOKEN` "
                               "(gpusched user token NAME) or an nkey proof of this request")
        try:
            return await handler(request, api, caller, body)
        except ControlPlaneUnavailable as err:
            return _error(503, str(err))
    return wrapped


_reply = msgspec.json.Decoder(CommandReply)


@_authenticated
async def submit(request: web.Request, api: Api, caller: Caller, body: bytes) -> web.Response:
    try:
        req = msgspec.json.decode(body, type=SubmitRequest)
    except msgspec.ValidationError as err:
        return _error(400, f"invalid job: {err}")
    except msgspec.DecodeError as err:
        return _error(400, f"not JSON: {err}")
    subject = api.command_subject(caller, "submit", req.spec.team, req.on_behalf_of)
    return await api.command(caller, subject, SubmitJob(request_id=req.request_id or new_request_id(), spec=req.spec),
                             201)


@_authenticated
async def cancel(request: web.Request, api: Api, caller: Caller, body: bytes) -> web.Response:
    team = request.query.get("team")
    if len(api.teams_of(caller, team)) > 1:  # the job's own team (none of them: admission says why)
        found = await api.find_job(caller, request.match_info["job_id"], team)
        if isinstance(found, web.Response):
            return found
        team = found[0]
    subject = api.command_subject(caller, "cancel", team)
    cmd = CancelJob(request_id=new_request_id(), job_id=request.match_info["job_id"],
                    reason=request.query.get("reason", f"cancelled through the HTTP API by {caller.principal.name}"))
    return await api.command(caller, subject, cmd, 200)


@_authenticated
async def show(request: web.Request, api: Api, caller: Caller, body: bytes) -> web.Response:
    job_id = request.match_info["job_id"]
    found = await api.find_job(caller, job_id, request.query.get("team"))
    if isinstance(found, web.Response):
        return found
    if "error" in found[1]:  # another team's job answers exactly like one that does not exist
        return _error(404, found[1]["error"])
    return web.json_response(found[1])


@_authenticated
async def jobs(request: web.Request, api: Api, caller: Caller, body: bytes) -> web.Response:
    docs: list[dict] = []
    for team in api.teams_of(caller, request.query.get("team")):  # a platform's teams, merged
        data = await api.read(caller, "jobs", team, {})
        if isinstance(data, web.Response):
            return data
        docs += data["docs"]
    return web.json_response(sorted(docs, key=lambda d: (d["submitted_at"], d["job_id"])))


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def openapi(request: web.Request) -> web.Response:
    from gpusched import openapi as spec

    return web.Response(text=spec.render(), content_type="application/json")


API: web.AppKey[Api] = web.AppKey("api", Api)


def make_app(api: Api) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    app[API] = api
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/openapi.json", openapi)
    app.router.add_post("/v1/jobs", submit)
    app.router.add_delete("/v1/jobs/{job_id}", cancel)
    app.router.add_get("/v1/jobs/{job_id}", show)
    app.router.add_get("/v1/jobs", jobs)
    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1 only)")
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--keys", default=os.environ.get("GPUSCHED_KEYS"),
                        help="the keyring (keys.json; default $GPUSCHED_KEYS); API tokens are read beside it")


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    if not args.keys:
        raise SystemExit("gpusched api: no keyring: pass --keys DATA/trust/keys.json (or $GPUSCHED_KEYS)")
    nc = await connect(getattr(args, "nats", None), name="gpusched-api")
    api = Api(nc, args.keys, httpauth.Tokens(Path(args.keys).parent))
    runner = web.AppRunner(make_app(api), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    log.info("api_ready", url=f"http://{args.host}:{args.port}/v1/")
    notify_ready()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await nc.close()
