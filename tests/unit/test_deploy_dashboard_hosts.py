"""The dashboard through its Service or Ingress: a configured name passes as a Service or an
Ingress sends it (bare, :80, :443), an unconfigured one still gets 421 (DNS rebinding), and the
deployed manifests configure the Service's names."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gpusched.services.dashboard.guard import GUARD, Guard, allowed_forms, guard_middleware

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
TOKEN = "t0ken-hosts"


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def _page(request: web.Request) -> web.Response:
    return web.Response(text="page")


async def _client(guard: Guard) -> TestClient:
    app = web.Application(middlewares=[guard_middleware])
    app[GUARD] = guard
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/", _page)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


@pytest.mark.parametrize("host", ["dashboard.gpusched.svc", "dashboard.gpusched.svc:80",
                                  "dashboard.gpusched.svc:8080", "gpusched.example.com:443"])
async def test_configured_names_pass_as_a_service_or_ingress_sends_them(host, monkeypatch):
    monkeypatch.setenv("GPUSCHED_DASHBOARD_HOSTS", "dashboard.gpusched.svc, gpusched.example.com")
    monkeypatch.setenv("GPUSCHED_DASHBOARD_TOKEN", TOKEN)
    client = await _client(Guard.from_env(8080))
    try:
        assert (await client.get("/healthz", headers={"Host": host})).status == 200
        page = await client.get("/", headers={"Host": host, "Authorization": f"Bearer {TOKEN}"})
        assert page.status == 200 and await page.text() == "page"
    finally:
        await client.close()


@pytest.mark.parametrize("host", ["dashboard.gpusched.svc", "evil.example:8080", "localhost:80",
                                  "dashboard.gpusched.svc.attacker.example"])
async def test_unexpected_hosts_are_refused_by_default(host, monkeypatch):
    monkeypatch.delenv("GPUSCHED_DASHBOARD_HOSTS", raising=False)
    client = await _client(Guard(TOKEN, 8080))
    try:
        resp = await client.get("/healthz", headers={"Host": host})
        assert resp.status == 421
        assert "unknown Host" in await resp.text()
    finally:
        await client.close()


def test_a_name_with_a_port_passes_only_on_that_port():
    assert allowed_forms("proxy.internal:8443", 8080) == {"proxy.internal:8443"}
    assert allowed_forms("[fd00::1]:9000", 8080) == {"[fd00::1]:9000"}
    assert allowed_forms("[fd00::1]", 8080) == {"[fd00::1]", "[fd00::1]:8080", "[fd00::1]:80", "[fd00::1]:443"}


def test_the_kustomize_dashboard_allows_its_service_names():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "control-plane.yaml").read_text()) if d]
    dash = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "dashboard")
    env = {e["name"]: e for e in dash["spec"]["template"]["spec"]["containers"][0]["env"]}
    hosts = env["GPUSCHED_DASHBOARD_HOSTS"]["value"].split(",")
    assert {"dashboard", "dashboard.gpusched.svc", "dashboard.gpusched.svc.cluster.local"} <= set(hosts)
    assert env["GPUSCHED_DASHBOARD_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "gpusched-dashboard"
