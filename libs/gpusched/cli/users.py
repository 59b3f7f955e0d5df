"""`gpusched user add|list|revoke`: the people and systems that may talk to a stack.

The trust store is the stack's (`DATA/trust`, named `trust` in the client config that `up`
writes, or `--trust DIR`); changing it needs file access to it, which is what being the stack's
admin means on one machine. Each change re-renders the NATS config and reloads the server
(SIGHUP): a new user connects at once; a revoked one is cut off and refused, no restart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from gpusched.security import clientconfig
from gpusched.security.identity import IdentityError
from gpusched.security.trust import TrustStore

PERSON_ROLES = ("tenant", "platform", "auditor", "admin", "node")


def _store(args: argparse.Namespace) -> TrustStore:
    where = args.trust or clientconfig.get("trust")
    if not where:
        raise SystemExit("gpusched user: no trust store: pass --trust DATA/trust (or start the stack with "
                         "`gpusched up`, whose client config names it)")
    if not (Path(where) / "keys.json").exists():
        raise SystemExit(f"gpusched user: {where} is not a trust store (no keys.json)")
    return TrustStore(where)


def _reloaded(store: TrustStore) -> str:
    return "server reloaded" if store.reload_server() else "no running server found: takes effect at next start"


def cmd_add(args: argparse.Namespace) -> int:
    store = _store(args)
    teams = [t for t in (args.teams or "").split(",") if t] or ([args.team] if args.team else [])
    try:
        ident = store.add(args.name, args.role, teams=teams, node=args.node, out=args.out)
    except IdentityError as err:
        print(f"gpusched user add: {err}", file=sys.stderr)
        return 1
    print(f"{ident.name}: {ident.role}" + (f" of {', '.join(ident.teams)}" if ident.teams else "")
          + (f" on node {ident.node}" if ident.node else "") + f", key {ident.public_key}; credentials "
          f"{args.out or ident.seed_file} (give them with --creds or $GPUSCHED_CREDS); {_reloaded(store)}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    ring = _store(args).ring()
    rows: list[dict[str, Any]] = [{"name": p.name, "role": p.role, "teams": p.teams, "node": p.node, "nodes": p.nodes,
             "public_key": key, "revoked_at": p.revoked_at} for key, p in ring.keys.items()]
    if not args.all:
        rows = [r for r in rows if r["revoked_at"] is None]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from .output import plain_table

    table = [[r["name"], r["role"], ",".join(r["teams"]) or r["node"] or (f"{len(r['nodes'])} nodes" if r["nodes"] else "-"),
              "revoked" if r["revoked_at"] else "active", r["public_key"]]
             for r in sorted(rows, key=lambda r: (r["role"], r["name"]))]
    sys.stdout.write(plain_table(table, None if args.no_header else ["NAME", "ROLE", "TEAMS/NODE", "STATE", "PUBLIC_KEY"]))
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        p = store.revoke(args.name)
    except IdentityError as err:
        print(f"gpusched user revoke: {err}", file=sys.stderr)
        return 1
    print(f"{p.name}: revoked (its key stays in keys.json, so what it signed can still be verified); {_reloaded(store)}")
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    """A trust store for a deployment (deploy/): admin, one identity per service kind, and
    one per listed node."""
    from gpusched.services.nodeagent.main import sim_node_names

    store = TrustStore(args.trust)
    store.ensure_stack(sim_node_names(args.sim_nodes) if args.sim_nodes else ())
    for node in [n for n in (args.nodes or "").split(",") if n]:
        if store.get(node) is None:
            store.add(node, "node", node=node)
    print(f"trust store {store.dir}: {len(store.ring().active())} identities; credentials in {store.ids}")
    return 0


def cmd_nats_auth(args: argparse.Namespace) -> int:
    """The NATS `authorization` block of the trust store, for deploy/nats/*.conf to include."""
    from gpusched.security import authz

    text = authz.auth_include(_store(args).ring())
    if args.out in (None, "-"):
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
    return 0


def cmd_stream_create(args: argparse.Namespace) -> int:
    """Admin: create (or update) the streams; services only check that they exist."""
    import asyncio
    import os

    from gpusched.bus.log import EventLog, connect

    async def run() -> None:
        log = EventLog(await connect(args.nats, name="gpusched-stream-create", creds=getattr(args, "creds", None)), args.replicas)
        try:
            await log.create_streams()
        finally:
            await log.close()

    if args.replicas is None:
        args.replicas = int(os.environ.get("GPUSCHED_STREAM_REPLICAS", "1"))
    asyncio.run(run())
    print(f"streams ready (replicas {args.replicas})")
    return 0


def cmd_tls(args: argparse.Namespace) -> int:
    """A local CA and a NATS server certificate (what `up --tls` makes), for deploy/compose."""
    from gpusched.security import tlsgen

    files = tlsgen.ensure(args.dir, hosts=[h for h in args.hosts.split(",") if h])
    print(" ".join(f"{k}={v}" for k, v in files.items()))
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    """An API token for an identity (the HTTP API, `gpusched service run api`): printed once; the
    trust store keeps only its hash, and it stops working when the identity is revoked."""
    from gpusched.security.httpauth import Tokens

    store = _store(args)
    found = store.ring().by_name(args.name)
    if found is None or found[1].revoked_at is not None:
        print(f"gpusched user token: no live identity {args.name!r} (gpusched user list)", file=sys.stderr)
        return 1
    print(Tokens(store.dir).issue(args.name))
    return 0


def cmd_k8s_secrets(args: argparse.Namespace) -> int:
    """The Secrets the Kubernetes pods mount: as manifests under --out from a local trust store
    (make-secrets.sh), or made and applied in the cluster (the Helm chart's bootstrap Job)."""
    import asyncio
    import tempfile

    from gpusched.kube import KubeApi, KubeError
    from gpusched.security import k8s_secrets as ks

    nodes = [n for n in (args.nodes or "").split(",") if n]
    hosts = None if args.tls_hosts is None else [h for h in args.tls_hosts.split(",") if h]
    if args.apply:
        try:
            with tempfile.TemporaryDirectory(prefix="gpusched-trust-") as work:
                done = asyncio.run(ks.apply(KubeApi(), args.namespace, nodes=nodes, selectors=args.node_selector,
                                            tls_hosts=hosts, workdir=Path(work)))
        except KubeError as err:
            print(f"gpusched user k8s-secrets: {err}", file=sys.stderr)
            return 1
        print(" ".join(f"{name}={what}" for name, what in done.items()))
        return 0
    if not args.out or not args.trust:
        raise SystemExit("gpusched user k8s-secrets: pass --apply (in a pod), or --trust DIR and --out DIR")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    store = TrustStore(args.trust)
    ks.init_store(store, nodes)
    if hosts is not None:
        ks.make_tls(out / "tls", hosts)
    pw_file = out / "redis-password"
    if not pw_file.exists():
        pw_file.write_bytes(ks.new_password())
        pw_file.chmod(0o600)
    for name, data in ks.secrets_of(store, out / "tls" if hosts is not None else None,
                                    pw_file.read_bytes().strip()).items():
        target = out / f"{name}.yaml"
        target.write_text(json.dumps(ks.manifest(name, args.namespace, data), indent=2) + "\n")
        target.chmod(0o600)
        if name == "nats-auth":  # the plain file too, for a NATS config that includes it (the lab's)
            (out / "auth.conf").write_bytes(data["auth.conf"])
    print(f"secrets in {out}: kubectl apply -f {out}/  (the trust store: {store.dir})")
    return 0


def register(sub) -> None:
    stream = sub.add_parser("stream", help="admin: create the streams (deploy/; `up` does it itself)")
    ssub = stream.add_subparsers(dest="stream_command", required=True, metavar="ACTION")
    from .output import CONNECTION

    p = ssub.add_parser("create", parents=[CONNECTION], help="create or update the log's streams (admin credentials)")
    p.add_argument("--replicas", type=int, default=None, help="default: $GPUSCHED_STREAM_REPLICAS or 1")
    p.set_defaults(func=cmd_stream_create)

    user = sub.add_parser("user", help="add, list or revoke the identities that may use the stack")
    usub = user.add_subparsers(dest="user_command", required=True, metavar="ACTION")
    p = usub.add_parser("add", help="make an identity and write its credentials file")
    p.add_argument("name", help="the identity's name (a user, a system or a node host)")
    p.add_argument("--role", choices=PERSON_ROLES, default="tenant", help="what it may do (default: tenant)")
    p.add_argument("--team", default=None, help="a tenant's team")
    p.add_argument("--teams", default=None, help="a platform's teams, comma-separated")
    p.add_argument("--node", default=None, help="a node daemon's node name (role node)")
    p.add_argument("--out", default=None, help="write the credentials here (default: the trust store's copy)")
    p.add_argument("--trust", default=None, help="the stack's trust store (default: the client config's)")
    p.set_defaults(func=cmd_add)
    p = usub.add_parser("list", help="the identities")
    p.add_argument("--all", action="store_true", help="revoked ones too")
    p.add_argument("--json", action="store_true", help="print every field as JSON")
    p.add_argument("--no-header", action="store_true", help="print no header line (for scripts)")
    p.add_argument("--trust", default=None, help="the stack's trust store (default: the client config's)")
    p.set_defaults(func=cmd_list)
    p = usub.add_parser("init", help="make a trust store for a deployment: admin, the services, nodes")
    p.add_argument("--trust", required=True, help="the directory of the new trust store")
    p.add_argument("--nodes", default=None, help="node daemons to make identities for, comma-separated")
    p.add_argument("--sim-nodes", type=int, default=0,
                   help="the simulated-node host identity (`nodeagent`) speaks for node00..node<N-1>")
    p.set_defaults(func=cmd_init)
    p = usub.add_parser("nats-auth", help="print the NATS authorization block (for deploy/nats/*.conf)")
    p.add_argument("--trust", default=None, help="the stack's trust store (default: the client config's)")
    p.add_argument("--out", default=None, help="write the block to this file (default: stdout)")
    p.set_defaults(func=cmd_nats_auth)
    p = usub.add_parser("tls", help="make a local CA and a NATS server certificate (deploy/compose)")
    p.add_argument("--dir", required=True, help="where to write the CA and the server certificate")
    p.add_argument("--hosts", default="", help="DNS names of the server, comma-separated (e.g. nats)")
    p.set_defaults(func=cmd_tls)
    p = usub.add_parser("token", help="issue an HTTP API token for an identity (printed once)")
    p.add_argument("name", help="the identity the token acts as")
    p.add_argument("--trust", default=None, help="the stack's trust store (default: the client config's)")
    p.set_defaults(func=cmd_token)
    p = usub.add_parser("k8s-secrets", help="the Secrets of a Kubernetes deployment: manifests, or applied in a pod")
    p.add_argument("--namespace", default=os.environ.get("GPUSCHED_NAMESPACE", "gpusched"),
                   help="their namespace (default: $GPUSCHED_NAMESPACE or gpusched)")
    p.add_argument("--nodes", default=None, help="GPU nodes to make identities for, comma-separated")
    p.add_argument("--node-selector", action="append", default=[], metavar="K=V[,K=V]",
                   help="with --apply: also every Node these labels select (a node pool; repeatable)")
    p.add_argument("--tls-hosts", default=None, metavar="H[,H]",
                   help="make the NATS servers' CA and certificate for these names (Secret nats-tls); "
                        "leave out when cert-manager issues it")
    p.add_argument("--trust", default=None, help="with --out: the trust store (made when absent)")
    p.add_argument("--out", default=None, help="write the Secrets as manifests here")
    p.add_argument("--apply", action="store_true",
                   help="in a pod: keep the trust store in the Secret gpusched-trust and create or update every Secret")
    p.set_defaults(func=cmd_k8s_secrets)
    p = usub.add_parser("revoke", help="revoke an identity (cut off now, refused from now on)")
    p.add_argument("name", help="the identity to revoke")
    p.add_argument("--trust", default=None, help="the stack's trust store (default: the client config's)")
    p.set_defaults(func=cmd_revoke)
