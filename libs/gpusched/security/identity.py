"""Identities: one nkey pair per principal (each service kind, each node agent, each person).

An identity on disk is two files side by side:
- `NAME.nk`: the nkey seed, 0600. It is the credential: `gpusched --creds NAME.nk`, or a plain
  nats-py client with `nats.connect(url, nkeys_seed="NAME.nk", inbox_prefix="_INBOX.<public key>")`.
- `NAME.json`: who it is (name, role, public key, node(s), teams). Public; the CLI reads it to
  put its team and user into the command subjects the server allows it.

Why nkeys users rather than accounts/JWT: one server, one account, per-user permissions in a
config file the stack generates and reloads (`SIGHUP`) - no operator/account JWT hierarchy or
resolver to run, revocation is "remove the user and reload", and the same nkey pair signs events.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nkeys

from .keyring import Principal
from .roles import ROLES

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class IdentityError(ValueError):
    """A name, role or file that cannot make an identity (precise reason in the message)."""


class _Card(msgspec.Struct, kw_only=True):
    name: str
    role: str
    public_key: str
    node: str | None = None
    nodes: list[str] = []
    teams: list[str] = []


@dataclass(frozen=True)
class Identity:
    name: str
    role: str
    public_key: str
    seed_file: Path
    node: str | None = None
    nodes: tuple[str, ...] = ()
    teams: tuple[str, ...] = field(default=())

    @property
    def inbox_prefix(self) -> str:
        """Replies to this identity's requests arrive under here; nobody else may read them."""
        return inbox_prefix(self.public_key)

    @property
    def team(self) -> str | None:
        return self.teams[0] if self.teams else None

    @property
    def all_nodes(self) -> tuple[str, ...]:
        return ((self.node,) if self.node else ()) + self.nodes

    def principal(self) -> Principal:
        return Principal(name=self.name, role=self.role, node=self.node, teams=list(self.teams),
                         nodes=list(self.nodes))

    def seed(self) -> bytes:
        return self.seed_file.read_bytes().strip()


def inbox_prefix(public_key: str) -> str:
    return f"_INBOX.{public_key}"


def check_name(kind: str, value: str) -> str:
    if not _NAME.match(value or ""):
        raise IdentityError(f"{kind} {value!r}: use 1-64 letters, digits, '-' or '_' (it becomes a NATS subject token)")
    return value


def card_path(seed_file: str | os.PathLike) -> Path:
    return Path(seed_file).with_suffix(".json")


def create(name: str, role: str, directory: str | os.PathLike | None = None, *, node: str | None = None,
           nodes: tuple[str, ...] | list[str] = (), teams: tuple[str, ...] | list[str] = (),
           out: str | os.PathLike | None = None) -> Identity:
    """Make a new nkey user and write its seed (0600) and card. `out` names the seed file
    (default `directory/NAME.nk`)."""
    check_name("name", name)
    if role not in ROLES:
        raise IdentityError(f"role {role!r}: expected one of {', '.join(ROLES)}")
    for team in teams:
        check_name("team", team)
    for n in ([node] if node else []) + list(nodes):
        check_name("node", n)
    if role in ("tenant",) and len(teams) != 1:
        raise IdentityError("a tenant belongs to exactly one team (--team)")
    if role == "platform" and not teams:
        raise IdentityError("a platform acts for a listed set of teams (--teams T1,T2)")
    seed_file = Path(out) if out else Path(directory or ".") / f"{name}.nk"
    seed_file.parent.mkdir(parents=True, exist_ok=True)
    kp = nkeys.from_seed(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    fd = os.open(seed_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(kp.seed + b"\n")
    os.chmod(seed_file, 0o600)
    ident = Identity(name, role, kp.public_key.decode(), seed_file, node, tuple(nodes), tuple(teams))
    card = _Card(name=name, role=role, public_key=ident.public_key, node=node, nodes=list(nodes), teams=list(teams))
    card_path(seed_file).write_bytes(msgspec.json.format(msgspec.json.encode(card), indent=2))
    return ident


def public_key_of(seed_file: str | os.PathLike) -> str:
    try:
        kp = nkeys.from_seed(bytearray(Path(seed_file).read_bytes().strip()))
    except (OSError, ValueError, nkeys.NkeysError) as err:
        raise IdentityError(f"{seed_file}: not an nkey seed file ({err})") from None
    return kp.public_key.decode()


def load(seed_file: str | os.PathLike) -> Identity:
    """The identity of a seed file; without its card only the public key is known (role
    'unknown'), which is enough to connect."""
    seed_file = Path(seed_file)
    public_key = public_key_of(seed_file)
    path = card_path(seed_file)
    if not path.exists():
        return Identity(public_key[:12], "unknown", public_key, seed_file)
    card = msgspec.json.decode(path.read_bytes(), type=_Card)
    if card.public_key != public_key:
        raise IdentityError(f"{path} names key {card.public_key[:12]}..., but {seed_file} holds {public_key[:12]}...")
    return Identity(card.name, card.role, public_key, seed_file, card.node, tuple(card.nodes), tuple(card.teams))
