"""The dashboard cannot be framed and never writes its login token to a log. Before, no response
carried `X-Frame-Options` or a CSP `frame-ancestors`, so a page on another port of the same host
(its cookie being same-site) framed the controls transparently; and the `dashboard_ready` line
put `?token=<admin token>` into DATA/logs/dashboard.log. A real dashboard process."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

from gpusched.bus.servers import free_port

from .harness import harness  # noqa: F401

TOKEN = "framing-test-admin-token-0123456789"
VIEW = "framing-test-view-token-0123456789"


async def test_every_dashboard_response_refuses_framing_and_no_log_holds_the_token(harness, monkeypatch):  # noqa: F811
    monkeypatch.setenv("GPUSCHED_DASHBOARD_TOKEN", TOKEN)
    monkeypatch.setenv("GPUSCHED_DASHBOARD_VIEW_TOKEN", VIEW)
    port = free_port()
    harness.start("dashboard", "--port", str(port))
    await harness.ready("dashboard")
    base = f"http://127.0.0.1:{port}"
    cases = {  # path, headers -> the status it gets: logins, refusals, the API, a wrong Host
        ("/", None): 401,
        ("/api/state", None): 401,
        (f"/?token={TOKEN}", None): 302,
        ("/?token=wrong", None): 401,
        (f"/?token={VIEW}", None): 302,
        ("/healthz", None): 200,
        ("/", (("Host", f"rebind.test:{port}"),)): 421,
    }
    opener = urllib.request.build_opener(_NoRedirect)
    for (path, headers), status in cases.items():
        req = urllib.request.Request(base + path, headers=dict(headers or ()))
        try:
            resp = await asyncio.to_thread(opener.open, req, timeout=5)
            got, hdrs = resp.status, resp.headers
        except urllib.error.HTTPError as err:
            got, hdrs = err.code, err.headers
        assert got == status, (path, got)
        assert hdrs.get("X-Frame-Options") == "DENY", path
        assert hdrs.get("Content-Security-Policy") == "frame-ancestors 'none'", path
    await asyncio.sleep(0.5)  # the log has had every line of these requests
    written = harness.service_log("dashboard")
    assert "dashboard_ready" in written
    assert TOKEN not in written and VIEW not in written


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None
