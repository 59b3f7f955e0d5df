"""`gpusched up` (the whole stack on one machine) and `gpusched service run NAME` (one service,
the form deploy files use).

`up` starts NATS (JetStream) and Redis unless given URLs, then every service of the registry
as its own subprocess (`gpusched service run NAME ...`), so that each can be killed on its own
(`kill -9 $(jq .services.placement DATA/stack.json)` is the chaos test), and restarts a
service that died after `--restart-delay` seconds (`--no-restart`: leave it dead); NATS and
Redis that die are restarted at once on the same port and data dir. It prints ONE line when
the stack is ready (every service said READY=1 on the notify socket: `cli/startup.py`), writes
`DATA/stack.json` (URLs and pids of services and servers), and on SIGINT / SIGTERM stops the
services (the node agents stop their jobs, unless `--keep-jobs`), then Redis and NATS, and exits
0; killed outright, its children follow (PR_SET_PDEATHSIG), the node agents with SIGKILL so that
the jobs (each in its own session) run on and the next `up` on the same data dir adopts them;
when there are such runs, its reconciler starts only once the node agents said READY (adopted
them), so a restarted stack never calls a job lost for the restart itself. DATA defaults to
`$XDG_DATA_HOME/gpusched` and is kept across runs (`--fresh` empties it, after stopping the job
processes a crashed `up` left running). Logs: `DATA/logs/NAME.log`, rotated at `--log-max-mb`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpusched.bus.log import connect
from gpusched.bus.servers import Server, die_with_parent, seed_urls, start_nats, start_nats_cluster, start_redis
from gpusched.cli.startup import (
    LogPump,
    RotatingLog,
    StartupNotify,
    choose_port,
    claim_data_dir,
    default_data_dir,
    harden_data_dir,
)
from gpusched.security import clientconfig
from gpusched.security import trust as trust_mod
from gpusched.services.dashboard import control


def service_command(name: str, nats_url: str, redis_url: str, *extra: str) -> list[str]:
    """The command line of one service process. A Redis URL with a password stays off it
    (`ps` shows every process's arguments to every user on the host): `spawn_service` gives
    the URL without it, and the password as a file or an inherited descriptor."""
    redis = [] if urlsplit(redis_url).password else ["--redis", redis_url]
    return [sys.executable, "-m", "gpusched.cli.main", "service", "run", name, "--nats", nats_url, *redis, *extra]


def password_handover(redis_url: str, password_file: str | os.PathLike | None) -> tuple[str, dict[str, str], int | None]:
    """How a service gets the Redis password: (the URL without it, the environment naming where
    it is, a pipe's read end to inherit or None). `password_file` (0600, `up` writes it) is
    named as is; without one the password goes down a pipe the service reads once (`/dev/fd/N`),
    so it is in no file, no argument and no environment."""
    from gpusched.redis_client import PASSWORD_FILE_ENV, without_password

    url, password = without_password(redis_url)
    if password is None:
        return url, {}, None
    if password_file is not None:
        return url, {PASSWORD_FILE_ENV: str(password_file)}, None
    read, write = os.pipe()
    os.write(write, password.encode())
    os.close(write)
    return url, {PASSWORD_FILE_ENV: f"/dev/fd/{read}"}, read


def service_creds(name: str, identity_dir: str | os.PathLike | None = None) -> str | None:
    """The credentials a service runs with: its own role's identity from `identity_dir` (or
    $GPUSCHED_IDENTITY_DIR, which `up` and the test fixtures set), else whatever the caller has."""
    directory = identity_dir or os.environ.get("GPUSCHED_IDENTITY_DIR")
    if directory:
        path = Path(directory) / f"{name}.nk"
        if path.exists():
            return str(path)
    return os.environ.get("GPUSCHED_CREDS")


def spawn_service(name: str, nats_url: str, redis_url: str, extra: list[str] | tuple[str, ...] = (),
                  log_path: str | os.PathLike | None = None, env: dict[str, str] | None = None,
                  creds: str | os.PathLike | None = None, pipe: bool = False,
                  death_signal: int = signal.SIGTERM,
                  redis_password_file: str | os.PathLike | None = None) -> subprocess.Popen:
    """Start one service as a subprocess in its own session (signals from a terminal reach
    only `up`, which stops the services in order), as its own identity (`service_creds`), ended
    by `death_signal` if its parent dies. Output goes to `log_path`, or to a pipe (`pipe=True`: `up`
    rotates it). Used by `up`, the e2e tests and the bench."""
    if pipe:
        log_path = None
    log_file = open(log_path, "ab") if log_path is not None else None
    out = log_file if log_file is not None else (subprocess.PIPE if pipe else subprocess.DEVNULL)
    # The project's interpreter comes first on PATH, so a job's `python` on the simulated nodes
    # is the one gpusched (and its job SDK) is installed in.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    redis_url, password_env, inherited = password_handover(redis_url, redis_password_file)
    full_env = {**os.environ, "PATH": path, "GPUSCHED_NATS_URL": nats_url, "GPUSCHED_REDIS_URL": redis_url,
                **password_env, **(env or {})}
    creds = creds or service_creds(name)
    if creds:
        full_env["GPUSCHED_CREDS"] = str(creds)
    try:
        return subprocess.Popen(service_command(name, nats_url, redis_url, *extra), stdout=out,
                                stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
                                preexec_fn=die_with_parent(death_signal),
                                pass_fds=() if inherited is None else (inherited,))
    finally:
        if log_file is not None:
            log_file.close()
        if inherited is not None:
            os.close(inherited)


def stop_processes(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM all, wait, then SIGKILL the ones still running."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@dataclass
class Child:
    name: str
    argv_extra: list[str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    died_at: float | None = None
    held: bool = False  # stopped on purpose (dashboard control): not restarted
    env: dict[str, str] = field(default_factory=dict)  # secrets for this child only (not on argv)
    ready: bool = False  # said READY=1 on the notify socket since its last start
    after: str | None = None  # first started once this sibling said READY (the reconciler: the node agents)


#: How `up` going away ends a service: SIGTERM (an orderly stop) for all but the node agents,
#: which die outright so that their jobs run on, to be adopted by the next `up` (a crash of
#: `up` must not end the jobs; its orderly stop does, unless `--keep-jobs`).
DEATH_SIGNAL = {"nodeagent": signal.SIGKILL}

#: The simulated nodes' kill grace (SIGTERM to SIGKILL of a job): a node daemon's orderly stop
#: takes up to `shell.stop_grace_s` (8 s plus this), within `STOP_TIMEOUT_S`.
NODE_KILL_GRACE_S = 5.0
#: How long `up`'s orderly stop waits for the services before it kills them: past their own
#: stop grace and its cancellation.
STOP_TIMEOUT_S = 15.0


@dataclass
class Stack:
    args: argparse.Namespace
    data_dir: Path
    nats_url: str = ""
    redis_url: str = ""
    redis_password_file: Path | None = None  # 0600: how the services get the Redis password
    dashboard_url: str | None = None
    servers: list[Server] = field(default_factory=list)
    children: dict[str, Child] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    trust: Any = None  # security.trust.TrustStore of the embedded NATS
    ca: str | None = None
    notify: StartupNotify | None = field(default_factory=StartupNotify)
    pumps: dict[str, LogPump] = field(default_factory=dict)

    # --- start ------------------------------------------------------------------------------

    @property
    def admin_creds(self) -> str | None:
        """What `up` itself connects with: its own admin identity, or (external NATS) the caller's
        (`--creds`; None: $GPUSCHED_CREDS, then the client config)."""
        return str(self.trust.creds("admin")) if self.trust is not None else getattr(self.args, "creds", None)

    def creds_for(self, service: str) -> str | None:
        if self.trust is None:
            return self.admin_creds  # external NATS: the services use the caller's credentials
        return str(self.trust.creds(trust_mod.NODE_HOST if service == "nodeagent" else service))

    def start_trust(self) -> None:
        """The stack's identities (created on first start, kept in DATA/trust) and, when the
        caller already holds admin credentials ($GPUSCHED_CREDS), those too."""
        from gpusched.security import identity, keyring
        from gpusched.services.nodeagent.main import sim_node_names

        self.trust = trust_mod.TrustStore(self.data_dir / "trust")
        self.trust.ensure_stack(sim_node_names(self.args.nodes))
        caller = getattr(self.args, "creds", None) or os.environ.get("GPUSCHED_CREDS")
        if caller and Path(caller).exists():
            ident = identity.load(caller)
            ring = self.trust.ring()
            if ident.role == "admin" and ident.public_key not in ring.keys:
                ring.add(ident.public_key, keyring.Principal(name=f"caller-{ident.name}", role="admin"))
                keyring.save(ring, self.trust.keys_file)

    def start_servers(self) -> None:
        a = self.args
        if a.nats:
            self.nats_url = a.nats
            if a.replicas is not None:  # an existing cluster: scale the log as asked (caller's admin creds)
                from gpusched.security.bootstrap import create_streams_sync

                create_streams_sync(self.nats_url, None, a.replicas)
        else:
            self.start_nats()
        if a.redis:
            self.redis_url = a.redis
        else:
            server = start_redis(choose_port(a.redis_port, 6379, "--redis-port"), workdir=self.data_dir / "redis")
            self.servers.append(server)
            self.redis_url = server.url
        self.redis_password_file = self.write_redis_password()

    def write_redis_password(self) -> Path | None:
        """The Redis password as a 0600 file in the 0700 data dir (`DATA/redis.password`), the
        one way `up` gives it to its services."""
        from gpusched.redis_client import without_password

        password = without_password(self.redis_url)[1]
        if password is None:
            return None
        path = self.data_dir / "redis.password"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        os.chmod(tmp, 0o600)  # whatever the umask or an older file's mode
        os.replace(tmp, path)
        return path

    def start_nats(self) -> None:
        """The embedded NATS: one server, or `--nats-cluster N` servers clustered on this machine
        (data in DATA/nats-cluster/nats-<i>), the log at `--replicas` (checked against N first)."""
        from gpusched.security.bootstrap import create_streams_sync

        a = self.args
        size, replicas = cluster_shape(a.nats_cluster, a.replicas)
        self.start_trust()
        tls = None
        if a.tls:
            from gpusched.security import tlsgen

            tls = tlsgen.ensure(self.data_dir / "tls")
            self.ca = tls["ca_file"]
            os.environ["GPUSCHED_CA"] = self.ca  # this process and its children verify the server
        if size == 1:
            server = start_nats(choose_port(a.nats_port, 4222, "--nats-port"), store_dir=self.data_dir / "nats",
                                trust=self.trust, tls=tls)
            self.servers.append(server)
            self.nats_url = server.url
        else:
            pick = None if a.nats_port is None else 0  # an explicit first port: the others any free one
            ports = [choose_port(a.nats_port if i == 0 else pick, 4222 + i, "--nats-port") for i in range(size)]
            routes = [choose_port(pick, 6222 + i, "--nats-port") for i in range(size)]
            members = start_nats_cluster(size, self.data_dir / "nats-cluster", self.trust, ports, routes, tls)
            self.servers.extend(members)
            self.nats_url = seed_urls(members)
        create_streams_sync(self.nats_url, self.admin_creds, replicas)

    def plan(self) -> None:
        from gpusched.services import registry

        a = self.args
        wanted = [n.strip() for n in a.services.split(",")] if a.services else [
            s.name for s in registry.SERVICES.values() if s.in_stack]
        ttl = ["--lease-ttl-ms", str(a.lease_ttl_ms)]
        policy = ["--policy", a.policy] + [f"--policy-set={kv}" for kv in a.policy_set]
        extra: dict[str, list[str]] = {
            "admission": ["--placeholders", a.placeholders, *(["--auto-create-teams"] if a.teams == "auto" else []),
                          "--checkpoint-root", str(self.data_dir / "work" / "checkpoints")],  # the nodes' root
            "placement": [*policy, *ttl],
            "preemptor": policy,
            "projector": policy,  # its fold and queue order follow the running policy
            "quota_ledger": policy,  # its standings order teams as the running policy does
            "reader": policy,  # `show` for tenants explains under the running policy
            "reconciler": [*policy, *reconciler_timings(a)],  # idle_util_pct, idle_after_s; timings
            "fallback": [*policy, *ttl],  # it orders the queue as the running policy does
            "nodeagent": ["--backend", "sim", "--count", str(a.nodes), "--gpus", str(a.gpus_per_node),
                          *(["--gpu-types", a.gpu_types] if a.gpu_types else []),
                          *(["--mig"] if getattr(a, "mig", False) else []),
                          "--nodes-per-rack", str(a.nodes_per_rack), "--nvlink", a.nvlink,
                          "--work-dir", str(self.data_dir / "work"), "--heartbeat-s", "2",
                          "--kill-grace-s", f"{NODE_KILL_GRACE_S:g}", *(["--keep-jobs"] if a.keep_jobs else []),
                          *(["--uid-range", a.uid_range] if a.uid_range else []),
                          *(["--cpus", f"{a.node_cpus:g}"] if a.node_cpus is not None else []),
                          *(["--mem", a.node_mem] if a.node_mem is not None else []),
                          "--checkpoint-root", str(self.data_dir / "work" / "checkpoints")],
        }
        env: dict[str, dict[str, str]] = {}
        if a.node_timeout_s is not None:  # the agents' fences must fire before the reconciler's timeout
            env["nodeagent"] = {"GPUSCHED_NODE_TIMEOUT_S": f"{a.node_timeout_s:g}"}
        if "dashboard" in wanted and registry.available("dashboard"):
            from gpusched.services.dashboard.guard import new_token

            port = choose_port(a.dashboard_port, 8080, "--dashboard-port")
            extra["dashboard"] = ["--port", str(port), *policy]  # its job view explains under the running policy
            token = os.environ.get("GPUSCHED_DASHBOARD_TOKEN") or new_token()  # the login, as Jupyter's
            env["dashboard"] = {"GPUSCHED_DASHBOARD_TOKEN": token,  # admins may also sign in with their nkey
                                "GPUSCHED_KEYS": str(self.data_dir / "trust" / "keys.json")}
            self.dashboard_url = f"http://127.0.0.1:{port}/?token={token}"
        for i, name in enumerate(wanted):
            if name not in registry.SERVICES:
                raise SystemExit(f"gpusched up: unknown service {name!r}; known: {', '.join(registry.SERVICES)}")
            if not registry.available(name):
                self.missing.append(name)
                continue
            argv = extra.get(name, [])
            if a.metrics_port_base and name != "dashboard":  # the dashboard serves /metrics itself
                argv = [*argv, "--metrics-port", str(a.metrics_port_base + i)]
            self.children[name] = Child(name, argv, env=env.get(name, {}))
        if "nodeagent" in self.children and "reconciler" in self.children and self.runs_to_adopt():
            self.children["reconciler"].after = "nodeagent"

    def runs_to_adopt(self) -> bool:
        """The node agents' state files record runs (`up` crashed, or stopped with --keep-jobs):
        the reconciler then starts only once the agents have adopted them and said READY, so that
        it never calls a job lost, or its node silent, for the restart itself."""
        try:
            return any((self.data_dir / "work" / "runs").glob("*/*.json"))
        except OSError:
            return False

    def spawn_due(self) -> None:
        """Start every child not started yet whose `after` sibling is ready (or absent)."""
        self.collect_ready()
        for child in self.children.values():
            first = self.children.get(child.after) if child.after else None
            if child.proc is None and not child.held and (first is None or first.ready):
                self.spawn(child)

    def spawn(self, child: Child) -> None:
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = {**child.env, **({"NOTIFY_SOCKET": self.notify.address} if self.notify is not None else {})}
        child.proc = spawn_service(child.name, self.nats_url, self.redis_url, child.argv_extra, env=env, pipe=True,
                                   creds=self.creds_for(child.name),
                                   death_signal=DEATH_SIGNAL.get(child.name, signal.SIGTERM),
                                   redis_password_file=self.redis_password_file)
        self.pumps[child.name] = LogPump(child.proc, RotatingLog(logs / f"{child.name}.log",
                                                                 int(self.args.log_max_mb * 2**20)))
        child.died_at, child.ready = None, False
        self.write_state()

    def write_state(self) -> None:
        state = {
            "nats": self.nats_url, "redis": self.redis_url, "dashboard": self.dashboard_url,
            "data_dir": str(self.data_dir), "pid": os.getpid(),
            "services": {n: c.proc.pid for n, c in self.children.items() if c.proc is not None},
            "servers": {srv.name: srv.proc.pid for srv in self.servers},
            "nats_servers": [{"name": srv.name, "url": srv.url, "pid": srv.proc.pid, "data": str(srv.workdir)}
                             for srv in self.servers if srv.name.startswith("nats")],
        }
        if self.trust is not None:
            state["admin_creds"] = self.admin_creds
        tmp = self.data_dir / "stack.json.tmp"
        tmp.touch(mode=0o600)  # it holds the dashboard's login URL
        tmp.write_text(json.dumps(state, indent=2))
        os.chmod(tmp, 0o600)  # it names the Redis password
        tmp.replace(self.data_dir / "stack.json")

    # --- readiness ----------------------------------------------------------------------------

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.data_dir / "logs" / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def ready_line_seen(self, name: str) -> bool:
        """The service said READY=1 (systemd's notify protocol) since its last start."""
        self.collect_ready()
        child = self.children.get(name)
        return child is not None and child.ready

    def collect_ready(self) -> None:
        if self.notify is None:
            return
        by_pid = {c.proc.pid: c for c in self.children.values() if c.proc is not None}
        for pid in self.notify.ready_pids():
            if pid in by_pid:
                by_pid[pid].ready = True

    async def wait_ready(self, timeout: float) -> None:
        from gpusched.bus.log import EventLog
        from gpusched.core.state import ClusterState

        deadline = time.monotonic() + timeout
        own = [n for n in self.children if n not in ("nodeagent", "dashboard")]
        log = await EventLog.open(self.nats_url, name="gpusched-up", creds=self.admin_creds)
        try:
            if "nodeagent" not in self.children:
                await register_simulated_nodes(log, self.args.nodes, self.args.gpus_per_node,
                                               self.args.nodes_per_rack, self.args.nvlink, self.args.gpu_types)
            state, seq = ClusterState(), 0
            while True:
                self.spawn_due()  # the reconciler once the node agents are ready
                for name, child in self.children.items():
                    if child.proc is not None and child.proc.poll() is not None:
                        raise RuntimeError(f"service {name} exited with code {child.proc.returncode} while "
                                           f"starting:\n{self.log_tail(name)}")
                async for s, e in log.replay(seq + 1):
                    state.apply(e, s)
                    seq = s
                nodes_ok = len(state.nodes) >= self.args.nodes
                services_ok = all(self.ready_line_seen(n) for n in own)
                dash_ok = self.dashboard_url is None or _http_ok(self.dashboard_url.split("/?")[0] + "/healthz")
                if nodes_ok and services_ok and dash_ok:
                    return
                if time.monotonic() > deadline:
                    waiting = [n for n in own if not self.ready_line_seen(n)]
                    raise RuntimeError(f"stack not ready within {timeout:.0f}s: nodes {len(state.nodes)}/"
                                       f"{self.args.nodes}, services waiting: {waiting or 'none'}, "
                                       f"dashboard {'ok' if dash_ok else 'not answering'}")
                await asyncio.sleep(0.2)
        finally:
            await log.close()

    # --- run ----------------------------------------------------------------------------------

    def supervise_servers(self) -> None:
        """Restart NATS or Redis that died, on the same port and data dir: the log is on disk,
        and the services reconnect by themselves."""
        for server in self.servers:
            if server.proc.poll() is None:
                continue
            print(f"gpusched up: {server.name}-server exited with code {server.proc.returncode}; restarting "
                  f"on port {server.port}", file=sys.stderr, flush=True)
            try:
                server.restart()
            except RuntimeError as err:  # port still busy: next tick
                print(f"gpusched up: {err}", file=sys.stderr, flush=True)
            self.write_state()

    def supervise(self, stop: asyncio.Event) -> None:
        """Restart a service that died (after the delay), unless --no-restart."""
        self.supervise_servers()
        self.spawn_due()
        now = time.monotonic()
        for child in self.children.values():
            if child.held or child.proc is None or child.proc.poll() is None:
                continue
            if child.died_at is None:
                child.died_at = now
                print(f"gpusched up: service {child.name} exited with code {child.proc.returncode}"
                      + ("" if self.args.no_restart else f"; restarting in {self.args.restart_delay:g}s"),
                      file=sys.stderr, flush=True)
            if not self.args.no_restart and now - child.died_at >= self.args.restart_delay and not stop.is_set():
                child.restarts += 1
                self.spawn(child)

    def stop(self) -> None:
        stop_processes([c.proc for c in self.children.values() if c.proc is not None], timeout=STOP_TIMEOUT_S)
        for server in reversed(self.servers):
            server.proc.send_signal(signal.SIGCONT)  # a stopped server must still hear SIGTERM
            server.stop()
        for pump in self.pumps.values():
            pump.join(timeout=2)
        if self.notify is not None:
            self.notify.close()


def reconciler_timings(args: argparse.Namespace) -> list[str]:
    """The reconciler's options that `up` passes on when given (else the reconciler's defaults)."""
    out: list[str] = []
    for flag in ("node_timeout_s", "no_process_grace_s"):
        value = getattr(args, flag, None)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", f"{value:g}"]
    return out


def cluster_shape(size: int, replicas: int | None) -> tuple[int, int]:
    """(servers, log replicas) of the embedded NATS: replicas default to 1 on one server and to
    3 (at most the cluster's size) on a cluster; more replicas than servers is refused up front."""
    if size < 1:
        raise RuntimeError(f"--nats-cluster {size}: at least one server")
    if replicas is None:
        replicas = 1 if size == 1 else min(3, size)
    if replicas < 1:
        raise RuntimeError(f"--replicas {replicas}: at least 1")
    if replicas > size:
        raise RuntimeError(f"--replicas {replicas} needs at least {replicas} NATS servers, but --nats-cluster is "
                           f"{size}; pass --nats-cluster {replicas} (or lower --replicas)")
    return size, replicas


async def close_quietly(nc) -> None:
    """Close a connection (`connection.close`), but never hang or fail the shutdown on it (NATS
    may be down, or hung: then even the close after the drain's bound may wait)."""
    from gpusched.bus import connection

    try:
        await asyncio.wait_for(connection.close(nc), connection.CLOSE_DRAIN_S + 1.0)
    except Exception:
        pass


def _without_password(url: str) -> str:
    """A Redis URL fit to print (the password stays in stack.json and the client config, 0600)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return url if not parts.password else url.replace(f":{parts.password}@", ":***@", 1)


def _http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status < 500
    except Exception:
        return False


def simulated_nodes(nodes: int, gpus_per_node: int, nodes_per_rack: int, nvlink: str, at: float | None = None,
                    prefix: str = "node", gpu_types: str | None = None):
    """NodeRegistered events of a simulated cluster without daemons: what `up`
    appends itself when no node daemon is installed, and what tests and the bench use. Names
match the simulated node daemons': `node00` in `rack00`, ...; `gpu_types` (`2:H100,2:A100`):
    each node's model, and so how many nodes."""
    from gpusched.core import events as ev
    from gpusched.core.model import GpuInfo, nvlink_domains
    from gpusched.core.pools import parse_gpu_types, sim_memory_mb

    models = parse_gpu_types(gpu_types) if gpu_types else ["SIM-H100"] * nodes
    nodes = len(models)

    at = time.time() if at is None else at
    width = max(2, len(str(nodes - 1)))
    out = []
    for i in range(nodes):
        name = f"{prefix}{i:0{width}d}"
        domains = nvlink_domains(nvlink, gpus_per_node)
        gpus = [GpuInfo(index=g, uuid=f"GPU-sim-{name}-{g}", model=models[i], memory_mb=sim_memory_mb(models[i]),
                        nvlink_domain=domains[g]) for g in range(gpus_per_node)]
        out.append(ev.NodeRegistered(at=at, node=name, rack=f"rack{i // max(1, nodes_per_rack):02d}", gpus=gpus,
                                     nvlink=nvlink))  # type: ignore[arg-type]
    return out


async def register_simulated_nodes(log, nodes: int, gpus_per_node: int, nodes_per_rack: int, nvlink: str,
                                   gpu_types: str | None = None) -> None:
    """Each registration is a compare-and-set, as every fact of the alloc tree
    (`bus.cas.append_cas`), against the tree's last sequence that a lost one names."""
    from gpusched.bus.log import Conflict

    for event in simulated_nodes(nodes, gpus_per_node, nodes_per_rack, nvlink, gpu_types=gpu_types):
        expected = 0
        for _ in range(100):
            try:
                await log.append(event, msg_id=f"register-{event.node}", expect_alloc_seq=expected)
                break
            except Conflict as conflict:
                if conflict.actual is None:  # another writer's check in flight: it names no sequence
                    await asyncio.sleep(0.01)
                expected = conflict.actual if conflict.actual is not None else expected
        else:
            raise RuntimeError(f"registering {event.node}: the alloc tree kept changing")


def cmd_up(args: argparse.Namespace) -> int:
    if args.gpu_types:
        from gpusched.core.pools import parse_gpu_types

        try:
            args.nodes = len(parse_gpu_types(args.gpu_types))
        except ValueError as err:
            print(f"gpusched up: --gpu-types: {err}", file=sys.stderr, flush=True)
            return 2
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    try:
        lock = claim_data_dir(data_dir, fresh=args.fresh)
    except RuntimeError as err:
        print(f"gpusched up: {err}", file=sys.stderr, flush=True)
        return 1
    stack = Stack(args, data_dir.resolve())

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            stack.start_servers()
            stack.plan()
            stack.spawn_due()
            harden_data_dir(stack.data_dir)  # what the servers and services made: private to up
            ready = asyncio.create_task(stack.wait_ready(args.ready_timeout))
            await asyncio.wait({ready, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                ready.cancel()
                return 0
            ready.result()
            controls = await connect(stack.nats_url, name="gpusched-up", creds=stack.admin_creds)
            if stack.trust is not None and not args.no_client_config:
                written = clientconfig.write({"nats": stack.nats_url, "redis": stack.redis_url,
                                              "creds": stack.admin_creds, "ca": stack.ca,
                                              "trust": str(stack.trust.dir)})
            await control.serve_controls(controls, control.stack_handlers(stack))  # dashboard stop/start
            parts = [f"nats {stack.nats_url}", f"redis {_without_password(stack.redis_url)}"]
            if stack.dashboard_url:
                parts.append(f"dashboard {stack.dashboard_url}")
            parts.append(f"{args.nodes} nodes x {args.gpus_per_node} GPUs, policy {args.policy}, data {data_dir}")
            if stack.trust is not None:
                parts.append(f"admin creds {stack.admin_creds}"
                             + ("" if args.no_client_config else f" (client config {written})"))
            if stack.missing:
                parts.append(f"not installed: {', '.join(stack.missing)}")
            print("gpusched up: ready - " + " | ".join(parts), flush=True)
            while not stop.is_set():
                stack.supervise(stop)
                try:
                    await asyncio.wait_for(stop.wait(), 0.5)
                except TimeoutError:
                    pass
            await close_quietly(controls)
            return 0
        except RuntimeError as err:
            print(f"gpusched up: {err}", file=sys.stderr, flush=True)
            return 1

    try:
        return asyncio.run(main())
    finally:
        stack.stop()
        lock.close()
        print("gpusched up: stopped", file=sys.stderr, flush=True)


def cmd_service_run(args: argparse.Namespace) -> int:
    from gpusched.services import registry
    from gpusched.services.shell import common_arguments, run

    if args.name not in registry.SERVICES:
        raise SystemExit(f"gpusched service run: unknown service {args.name!r}; known: {', '.join(registry.SERVICES)}")
    try:
        entry = registry.load(args.name)
    except (ModuleNotFoundError, AttributeError) as err:
        raise SystemExit(f"gpusched service run: service {args.name} is not installed ({err})") from None
    parser = argparse.ArgumentParser(prog=f"gpusched service run {args.name}",
                                     description=registry.SERVICES[args.name].about, conflict_handler="resolve")
    common_arguments(parser)  # every service takes --nats, --redis, --log-level
    entry.add_arguments(parser)
    opts = parser.parse_args(args.rest)
    from gpusched.redis_client import PASSWORD_FILE_ENV, SecretFileError, redis_password, redis_url

    for flag, var in (("nats", "GPUSCHED_NATS_URL"), ("redis", "GPUSCHED_REDIS_URL"),
                      ("redis_password_file", PASSWORD_FILE_ENV)):
        if getattr(opts, flag, None):
            os.environ[var] = getattr(opts, flag)  # for modules that read the environment
    try:
        redis_password(redis_url(opts.redis))  # a bad password file is refused now, precisely
    except SecretFileError as err:
        raise SystemExit(f"gpusched service run {args.name}: {err}") from None
    return run(entry.serve, opts, args.name)


def cmd_service_list(args: argparse.Namespace) -> int:
    from gpusched.services import registry

    for s in registry.SERVICES.values():
        mark = "" if registry.available(s.name) else "  (not installed)"
        print(f"{s.name:14s} {s.about}{mark}")
    return 0


def _cluster_arguments(up: argparse.ArgumentParser) -> None:
    """`up`'s simulated cluster: its nodes, their GPUs and how they are laid out."""
    up.add_argument("--nodes", type=int, default=4, help="simulated nodes (default 4)")
    up.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per simulated node (default 8)")
    up.add_argument("--gpu-types", default=None, metavar="COUNT:MODEL,...",
                    help="a mixed cluster: each simulated node's GPU model in order, e.g. 2:H100,2:A100 "
                         "(sets --nodes; docs/gpu-pools.md)")
    up.add_argument("--mig", action="store_true",
                    help="the simulated A100/H100 GPUs are in MIG mode, offering their published profiles: an admin "
                         "lays out slices with `gpusched mig set` (docs/gpu-sharing.md#mig-slices)")
    up.add_argument("--nodes-per-rack", type=int, default=4, help="simulated nodes per rack (default 4)")
    up.add_argument("--nvlink", choices=["all", "pairs", "quads", "none"], default="all",
                    help="NVLink layout inside a simulated node (default: all)")


def register(sub) -> None:
    up = sub.add_parser("up", help="start NATS, Redis, every service and simulated nodes on this machine")
    _cluster_arguments(up)
    up.add_argument("--nats", default=None,
                    help="use this NATS server (or cluster: a comma-separated seed list) instead of starting one")
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="start N JetStream servers clustered on this machine (default 1: one server); every "
                         "service and the client config get the seed list")
    up.add_argument("--replicas", type=int, default=None,
                    help="replicas of the log's stream (default 1 on one server, 3 on a cluster); more than "
                         "the cluster's servers is refused at start")
    up.add_argument("--redis", default=None, help="use this Redis instead of starting one")
    up.add_argument("--nats-port", type=int, default=None,
                    help="port of the embedded NATS (default 4222, or any free one if busy; 0: any free one; "
                         "an explicit port that is busy is an error)")
    up.add_argument("--redis-port", type=int, default=None,
                    help="port of the embedded Redis (default 6379, or any free one if busy; 0: any free one)")
    up.add_argument("--dashboard-port", type=int, default=None,
                    help="port of the dashboard (default 8080, or any free one if busy; 0: any free one)")
    up.add_argument("--metrics-port-base", type=int, default=0,
                    help="serve each service's Prometheus /metrics on BASE+i (0: only the dashboard's /metrics)")
    up.add_argument("--data-dir", default=None,
                    help="NATS store, Redis dir, logs, stack.json: kept across runs (default: "
                         "$XDG_DATA_HOME/gpusched, i.e. ~/.local/share/gpusched)")
    up.add_argument("--fresh", action="store_true", help="start an empty cluster: delete the data dir's store first")
    up.add_argument("--log-max-mb", type=float, default=10.0,
                    help="rotate each service log at this size (3 old files kept)")
    up.add_argument("--policy", default="full", help="scheduling policy preset (default: full)")
    up.add_argument("--policy-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one field of the policy preset (repeatable)")
    up.add_argument("--services", default=None, help="comma-separated subset of services to start")
    up.add_argument("--lease-ttl-ms", type=int, default=3000,
                    help="placement lease TTL: how soon the fallback takes over (default 3000)")
    up.add_argument("--restart-delay", type=float, default=5.0, help="seconds before a dead service is restarted")
    up.add_argument("--no-restart", action="store_true", help="leave dead services dead (chaos demos)")
    up.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for every service to be ready")
    up.add_argument("--keep-jobs", action="store_true",
                    help="on Ctrl-C / SIGTERM leave the simulated nodes' job processes running for the next `up` "
                         "on this data dir to adopt (default: stop them; a crash of `up` always leaves them running)")
    up.add_argument("--uid-range", default=None, metavar="FIRST-LAST",
                    help="dynamic uids of the simulated nodes' jobs (default when root: 61184-65519, one uid per "
                         "running job, never root; 'none': jobs run as up's own user, for a machine where the "
                         "jobs' programs are under a private home)")
    up.add_argument("--node-cpus", type=float, default=None, metavar="N",
                    help="CPUs each simulated node offers jobs (default: not declared, CPUs are not scheduled)")
    up.add_argument("--node-mem", default=None, metavar="SIZE",
                    help="memory each simulated node offers jobs, like 64G (default: not declared)")
    up.add_argument("--node-timeout-s", type=float, default=None, metavar="S",
                    help="a node silent this long is lost and its jobs requeued (reconciler); the node agents "
                         "fence their jobs before it (default 30)")
    up.add_argument("--no-process-grace-s", type=float, default=None, metavar="S",
                    help="reconciler: a running job its node's heartbeats show without a process this long is "
                         "requeued or failed (default 60)")
    up.add_argument("--tls", action="store_true",
                    help="NATS over TLS with a local CA generated under DATA/tls (clients verify it)")
    up.add_argument("--no-client-config", action="store_true",
                    help="do not write the client config ($GPUSCHED_CONFIG or ~/.config/gpusched/config.toml)")
    up.add_argument("--placeholders", choices=["refuse", "bounded", "any"], default="bounded",
                    help="jobs without a command on the simulated nodes: bounded (default: they need a time limit "
                         "or GPUSCHED_SIM_DURATION_S), any, or refuse")
    up.add_argument("--teams", choices=["auto", "strict"], default="auto",
                    help="auto (default for this dev stack): a job of a team nobody created creates it; strict: "
                         "refused until `gpusched quota TEAM` creates it (a deployed admission's default)")
    up.set_defaults(func=cmd_up)

    service = sub.add_parser("service", help="run one service (the form deploy files use)")
    ssub = service.add_subparsers(dest="service_command", required=True, metavar="ACTION")
    run = ssub.add_parser("run", help="run one service in the foreground", add_help=False)
    run.add_argument("name", help="the service (gpusched service list)")
    run.add_argument("rest", nargs=argparse.REMAINDER, help="the service's own options (gpusched service run NAME --help)")
    run.set_defaults(func=cmd_service_run)
    lst = ssub.add_parser("list", help="list the services")
    lst.set_defaults(func=cmd_service_list)
