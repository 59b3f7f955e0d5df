"""NATS permissions from roles: the narrowest publish/subscribe allow-list of every principal,
and the server configuration (`authorization { users: [...] }`) that `gpusched up`, the test
fixtures and `gpusched user add|revoke` write and the server reloads.

Everything not allowed is refused by the server. Who may append an event kind is
`roles.EVENT_WRITERS`; only admin reaches the stream-changing JetStream API. The snapshot store
is written by the projector alone and read by every service, node and auditor (not tenants).
The lease bucket is placement's and the fallback's alone (`lease_access`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpusched.bus import subjects

from .identity import inbox_prefix
from .keyring import KeyRing, Principal
from .roles import SERVICE_ROLES, kinds_of

STREAMS = (subjects.STREAM, subjects.DEAD_STREAM)


def read_log() -> list[str]:
    """JetStream calls that read the streams (ordered consumers, stream info), nothing that
    changes them."""
    out = ["$JS.API.INFO"]
    for s in STREAMS:
        out += [f"$JS.API.STREAM.INFO.{s}", f"$JS.API.CONSUMER.CREATE.{s}", f"$JS.API.CONSUMER.CREATE.{s}.>",
                f"$JS.API.CONSUMER.INFO.{s}.>", f"$JS.API.CONSUMER.DELETE.{s}.>", f"$JS.FC.{s}.>",
                f"$JS.API.STREAM.MSG.GET.{s}", f"$JS.API.DIRECT.GET.{s}", f"$JS.API.DIRECT.GET.{s}.>"]
    return out


def read_snapshots() -> list[str]:
    """Reading the snapshot object store (`gpusched.store.SnapshotStore`): its info, its
    objects' metadata (message get) and chunks (ordered consumers; the client finds their stream
    by subject: STREAM.NAMES, which lists stream names only). Nothing that writes it."""
    s = subjects.SNAPSHOT_STREAM
    return ["$JS.API.STREAM.NAMES", f"$JS.API.STREAM.INFO.{s}", f"$JS.API.STREAM.MSG.GET.{s}", f"$JS.API.DIRECT.GET.{s}",
            f"$JS.API.DIRECT.GET.{s}.>", f"$JS.API.CONSUMER.CREATE.{s}", f"$JS.API.CONSUMER.CREATE.{s}.>",
            f"$JS.API.CONSUMER.INFO.{s}.>", f"$JS.API.CONSUMER.DELETE.{s}.>", f"$JS.FC.{s}.>"]


def write_snapshots() -> list[str]:
    """The one snapshotting service (the projector): store objects and drop a replaced one's chunks."""
    return [f"$O.{subjects.SNAPSHOT_BUCKET}.>", f"$JS.API.STREAM.PURGE.{subjects.SNAPSHOT_STREAM}"]


#: Lease keys (`services/lease.py`) each role may write and read; a `KEY.NAME` form goes with KEY.
LEASE_WRITES = {"placement": ("placement",), "fallback": ("fallback",)}
LEASE_READS = {"placement": ("placement",), "fallback": ("placement", "fallback"), "dashboard": ("placement",)}


def lease_access(role: str) -> list[str]:
    """The lease bucket: placement writes only its lease, the fallback only its own and reads
    placement's, the dashboard reads placement's. No one else (admin aside) reaches it: a tenant
    or a node can neither forge, delete, purge nor read a lease, nor touch its stream."""
    stream, bucket = subjects.LEASE_STREAM, subjects.LEASE_BUCKET
    reads = LEASE_READS.get(role, ())
    if not reads:
        return []
    out = [f"$JS.API.STREAM.INFO.{stream}"]  # opening the bucket (`js.key_value`)
    for key in LEASE_WRITES.get(role, ()):
        out += [f"$KV.{bucket}.{key}", f"$KV.{bucket}.{key}.*"]
    for key in reads:  # direct get of a key's last value (the bucket allows direct gets)
        out += [f"$JS.API.DIRECT.GET.{stream}.$KV.{bucket}.{key}", f"$JS.API.DIRECT.GET.{stream}.$KV.{bucket}.{key}.*"]
    return out


def event_subjects(kind: str) -> list[str]:
    """The service-form subjects of one kind, in both trees (a kind lives in one; both are
    harmless and keep this table independent of the ALLOC flags)."""
    return [f"gpusched.evt.info.{kind}.*", f"gpusched.evt.alloc.{kind}.*"]


def _service(role: str) -> tuple[list[str], list[str]]:
    pub = read_log() + read_snapshots() + ["gpusched.dead.>"] + [s for k in sorted(kinds_of(role))
                                                                  for s in event_subjects(k)]
    pub += lease_access(role)
    sub: list[str] = []
    if role == "projector":
        pub += write_snapshots()
    elif role == "admission":
        sub.append(f"{subjects.CMD_ANY} admission")  # only in admission's queue group
    elif role == "quota_ledger":
        sub.append(f"{subjects.Q_SHARES} quota_ledger")
    elif role == "reconciler":
        sub.append(subjects.HEARTBEATS)
        pub += ["gpusched.node.*.ctl.KillProcesses", "gpusched.node.*.ctl.ResetGpu"]
    elif role == "api":  # acts for the caller it authenticated, on the subjects that caller may use
        pub += ["gpusched.cmd.>", "gpusched.read.>"]
    elif role == "reader":
        more_pub, more_sub = _reader()
        sub += more_sub
        pub += more_pub
    elif role == "dashboard":  # acts for a logged-in admin (the dashboard checks the login)
        pub += ["gpusched.cmd.*", "gpusched.cmd.*.*", "gpusched.ctl.*", subjects.Q_SHARES,
                "gpusched.node.*.logs"]  # job logs, for the admin it acts for (tenants may not ask)
    return pub, sub


