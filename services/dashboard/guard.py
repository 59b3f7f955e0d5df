"""Who may see the dashboard and who may press its buttons.

- Login token: generated at start (or `GPUSCHED_DASHBOARD_TOKEN`); `gpusched up` prints the URL
  `http://127.0.0.1:PORT/?token=...` (as Jupyter does). Opening it sets an HttpOnly, SameSite=Strict
  cookie and redirects to the bare URL; scripts and Prometheus send `Authorization: Bearer TOKEN`.
  The login token is the admin's: it may use the controls. An optional view token
  (`GPUSCHED_DASHBOARD_VIEW_TOKEN`) sees everything and changes nothing.
- Host allow-list (DNS rebinding): every request's `Host` must be one the dashboard is served
  as (127.0.0.1, localhost, [::1] on its port, plus `--allow-host`), or it gets 421.
- CSRF: a state-changing request must be `application/json` (so `text/plain` and form posts,
  which a foreign page can send without a CORS preflight, are refused), must come from an allowed
  `Origin` when it has one, and when it authenticates by cookie must carry `Origin` and the
  session's CSRF token in `X-Gpusched-Csrf` (the page reads it from `GET /api/session`, which a
  foreign origin cannot read).
Without a valid token the page, the API and `/metrics` answer 401; `/healthz` stays open.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable

from aiohttp import web

CSRF_HEADER = "X-Gpusched-Csrf"
OPEN_PATHS = ("/healthz",)
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
LOGIN_PAGE = """<!doctype html><meta charset="utf-8"><title>gpusched: login needed</title>
<body style="font-family:sans-serif;background:#0f1419;color:#d7dde4;padding:3em">
<h1>gpusched dashboard</h1><p>This page needs its login token. Open the URL that <code>gpusched up</code>
printed in its ready line (<code>http://127.0.0.1:PORT/?token=...</code>), or send
<code>Authorization: Bearer TOKEN</code>.</p></body>"""


def new_token() -> str:
    return secrets.token_urlsafe(24)


class Guard:
    def __init__(self, admin_token: str, port: int, view_token: str | None = None,
                 allow_hosts: Iterable[str] = ()):
        self.tokens = {admin_token: "admin"}
        if view_token:
            self.tokens[view_token] = "viewer"
        self.port = port
        self.cookie = f"gpusched_token_{port}"  # cookies ignore ports: one per dashboard
        names = {"127.0.0.1", "localhost", "[::1]", *(h.strip().lower() for h in allow_hosts if h.strip())}
        self.hosts = {n if ":" in n.replace("[::1]", "") else f"{n}:{port}" for n in names}
        self.origins = {f"http://{h}" for h in self.hosts} | {f"https://{h}" for h in self.hosts}

    @classmethod
    def from_env(cls, port: int, allow_hosts: Iterable[str] = ()) -> Guard:
        return cls(os.environ.get("GPUSCHED_DASHBOARD_TOKEN") or new_token(), port,
                   os.environ.get("GPUSCHED_DASHBOARD_VIEW_TOKEN") or None,
                   [*allow_hosts, *os.environ.get("GPUSCHED_DASHBOARD_HOSTS", "").split(",")])

    @property
    def admin_token(self) -> str:
        return next(t for t, role in self.tokens.items() if role == "admin")

    def role_of(self, token: str | None) -> str | None:
        if not token:
            return None
        for known, role in self.tokens.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                return role
        return None

    def csrf_token(self, token: str) -> str:
        return hmac.new(token.encode(), b"gpusched-dashboard-csrf", hashlib.sha256).hexdigest()[:32]

    def credentials(self, request: web.Request) -> tuple[str | None, str]:
        """(token, how): from `Authorization: Bearer`, else the login cookie."""
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return auth[7:].strip(), "bearer"
        return request.cookies.get(self.cookie), "cookie"

    def forgery(self, request: web.Request, token: str, how: str) -> str | None:
        """Why a state-changing request may be a cross-site forgery (None: it is not)."""
        if request.content_type != "application/json":
            return "state-changing requests must be application/json"
        origin = request.headers.get("Origin")
        if origin is not None and origin.lower() not in self.origins:
            return f"origin {origin} is not this dashboard"
        if how == "cookie":
            if origin is None:
                return "a request authenticated by cookie must carry Origin"
            sent = request.headers.get(CSRF_HEADER, "")
            if not hmac.compare_digest(sent.encode(), self.csrf_token(token).encode()):
                return f"missing or wrong {CSRF_HEADER} header"
        return None


GUARD: web.AppKey[Guard] = web.AppKey("guard", Guard)
ROLE: web.RequestKey[str] = web.RequestKey("role", str)
CSRF: web.RequestKey[str] = web.RequestKey("csrf", str)


def _refuse(request: web.Request, status: int, why: str) -> web.Response:
    if request.path.startswith("/api/") or request.method not in SAFE_METHODS:
        return web.json_response({"ok": False, "error": why}, status=status)
    if status == 401:
        return web.Response(text=LOGIN_PAGE, content_type="text/html", status=401)
    return web.Response(text=why, status=status)


def _login(request: web.Request, guard: Guard, token: str) -> web.Response:
    """`?token=`: set the cookie and drop the token from the address bar."""
    if guard.role_of(token) is None:
        return _refuse(request, 401, "wrong login token")
    resp = web.Response(status=302, headers={"Location": request.rel_url.path})
    resp.set_cookie(guard.cookie, token, httponly=True, samesite="Strict", path="/")
    return resp


@web.middleware
async def guard_middleware(request: web.Request, handler):
    guard = request.app[GUARD]
    if request.host.lower() not in guard.hosts:
        return _refuse(request, 421, f"unknown Host {request.host!r} (allowed: {', '.join(sorted(guard.hosts))})")
    if request.path in OPEN_PATHS:
        return await handler(request)
    if request.method == "GET" and "token" in request.query:
        return _login(request, guard, request.query["token"])
    token, how = guard.credentials(request)
    role = guard.role_of(token)
    if role is None:
        return _refuse(request, 401, "login needed: open the URL with ?token= that `gpusched up` printed")
    if request.method not in SAFE_METHODS:
        why = guard.forgery(request, token or "", how)
        if why is not None:
            return _refuse(request, 403, why)
        if role != "admin":
            return _refuse(request, 403, "the dashboard's controls need the admin role")
    request[ROLE], request[CSRF] = role, guard.csrf_token(token or "")
    return await handler(request)


async def api_session(request: web.Request) -> web.Response:
    """The page's role and CSRF token (readable only by a same-origin page)."""
    return web.json_response({"role": request[ROLE], "csrf": request[CSRF]},
                             headers={"Cache-Control": "no-store"})
