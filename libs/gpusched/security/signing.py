"""Signed appends: every fact carries its writer's ed25519 signature (the writer's nkey) and a
link to that writer's previous fact, so a forged, altered, removed or reordered fact shows.

What is signed (`signing_input`), one line each, then the payload bytes as stored:

    gpusched-sig/v1
    <subject>              the event's subject (its kind, and its node/job/team key)
    <signer public nkey>
    <chain id>             random: one per writer process (one per append in flight at once;
                           a new one after an append whose outcome is unknown, below)
    <n>                    1, 2, 3 ... within the chain: the writer's own sequence
    <prev>                 digest of the chain's previous fact ("-" for n = 1)
    <cas>                  the expected alloc-tree sequence of a compare-and-set append, or "-"
    <payload>

The digest of a fact is SHA-256 of that input; the next fact of the same chain signs it as
`prev`. It travels in one header, `Gpusched-Sig: v1 PUBKEY CHAIN N PREV CAS SIGNATURE`
(signature base64url, unpadded). In an atomic batch only the last fact is signed (the others
carry "-"): its signature covers the earlier ones through the `prev` links, so a cycle of 64
grants costs one signature, and a verifier checks one signature per run of linked facts. A chain is exactly the sequence of facts its writer got acked,
in stream order: a verifier sees a fact removed from the middle (n skips, or prev does not
match), reordered (n goes back), or forged into a writer's chain (bad signature). What a writer
appended last cannot be told from a truncated log; the stream's own sequence numbers (no gaps)
and an export's `--until` cover that.

`Nats-Msg-Id`, batch and trace headers are not signed: they steer the server, not the fact.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import nacl.exceptions
import nacl.signing
import nkeys

SIG_HEADER = "Gpusched-Sig"
VERSION = "v1"
_SEED = re.compile(rb"\bS[A-Z][A-Z2-7]{56}\b")


class Signer:
    """A writer's signing key (an nkey seed). `public_key` is how the keyring names it."""

    def __init__(self, keypair: nkeys.KeyPair):
        self._key: nacl.signing.SigningKey = keypair._keys  # nkeys wraps PyNaCl (libsodium)
        self.public_key: str = keypair.public_key.decode()

    @classmethod
    def from_seed(cls, seed: str | bytes) -> Signer:
        return cls(nkeys.from_seed(seed.encode() if isinstance(seed, str) else seed))

    @classmethod
    def generate(cls) -> Signer:
        """A fresh user nkey (tests, benchmarks; identities proper come from `gpusched up`)."""
        return cls.from_seed(new_seed())

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data).signature


def new_seed() -> bytes:
    """A new nkey user seed (`SU...`)."""
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)


def seed_from_file(path: str | os.PathLike) -> bytes:
    """The nkey seed in a file: a bare seed (`.nk`) or a NATS credentials file (`.creds`)."""
    found = _SEED.search(Path(path).read_bytes())
    if found is None:
        raise ValueError(f"{path}: no nkey seed found")
    return found.group(0)


def signer_from_env(environ: dict[str, str] | None = None) -> Signer | None:
    """The one place a process finds its signing key: `GPUSCHED_SIGNING_SEED` (the seed itself),
    else `GPUSCHED_SIGNING_SEED_FILE`, else the credentials its NATS connection uses
    (`GPUSCHED_CREDS`: the nkey seed in the creds file). None: this process appends unsigned."""
    env = os.environ if environ is None else environ
    if env.get("GPUSCHED_SIGNING_SEED"):
        return Signer.from_seed(env["GPUSCHED_SIGNING_SEED"].strip())
    for var in ("GPUSCHED_SIGNING_SEED_FILE", "GPUSCHED_CREDS"):
        if env.get(var):
            return Signer.from_seed(seed_from_file(env[var]))
    return None


def signing_input(subject: str, signer: str, chain: str, n: int, prev: str, cas: str, payload: bytes) -> bytes:
    head = "\n".join(("gpusched-sig/" + VERSION, subject, signer, chain, str(n), prev, cas, ""))
    return head.encode() + payload


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Signature:
    """A parsed `Gpusched-Sig` header."""

    signer: str
    chain: str
    n: int
    prev: str
    cas: str
    sig: bytes

    def input(self, subject: str, payload: bytes) -> bytes:
        return signing_input(subject, self.signer, self.chain, self.n, self.prev, self.cas, payload)


