"""Every NATS config in deploy/ (deploy/nats/*.conf and the Kubernetes copy in deploy/k8s) is
one nats-server accepts (`nats-server -t`), with the generated users and TLS files in place,
and they carry the security model: no unauthenticated listener, monitoring on localhost only."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from gpusched.bus.servers import find_binary
from gpusched.security import authz, tlsgen
from gpusched.security.trust import TrustStore

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CONFIGS = sorted(str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*.conf"))


def test_every_nats_config_is_checked():
    assert {"nats/single.conf", "nats/cluster.conf", "k8s/nats-cluster.conf"} <= set(CONFIGS)


@pytest.mark.parametrize("conf", CONFIGS)
def test_deploy_nats_config_is_valid_and_authenticated(conf, tmp_path):
    name = Path(conf).name
    text = (DEPLOY / conf).read_text()
    assert re.search(r"^http: 127\.0\.0\.1:", text, re.M), "monitoring must listen on localhost only"
    assert "include ./auth.conf" in text and "tls {" in text
    trust = TrustStore(tmp_path / "trust")
    trust.ensure_stack(["node00"])
    tls_dir = str(tmp_path / "tls")
    (tmp_path / name).write_text(text.replace("/etc/nats/tls", tls_dir))
    (tmp_path / "auth.conf").write_text(authz.auth_include(trust.ring()))
    tls = tlsgen.ensure(tmp_path / "tls")
    assert Path(tls["ca_file"]).parent == Path(tls_dir)
    env = {**os.environ, "NATS_NAME": "nats-0"}
    done = subprocess.run([find_binary("nats-server"), "-t", "-c", str(tmp_path / name)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert trust.ring().by_name("admission")[0] in (tmp_path / "auth.conf").read_text()
