"""No service carries the Redis password on its command line or in its environment: `ps` shows
every process's arguments to every user of the host, and with that password `nobody` rewrote
the read models (and, before the lease moved to NATS, stopped placement). A service reads it from
a 0600 file (`--redis-password-file`, `GPUSCHED_REDIS_PASSWORD_FILE`; `gpusched up` writes one)
or from a pipe it inherits (`/dev/fd/N`, what the harness's `spawn_service` hands it), and
refuses a file that group or others may read. Real processes, a real password-protected Redis."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from gpusched.redis_client import PASSWORD_FILE_ENV, without_password
from gpusched.views import K

from .harness import harness  # noqa: F401


async def views_written(redis_url: str) -> bool:
    r = aioredis.Redis.from_url(redis_url)
    try:
        for _ in range(100):
            if await r.exists(K["meta"]):
                return True
            await asyncio.sleep(0.05)
        return False
    finally:
        await r.aclose()


async def test_services_get_the_redis_password_by_an_inherited_pipe_and_nowhere_else(harness, redis_url):  # noqa: F811
    password = urlsplit(redis_url).password
    assert password  # the fixture's Redis requires one, as `gpusched up`'s does
    harness.start("admission")
    proc = harness.start("projector")
    await harness.ready("admission", "projector")
    for p in harness.procs.values():
        assert password.encode() not in Path(f"/proc/{p.pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{p.pid}/environ").read_bytes()
        assert password.encode() not in environ and f"{PASSWORD_FILE_ENV}=/dev/fd/".encode() in environ
    assert await views_written(redis_url)  # the projector, given it that way, writes the views
    anonymous = aioredis.Redis.from_url(without_password(redis_url)[0])
    try:  # and without it Redis refuses
        with pytest.raises(Exception, match="(?i)auth"):
            await anonymous.set(K["meta"], "forged")
    finally:
        await anonymous.aclose()
    assert proc.poll() is None


def run_projector(nats_url: str, redis_url: str, password_file: Path) -> subprocess.Popen:
    env = {**os.environ, "GPUSCHED_REDIS_URL": without_password(redis_url)[0]}
    env.pop(PASSWORD_FILE_ENV, None)
    return subprocess.Popen([sys.executable, "-m", "gpusched.cli.main", "service", "run", "projector", "--nats", nats_url,
                             "--redis-password-file", str(password_file)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


async def test_a_password_file_others_may_read_is_refused_and_a_0600_one_is_used(nats_url, redis_url, tmp_path):
    secret = tmp_path / "redis.password"
    secret.write_text(urlsplit(redis_url).password + "\n")
    for mode in (0o640, 0o604):  # group may read; others may
        secret.chmod(mode)
        refused = run_projector(nats_url, redis_url, secret)
        out, _ = refused.communicate(timeout=30)
        assert refused.returncode != 0
        assert f"Redis password file {secret} has mode {mode:04o}: group or others may read or change it; " \
               f"it must be 0600 (chmod 600 {secret})" in out
    secret.chmod(0o600)
    used = run_projector(nats_url, redis_url, secret)
    try:
        assert await views_written(redis_url), used.poll()
    finally:
        used.terminate()
        used.wait(timeout=15)
