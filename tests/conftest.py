"""Fixtures that start real servers: no mocks of NATS or Redis.

Each test that asks for `nats_url` gets its own fresh `nats-server` (JetStream on, temp store,
free port): starting one takes a few tens of milliseconds and keeps tests independent.
Redis is shared per session and flushed per test.

Authentication is on, as in production: the session has one trust store (admin, one identity
per service kind, the simulated-node host), every server requires one of its identities, the
fixture creates the streams as admin, and this process connects as admin by default
(`GPUSCHED_CREDS`), while services the harness starts get their own role's identity
(`GPUSCHED_IDENTITY_DIR`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from gpusched.bus.servers import start_nats, start_redis

TRUST = None  # the session's security.trust.TrustStore
#: Simulated node names the session's node-host identity may speak for.
SIM_NODES = [f"node{i:02d}" for i in range(64)]


def pytest_configure(config):
    global TRUST
    from gpusched.security.trust import TrustStore

    root = Path(tempfile.mkdtemp(prefix="gpusched-trust-"))
    TRUST = TrustStore(root)
    TRUST.ensure_stack(SIM_NODES)
    os.environ["GPUSCHED_CREDS"] = str(TRUST.creds("admin"))
    os.environ["GPUSCHED_IDENTITY_DIR"] = str(TRUST.ids)
    os.environ["GPUSCHED_KEYS"] = str(TRUST.keys_file)  # what `replay --verify` checks signatures against
    os.environ["GPUSCHED_CONFIG"] = str(root / "no-client-config.toml")  # never the developer's own


def pytest_unconfigure(config):
    if TRUST is not None:
        shutil.rmtree(TRUST.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def trust():
    """The session's trust store: `trust.add(...)` makes more identities; `nats_server.reload()`
    makes a running server accept (or, after `trust.revoke`, refuse) them."""
    return TRUST


@pytest.fixture
def nats_server():
    from gpusched.security.bootstrap import create_streams_sync

    server = start_nats(trust=TRUST)
    create_streams_sync(server.url, TRUST.creds("admin"))
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def redis_session_server():
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_session_server) -> str:
    import redis

    client = redis.Redis.from_url(redis_session_server.url)
    client.flushall()
    client.close()
    return redis_session_server.url


@pytest.fixture
async def event_log(nats_url):
    from gpusched.bus.log import EventLog

    log = await EventLog.open(nats_url)
    yield log
    await log.close()
