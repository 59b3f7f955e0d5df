"""A tenant with nothing but the credential `gpusched user add` gave them: what the server
refuses is reported as a refusal (the subject and the role, exit 1), never as a server that
cannot be reached (exit 2)."""

from __future__ import annotations

import subprocess
import sys
import time

from gpusched.cli.main import main


def _gpusched(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpusched.cli.main", *argv], capture_output=True, text=True,
                          timeout=60)


def test_a_refused_read_says_permission_denied_naming_subject_and_role(trust, nats_server, tmp_path):
    creds = tmp_path / "dana.nk"
    assert main(["user", "add", "dana", "--team", "nlp", "--out", str(creds), "--trust", str(trust.dir)]) == 0
    for _ in range(100):  # the reload (SIGHUP) lands within milliseconds
        proc = _gpusched("nodes", "--nats", nats_server.url, "--creds", str(creds), "--fold")  # not a tenant's read
        if "authorization violation" not in proc.stderr:
            break
        time.sleep(0.05)
    assert proc.returncode == 1, proc.stderr
    assert "cannot reach" not in proc.stderr
    assert "permission denied: dana (role tenant, teams nlp)" in proc.stderr
    assert "publish to \"$js.api.stream.info.gpusched\"" in proc.stderr.lower()  # the subject refused


def test_a_tenants_read_without_the_reader_service_names_it(trust, nats_server, tmp_path):
    creds = tmp_path / "erin.nk"
    assert main(["user", "add", "erin", "--team", "nlp", "--out", str(creds), "--trust", str(trust.dir)]) == 0
    for _ in range(100):
        proc = _gpusched("jobs", "--nats", nats_server.url, "--creds", str(creds))
        if "authorization violation" not in proc.stderr:
            break
        time.sleep(0.05)
    assert proc.returncode == 2, proc.stderr
    assert "cannot reach the reader service at gpusched.read.jobs.nlp.erin (no responders)" in proc.stderr
