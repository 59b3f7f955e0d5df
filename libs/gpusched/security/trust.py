"""The trust store of one stack: a directory with every identity (`identities/NAME.nk` + card),
the keyring (`keys.json`, public keys only: hand it to an auditor) and what the NATS server
needs to be re-rendered and reloaded when a user is added or revoked (`nats-server.json`).

`gpusched up` keeps it under its data dir (`DATA/trust`); the test fixtures keep one per session.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from . import authz, identity, keyring
from .identity import Identity, IdentityError
from .roles import SERVICE_ROLES

#: The identity of the simulated-node host process that `up` runs (role node, all its nodes).
NODE_HOST = "nodeagent"


class TrustStore:
    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.ids = self.dir / "identities"
        self.keys_file = self.dir / "keys.json"
        self.server_file = self.dir / "nats-server.json"

    # --- the keyring and identities -------------------------------------------------------

    def ring(self) -> keyring.KeyRing:
        return keyring.load(self.keys_file) if self.keys_file.exists() else keyring.KeyRing()

    def creds(self, name: str) -> Path:
        return self.ids / f"{name}.nk"

    def get(self, name: str) -> Identity | None:
        path = self.creds(name)
        return identity.load(path) if path.exists() else None

    def add(self, name: str, role: str, *, teams=(), node: str | None = None, nodes=(),
            out: str | os.PathLike | None = None) -> Identity:
        """A new identity, registered in the keyring (and so allowed to connect once the server
        is reloaded). A live identity of the same name is refused: revoke it first."""
        ring = self.ring()
        live = ring.by_name(name)
        if live is not None and live[1].revoked_at is None:
            raise IdentityError(f"identity {name!r} exists (role {live[1].role}); revoke it first")
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        # with `out`, only the holder gets the seed: the store keeps the public key (keys.json)
        ident = identity.create(name, role, self.ids, node=node, nodes=tuple(nodes), teams=tuple(teams), out=out)
        ring.add(ident.public_key, ident.principal())
        keyring.save(ring, self.keys_file)
        return ident

    def revoke(self, name: str) -> keyring.Principal:
        ring = self.ring()
        found = ring.by_name(name)
        if found is None or found[1].revoked_at is not None:
            raise IdentityError(f"no live identity named {name!r}")
        key, p = found
        import msgspec

        revoked = msgspec.structs.replace(p, revoked_at=time.time())
        ring.add(key, revoked)
        keyring.save(ring, self.keys_file)
        for path in (self.creds(name), identity.card_path(self.creds(name))):
            path.unlink(missing_ok=True)
        return revoked

    def ensure_stack(self, nodes: list[str] | tuple[str, ...] = ()) -> None:
        """The stack's own identities, created once: admin, one per service kind, and the
        simulated-node host (widened when the stack is started with more nodes)."""
        for name, role in [("admin", "admin"), *((r, r) for r in SERVICE_ROLES)]:
            if self.get(name) is None:
                self.add(name, role)
        host = self.get(NODE_HOST)
        if host is None or not set(nodes) <= set(host.all_nodes):
            if host is not None:
                self.revoke(NODE_HOST)
            wanted = sorted(set(nodes) | set(host.all_nodes if host else ()))
            self.add(NODE_HOST, "node", nodes=wanted)

    # --- the server -----------------------------------------------------------------------

    def render(self, conf: str | os.PathLike, *, port: int, store_dir: str | os.PathLike,
               tls: dict[str, str] | None = None, host: str = "127.0.0.1", cluster: dict | None = None) -> Path:
        return authz.write_server_config(self.ring(), conf, port=port, store_dir=store_dir, tls=tls, host=host,
                                         cluster=cluster)

    def remember_server(self, conf: Path, pid: int, port: int, store_dir: Path, tls: dict | None, host: str,
                        cluster: dict | None = None) -> None:
        """Note a running server (one of a cluster's members: each is noted) for `reload_server`."""
        entry = {"conf": str(conf), "pid": pid, "port": port, "host": host, "store_dir": str(store_dir), "tls": tls,
                 "cluster": cluster}
        known = [s for s in self._servers() if cluster is not None and s.get("cluster")
                 and s["cluster"].get("server_name") != cluster.get("server_name")]
        self.server_file.write_text(json.dumps({"servers": [*known, entry]}, indent=2))
        os.chmod(self.server_file, 0o600)  # a cluster's route password

    def _servers(self) -> list[dict]:
        if not self.server_file.exists():
            return []
        data = json.loads(self.server_file.read_text())
        return data.get("servers", [data]) if "servers" in data else [data]

    def reload_server(self) -> bool:
        """Re-render the running servers' configs (every member of a cluster) from the keyring and
        make them reload (SIGHUP): a new user may connect, a revoked one is disconnected and
        refused. False: no server."""
        reloaded = False
        for s in self._servers():
            self.render(s["conf"], port=s["port"], store_dir=s["store_dir"], tls=s.get("tls"),
                        host=s.get("host", "127.0.0.1"), cluster=s.get("cluster"))
            pid = int(s["pid"])
            if not _runs_config(pid, s["conf"]):
                continue  # a stale pid (the server was restarted, or died): never signal a stranger
            try:
                os.kill(pid, signal.SIGHUP)
                reloaded = True
            except ProcessLookupError:
                continue
        return reloaded


def _runs_config(pid: int, conf: str) -> bool:
    """The process `pid` is a nats-server started with `conf` (its command line says so)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return conf.encode() in argv and any(b"nats-server" in a for a in argv[:1])
