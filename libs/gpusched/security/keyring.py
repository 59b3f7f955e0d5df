"""The keyring: every registered identity's public key and what it is (role, node, teams).

Written by `gpusched up` / `gpusched user add|revoke` under the data dir (`keys.json`) and read by
`replay --verify` to check that each fact was signed by a writer whose role decides that kind.
It holds only public keys, so it can be handed to an auditor with an export of the stream.

File format (JSON): `{"keys": {PUBLIC_NKEY: {"name": ..., "role": ..., "node": ... | null,
"teams": [...], "revoked_at": UNIX_SECONDS | null, "nodes": [...]}}}`. Revoked keys stay (their
past signatures remain verifiable); they just no longer connect.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec


class Principal(msgspec.Struct, frozen=True, kw_only=True):
    """Who holds a key: `role` is one of `roles.ROLES`; `node` for node agents; `teams` for
    tenants (one team) and platforms (the teams they may act for)."""

    name: str
    role: str
    node: str | None = None
    teams: list[str] = []
    revoked_at: float | None = None
    #: A simulated host process that carries several nodes holds one identity for all of them
    #: (real node daemons: one node, in `node`).
    nodes: list[str] = []

    def all_nodes(self) -> list[str]:
        return ([self.node] if self.node else []) + list(self.nodes)


class KeyRing(msgspec.Struct, kw_only=True):
    keys: dict[str, Principal] = {}

    def principal(self, public_key: str) -> Principal | None:
        return self.keys.get(public_key)

    def add(self, public_key: str, principal: Principal) -> None:
        self.keys[public_key] = principal

    def by_name(self, name: str) -> tuple[str, Principal] | None:
        """The live (unrevoked) key of a name, else the last revoked one."""
        found = None
        for key, p in self.keys.items():
            if p.name == name:
                if p.revoked_at is None:
                    return key, p
                found = (key, p)
        return found

    def active(self) -> dict[str, Principal]:
        return {k: p for k, p in self.keys.items() if p.revoked_at is None}


def load(path: str | os.PathLike) -> KeyRing:
    return msgspec.json.decode(Path(path).read_bytes(), type=KeyRing)


class Followed:
    """A keyring file read again whenever it changes, so that an identity added or revoked
    counts at once in a long-running reader (the dashboard, the HTTP API); None while the file
    is absent or does not decode (nobody is known then)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._mtime: float | None = None
        self._ring: KeyRing | None = None

    def current(self) -> KeyRing | None:
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            self._mtime = self._ring = None
            return None
        if mtime != self._mtime:
            try:
                self._ring = load(self.path)
            except (OSError, ValueError):
                self._ring = None
            self._mtime = mtime
        return self._ring


def save(ring: KeyRing, path: str | os.PathLike) -> None:
    """Write atomically (rename), so a reader never sees half a keyring."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(ring), indent=2))
    os.replace(tmp, path)
