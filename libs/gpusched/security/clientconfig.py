"""The client config, like kind's kubeconfig: which stack to talk to and with which credentials.

`gpusched up` writes it (default `~/.config/gpusched/config.toml`, or `$GPUSCHED_CONFIG`):

    nats = "nats://127.0.0.1:4222"
    redis = "redis://:PASSWORD@127.0.0.1:6379/0"
    creds = "/path/to/data/trust/identities/admin.nk"
    ca = "/path/to/data/tls/ca.pem"          # only with `up --tls`
    trust = "/path/to/data/trust"             # where `gpusched user add|list|revoke` work

Precedence everywhere: an explicit flag (`--nats`, `--creds`) > environment (`GPUSCHED_NATS_URL`,
`GPUSCHED_REDIS_URL`, `GPUSCHED_CREDS`, `GPUSCHED_CA`) > this file > built-in defaults.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

KEYS = ("nats", "redis", "creds", "ca", "trust")


def path() -> Path:
    explicit = os.environ.get("GPUSCHED_CONFIG")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "gpusched" / "config.toml"


def load() -> dict[str, str]:
    p = path()
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise SystemExit(f"gpusched: cannot read the client config {p}: {err}") from None
    return {k: str(v) for k, v in data.items() if k in KEYS and v}


def get(key: str) -> str | None:
    return load().get(key)


def write(values: dict[str, str | None], target: Path | None = None) -> Path:
    """Write the config (0600: it names the admin credentials)."""
    p = target or path()
    p.parent.mkdir(parents=True, exist_ok=True)
    text = "# written by `gpusched up`; see gpusched.security.clientconfig\n" + "".join(
        f"{k} = {json.dumps(v)}\n" for k, v in values.items() if k in KEYS and v)
    tmp = p.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, p)
    return p


def resolve(key: str, explicit: str | None = None, env: str | None = None) -> str | None:
    return explicit or (os.environ.get(env) if env else None) or get(key)