def read_requests(p: Principal) -> list[str]:
    """The read subjects a person may ask the reader service on (`subjects.read_subject`): a
    tenant or platform only its own team(s) and name (the reader scopes every answer by the
    subject); an auditor the unscoped form (every team). Admin may publish anything."""
    if p.role in ("tenant", "platform"):
        return [subjects.read_subject("*", team, p.name) for team in p.teams]
    if p.role == "auditor":
        return [subjects.read_subject("*")]
    return []


def on_behalf(p: Principal) -> list[str]:
    """A platform may submit for any user of its own teams (`subjects.on_behalf_subject`)."""
    if p.role != "platform":
        return []
    return [subjects.command_subject("submit", team, p.name) + ".*" for team in p.teams]


def _reader() -> tuple[list[str], list[str]]:
    """The reader service: it answers read requests in its queue group, and asks the node that
    ran a job for its logs (only after checking the job is the requester's team's)."""
    return ["gpusched.node.*.logs"], [f"{subjects.READ_ANY} reader"]


def _node(p: Principal) -> tuple[list[str], list[str]]:
    pub = read_log() + read_snapshots()  # no dead letters: the services file them, a node could flood
    sub: list[str] = []
    for node in p.all_nodes():
        pub += subjects.node_event_subjects(node) + [subjects.heartbeat_subject(node)]
        # it answers its own jobs' log requests (`gpusched logs`: admin and the dashboard ask)
        sub += [subjects.node_control_subject(node), subjects.node_kill_subject(node),
                subjects.node_reset_subject(node), subjects.node_logs_subject(node)]
    return pub, sub


def permissions(public_key: str, p: Principal) -> dict:
    """The server's `permissions` block of one user."""
    sub = [f"{inbox_prefix(public_key)}.>"]
    if p.role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    if p.role in SERVICE_ROLES:
        pub, more = _service(p.role)
    elif p.role == "node":
        pub, more = _node(p)
    elif p.role == "auditor":
        pub, more = read_log() + read_snapshots() + read_requests(p), []
    elif p.role in ("tenant", "platform"):
        pub = [subjects.command_subject(kind, team, p.name) for team in p.teams for kind in subjects.TENANT_COMMANDS]
        # not gpusched.q.shares: the ledger's whole table is every team's standing; a tenant's
        # `teams` asks the reader, which answers with its own team's and the cluster's totals
        pub += read_requests(p) + on_behalf(p)
        more = []
    else:
        pub, more = [], []
    perms: dict = {"publish": {"allow": pub}, "subscribe": {"allow": sub + more}}
    if more:  # it answers requests: replies to the requester's inbox, once, within the window
        perms["allow_responses"] = True
    return perms


def users(ring: KeyRing) -> list[dict]:
    return [{"nkey": key, "permissions": permissions(key, p)} for key, p in ring.active().items()]


def auth_include(ring: KeyRing) -> str:
    """The `authorization` block alone, for `include`-ing into a hand-written config (deploy/)."""
    return "authorization: " + json.dumps({"users": users(ring), "timeout": 5}, indent=2) + "\n"


def server_config(ring: KeyRing, *, port: int, store_dir: str | os.PathLike, host: str = "127.0.0.1",
                  tls: dict[str, str] | None = None, name: str = "gpusched", cluster: dict | None = None) -> str:
    """A complete nats-server config: JetStream, auth on for every connection, no monitoring
    port. `tls`: {"cert_file", "key_file", "ca_file"} paths. `cluster`: {"name", "server_name",
    "port", "routes": [port, ...], "password"}: one member of a local JetStream cluster, its
    routes authenticated by the cluster's own password (a route bypasses client auth)."""
    conf: dict = {
        "server_name": cluster["server_name"] if cluster else name,
        "listen": f"{host}:{port}",
        "jetstream": {"store_dir": str(store_dir)},
        "max_payload": 8 * 1024 * 1024,
        "authorization": {"users": users(ring), "timeout": 5},
    }
    if tls:
        conf["tls"] = {**tls, "timeout": 5}
    if cluster:
        conf["cluster"] = cluster_block(cluster, host)
    # nats-server reads JSON: a config is a JSON object without the outer braces, or with them
    return json.dumps(conf, indent=2) + "\n"


def cluster_block(cluster: dict, host: str) -> dict:
    """The `cluster {}` block: listen on the member's route port, routes to every member (its
    own is ignored by the server), each route authenticated."""
    user, password = "route", cluster["password"]
    return {
        "name": cluster["name"],
        "listen": f"{host}:{cluster['port']}",
        "authorization": {"user": user, "password": password, "timeout": 5},
        "routes": [f"nats-route://{user}:{password}@{host}:{p}" for p in cluster["routes"]],
    }


def write_server_config(ring: KeyRing, path: str | os.PathLike, **kwargs) -> Path:
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(server_config(ring, **kwargs))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path
