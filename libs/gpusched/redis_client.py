"""The one way anything connects to Redis (services, the CLI's read models, snapshots): below
the services, so that `libs/` never imports `services/`."""

from __future__ import annotations

import sys

if "redis" not in sys.modules and "opentelemetry.sdk.metrics" not in sys.modules:
    # redis-py imports the OpenTelemetry metrics SDK when it is installed (for its own metrics,
    # which gpusched never turns on): two thirds of importing redis. Hidden while redis loads, it
    # stays importable for whoever asks for it later.
    sys.modules["opentelemetry.sdk.metrics"] = None  # type: ignore[assignment]
    try:
        import redis.asyncio as aioredis
    finally:
        del sys.modules["opentelemetry.sdk.metrics"]
else:
    import redis.asyncio as aioredis

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_url(url: str | None = None) -> str:
    """Explicit > $GPUSCHED_REDIS_URL > the client config's (which carries the password)."""
    from gpusched.security import clientconfig

    return clientconfig.resolve("redis", url, "GPUSCHED_REDIS_URL") or DEFAULT_REDIS_URL


def connect_redis(url: str | None = None) -> aioredis.Redis:
    """A client with the control plane's timeouts."""
    return aioredis.Redis.from_url(redis_url(url), socket_timeout=2.0, socket_connect_timeout=2.0)
