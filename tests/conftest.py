"""Fixtures that start real servers: no mocks of NATS or Redis.

Each test that asks for `nats_url` gets its own fresh `nats-server` (JetStream on, temp store,
free port): starting one takes a few tens of milliseconds and keeps tests independent.
Redis is shared per session and flushed per test.
"""

from __future__ import annotations

import pytest

from gpusched.bus.servers import start_nats, start_redis


@pytest.fixture
def nats_server():
    server = start_nats()
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
