"""`schemas/openapi.json`: the HTTP API (`services/api.py`) for integrators that do not speak
NATS, generated from the same msgspec types as the bus schemas (`gpusched schemas` writes it,
the drift test covers it; the API serves it at `/v1/openapi.json`)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from .core import schemas
from .core.commands import CommandReply
from .core.model import SCHEMA_VERSION, JobSpec
from .core.schemas import _clean

FILE = "openapi.json"


class SubmitRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/jobs`: the job; `request_id`, an idempotency key (the same id again returns the
    same job); `on_behalf_of`, a platform's submit for one of its team's users (recorded as that
    user's job, sent via the platform)."""

    spec: JobSpec
    request_id: str | None = None
    on_behalf_of: str | None = None


class Error(msgspec.Struct, frozen=True):
    """Any refusal: `error` says why (the field msgspec could not decode, the subject the
    identity may not use, admission's reason)."""

    ok: bool
    error: str


def _json(ref: str) -> dict:
    return {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}}


def _answers(ok: tuple[str, str, str], *errors: tuple[str, str]) -> dict:
    status, what, ref = ok
    return {status: {"description": what, **_json(ref)}, **_refusals(*errors)}


def _refusals(*errors: tuple[str, str]) -> dict:
    return {code: {"description": why, **_json("Error")} for code, why in (("401", "no valid credential"), *errors)}


def document() -> dict:
    _, components = msgspec.json.schema_components([SubmitRequest, CommandReply, Error],
                                                        ref_template="#/components/schemas/{name}")
    job_doc = {"type": "object", "description": "a job's document, as `gpusched jobs --json` prints each "
                                                "(state, attempt, GPUs, team, user, times; `via`: the platform "
                                                "that submitted it on behalf of `user`, null if none)"}
    show_doc = {"type": "object", "description": "as `gpusched show JOB --json`: `job` (its document), `history` "
                                                 "(its facts), `why_pending` / `preemptions` (the scheduler's reasons)"}
    team = {"name": "team", "in": "query", "required": False, "schema": {"type": "string"},
            "description": "only this one of the caller's teams (default: all of them; a platform of several "
                           "need not name one)"}
    job_id = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
    refused = ("403", "the identity may not use the subject this call needs (the NATS server's permissions)")
    down = ("503", "the control plane does not answer")
    paths = {
        "/v1/jobs": {
            "post": {"summary": "submit a job", "operationId": "submitJob",
                     "requestBody": {"required": True, **_json("SubmitRequest")},
                     "responses": _answers(("201", "accepted: the job's id", "CommandReply"),
                                           ("400", "the body does not decode as a SubmitRequest"), refused,
                                           ("422", "admission refused it (its reason)"), down)},
            "get": {"summary": "the caller's jobs: its teams' (a tenant's, a platform's), every team's (admin, "
                               "auditors), through the reader service", "operationId": "listJobs", "parameters": [team],
                    "responses": {"200": {"description": "job documents", "content": {"application/json": {
                        "schema": {"type": "array", "items": job_doc}}}},
                        **_refusals(refused, ("422", "the reader refused the request"), down)}},
        },
        "/v1/jobs/{job_id}": {
            "get": {"summary": "one job, as `gpusched show` (another team's job answers 404, as one that does not "
                               "exist)", "operationId": "showJob", "parameters": [job_id, team],
                    "responses": {"200": {"description": "the job", "content": {"application/json": {"schema": show_doc}}},
                                  **_refusals(refused, ("404", "no such job among the caller's teams' jobs"), down)}},
            "delete": {"summary": "cancel a job", "operationId": "cancelJob",
                       "parameters": [job_id, team, {"name": "reason", "in": "query", "required": False,
                                                     "schema": {"type": "string"}}],
                       "responses": _answers(("200", "cancelled", "CommandReply"), refused,
                                             ("422", "admission refused it"), down)},
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "gpusched HTTP API", "version": f"{SCHEMA_VERSION}",
                 "description": "gpusched for systems that do not speak NATS: the same identities, permissions and "
                                "schemas as the bus (asyncapi.json). Authenticate with `Authorization: Bearer TOKEN` "
                                "(`gpusched user token NAME`) or an nkey proof of the request "
                                "(`gpusched.security.httpauth`). Generated by `gpusched schemas`."},
        "servers": [{"url": "http://127.0.0.1:8081", "description": "`gpusched service run api`"}],
        "security": [{"token": []}, {"nkey": []}],
        "paths": paths,
        "components": {"schemas": _clean(components),
                       "securitySchemes": {
                           "token": {"type": "http", "scheme": "bearer",
                                     "description": "an API token `gpusched user token NAME` issued for an identity"},
                           "nkey": {"type": "apiKey", "in": "header", "name": "Authorization",
                                    "description": "`Nkey PUBKEY.UNIXTIME.SIG`: the identity's nkey signs "
                                                   "`gpusched-api/v1`, the Host, the time and the SHA-256 of "
                                                   "`METHOD PATH?QUERY` and the body (httpauth.request_digest)"}}},
    }


def render() -> str:
    return json.dumps(document(), indent=2, sort_keys=True) + "\n"


def write(directory: Path) -> Path:
    return schemas.write_file(directory, FILE, render())


def drift(directory: Path) -> list[str]:
    return [FILE] if schemas.drifted(directory, FILE, render()) else []
