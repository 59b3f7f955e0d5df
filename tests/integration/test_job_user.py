"""Jobs run unprivileged: as the configured user (per team, or one default), with a clean
environment, in their own 0700 control, log and checkpoint directories."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from gpusched.core.model import JobSpec
from gpusched.services.nodeagent.launcher import ENV_ALLOW

from .node_helpers import Cluster

USER = "gpusched-testjob"

SCRIPT = 'id -u > "$GPUSCHED_CHECKPOINT_DIR/uid"; env > "$GPUSCHED_CHECKPOINT_DIR/env"; ' \
         'echo ok > "$GPUSCHED_CONTROL_DIR/written-by-job"'


@pytest.fixture
def job_user():
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create an unprivileged user")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER], check=True)
    return pwd.getpwnam(USER)


async def test_a_job_runs_as_its_teams_user_with_a_clean_environment(nats_url, job_user, monkeypatch):
    monkeypatch.setenv("DAEMON_SECRET_TOKEN", "do-not-leak")  # in the daemon's environment only
    root = Path(tempfile.mkdtemp(prefix="gpusched-user-"))
    os.chmod(root, 0o755)
    try:
        async with Cluster(nats_url, root) as c:
            host = await c.start_nodes(["z0"], gpus=1, team_users={"ml": USER})
            await c.submit("u", JobSpec(team="ml", gpus=1, command=["/bin/sh", "-c", SCRIPT], workdir="/",
                                        env={"FROM_SPEC": "1"}))
            await c.grant("u", ["z0/0"])
            job = await c.wait(lambda s: s.jobs["u"].state in ("completed", "failed") and s.jobs["u"], "done")
            assert job.state == "completed", job.end_reason
            ckpt = root / "work" / "checkpoints" / "u"
            assert int((ckpt / "uid").read_text()) == job_user.pw_uid != 0
            env = dict(line.split("=", 1) for line in (ckpt / "env").read_text().splitlines() if "=" in line)
            assert "DAEMON_SECRET_TOKEN" not in env and env["FROM_SPEC"] == "1" and env["USER"] == USER
            assert all(k.startswith("GPUSCHED_") or k in ("FROM_SPEC", "HOME", "USER", "LOGNAME", "PWD", "SHLVL",
                                                          "_", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
                                                          "LOCAL_RANK", "PYTHONUNBUFFERED")
                       or any(k == a or (a.endswith("_") and k.startswith(a)) for a in ENV_ALLOW) for k in env), env
            st = ckpt.stat()
            assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == job_user.pw_uid
            st = (root / "work" / "logs" / "u").stat()  # the daemon writes logs: the job cannot read them back
            assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
            assert host.agents["z0"].cfg.user_for("other") is None  # other teams: the daemon's own user
    finally:
        shutil.rmtree(root, ignore_errors=True)
