"""The dashboard refuses what the issue's attacker did, in a real browser: without its login
token the page and the API refuse; a page on another origin (same host, other port: the login
cookie goes along, as SameSite ignores ports) cannot stop placement or flood jobs with a form
post or a `text/plain` fetch; a DNS-rebound name (a foreign Host header) is refused; a view
token sees but cannot press the buttons."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from gpusched.bus.log import EventLog
from gpusched.bus.servers import free_port
from gpusched.core import events as ev
from gpusched.security import signing
from gpusched.security.keyring import KeyRing, Principal
from gpusched.services import dashboard
from gpusched.services.dashboard import control
from gpusched.services.dashboard.guard import CSRF_HEADER, Guard, nkey_authorization

from .conftest import CHROMIUM_ARGS, chromium_path

pytestmark = pytest.mark.browser

TOKEN = "admin-login-token"
VIEW = "view-only-token"

ATTACK = """<!doctype html><body>
<form id="f" method="POST" action="{target}/api/placement" enctype="text/plain">
  <input name='{{"action":"stop","x":"' value='"}}'></form>
<form id="g" method="POST" action="{target}/api/flood"><input name="count" value="500"></form>
<iframe name="sink"></iframe>
<script>
  const body = JSON.stringify({{action: "stop"}});
  Promise.allSettled([
    fetch("{target}/api/placement", {{method: "POST", mode: "no-cors", credentials: "include",
      headers: {{"Content-Type": "text/plain"}}, body}}),
    fetch("{target}/api/flood", {{method: "POST", mode: "no-cors", credentials: "include",
      headers: {{"Content-Type": "text/plain"}}, body: JSON.stringify({{count: 500}})}}),
    fetch("{target}/api/placement", {{method: "POST", credentials: "include",
      headers: {{"Content-Type": "application/json"}}, body}}),
  ]).then(() => {{
    document.getElementById("f").target = "sink"; document.getElementById("f").submit();
    setTimeout(() => {{ document.getElementById("g").target = "sink"; document.getElementById("g").submit(); }}, 200);
    setTimeout(() => {{ document.title = "done"; }}, 800);
  }});
</script></body>"""


@pytest.fixture
async def rebinding_browser():
    """Chromium that resolves `rebind.test` to 127.0.0.1, as a rebinding attacker's DNS would."""
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=chromium_path(), headless=True,
                                     args=[*CHROMIUM_ARGS, "--host-resolver-rules=MAP rebind.test 127.0.0.1"])
        try:
            yield b
        finally:
            await b.close()


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


