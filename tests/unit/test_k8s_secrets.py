"""The chart's identities Job (`gpusched user k8s-secrets --apply`) against a real local HTTP
server standing in for the Kubernetes API (bearer token, Secrets with resourceVersions, Nodes by
label selector): it makes every Secret the pods mount, keeps the trust store in its own Secret,
and run again it changes nothing, or only what a new GPU node needs."""

from __future__ import annotations

import base64
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gpusched.kube import KubeApi, KubeError
from gpusched.security import k8s_secrets as ks
from gpusched.security.identity import public_key_of

TOKEN = "sa-token-identities"
NS = "gpusched"
MOUNTED = {"gpusched-creds", "gpusched-node-creds", "nats-auth", "gpusched-redis", "gpusched-admin", "nats-tls",
           "gpusched-api-keyring"}


@pytest.fixture
async def api(tmp_path):
    secrets: dict[str, dict] = {}
    nodes = {"gpu-a": {"gpu": "h100"}, "gpu-b": {"gpu": "h100", "zone": "x"}, "cpu-1": {}}
    version = [0]

    def allowed(request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {TOKEN}"

    async def secret(request: web.Request) -> web.Response:
        if not allowed(request) or request.match_info["ns"] != NS:
            return web.json_response({"kind": "Status", "code": 403}, status=403)
        name = request.match_info.get("name")
        if request.method == "GET":
            return web.json_response(secrets[name]) if name in secrets else web.json_response({}, status=404)
        body = await request.json()
        name = body["metadata"]["name"]
        if request.method == "POST" and name in secrets:
            return web.json_response({"code": 409}, status=409)
        if request.method == "PUT" and body["metadata"].get("resourceVersion") != secrets[name]["metadata"]["resourceVersion"]:
            return web.json_response({"code": 409}, status=409)
        version[0] += 1
        body["metadata"]["resourceVersion"] = str(version[0])
        secrets[name] = body
        return web.json_response(body, status=201 if request.method == "POST" else 200)

    async def list_nodes(request: web.Request) -> web.Response:
        want = dict(kv.split("=", 1) for kv in request.query["labelSelector"].split(","))
        items = [{"metadata": {"name": n, "labels": labels}} for n, labels in nodes.items()
                 if all(labels.get(k) == v for k, v in want.items())]
        return web.json_response({"kind": "NodeList", "items": items})

    app = web.Application()
    app.router.add_route("*", "/api/v1/namespaces/{ns}/secrets", secret)
    app.router.add_route("*", "/api/v1/namespaces/{ns}/secrets/{name}", secret)
    app.router.add_get("/api/v1/nodes", list_nodes)
    server = TestServer(app)
    await server.start_server()
    token = tmp_path / "token"
    token.write_text(TOKEN)
    yield {"kube": KubeApi(str(server.make_url("")), token), "secrets": secrets, "nodes": nodes,
           "token": token, "url": str(server.make_url(""))}
    await server.close()


async def _apply(api, tmp_path, run: str) -> dict[str, str]:
    work = tmp_path / run
    work.mkdir()
    return await ks.apply(api["kube"], NS, nodes=["gpu-extra"], selectors=["gpu=h100"],
                          tls_hosts=["nats", "nats.gpusched.svc"], workdir=work)


def _data(api, name: str) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in api["secrets"][name]["data"].items()}


def _auth_keys(api) -> set[str]:
    text = _data(api, "nats-auth")["auth.conf"].decode()
    return {u["nkey"] for u in json.loads(text.split(":", 1)[1])["users"]}


async def test_makes_every_mounted_secret_and_keeps_the_store(api, tmp_path):
    done = await _apply(api, tmp_path, "first")
    assert done == {name: "created" for name in [ks.TRUST_SECRET, *MOUNTED]}
    nodes = _data(api, "gpusched-node-creds")
    assert set(nodes) == {"gpu-a.nk", "gpu-a.json", "gpu-b.nk", "gpu-b.json", "gpu-extra.nk", "gpu-extra.json"}
    # every seed handed to a pod is a user NATS admits, with its own key
    for name, seed in {**_data(api, "gpusched-creds"), **nodes, **_data(api, "gpusched-admin")}.items():
        if name.endswith(".nk"):
            path = tmp_path / name
            path.write_bytes(seed)
            assert public_key_of(path) in _auth_keys(api), name

    # the HTTP API's keyring: every identity's public key and role, the token table, no seed
    keyring = _data(api, "gpusched-api-keyring")
    assert set(keyring) == {"keys.json", "api-tokens.json"} and json.loads(keyring["api-tokens.json"]) == {}
    assert json.loads(keyring["keys.json"]) == json.loads((tmp_path / "first" / "trust" / "keys.json").read_text())
    assert not any(seed.rstrip() in keyring["keys.json"] for name, seed in _data(api, "gpusched-creds").items()
                   if name.endswith(".nk"))

    again = await _apply(api, tmp_path, "second")
    assert set(again.values()) == {"unchanged"}  # same identities, CA and password: idempotent


async def test_a_new_pool_node_gets_an_identity_and_nothing_else_changes(api, tmp_path):
    await _apply(api, tmp_path, "first")
    admin, ca, password = _data(api, "gpusched-admin"), _data(api, "nats-tls")["ca.pem"], _data(api, "gpusched-redis")
    api["nodes"]["gpu-c"] = {"gpu": "h100"}
    done = await _apply(api, tmp_path, "second")
    assert {n for n, what in done.items() if what == "updated"} == {ks.TRUST_SECRET, "gpusched-node-creds", "nats-auth",
                                                                   "gpusched-api-keyring"}  # its public key
    assert "gpu-c.nk" in _data(api, "gpusched-node-creds")
    assert _data(api, "gpusched-admin") == admin and _data(api, "nats-tls")["ca.pem"] == ca
    assert _data(api, "gpusched-redis") == password


async def test_a_refused_call_is_a_precise_error(api, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    with pytest.raises(KubeError, match="HTTP 403: forbidden"):
        await ks.apply(KubeApi(api["url"], wrong), NS, nodes=[], selectors=[], tls_hosts=None, workdir=tmp_path)


def test_a_trust_secret_key_cannot_escape_the_store(tmp_path):
    with pytest.raises(ValueError, match="not a file of a trust store"):
        ks.restore({"identities__..__..__etc__passwd": b"x"}, tmp_path / "trust", tmp_path / "tls")
