"""The HTTP API through real processes: admission and `gpusched service run api` on a real
nats-server, called with a real HTTP client. Callers are keyring identities, by API token or by
an nkey proof of the request; each may do over HTTP exactly what the NATS server lets it do."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from gpusched.bus.servers import free_port
from gpusched.core import events as ev
from gpusched.security import httpauth, signing
from gpusched.security.httpauth import Tokens

from .harness import harness  # noqa: F401


@pytest.fixture
async def api(harness, trust):  # noqa: F811
    port = free_port()
    harness.start("admission")
    harness.start("reader")
    harness.start("api", "--port", str(port), "--keys", str(trust.keys_file))
    await harness.ready("admission", "reader", "api")
    tokens = Tokens(trust.dir)
    names = {}
    for name, role, teams in (("http-alice", "tenant", ["ml"]), ("http-ci", "platform", ["ml", "cv"]),
                              ("http-audit", "auditor", [])):
        if trust.get(name) is None:
            trust.add(name, role, teams=teams)
        names[name] = tokens.issue(name)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
        yield {"http": http, "tokens": names, "port": port, "harness": harness, "trust": trust}


def bearer(api, name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api['tokens'][name]}"}


async def test_a_tenant_submits_to_its_team_only_and_cancels(api):
    http, h = api["http"], api["harness"]
    async with http.post("/v1/jobs", json={"spec": {"team": "ml", "gpus": 2, "name": "over-http"}}) as r:
        assert r.status == 401  # no credential
    async with http.post("/v1/jobs", json={"spec": {"team": "ml", "gpus": 2, "name": "over-http"}},
                         headers=bearer(api, "http-alice")) as r:
        assert r.status == 201, await r.text()
        job_id = (await r.json())["job_id"]
    await h.wait_for("the job in the log", lambda s: job_id in s.jobs)
    state = h.state
    submitted = next(e for e in h.events(ev.JobSubmitted) if e.job_id == job_id)
    assert (submitted.spec.team, submitted.user, state.jobs[job_id].spec.name) == ("ml", "http-alice", "over-http")
    async with http.post("/v1/jobs", json={"spec": {"team": "cv", "gpus": 1}}, headers=bearer(api, "http-alice")) as r:
        assert r.status == 403 and "gpusched.cmd.submit.cv.http-alice" in (await r.json())["error"]
    # a platform submits for one of its team's users: recorded as both
    async with http.post("/v1/jobs", json={"spec": {"team": "cv", "gpus": 1}, "on_behalf_of": "carol"},
                         headers=bearer(api, "http-ci")) as r:
        assert r.status == 201, await r.text()
        theirs = (await r.json())["job_id"]
    await h.wait_for("the platform's job", lambda s: theirs in s.jobs)
    on_behalf = next(e for e in h.events(ev.JobSubmitted) if e.job_id == theirs)
    assert (on_behalf.user, on_behalf.via) == ("carol", "http-ci")

    # reads go through the reader, scoped like the caller's NATS reads
    async with http.get(f"/v1/jobs/{job_id}", headers=bearer(api, "http-alice")) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["job"]["state"] == "pending"
    async with http.get(f"/v1/jobs/{theirs}", headers=bearer(api, "http-alice")) as r:
        assert r.status == 404  # another team's job reads as no job at all
    async with http.get(f"/v1/jobs/{theirs}", headers=bearer(api, "http-ci")) as r:  # the job's document: both
        assert r.status == 200, await r.text()
        doc = (await r.json())["job"]
    assert (doc["user"], doc["via"]) == ("carol", "http-ci")
    async with http.get("/v1/jobs", headers=bearer(api, "http-alice")) as r:
        assert r.status == 200
        listed = {d["job_id"]: d["team"] for d in await r.json()}
    assert job_id in listed and theirs not in listed and set(listed.values()) == {"ml"}
    async with http.get("/v1/jobs", headers=bearer(api, "http-audit")) as r:  # an auditor reads every team
        assert {job_id, theirs} <= {d["job_id"] for d in await r.json()}

    async with http.delete(f"/v1/jobs/{theirs}", headers=bearer(api, "http-alice")) as r:
        assert r.status == 422  # not her team's: admission refuses, as over NATS
    await asyncio.sleep(0.2)
    assert h.state.jobs[theirs].state == "pending"
    async with http.delete(f"/v1/jobs/{job_id}", headers=bearer(api, "http-alice")) as r:
        assert r.status == 200, await r.text()
    await h.wait_for("cancelled", lambda s: s.jobs[job_id].state == "cancelled")


async def test_bad_bodies_and_roles_are_refused_precisely(api):
    http = api["http"]
    async with http.post("/v1/jobs", json={"spec": {"team": "ml", "gpus": "two"}}, headers=bearer(api, "http-alice")) as r:
        assert r.status == 400 and "$.spec.gpus" in (await r.json())["error"]
    async with http.post("/v1/jobs", data=b"{not json", headers=bearer(api, "http-alice")) as r:
        assert r.status == 400 and "not JSON" in (await r.json())["error"]
    async with http.post("/v1/jobs", json={"spec": {"team": "ml", "gpus": 1}}, headers=bearer(api, "http-audit")) as r:
        assert r.status == 403  # an auditor reads; it submits nothing, over NATS or HTTP
    async with http.post("/v1/jobs", json={"spec": {"team": "ml", "gpus": 100_000}},
                         headers=bearer(api, "http-alice")) as r:
        assert r.status == 400 and "$.spec.gpus" in (await r.json())["error"]  # the schema's bound
    async with http.post("/v1/jobs", json={"spec": {"team": "ml", "gpus": 1,
                                                    "dependency": [{"kind": "afterok", "job": "j-00000000"}]}},
                         headers=bearer(api, "http-alice")) as r:
        assert r.status == 422 and "unknown job" in (await r.json())["error"]  # admission's own reason
    async with http.post("/v1/jobs", json={"spec": {"team": "ml", "gpus": 1}},
                         headers={"Authorization": "Bearer gsk_forged"}) as r:
        assert r.status == 401
    async with http.post("/v1/jobs", data=b"x" * (300 * 1024), headers=bearer(api, "http-alice")) as r:
        assert r.status == 413  # bounded before it is read whole

    async def chunks():
        for _ in range(40):  # a chunked body names no length
            yield b"y" * 8192

    async with http.post("/v1/jobs", data=chunks(), headers=bearer(api, "http-alice")) as r:
        assert r.status == 413
    async with http.get("/v1/jobs") as r:  # reads need a credential too
        assert r.status == 401


async def test_an_nkey_proof_opens_only_its_own_request_and_revocation_counts_at_once(api):
    http, trust = api["http"], api["trust"]
    signer = signing.Signer.from_seed(trust.get("http-ci").seed())
    body = json.dumps({"spec": {"team": "cv", "gpus": 1}}).encode()
    host = f"127.0.0.1:{api['port']}"
    proof = httpauth.nkey_authorization(signer, host, realm="gpusched-api/v1",
                                        digest=httpauth.request_digest("POST", "/v1/jobs", body))
    headers = {"Authorization": proof, "Content-Type": "application/json"}
    async with http.post("/v1/jobs", data=body, headers=headers) as r:
        assert r.status == 201, await r.text()
    other = json.dumps({"spec": {"team": "cv", "gpus": 8}}).encode()
    async with http.post("/v1/jobs", data=other, headers=headers) as r:
        assert r.status == 401  # the same proof on another body is no proof

    # a revoked identity's token stops working with it
    trust.add("http-bob", "tenant", teams=["ml"])
    token = Tokens(trust.dir).issue("http-bob")
    headers = {"Authorization": f"Bearer {token}"}
    async with http.post("/v1/jobs", json={"spec": {"team": "ml", "gpus": 1}}, headers=headers) as r:
        assert r.status == 201
    trust.revoke("http-bob")
    await asyncio.sleep(0.05)  # the keyring file's mtime moves on
    async with http.post("/v1/jobs", json={"spec": {"team": "ml", "gpus": 1}}, headers=headers) as r:
        assert r.status == 401

    from gpusched import openapi

    async with http.get("/v1/openapi.json") as r:  # open: the generated document
        assert r.status == 200
        doc = await r.json()
    assert doc == json.loads(openapi.render()) and doc["openapi"] == "3.1.0"
    assert {"submitJob", "cancelJob"} <= {op["operationId"] for p in doc["paths"].values() for op in p.values()}


async def test_a_platform_of_several_teams_lists_shows_and_cancels_without_naming_one(api):
    """As the CLI and `gpusched.client` do: its second team's job is found without `?team=` (the
    listing merged, the cancel sent for the job's own team); it was a 400 in plain text before."""
    http, h = api["http"], api["harness"]
    async with http.post("/v1/jobs", json={"spec": {"team": "cv", "gpus": 1}, "on_behalf_of": "dora"},
                         headers=bearer(api, "http-ci")) as r:
        assert r.status == 201, await r.text()
        job_id = (await r.json())["job_id"]
    await h.wait_for("the job in the log", lambda s: job_id in s.jobs)
    async with http.get("/v1/jobs", headers=bearer(api, "http-ci")) as r:
        assert r.status == 200, await r.text()
        assert {d["job_id"]: d["team"] for d in await r.json()}[job_id] == "cv"
    async with http.get(f"/v1/jobs/{job_id}", headers=bearer(api, "http-ci")) as r:
        assert r.status == 200, await r.text()
        assert ((await r.json())["job"]["team"], (await r.json())["job"]["user"]) == ("cv", "dora")
    async with http.get("/v1/jobs/j-00000000", headers=bearer(api, "http-ci")) as r:
        assert r.status == 404 and (await r.json())["error"] == \
            "http-ci (role platform) reads team(s) ml, cv only; no job j-00000000 among them"
    async with http.get("/v1/jobs?team=ml", headers=bearer(api, "http-ci")) as r:  # narrowed to one
        assert job_id not in {d["job_id"] for d in await r.json()}
    async with http.delete(f"/v1/jobs/{job_id}", headers=bearer(api, "http-ci")) as r:
        assert r.status == 200, await r.text()
    await h.wait_for("cancelled", lambda s: s.jobs[job_id].state == "cancelled")