async def test_dashboard_refuses_strangers_forgeries_and_rebinding(nats_url, rebinding_browser):
    log = await EventLog.open(nats_url, name="test")
    await log.append(ev.NodeRegistered(at=1, node="n0", rack="r0", gpus=[]))
    stop = asyncio.Event()
    from gpusched.services import admission

    adm = asyncio.create_task(admission.serve(argparse.Namespace(nats=nats_url, redis=None, auto_create_teams=True), stop))
    actions: list[str] = []
    await control.serve_controls(log.nc, {"placement": lambda a: actions.append(a) or a != "stop"})
    port, evil_port = free_port(), free_port()
    ready = asyncio.Event()
    admin_key, tenant_key = signing.Signer.generate(), signing.Signer.generate()
    keys = KeyRing()
    keys.add(admin_key.public_key, Principal(name="root", role="admin"))
    keys.add(tenant_key.public_key, Principal(name="ann", role="tenant", teams=["nlp"]))
    guard = Guard(TOKEN, port, view_token=VIEW, keys=keys)
    dash = asyncio.create_task(dashboard.run(nats_url, None, "127.0.0.1", port, stop, ready, guard=guard))
    await asyncio.wait_for(ready.wait(), 15)
    base = f"http://127.0.0.1:{port}"

    async def attack_page(request: web.Request) -> web.Response:
        return web.Response(text=ATTACK.format(target=base), content_type="text/html")

    evil = web.Application()
    evil.router.add_get("/", attack_page)
    runner = web.AppRunner(evil)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", evil_port).start()
    context = await rebinding_browser.new_context()
    page = await context.new_page()
    try:
        # no token: the page and the API refuse
        resp = await page.goto(f"{base}/")
        assert resp.status == 401 and "login token" in await page.content()
        assert await page.locator(".gpu").count() == 0
        for path in ("/api/state", "/api/session", "/metrics", "/api/job/x"):
            assert (await page.goto(base + path)).status == 401, path
        assert (await page.goto(f"{base}/?token=wrong")).status == 401
        status, _ = await asyncio.to_thread(http, "POST", f"{base}/api/placement", b'{"action":"stop"}',
                                            {"Content-Type": "application/json"})
        assert status == 401

        # log in; then a foreign page, with the login cookie in the same browser, attacks
        await page.goto(f"{base}/?token={TOKEN}")
        await page.wait_for_selector('#conn-badge[data-state="live"]', timeout=10_000)
        assert await page.evaluate("document.body.dataset.role") == "admin"
        attacker = await context.new_page()
        await attacker.goto(f"http://127.0.0.1:{evil_port}/")
        await attacker.wait_for_function("document.title === 'done'", timeout=10_000)
        await attacker.wait_for_timeout(500)
        assert actions == []  # placement was never asked to stop
        await log.nc.flush()
        jobs = [r async for r in log.records() if isinstance(r.event, ev.JobSubmitted)]
        assert jobs == []  # and no flood reached admission

        # DNS rebinding: the attacker's name now points at 127.0.0.1; the Host header gives it away
        rebound = await context.new_page()
        resp = await rebound.goto(f"http://rebind.test:{port}/?token={TOKEN}")
        assert resp.status == 421
        resp = await rebound.goto(f"http://rebind.test:{port}/api/state")
        assert resp.status == 421
        status, _ = await asyncio.to_thread(http, "POST", f"{base}/api/placement", b'{"action":"stop"}',
                                            {"Content-Type": "application/json", "Host": f"rebind.test:{port}",
                                             "Authorization": f"Bearer {TOKEN}"})
        assert status == 421 and actions == []

        # the view token sees the page but cannot press the buttons
        status, _ = await asyncio.to_thread(http, "GET", f"{base}/api/state", None, {"Authorization": f"Bearer {VIEW}"})
        assert status == 200
        status, body = await asyncio.to_thread(http, "POST", f"{base}/api/placement", b'{"action":"stop"}',
                                               {"Content-Type": "application/json", "Authorization": f"Bearer {VIEW}"})
        assert status == 403 and "admin" in json.loads(body)["error"] and actions == []

        # the logged-in page itself still works: its button carries the CSRF token
        await page.click("#placement-stop")
        await page.wait_for_function(
            "() => document.querySelector('#toast').textContent === 'placement stopped'", timeout=5_000)
        assert actions == ["stop"]
        # and a script with the admin token (no cookie, no Origin) may too; a cookie without the header may not
        status, _ = await asyncio.to_thread(http, "POST", f"{base}/api/placement", b'{"action":"status"}',
                                            {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and actions == ["stop", "status"]
        status, body = await asyncio.to_thread(
            http, "POST", f"{base}/api/placement", b'{"action":"start"}',
            {"Content-Type": "application/json", "Cookie": f"{guard.cookie}={TOKEN}", "Origin": base})
        assert status == 403 and CSRF_HEADER in json.loads(body)["error"] and actions == ["stop", "status"]

        # an admin credential instead of the token: the admin's nkey signs the Host and the time
        host = f"127.0.0.1:{port}"
        for signer, when, expected in ((tenant_key, None, 401), (admin_key, time.time() - 600, 401),
                                       (admin_key, None, 200)):
            status, _ = await asyncio.to_thread(
                http, "POST", f"{base}/api/placement", b'{"action":"status"}',
                {"Content-Type": "application/json", "Authorization": nkey_authorization(signer, host, when)})
            assert status == expected, (signer.public_key, when)
        assert actions == ["stop", "status", "status"]
        forged = nkey_authorization(admin_key, "rebind.test:80")  # signed for another Host
        status, _ = await asyncio.to_thread(http, "GET", f"{base}/api/state", None, {"Authorization": forged})
        assert status == 401
    finally:
        await context.close()
        await runner.cleanup()
        stop.set()
        await asyncio.wait_for(asyncio.gather(dash, adm, return_exceptions=True), 15)
        await log.close()
