"""The one way anything connects to Redis (services, the CLI's read models, snapshots): below
the services, so that `libs/` never imports `services/`.

Redis holds only what can be rebuilt from the log, so losing it loses nothing; a site that wants
it to stay up through a server's loss runs Redis Sentinel and gives a sentinel URL:

    redis+sentinel://:PASSWORD@sentinel-0:26379,sentinel-1:26379,sentinel-2:26379/MASTER/DB

Every client then asks the sentinels for the current master on each new connection, so after a
failover the next command reconnects to the promoted replica. The one password is the data
servers' and the sentinels' (`requirepass` on both; the chart configures them so).

The password comes from a file only its owner may read (`--redis-password-file`, or
`$GPUSCHED_REDIS_PASSWORD_FILE`), or from an inherited file descriptor named as `/dev/fd/N`
(what `spawn_service` hands a service: nothing on disk, nothing in its arguments or
environment). A URL that carries the password itself is still read, for deploy files that set it
from a secret; `gpusched up` never gives one to a service.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from typing import NamedTuple, TypedDict
from urllib.parse import urlsplit, urlunsplit

from gpusched.deferred import dist_version, metadata_deferred

#: redis-py imports the OpenTelemetry metrics SDK and API when they are installed (for its own
#: metrics, which gpusched never turns on): the SDK was two thirds of importing redis, the API
#: another 5 ms of a CLI read from Redis. Hidden while redis loads (it then takes them for not
#: installed), they stay importable for whoever asks for them later. importlib.metadata, which
#: it imports at its start only to read its own version when it connects, stands in until used
#: (`DRIVER` gives it that version): a fifth of importing redis.
_OTEL_METRICS = ("opentelemetry.sdk.metrics", "opentelemetry.metrics")
_hidden = [] if "redis" in sys.modules else [m for m in _OTEL_METRICS if m not in sys.modules]
for _name in _hidden:
    sys.modules[_name] = None  # type: ignore[assignment]
try:
    with metadata_deferred():
        import redis.asyncio as aioredis
finally:
    for _name in _hidden:
        del sys.modules[_name]
from redis.asyncio.sentinel import Sentinel  # noqa: E402 - after the guarded import above
from redis.driver_info import DriverInfo  # noqa: E402

#: What every connection tells the server in CLIENT SETINFO (as redis-py would: its name and version).
DRIVER = DriverInfo(lib_version=dist_version(os.path.dirname(os.path.dirname(aioredis.__file__)), "redis"))

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SENTINEL_SCHEME = "redis+sentinel://"
class _Timeouts(TypedDict):
    socket_timeout: float
    socket_connect_timeout: float


TIMEOUTS: _Timeouts = {"socket_timeout": 2.0, "socket_connect_timeout": 2.0}
PASSWORD_FILE_ENV = "GPUSCHED_REDIS_PASSWORD_FILE"

_read: dict[str, str] = {}  # path -> its secret: an inherited pipe can be read only once


class SentinelUrl(NamedTuple):
    sentinels: list[tuple[str, int]]
    master: str
    db: int
    password: str | None


def parse_sentinel_url(url: str) -> SentinelUrl:
    """`redis+sentinel://[:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB]`, refused precisely."""
    rest = url[len(SENTINEL_SCHEME):]
    netloc, _, path = rest.partition("/")
    auth, _, hosts = netloc.rpartition("@")
    password = (auth.partition(":")[2] or None) if auth else None
    sentinels: list[tuple[str, int]] = []
    for item in filter(None, hosts.split(",")):
        host, _, port = item.rpartition(":") if item.count(":") == 1 else (item, "", "26379")
        if not host or not port.isdigit():
            raise ValueError(f"{url!r}: {item!r} is not HOST[:PORT] (a sentinel)")
        sentinels.append((host, int(port)))
    parts = [p for p in path.split("/") if p]
    if not sentinels or not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(f"{url!r}: expected redis+sentinel://[:PASSWORD@]HOST[:PORT][,...]/MASTER[/DB]")
    return SentinelUrl(sentinels, parts[0], int(parts[1]) if len(parts) == 2 else 0, password)


class SecretFileError(ValueError):
    """A secret file that is missing, empty, or that others than its owner could read."""


def redis_url(url: str | None = None) -> str:
    """Explicit > $GPUSCHED_REDIS_URL > the client config's (which carries the password)."""
    from gpusched.security import clientconfig

    return clientconfig.resolve("redis", url, "GPUSCHED_REDIS_URL") or DEFAULT_REDIS_URL


def read_secret(path: str | os.PathLike) -> str:
    """The secret in `path`: a regular file of mode 0600 or 0400 (nothing for group or others),
    or an inherited pipe (`/dev/fd/N`). Read once per process."""
    key = str(path)
    if key in _read:
        return _read[key]
    inherited = re.fullmatch(r"/dev/fd/([0-9]+)", key)
    try:  # an inherited descriptor is read (and closed) itself: no copy of it stays open
        fd = int(inherited.group(1)) if inherited else os.open(key, os.O_RDONLY | os.O_CLOEXEC)
        st = os.fstat(fd)
    except OSError as err:
        raise SecretFileError(f"Redis password file {key}: {err.strerror}") from None
    try:
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
            raise SecretFileError(f"Redis password file {key} has mode {stat.S_IMODE(st.st_mode):04o}: group or "
                                  f"others may read or change it; it must be 0600 (chmod 600 {key})")
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
            raise SecretFileError(f"Redis password file {key} is neither a file nor an inherited pipe")
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    secret = data.decode().strip()
    if not secret:
        raise SecretFileError(f"Redis password file {key} is empty")
    _read[key] = secret
    return secret


def redis_password(url: str) -> str | None:
    """The password from `$GPUSCHED_REDIS_PASSWORD_FILE`, when set (None: the URL's own, if any).
    Given twice (file and URL) is refused: which one is meant would be a guess."""
    path = os.environ.get(PASSWORD_FILE_ENV)
    if not path:
        return None
    if urlsplit(url).password:
        raise SecretFileError(f"the Redis URL carries a password and {PASSWORD_FILE_ENV} names a file: give it once")
    return read_secret(path)


def without_password(url: str) -> tuple[str, str | None]:
    """(the URL with its password taken out, that password)."""
    parts = urlsplit(url)
    if not parts.password:
        return url, None
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    netloc = f"{user}@{host}" if user else host
    return urlunsplit(parts._replace(netloc=netloc)), parts.password


def connect_redis(url: str | None = None) -> aioredis.Redis:
    """A client with the control plane's timeouts: of one server, or of the master the sentinels name."""
    url = redis_url(url)
    password = redis_password(url)
    if not url.startswith(SENTINEL_SCHEME):
        return aioredis.Redis.from_url(url, password=password, driver_info=DRIVER, **TIMEOUTS)
    s = parse_sentinel_url(url)
    password = password or s.password
    sentinel = Sentinel(s.sentinels, sentinel_kwargs={"password": password, "driver_info": DRIVER, **TIMEOUTS},
                        driver_info=DRIVER, **TIMEOUTS)
    return sentinel.master_for(s.master, password=password, db=s.db, **TIMEOUTS)
