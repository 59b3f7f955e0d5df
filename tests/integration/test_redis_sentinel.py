"""Redis through a server's loss: a real master, its replica and a sentinel; a client made from
a `redis+sentinel://` URL keeps working after the master is killed, on the promoted replica."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import pytest

from gpusched.bus.servers import _wait_port, find_binary, free_port, start_redis
from gpusched.redis_client import connect_redis, parse_sentinel_url


def _start(conf_text: str, workdir, name: str, *extra: str) -> subprocess.Popen:
    conf = workdir / f"{name}.conf"
    conf.write_text(conf_text)
    log = open(workdir / f"{name}.log", "ab")
    proc = subprocess.Popen([find_binary("redis-server"), str(conf), *extra], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


@pytest.fixture
def sentinel_set(tmp_path):
    master = start_redis(workdir=tmp_path / "master")
    pw = master.password
    replica_port, sentinel_port = free_port(), free_port()
    (tmp_path / "replica").mkdir()
    replica = _start(f"port {replica_port}\nbind 127.0.0.1\ndir {tmp_path / 'replica'}\nsave \"\"\n"
                     f"requirepass {pw}\nmasterauth {pw}\nreplicaof 127.0.0.1 {master.port}\n", tmp_path / "replica",
                     "replica")
    sentinel = _start(f"port {sentinel_port}\nbind 127.0.0.1\ndir {tmp_path}\nrequirepass {pw}\n"
                      f"sentinel monitor gpusched 127.0.0.1 {master.port} 1\nsentinel auth-pass gpusched {pw}\n"
                      "sentinel down-after-milliseconds gpusched 1000\nsentinel failover-timeout gpusched 4000\n",
                      tmp_path, "sentinel", "--sentinel")
    try:
        _wait_port(replica_port, replica, "redis replica")
        _wait_port(sentinel_port, sentinel, "redis sentinel")
        yield {"url": f"redis+sentinel://:{pw}@127.0.0.1:{sentinel_port}/gpusched/0", "master": master,
               "replica_port": replica_port}
    finally:
        for proc in (replica, sentinel):
            proc.kill()
            proc.wait()
        master.stop()


async def test_a_client_follows_the_failover(sentinel_set):
    client = connect_redis(sentinel_set["url"])
    await client.set("gpusched:probe", "before")
    for _ in range(20):  # the replica's first sync takes a moment; WAIT stays under the socket timeout
        if await client.execute_command("WAIT", 1, 1000) == 1:
            break
    else:
        pytest.fail("the replica never acknowledged the write")
    # a sentinel learns of replicas from the master's INFO, polled every 10 s: a failover before
    # it knows one has nothing to promote
    import redis.asyncio as aioredis

    url = parse_sentinel_url(sentinel_set["url"])
    sentinel = aioredis.Redis(host=url.sentinels[0][0], port=url.sentinels[0][1], password=url.password)
    deadline = time.monotonic() + 30
    while not await sentinel.execute_command("SENTINEL", "REPLICAS", url.master):
        assert time.monotonic() < deadline, "the sentinel never learned of the replica"
        await asyncio.sleep(0.25)
    await sentinel.aclose()
    os.kill(sentinel_set["master"].proc.pid, signal.SIGKILL)
    deadline, value = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        try:
            value = await client.get("gpusched:probe")
            await client.set("gpusched:probe", "after")
            break
        except Exception:  # the old master is gone until the sentinel promotes the replica
            await asyncio.sleep(0.25)
    assert value == b"before", "no answer from the promoted replica within 30 s"
    info = await client.info("server")
    assert info["tcp_port"] == sentinel_set["replica_port"]  # the replica, now the master
    await client.aclose()


@pytest.mark.parametrize(("url", "wanted"), [
    ("redis+sentinel://:pw@a:26379,b/master/2", ([("a", 26379), ("b", 26379)], "master", 2, "pw")),
    ("redis+sentinel://s1:1/m", ([("s1", 1)], "m", 0, None)),
])
def test_sentinel_urls(url, wanted):
    assert tuple(parse_sentinel_url(url)) == wanted


@pytest.mark.parametrize("url", ["redis+sentinel://a:26379/", "redis+sentinel:///m", "redis+sentinel://a:x/m",
                                 "redis+sentinel://a/m/zero"])
def test_bad_sentinel_urls_are_refused(url):
    with pytest.raises(ValueError, match="redis\\+sentinel|HOST"):
        parse_sentinel_url(url)
