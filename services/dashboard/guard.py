"""Who may see the dashboard and who may press its buttons.

- Login token: generated at start (or `GPUSCHED_DASHBOARD_TOKEN`); `gpusched up` prints the URL
  `http://127.0.0.1:PORT/?token=...` (as Jupyter does). Opening it sets an HttpOnly, SameSite=Strict
  cookie and redirects to the bare URL; scripts and Prometheus send `Authorization: Bearer TOKEN`.
  The login token is the admin's: it may use the controls. An optional view token
  (`GPUSCHED_DASHBOARD_VIEW_TOKEN`) sees everything and changes nothing.
- Admin credential: `Authorization: Nkey PUBKEY.UNIXTIME.SIG`, the admin's nkey signature over
  the Host and the time (`nkey_authorization`), valid for two minutes, for a key the keyring
  (`GPUSCHED_KEYS`) lists with role admin and not revoked.
- Host allow-list (DNS rebinding): every request's `Host` must be one the dashboard is served
  as (127.0.0.1, localhost, [::1] on its port, plus `--allow-host` / `GPUSCHED_DASHBOARD_HOSTS`),
  or it gets 421. An allowed name given without a port also passes bare or on 80/443, as a
  Service or an Ingress sends it (`Host: dashboard.gpusched.svc`); a name given with a port
  passes only on that port. A rebinding page's Host is its own name, which no list holds.
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

from gpusched.security import httpauth, keyring, signing

CSRF_HEADER = "X-Gpusched-Csrf"
OPEN_PATHS = ("/healthz",)
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
LOGIN_PAGE = """<!doctype html><meta charset="utf-8"><title>gpusched: login needed</title>
<body style="font-family:sans-serif;background:#0f1419;color:#d7dde4;padding:3em">
<h1>gpusched dashboard</h1><p>This page needs its login token. Open the URL that <code>gpusched up</code>
printed in its ready line (<code>http://127.0.0.1:PORT/?token=...</code>), or send
<code>Authorization: Bearer TOKEN</code>.</p></body>"""


REALM = "gpusched-dashboard/v1"


def new_token() -> str:
    return secrets.token_urlsafe(24)


def nkey_authorization(signer: signing.Signer, host: str, now: float | None = None) -> str:
    """An `Authorization` value proving the holder of `signer`'s key, for `host` (e.g.
    "127.0.0.1:8080"), valid for two minutes around `now` (`security/httpauth.py`)."""
    return httpauth.nkey_authorization(signer, host, now, REALM)


def allowed_forms(name: str, port: int) -> set[str]:
    """The `Host` values an allowed name stands for: as given when it names its port, else bare
    and on the dashboard's port and the web's (a Service on 80, an Ingress on 443)."""
    if ":" in name.rsplit("]", 1)[-1]:  # NAME:PORT or [V6]:PORT
        return {name}
    return {name, *(f"{name}:{p}" for p in (port, 80, 443))}


class Guard:
    def __init__(self, admin_token: str, port: int, view_token: str | None = None,
                 allow_hosts: Iterable[str] = (), keys: keyring.KeyRing | None = None):
        self.keys = keys  # for admin nkey credentials (None: tokens only)
        self.keys_file: keyring.Followed | None = None  # or read them from this file, as it changes
        self.verifier = signing.Verifier()
        self.tokens = {admin_token: "admin"}
        if view_token:
            self.tokens[view_token] = "viewer"
        self.port = port
        self.cookie = f"gpusched_token_{port}"  # cookies ignore ports: one per dashboard
        self.hosts = {f"{n}:{port}" for n in ("127.0.0.1", "localhost", "[::1]")}
        for name in (h.strip().lower() for h in allow_hosts if h.strip()):
            self.hosts |= allowed_forms(name, port)
        self.origins = {f"http://{h}" for h in self.hosts} | {f"https://{h}" for h in self.hosts}

    @classmethod
    def from_env(cls, port: int, allow_hosts: Iterable[str] = ()) -> Guard:
        guard = cls(os.environ.get("GPUSCHED_DASHBOARD_TOKEN") or new_token(), port,
                    os.environ.get("GPUSCHED_DASHBOARD_VIEW_TOKEN") or None,
                    [*allow_hosts, *os.environ.get("GPUSCHED_DASHBOARD_HOSTS", "").split(",")])
        path = os.environ.get("GPUSCHED_KEYS")
        guard.keys_file = keyring.Followed(path) if path else None
        return guard

    def _reload_keys(self) -> None:
        """Follow the keyring file: a key added or revoked counts without a restart."""
        if self.keys_file is not None:
            self.keys = self.keys_file.current()

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

    def admin_by_nkey(self, proof: str, host: str, now: float | None = None) -> bool:
        """Whether `PUBKEY.UNIXTIME.SIG` is a fresh proof of a registered, unrevoked admin key."""
        self._reload_keys()
        if self.keys is None:
            return False
        who = httpauth.nkey_principal(proof, host, self.keys, self.verifier, REALM, now=now)
        return who is not None and who.role == "admin"

    def credentials(self, request: web.Request) -> tuple[str | None, str]:
        """(token, how): from `Authorization: Bearer` or `Nkey`, else the login cookie."""
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return auth[7:].strip(), "bearer"
        if auth.startswith("Nkey "):
            return auth[5:].strip(), "nkey"
        return request.cookies.get(self.cookie), "cookie"

    def role(self, request: web.Request) -> tuple[str | None, str | None, str]:
        """(role, token, how) of the request's credentials; role None: not logged in."""
        token, how = self.credentials(request)
        if how == "nkey":
            return ("admin" if self.admin_by_nkey(token or "", request.host) else None), token, how
        return self.role_of(token), token, how

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
    role, token, how = guard.role(request)
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
