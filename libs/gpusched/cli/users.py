"""`gpusched user add|list|revoke`: the people and systems that may talk to a stack.

The trust store is the stack's (`DATA/trust`, named `trust` in the client config that `up`
writes, or `--trust DIR`); changing it needs file access to it, which is what being the stack's
admin means on one machine. Each change re-renders the NATS config and reloads the server
(SIGHUP): a new user connects at once; a revoked one is cut off and refused, no restart.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
    rows = [{"name": p.name, "role": p.role, "teams": p.teams, "node": p.node, "nodes": p.nodes,
             "public_key": key, "revoked_at": p.revoked_at} for key, p in ring.keys.items()]
    if not args.all:
        rows = [r for r in rows if r["revoked_at"] is None]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in sorted(rows, key=lambda r: (r["role"], r["name"])):
        where = ",".join(r["teams"]) or r["node"] or (f"{len(r['nodes'])} nodes" if r["nodes"] else "")
        state = "revoked" if r["revoked_at"] else "active"
        print(f"{r['name']:20s} {r['role']:12s} {where:20s} {state:8s} {r['public_key']}")
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


def register(sub) -> None:
    user = sub.add_parser("user", help="add, list or revoke the identities that may use the stack")
    usub = user.add_subparsers(dest="user_command", required=True, metavar="ACTION")
    p = usub.add_parser("add", help="make an identity and write its credentials file")
    p.add_argument("name")
    p.add_argument("--role", choices=PERSON_ROLES, default="tenant")
    p.add_argument("--team", default=None, help="a tenant's team")
    p.add_argument("--teams", default=None, help="a platform's teams, comma-separated")
    p.add_argument("--node", default=None, help="a node daemon's node name (role node)")
    p.add_argument("--out", default=None, help="write the credentials here (default: the trust store's copy)")
    p.add_argument("--trust", default=None, help="the stack's trust store (default: the client config's)")
    p.set_defaults(func=cmd_add)
    p = usub.add_parser("list", help="the identities")
    p.add_argument("--all", action="store_true", help="revoked ones too")
    p.add_argument("--json", action="store_true")
    p.add_argument("--trust", default=None)
    p.set_defaults(func=cmd_list)
    p = usub.add_parser("revoke", help="revoke an identity (cut off now, refused from now on)")
    p.add_argument("name")
    p.add_argument("--trust", default=None)
    p.set_defaults(func=cmd_revoke)
