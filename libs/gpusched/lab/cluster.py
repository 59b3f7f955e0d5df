"""The deployed NATS cluster in a lab: deploy/k8s/nats-cluster.conf as it is (only its file
paths moved under the lab's work dir), the users, permissions and certificates from
deploy/k8s/make-secrets.sh, each server on its own host `nats-N` (named `nats-N.nats`, as the
StatefulSet's pods are), TLS on routes and clients. Readiness is the probe deploy/k8s/nats.yaml
runs, run inside each server's host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from gpusched.bus.servers import find_binary

from .netns import Lab

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "k8s"


def make_secrets(out: Path, nodes: list[str]) -> Path:
    """deploy/k8s/make-secrets.sh, with this installation's `gpusched`."""
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    done = subprocess.run(["bash", str(DEPLOY / "make-secrets.sh"), ",".join(nodes), str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"make-secrets.sh: {done.stderr.strip()}")
    return out


def readiness_probe() -> str:
    """The readiness probe deploy/k8s/nats.yaml gives each NATS pod (a shell command)."""
    docs = list(yaml.safe_load_all((DEPLOY / "nats.yaml").read_text()))
    pod = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    return pod["containers"][0]["readinessProbe"]["exec"]["command"][2]


class NatsCluster:
    def __init__(self, lab: Lab, work: Path, secrets: Path, size: int = 3):
        self.lab, self.work, self.secrets, self.size = lab, work, secrets, size
        self.names = [f"nats-{i}" for i in range(size)]
        self.procs: dict[str, subprocess.Popen] = {}

    def add_hosts(self) -> None:
        for name in self.names:
            self.lab.add_host(name, aliases=(f"{name}.nats",))

    def start(self, name: str) -> None:
        text = (DEPLOY / "nats-cluster.conf").read_text()
        d = self.work / name
        d.mkdir(parents=True, exist_ok=True)
        text = (text.replace("/etc/nats/tls", str(self.secrets / "tls")).replace("/data/jetstream", str(d / "js"))
                .replace("/var/run/nats/nats.pid", str(d / "nats.pid")))
        (d / "cluster.conf").write_text(text)
        (d / "auth.conf").write_text((self.secrets / "auth.conf").read_text())
        self.procs[name] = self.lab.popen(name, [find_binary("nats-server"), "-c", str(d / "cluster.conf")],
                                          cwd=d, env={**os.environ, "NATS_NAME": name},
                                          stdout=open(d / "log", "ab"), stderr=subprocess.STDOUT)

    def start_all(self) -> None:
        for name in self.names:
            self.start(name)

    def ready(self, name: str) -> bool:
        return self.lab.run(name, ["sh", "-c", readiness_probe()]).returncode == 0

    def monitor(self, name: str, path: str) -> dict:
        done = self.lab.run(name, ["wget", "-qO-", f"http://127.0.0.1:8222{path}"])
        return json.loads(done.stdout) if done.returncode == 0 and done.stdout else {}

    def meta_leader(self, name: str) -> str:
        return (self.monitor(name, "/jsz").get("meta_cluster") or {}).get("leader") or ""

    def wait(self, pred, timeout: float = 30.0, step: float = 0.2) -> float:
        """Seconds until `pred()` holds; raises TimeoutError after `timeout`."""
        t0 = time.monotonic()
        while not pred():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"not within {timeout:g}s")
            time.sleep(step)
        return time.monotonic() - t0

    def log(self, name: str) -> str:
        return (self.work / name / "log").read_text(errors="replace")

    def stop(self) -> None:
        for p in self.procs.values():
            p.kill()
            p.wait(10)
