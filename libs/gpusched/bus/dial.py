"""Dialling NATS as an identity: the address (`nats_url`), the credentials (`creds_file`), the
one `connect` every process uses, and the errors a client reports when a server cannot be
reached or is unsuitable. Apart from `log.py` (the event log over JetStream) so that a client
that only asks and answers (a tenant's `jobs` through the reader) connects without importing
JetStream's client; `log.py` re-exports these names, where most callers import them.
"""

from __future__ import annotations

import asyncio
import os

import nats
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from gpusched.core import limits
from gpusched.security import clientconfig
from gpusched.security.identity import Identity
from gpusched.security.identity import load as load_identity

from . import connection, fastpath

_log = connection.LazyLogger()

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def nats_url(url: str | None = None) -> str:
    """The NATS URL to use: one server, or a cluster's seed list, comma-separated."""
    return clientconfig.resolve("nats", url, "GPUSCHED_NATS_URL") or DEFAULT_NATS_URL


def seed_list(url: str) -> list[str]:
    """A comma-separated seed list (`nats://a:4222,nats://b:4222`) as the servers to try."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ValueError(f"no NATS server in {url!r}")
    return servers


class Unreachable(ConnectionError):
    """A client could not reach a server: says which, at what address, and what to do."""

    def __init__(self, what: str, url: str, cause: BaseException | str, hint: str):
        detail = cause if isinstance(cause, str) else (str(cause) or type(cause).__name__)
        super().__init__(f"cannot reach {what} at {url} ({detail}); {hint}")


NATS_HINT = "is `gpusched up` running? (or set --nats / GPUSCHED_NATS_URL)"
#: Connection options of this process. Services keep the default (reconnect forever: they must
#: outlive blips); a command-line client calls `fail_fast()` so an unreachable server is one
#: clear error within seconds instead of a retry loop.
_client_options: dict = {}


def fail_fast(connect_timeout: float = 1.5) -> None:
    """Make every later `connect` of this process try once, quietly, and raise `Unreachable`."""

    async def remember(err: Exception) -> None:  # no log line: the caller says it once
        _last_error[:] = [err]

    # one try (nats-py counts the first as a reconnect: 1 is the smallest value that stops)
    _client_options.update(allow_reconnect=False, max_reconnect_attempts=1, reconnect_time_wait=0.1,
                           connect_timeout=connect_timeout, error_cb=remember)


_last_error: list[Exception] = []


def creds_file(creds: str | os.PathLike | None = None) -> str | None:
    """Which credentials: explicit > $GPUSCHED_CREDS > the client config's (None: anonymous,
    which an authenticated server refuses)."""
    return clientconfig.resolve("creds", str(creds) if creds else None, "GPUSCHED_CREDS")


def tls_context(url: str, ca: str | None = None):
    """A TLS context that verifies the server against the stack's CA ($GPUSCHED_CA or the
    client config's `ca`), or the system's roots when none is named."""
    import ssl

    ca = clientconfig.resolve("ca", ca, "GPUSCHED_CA")
    return ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()


def identity_of(nc: NATS) -> Identity | None:
    """The identity a connection authenticated as (None: anonymous)."""
    return getattr(nc, "gpusched_identity", None)


class ServerUnsuitable(RuntimeError):
    """The NATS server is too old or accepts too small messages for gpusched."""


async def connect(url: str | None = None, name: str = "gpusched", creds: str | os.PathLike | None = None,
                  **kwargs) -> NATS:
    """The one way to connect to NATS (reconnects forever; services must outlive blips), as the
    identity `creds_file(creds)` names: its nkey answers the server's challenge, and replies
    come to its own inbox prefix (the only one its permissions let it read)."""
    url = nats_url(url)
    path = creds_file(creds)
    ident = None
    if path:
        ident = load_identity(path)
        kwargs.setdefault("nkeys_seed", str(path))
        kwargs.setdefault("inbox_prefix", ident.inbox_prefix)
    servers = seed_list(url)
    if any(s.startswith("tls://") for s in servers) and "tls" not in kwargs:
        kwargs["tls"] = tls_context(url)
    for key, value in _client_options.items():  # fail_fast(): one quiet try, then Unreachable
        kwargs.setdefault(key, value)
    kwargs.setdefault("max_reconnect_attempts", -1)
    kwargs.setdefault("reconnect_time_wait", 0.5)
    quiet, holder = connection.callbacks(name)  # one line per outage period; exit when closed for good
    watch = connection.QuorumWatch.for_servers(servers, name, kwargs)  # off a server without a quorum
    for key, value in quiet.items():
        if key != "error_cb":
            kwargs.setdefault(key, value)
    refused = asyncio.Event()
    user_cb = kwargs.pop("error_cb", None) or quiet["error_cb"]

    async def on_error(err: Exception) -> None:
        if "authorization violation" in str(err).lower() and not refused.is_set():
            refused.set()  # the server said no: retrying forever would only hide it
            if user_cb is None:
                return  # the caller gets a PermissionError that says so
        if user_cb is not None:
            await user_cb(err)
        else:
            _log.warning("nats_error", error=str(err), connection=name)

    attempt = asyncio.ensure_future(nats.connect(servers, name=name, error_cb=on_error, **kwargs))
    no = asyncio.ensure_future(refused.wait())
    limit = kwargs["connect_timeout"] + 1 if _client_options else None
    try:
        await asyncio.wait({attempt, no}, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
    finally:
        no.cancel()
    if refused.is_set() and (not attempt.done() or attempt.exception() is not None):
        attempt.cancel()
        who = f"credentials {path}" if path else ("an anonymous connection (give --creds FILE, "
                                                  "$GPUSCHED_CREDS, or run `gpusched up`)")
        raise PermissionError(f"NATS at {url} refused {who}: authorization violation")
    if not attempt.done():  # fail-fast and still trying past its limit
        attempt.cancel()
        raise Unreachable("NATS", url, _last_error[0] if _last_error else "timed out", NATS_HINT)
    try:
        nc = attempt.result()
    except (OSError, TimeoutError, NatsError) as err:
        if not _client_options:
            raise
        cause = _last_error[0] if _last_error else err  # what the socket said, not "no servers"
        raise Unreachable("NATS", url, cause, NATS_HINT) from err
    holder["nc"] = nc
    nc.gpusched_identity = ident  # type: ignore[attr-defined]
    watch.start(nc)
    fastpath.install(nc)  # header parse and encoding of every message: the same bytes, cheaper
    problem = limits.server_problem(nc._server_info)  # nats-py keeps the server's INFO here
    if problem:
        await nc.close()
        raise ServerUnsuitable(problem)
    return nc


