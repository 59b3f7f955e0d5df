"""Who is calling over HTTP (the dashboard, the HTTP API): an identity of the keyring, proven by
its own nkey or by an API token issued for it.

- `Authorization: Nkey PUBKEY.UNIXTIME.SIG`: the identity's seed signs the realm, the Host, the
  time and (for the API) a digest of the request's method, path and body, so a proof seen on the
  wire opens nothing else; valid for `PROOF_S` around the server's clock
  (`nkey_authorization` makes one).
- `Authorization: Bearer TOKEN`: a token `gpusched user token NAME` issued for identity NAME.
  The trust store keeps only its SHA-256 (`api-tokens.json`, 0600); a revoked identity's
  tokens stop working with it, since every lookup goes through the keyring.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import secrets
import time
from pathlib import Path

from . import keyring, signing

PROOF_S = 120.0
TOKENS_FILE = "api-tokens.json"
TOKEN_PREFIX = "gsk_"


def proof_input(realm: str, host: str, at: int, request_digest: str = "") -> bytes:
    text = f"{realm}\n{host.lower()}\n{at}"
    return (text + f"\n{request_digest}" if request_digest else text).encode()


def request_digest(method: str, path_qs: str, body: bytes) -> str:
    """What an API proof binds to: this request and no other."""
    return hashlib.sha256(f"{method.upper()} {path_qs}\n".encode() + body).hexdigest()


def nkey_authorization(signer: signing.Signer, host: str, now: float | None = None, realm: str = "gpusched-dashboard/v1",
                       digest: str = "") -> str:
    """An `Authorization` value proving the holder of `signer`'s key, for `host` (e.g.
    "127.0.0.1:8080"), valid for PROOF_S seconds around `now`."""
    at = int(time.time() if now is None else now)
    sig = base64.urlsafe_b64encode(signer.sign(proof_input(realm, host, at, digest))).rstrip(b"=").decode()
    return f"Nkey {signer.public_key}.{at}.{sig}"


def nkey_principal(proof: str, host: str, keys: keyring.KeyRing, verifier: signing.Verifier, realm: str,
                   digest: str = "", now: float | None = None) -> keyring.Principal | None:
    """The unrevoked identity whose fresh proof `PUBKEY.UNIXTIME.SIG` this is, else None."""
    try:
        public_key, at_text, sig_text = proof.split(".")
        at = int(at_text)
        sig = base64.urlsafe_b64decode(sig_text + "=" * (-len(sig_text) % 4))
    except (ValueError, binascii.Error):
        return None
    who = keys.principal(public_key)
    now = time.time() if now is None else now
    if who is None or who.revoked_at is not None or abs(now - at) > PROOF_S:
        return None
    return who if verifier.valid(public_key, proof_input(realm, host, at, digest), sig) else None


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Tokens:
    """API tokens of a trust store: token hash -> identity name."""

    def __init__(self, trust_dir: str | os.PathLike):
        self.path = Path(trust_dir) / TOKENS_FILE
        self._mtime = -1.0
        self._names: dict[str, str] = {}

    def issue(self, name: str) -> str:
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        known = json.loads(self.path.read_text()) if self.path.exists() else {}
        known[_hash(token)] = {"name": name, "issued_at": time.time()}
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(known, f, indent=1)
        return token

    def name_of(self, token: str) -> str | None:
        """The identity a token was issued for (None: unknown), following the file as it changes."""
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            return None
        if mtime != self._mtime:
            self._names = {h: d["name"] for h, d in json.loads(self.path.read_text()).items()}
            self._mtime = mtime
        return self._names.get(_hash(token))