def parse(header: str) -> Signature:
    """Raises ValueError with why when the header is not a v1 signature."""
    parts = header.split(" ")
    if len(parts) != 7 or parts[0] != VERSION:
        raise ValueError(f"not a {VERSION} signature header")
    _, signer, chain, n, prev, cas, sig = parts
    if not n.isdigit() or int(n) < 1 or not (cas == "-" or cas.isdigit()):
        raise ValueError("bad chain number or cas field")
    if sig == "-":  # a link vouched for by its chain's next signed fact
        return Signature(signer, chain, int(n), prev, cas, b"")
    try:
        raw = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("signature is not base64url") from None
    return Signature(signer, chain, int(n), prev, cas, raw)


def writer_scope(subject: str) -> str:
    """Who may publish on `subject`, as a name: its kind, and the node for a node's subject
    (`gpusched.evt.alloc.GpusReleased.node.node03` -> `GpusReleased.node.node03`). Chain
    numbers are kept per scope, so only a writer that may publish a kind there anyway could
    push a chain's number up with a forged header."""
    parts = subject.split(".")
    if len(parts) >= 6 and parts[4] == "node":
        return ".".join(parts[3:6])
    return parts[3] if len(parts) > 3 else subject


def position(subject: str, headers: dict[str, str] | None):
    """The fold's `Position` of a stored fact: its scope, signer, chain id and number; None for
    an unsigned fact or an unreadable header (the audit reports those)."""
    from gpusched.core.state import Position

    header = (headers or {}).get(SIG_HEADER)
    if header is None:
        return None
    try:
        sig = parse(header)
    except ValueError:
        return None
    return Position(f"{writer_scope(subject)} {sig.signer} {sig.chain}", sig.n)


def _public_bytes(public_key: str) -> bytes:
    """The raw ed25519 key inside a public user nkey (`U...`), checksum checked."""
    raw = base64.b32decode(public_key + "=" * (-len(public_key) % 8))
    if len(raw) != 35 or raw[0] != nkeys.PREFIX_BYTE_USER:
        raise ValueError("not a public user nkey")
    if nkeys.crc16(bytearray(raw[:33])).to_bytes(2, "little") != raw[33:]:
        raise ValueError("public nkey checksum mismatch")
    return raw[1:33]


class Verifier:
    """Checks signatures, caching the decoded public keys."""

    def __init__(self) -> None:
        self._keys: dict[str, nacl.signing.VerifyKey | None] = {}

    def valid(self, public_key: str, data: bytes, sig: bytes) -> bool:
        if public_key in self._keys:
            key = self._keys[public_key]
        else:
            try:
                key = nacl.signing.VerifyKey(_public_bytes(public_key))
            except (ValueError, binascii.Error, nacl.exceptions.CryptoError):
                key = None
            self._keys[public_key] = key
        if key is None:
            return False
        try:
            key.verify(data, sig)
            return True
        except (nacl.exceptions.BadSignatureError, ValueError):
            return False


class Chain:
    """One run of a writer's facts. One append at a time uses it (sign -> publish -> ack), so the
    chain's order is the stream's order; `advance` only after an ack that stored the facts."""

    def __init__(self, signer: Signer):
        self.signer = signer
        self.rotate()

    def rotate(self) -> None:
        """Start a new chain: after an append whose outcome is unknown (a timeout), the writer
        cannot know whether its last fact is in the log, so it links nothing to it."""
        self.id = uuid.uuid4().hex[:16]
        self.n = 0
        self.prev = "-"

    def sign(self, facts: list[tuple[str, bytes]], first_cas: int | None = None) -> tuple[list[str], str]:
        """`Gpusched-Sig` headers for (subject, payload) facts n+1..n+k (the chain is not
        advanced yet) and the digest the chain would end at. Only the last fact of an append
        is signed: its signature covers the digests of the batch's earlier facts (an atomic
        batch is stored whole or not at all), which carry "-" for a signature."""
        headers, prev = [], self.prev
        key = self.signer.public_key
        last = len(facts) - 1
        for i, (subject, payload) in enumerate(facts):
            cas = str(first_cas) if (i == 0 and first_cas is not None) else "-"
            n = self.n + 1 + i
            data = signing_input(subject, key, self.id, n, prev, cas, payload)
            sig = base64.urlsafe_b64encode(self.signer.sign(data)).rstrip(b"=").decode() if i == last else "-"
            headers.append(f"{VERSION} {key} {self.id} {n} {prev} {cas} {sig}")
            prev = digest(data)
        return headers, prev

    def advance(self, count: int, last_digest: str) -> None:
        self.n += count
        self.prev = last_digest
