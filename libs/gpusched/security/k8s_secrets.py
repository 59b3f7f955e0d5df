"""The trust store as Kubernetes Secrets, from one table, for both ways a cluster gets them:
`deploy/k8s/make-secrets.sh` writes them as manifests from a trust store kept on an admin's
machine (`gpusched user k8s-secrets --out`), and the Helm chart's pre-install/pre-upgrade Job
makes and applies them in the cluster itself (`--apply`), so that nothing is written by hand.

In the cluster the trust store itself (every seed, the keyring, the CA's key) is kept in the
Secret `gpusched-trust`, written before anything made from it: a second run restores it and
finds the same identities, the same CA and the same Redis password, so the Job is idempotent
and a crash half-way loses nothing. It adds an identity for every new GPU node (listed, or
found by the pools' label selectors) and rewrites only the Secrets whose content changed.
"""

from __future__ import annotations

import base64
import os
import secrets as random
from pathlib import Path

from . import authz, httpauth, tlsgen
from .roles import SERVICE_ROLES
from .trust import TrustStore

TRUST_SECRET = "gpusched-trust"
#: Inside `gpusched-trust`, a file's path `a/b` is the key `a__b` (keys may not hold "/").
SEP = "__"
#: The most bytes a Secret may hold (the API server's limit).
SECRET_MAX = 1024 * 1024


def init_store(store: TrustStore, nodes: list[str]) -> None:
    """The deployment's identities: admin, one per service kind, one per GPU node (kept when present)."""
    store.ensure_stack(())
    for node in nodes:
        if store.get(node) is None:
            store.add(node, "node", node=node)


def _files(directory: Path, prefix: str = "") -> dict[str, bytes]:
    return {prefix + SEP.join(p.relative_to(directory).parts): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def trust_files(store: TrustStore, tls_dir: Path | None) -> dict[str, bytes]:
    """The trust store (and the CA, whose key reissues the server certificate) as Secret keys."""
    files = _files(store.dir)
    if tls_dir is not None and tls_dir.is_dir():
        files.update(_files(tls_dir, "tls" + SEP))
    size = sum(len(v) for v in files.values())
    if size * 4 // 3 > SECRET_MAX:
        raise ValueError(f"the trust store is {size} bytes, over a Secret's {SECRET_MAX}: split node identities "
                         "into per-pool stores")
    return files


def restore(files: dict[str, bytes], store_dir: Path, tls_dir: Path) -> None:
    """Write `trust_files` back: the trust store under `store_dir`, the CA under `tls_dir`."""
    for key, data in files.items():
        parts = key.split(SEP)
        if any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"{TRUST_SECRET}: key {key!r} is not a file of a trust store")
        path = tls_dir.joinpath(*parts[1:]) if parts[0] == "tls" else store_dir.joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


def node_identities(store: TrustStore) -> list[str]:
    """The live identities of single GPU nodes: each node daemon's seed in gpusched-node-creds."""
    return sorted(p.name for p in store.ring().active().values() if p.role == "node" and p.node)


def api_keyring(store: TrustStore) -> dict[str, bytes]:
    """What the HTTP API checks its callers against, no seed among them: the keyring (public keys
    and roles; an identity added or revoked counts once the Secret's files change) and the
    hashes of the API tokens `gpusched user token` issued (none yet: an empty table)."""
    tokens = store.dir / httpauth.TOKENS_FILE
    return {"keys.json": store.keys_file.read_bytes(),
            httpauth.TOKENS_FILE: tokens.read_bytes() if tokens.exists() else b"{}"}


def secrets_of(store: TrustStore, tls_dir: Path | None, redis_password: bytes) -> dict[str, dict[str, bytes]]:
    """Every Secret the pods mount (deploy/k8s README's table), by name."""
    ids = store.ids

    def pairs(names) -> dict[str, bytes]:
        return {f"{n}.{ext}": (ids / f"{n}.{ext}").read_bytes() for n in names for ext in ("nk", "json")}

    made = {
        "nats-auth": {"auth.conf": authz.auth_include(store.ring()).encode()},
        "gpusched-creds": pairs(SERVICE_ROLES),
        "gpusched-node-creds": pairs(node_identities(store)),
        "gpusched-redis": {"password": redis_password},
        "gpusched-admin": {"admin.nk": (ids / "admin.nk").read_bytes()},
        "gpusched-api-keyring": api_keyring(store),
    }
    if tls_dir is not None:
        made["nats-tls"] = {k: (tls_dir / k).read_bytes() for k in ("ca.pem", "server.pem", "server-key.pem")}
    return made


def manifest(name: str, namespace: str, data: dict[str, bytes]) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace},
            "type": "Opaque", "data": {k: base64.b64encode(v).decode() for k, v in sorted(data.items())}}


def new_password() -> bytes:
    return random.token_urlsafe(24).encode()


def make_tls(tls_dir: Path, hosts: list[str]) -> None:
    tlsgen.ensure(tls_dir, hosts=hosts)


def decoded(secret: dict | None) -> dict[str, bytes] | None:
    if secret is None:
        return None
    return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}


async def pool_nodes(kube, selectors: list[str]) -> list[str]:
    """The names of the Nodes matching any of the label selectors (`k=v,k2=v2`)."""
    from urllib.parse import quote

    names: set[str] = set()
    for sel in selectors:
        doc = await kube.call("GET", f"/api/v1/nodes?labelSelector={quote(sel)}")
        names |= {item["metadata"]["name"] for item in (doc or {}).get("items", [])}
    return sorted(names)


async def put_secret(kube, namespace: str, name: str, data: dict[str, bytes]) -> str:
    """Create the Secret, or replace it when its content differs: 'created', 'updated' or 'unchanged'."""
    path = f"/api/v1/namespaces/{namespace}/secrets"
    have = await kube.call("GET", f"{path}/{name}")
    body = manifest(name, namespace, data)
    if have is None:
        await kube.call("POST", path, body)
        return "created"
    if decoded(have) == data:
        return "unchanged"
    body["metadata"]["resourceVersion"] = have["metadata"].get("resourceVersion")  # a concurrent writer: 409
    await kube.call("PUT", f"{path}/{name}", body)
    return "updated"


async def apply(kube, namespace: str, *, nodes: list[str], selectors: list[str], tls_hosts: list[str] | None,
                workdir: Path) -> dict[str, str]:
    """The bootstrap Job: restore the trust store from its Secret (or make one), add the new
    nodes' identities, save the trust store first, then every Secret made from it."""
    path = f"/api/v1/namespaces/{namespace}/secrets"
    store_dir, tls_dir = workdir / "trust", workdir / "tls"
    kept = decoded(await kube.call("GET", f"{path}/{TRUST_SECRET}"))
    if kept:
        restore(kept, store_dir, tls_dir)
    wanted = sorted(set(nodes) | set(await pool_nodes(kube, selectors)))
    store = TrustStore(store_dir)
    init_store(store, wanted)
    if tls_hosts is not None:
        make_tls(tls_dir, tls_hosts)
    done = {TRUST_SECRET: await put_secret(kube, namespace, TRUST_SECRET, trust_files(store, tls_dir))}
    password = (decoded(await kube.call("GET", f"{path}/gpusched-redis")) or {}).get("password") or new_password()
    made = secrets_of(store, tls_dir if tls_hosts is not None else None, password)
    for name, data in made.items():
        done[name] = await put_secret(kube, namespace, name, data)
    return done
