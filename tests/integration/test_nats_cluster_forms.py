"""The deployed NATS cluster forms: three servers run deploy/k8s/nats-cluster.conf (only its
addresses and paths moved to this machine's loopback) with the certificates, users and
permissions that deploy/k8s/make-secrets.sh makes, and within seconds their routes are up and a
JetStream meta leader is elected; the readiness probe (gpusched.health.nats_readiness, and the
shell copy deploy/k8s/nats.yaml runs) says so. With a route certificate made for serverAuth
only (the bug this guards against: "x509: certificate specifies an incompatible key usage")
the cluster never forms and the same probe says not ready."""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpusched import health
from gpusched.bus.servers import find_binary, free_port

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("secrets")
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    done = subprocess.run(["bash", str(K8S / "make-secrets.sh"), "gpu01", str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def loopback_config(text: str, i: int, ports: list[dict], tls_dir: Path, work: Path) -> str:
    """deploy/k8s/nats-cluster.conf for server i, its addresses on loopback, its paths in `work`."""
    p = ports[i]
    text = text.replace("listen: 0.0.0.0:4222", f"listen: 127.0.0.1:{p['client']}")
    text = text.replace("http: 127.0.0.1:8222", f"http: 127.0.0.1:{p['http']}")
    text = text.replace("listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{p['route']}")
    for j, q in enumerate(ports):
        text = text.replace(f"nats-route://nats-{j}.nats:6222", f"nats-route://localhost:{q['route']}")
    text = text.replace("/etc/nats/tls", str(tls_dir)).replace("/data/jetstream", str(work / "js"))
    text = text.replace("/var/run/nats/nats.pid", str(work / "nats.pid"))
    assert "nats-route://nats-" not in text and "0.0.0.0" not in text, "the config's shape changed"
    return text


def start_cluster(secrets: Path, tls_dir: Path, root: Path) -> tuple[list[subprocess.Popen], list[dict]]:
    ports = [{"client": free_port(), "http": free_port(), "route": free_port()} for _ in range(3)]
    text = (K8S / "nats-cluster.conf").read_text()
    procs = []
    for i in range(3):
        work = root / f"nats-{i}"
        work.mkdir(parents=True)
        (work / "auth.conf").write_text((secrets / "auth.conf").read_text())
        (work / "cluster.conf").write_text(loopback_config(text, i, ports, tls_dir, work))
        procs.append(subprocess.Popen([find_binary("nats-server"), "-c", "cluster.conf"], cwd=work,
                                      env={**os.environ, "NATS_NAME": f"nats-{i}"},
                                      stdout=open(work / "log", "w"), stderr=subprocess.STDOUT))
    return procs, ports


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait(10)


def shell_probe(port: int) -> bool:
    nats_yaml = list(yaml.safe_load_all((K8S / "nats.yaml").read_text()))
    pod = next(d for d in nats_yaml if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    script = pod["containers"][0]["readinessProbe"]["exec"]["command"][2]
    assert script == health.nats_ready_sh(1), "nats.yaml's readiness probe differs from health.nats_ready_sh"
    return subprocess.run(["sh", "-c", script.replace("127.0.0.1:8222", f"127.0.0.1:{port}")],
                          capture_output=True, timeout=10).returncode == 0


def wait_ready(ports: list[dict], timeout: float) -> list[tuple[bool, str]]:
    deadline = time.monotonic() + timeout
    while True:
        states = [health.nats_readiness(f"http://127.0.0.1:{p['http']}", peers=1) for p in ports]
        if all(ok for ok, _ in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.3)


def test_k8s_cluster_forms_with_the_certificates_make_secrets_makes(secrets, tmp_path):
    cert = x509.load_pem_x509_certificate((secrets / "tls" / "server.pem").read_bytes())
    usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= usages
    procs, ports = start_cluster(secrets, secrets / "tls", tmp_path)
    try:
        states = wait_ready(ports, timeout=30)
        assert all(ok for ok, _ in states), states
        assert all(re.match(r"ok: routes to 2 peers, meta leader nats-\d", why) for _, why in states), states
        assert all(shell_probe(p["http"]) for p in ports)
    finally:
        stop(procs)
    logs = "".join((tmp_path / f"nats-{i}" / "log").read_text() for i in range(3))
    assert "incompatible key usage" not in logs


def server_auth_only(secrets: Path, out: Path) -> Path:
    """The same CA's server certificate as it was made before the fix: serverAuth only."""
    out.mkdir()
    ca = x509.load_pem_x509_certificate((secrets / "tls" / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((secrets / "tls" / "ca-key.pem").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "old")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (out / "ca.pem").write_bytes((secrets / "tls" / "ca.pem").read_bytes())
    (out / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "server-key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return out


def test_a_server_auth_only_certificate_never_forms_and_the_probe_says_so(secrets, tmp_path):
    procs, ports = start_cluster(secrets, server_auth_only(secrets, tmp_path / "old-tls"), tmp_path)
    try:
        states = wait_ready(ports, timeout=5)
        assert not any(ok for ok, _ in states), states
        assert not any(shell_probe(p["http"]) for p in ports)
        # the old probe was fooled: JetStream is enabled on every server
        assert all(health._get_json(f"http://127.0.0.1:{p['http']}/healthz?js-enabled-only=true", 2)[0] == 200
                   for p in ports)
    finally:
        stop(procs)
    logs = "".join((tmp_path / f"nats-{i}" / "log").read_text() for i in range(3))
    assert "incompatible key usage" in logs
