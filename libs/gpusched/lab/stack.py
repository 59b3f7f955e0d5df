"""The whole deployed shape in a lab: the NATS cluster of `cluster.NatsCluster`, the control
plane in two service groups on hosts `svc-0` (Redis, admission, placement, fallback, projector)
and `svc-1` (preemptor, quota_ledger, reconciler), each node agent on its own host `gpuNN`, and
a `client` host for the CLI. Every process runs as deploy/k8s runs it (`gpusched service run
NAME`, its own identity from make-secrets.sh, TLS to the seed list of the three servers, the
log at R3); timings are shortened so that drills take seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .cluster import NatsCluster, make_secrets
from .netns import Lab

URLS = "tls://nats-0.nats:4222,tls://nats-1.nats:4222,tls://nats-2.nats:4222"
GROUPS = {"svc-0": ["admission", "placement", "fallback", "projector"],
          "svc-1": ["preemptor", "quota_ledger", "reconciler"]}


class LabStack:
    def __init__(self, work: Path, nodes: int = 3, node_timeout_s: float = 12.0, heartbeat_s: float = 1.0,
                 gpus: int = 2):
        self.work, self.node_timeout_s, self.heartbeat_s, self.gpus = work, node_timeout_s, heartbeat_s, gpus
        self.nodes = [f"gpu{i + 1:02d}" for i in range(nodes)]
        self.lab = Lab().up()
        self.secrets = make_secrets(work / "secrets", self.nodes)
        self.nats = NatsCluster(self.lab, work, self.secrets)
        self.procs: dict[str, subprocess.Popen] = {}
        self.specs: dict[str, tuple[str, list[str], str]] = {}  # name -> host, command, identity

    def env(self, identity: str) -> dict[str, str]:
        pw = (self.secrets / "redis-password").read_text().strip()
        base = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}  # never the caller's trust
        trust = self.secrets / "trust"
        return {**base, "GPUSCHED_NATS_URL": URLS, "GPUSCHED_IDENTITY_DIR": str(trust / "identities"),
                "GPUSCHED_KEYS": str(trust / "keys.json"), "GPUSCHED_CA": str(self.secrets / "tls" / "ca.pem"),
                "GPUSCHED_CREDS": str(self.secrets / "trust" / "identities" / f"{identity}.nk"),
                "GPUSCHED_STREAM_REPLICAS": "3", "GPUSCHED_REDIS_URL": f"redis://:{pw}@svc-0:6379/0",
                "GPUSCHED_CONFIG": str(self.work / "no-client-config.toml"),
                "GPUSCHED_NODE_TIMEOUT_S": f"{self.node_timeout_s:g}"}

    def spawn(self, host: str, name: str, cmd: list[str], identity: str) -> None:
        self.specs[name] = (host, cmd, identity)
        log = open(self.work / f"{name}.log", "ab")
        self.procs[name] = self.lab.popen(host, cmd, env=self.env(identity), cwd=self.work, stdout=log,
                                          stderr=subprocess.STDOUT)

    def restart(self, name: str) -> None:
        """Start a process again as it was started (after a kill -9 drill)."""
        host, cmd, identity = self.specs[name]
        self.spawn(host, name, cmd, identity)

    def gpusched(self, *args: str, identity: str = "admin", timeout: float = 30) -> subprocess.CompletedProcess:
        """The CLI on the client host, as admin by default."""
        return subprocess.run(["ip", "netns", "exec", self.lab.ns("client"), sys.executable, "-m",
                               "gpusched.cli.main", *args], env=self.env(identity), capture_output=True, text=True,
                              timeout=timeout)

    def up(self) -> LabStack:
        self.nats.add_hosts()
        for host in [*GROUPS, *self.nodes, "client"]:
            self.lab.add_host(host)
        self.lab.write_hosts()
        self.nats.start_all()
        self.nats.wait(lambda: all(self.nats.ready(n) for n in self.nats.names), 60)
        pw = (self.secrets / "redis-password").read_text().strip()
        self.spawn("svc-0", "redis", ["redis-server", "--bind", "0.0.0.0", "--port", "6379", "--requirepass", pw,
                                      "--save", "", "--appendonly", "no", "--dir", str(self.work)], "admin")
        boot = subprocess.run(["ip", "netns", "exec", self.lab.ns("client"), sys.executable, "-c",
                               "from gpusched.security.bootstrap import create_streams_sync as c; import os; "
                               "c(os.environ['GPUSCHED_NATS_URL'], os.environ['GPUSCHED_CREDS'], 3)"],
                              env=self.env("admin"), capture_output=True, text=True, timeout=60)
        if boot.returncode != 0:
            raise RuntimeError(f"streams: {boot.stderr[-1500:]}")
        extra = {"admission": ["--auto-create-teams"],
                 "reconciler": ["--node-timeout-s", f"{self.node_timeout_s:g}", "--no-process-grace-s", "3"]}
        for host, services in GROUPS.items():
            for s in services:
                self.spawn(host, s, [sys.executable, "-m", "gpusched.cli.main", "service", "run", s,
                                     *extra.get(s, [])], s)
        for i, node in enumerate(self.nodes):
            self.spawn(node, node, [sys.executable, "-m", "gpusched.cli.main", "service", "run", "nodeagent",
                                    "--backend", "sim", "--node", node, "--gpus", str(self.gpus), "--rack", "rack0",
                                    "--address", self.lab.hosts[node], "--heartbeat-s", f"{self.heartbeat_s:g}",
                                    "--kill-grace-s", "2", "--work-dir", str(self.work / node)], node)
        self.wait_nodes(len(self.nodes), 90)
        return self

    def jobs(self) -> list[dict]:
        done = self.gpusched("jobs", "--json")
        return json.loads(done.stdout) if done.returncode == 0 else []

    def node_docs(self) -> list[dict]:
        done = self.gpusched("nodes", "--json")
        return json.loads(done.stdout) if done.returncode == 0 else []

    def wait_nodes(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(1 for d in self.node_docs() if not d.get("lost")) >= n:
                return
            time.sleep(1)
        raise TimeoutError(f"{n} nodes not registered within {timeout:g}s; logs in {self.work}")

    def job_commands(self, host: str, marker: str) -> dict[int, str]:
        """The OS's census on one host: pid -> command line of the processes in its namespace
        whose command line has `marker` (the daemons' own excepted)."""
        out = {}
        for pid in self.lab.pids(host):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd and "gpusched" not in cmd:
                out[pid] = cmd
        return out

    def job_pids(self, host: str, marker: str) -> list[int]:
        return list(self.job_commands(host, marker))

    def down(self) -> None:
        for p in self.procs.values():
            p.kill()
        self.nats.stop()
        self.lab.down()
