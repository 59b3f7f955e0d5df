"""No service carries the Redis password on its command line: `ps` shows every process's
arguments to every user of the host, and with that password `nobody` stopped placement (`SET
gpusched:lease:placement ...`) and rewrote the read models. The password goes in the service's
environment, readable by its owner only. Real processes, a real password-protected Redis."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path
from urllib.parse import urlsplit

import redis.asyncio as aioredis

from gpusched.views import K

from .harness import harness  # noqa: F401


async def test_services_run_without_the_redis_password_in_their_arguments(harness, redis_url):  # noqa: F811
    password = urlsplit(redis_url).password
    assert password  # the fixture's Redis requires one, as `gpusched up`'s does
    harness.start("admission")
    proc = harness.start("projector")
    await harness.ready("admission", "projector")
    for p in harness.procs.values():
        args = Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")
        assert not any(password.encode() in a for a in args), args
        environ = Path(f"/proc/{p.pid}/environ")
        assert stat.S_IMODE(environ.stat().st_mode) & 0o077 == 0  # only its owner reads where it is
    r = aioredis.Redis.from_url(redis_url)
    try:
        for _ in range(100):  # and the projector, given it that way, writes the views
            if await r.exists(K["meta"]):
                break
            await asyncio.sleep(0.05)
        assert await r.exists(K["meta"])
        anonymous = aioredis.Redis.from_url(redis_url.replace(f":{password}@", ""))
        try:  # without the password Redis refuses: the lease key is not anyone's to set
            raised = None
            try:
                await anonymous.set("gpusched:lease:placement", "attacker", px=120000)
            except Exception as err:  # noqa: BLE001 - redis.AuthenticationError / ResponseError NOAUTH
                raised = err
            assert raised is not None and "auth" in str(raised).lower()
        finally:
            await anonymous.aclose()
    finally:
        await r.aclose()
    assert proc.poll() is None
