"""The red team on the node: an ordinary tenant's job attacks the node daemon, the control
plane's secrets and its co-tenants. Each attack gets a refusal, or a failure confined to the
attacker's own job. Real node daemons (root, per-job dynamic uids, a cgroup per job), a real
log; every job is a shell script (the jobs' uids cannot reach a Python under /root here)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest

from gpusched.core import events as ev
from gpusched.core.mig import slice_uuid
from gpusched.core.model import JobSpec
from gpusched.services.admission import AdmissionConfig, Capacity, submit_problem
from gpusched.services.nodeagent import cgroups

from .node_helpers import Cluster, alive

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or cgroups.version() is None,
                                reason="needs root (to switch uids) and a cgroup v1 or v2 hierarchy")

UIDS = (64000, 500)  # a test range inside systemd's DynamicUser range


@pytest.fixture
def site():
    """A data dir as `up` leaves it: traversable, its trust dir and stack file private."""
    from gpusched.cli.startup import harden_data_dir

    root = Path(tempfile.mkdtemp(prefix="gpusched-i23-redteam-"))
    os.chmod(root, 0o755)
    (root / "trust" / "identities").mkdir(parents=True)
    (root / "trust" / "identities" / "admin.nk").write_text("SUADMINSEEDSECRET\n")
    (root / "stack.json").write_text('{"redis": "redis://:hunter2@127.0.0.1:1"}')
    (root / "work").mkdir()
    harden_data_dir(root)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def _start(c: Cluster, site: Path, names: list[str], gpus: int, **config):
    c.tmp = site  # the nodes' work dir is <site>/work
    return await c.start_nodes(names, gpus=gpus, uid_range=UIDS, cgroup_parent="gpusched-i23-test",
                               checkpoint_roots=(str(site / "work" / "checkpoints"),), **config)


def sh(script: str, team: str = "t", **kw) -> JobSpec:
    return JobSpec(team=team, gpus=1, command=["/bin/sh", "-c", script], workdir="/", **kw)


async def _run(c: Cluster, job_id: str, spec: JobSpec, gpu: str, done: bool = True):
    await c.submit(job_id, spec)
    await c.grant(job_id, [gpu])
    if done:
        return await c.wait(lambda s: s.jobs[job_id].state in ("completed", "failed") and s.jobs[job_id], job_id)
    return await c.wait(lambda s: s.jobs[job_id].state == "running" and s.jobs[job_id], job_id)


def out(site: Path, job_id: str) -> str:
    return (site / "work" / "checkpoints" / job_id / "out").read_text()


OUT = '"$GPUSCHED_CHECKPOINT_DIR/out"'


async def test_a_tenant_job_cannot_read_admin_nk_or_the_stack_file(nats_url, site):
    async with Cluster(nats_url, site) as c:
        await _start(c, site, ["r0"], 1)
        script = (f"id -u > {OUT}; cat {site}/trust/identities/admin.nk >> {OUT} 2>&1; "
                  f"cat {site}/stack.json >> {OUT} 2>&1; ls {site} >> {OUT} 2>&1; true")
        job = await _run(c, "thief", sh(script), "r0/0")
        assert job.state == "completed", job.end_reason
        got = out(site, "thief")
        assert int(got.split()[0]) in range(UIDS[0], sum(UIDS)), got  # a dynamic uid, not root
        assert "SUADMINSEED" not in got and "hunter2" not in got, got
        assert got.count("Permission denied") == 3, got


async def test_a_tenant_cannot_read_another_tenants_environ(nats_url, site):
    async with Cluster(nats_url, site) as c:
        host = await _start(c, site, ["r0"], 2)
        await _run(c, "victim", sh("sleep 30", team="a", env={"HF_TOKEN": "hf_victim_token"}), "r0/0", done=False)
        pid = host.agents["r0"].current("victim").proc.pid
        script = f"cat /proc/{pid}/environ > {OUT} 2>&1; cat /proc/{pid}/cmdline >/dev/null; true"
        job = await _run(c, "spy", sh(script, team="b"), "r0/1")
        assert job.state == "completed", job.end_reason
        got = out(site, "spy")
        # another uid: unreadable; with the job's own /proc (hidepid=2), not even there
        assert "hf_victim_token" not in got and ("Permission denied" in got or "No such file" in got), got
        assert c.state.jobs["victim"].state == "running"  # untouched


async def _cmdline(pid: int, want: bytes, within_s: float = 5.0) -> bytes:
    """The process's command line once it shows `want` (or after `within_s`): at the instant the
    job runs, its process may still be in the confinement's wrapper (`unshare`, the /proc mount)
    or between two execs (an empty /proc/PID/cmdline: a CI rehearsal read b'')."""
    path, deadline = Path(f"/proc/{pid}/cmdline"), time.monotonic() + within_s
    got = path.read_bytes()
    while want not in got and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        got = path.read_bytes()
    return got


async def test_a_tenant_cannot_see_another_tenants_command_line_or_pid(nats_url, site):
    """Each job has its own /proc (`hidepid=2` in its own mount namespace): another tenant's
    processes are not there at all, its command line with them; the job's own are."""
    async with Cluster(nats_url, site) as c:
        host = await _start(c, site, ["r0"], 2)
        victim = sh("sleep 30; echo --api-key=hf_cmdline_secret", team="a")
        await _run(c, "victim", victim, "r0/0", done=False)
        pid = host.agents["r0"].current("victim").proc.pid
        assert b"hf_cmdline_secret" in await _cmdline(pid, b"hf_cmdline_secret")  # the host sees it
        script = (f"cat /proc/{pid}/cmdline > {OUT} 2>&1; cat /proc/[0-9]*/cmdline >> {OUT} 2>/dev/null; "
                  f"ls /proc | grep -x {pid} >> {OUT}; echo own $(cat /proc/$$/cmdline | tr '\\0' ' ') >> {OUT}; true")
        job = await _run(c, "spy", sh(script, team="b"), "r0/1")
        assert job.state == "completed", job.end_reason
        got = out(site, "spy")
        assert "hf_cmdline_secret" not in got and "No such file" in got, got
        assert "own /bin/sh -c" in got, got  # its own processes stay visible
        assert c.state.jobs["victim"].state == "running"  # untouched


async def test_naming_another_tenants_secret_file_is_refused(nats_url, site):
    async with Cluster(nats_url, site) as c:
        await _start(c, site, ["r0"], 1)
        secret = site / "victim-token"
        secret.write_text("hf_victims_secret\n")
        os.chown(secret, UIDS[0] + 7, UIDS[0] + 7)  # the victim's own file, 0600
        os.chmod(secret, 0o600)
        job = await _run(c, "borrower", sh(f"echo $HF_TOKEN > {OUT}", secret_env={"HF_TOKEN": str(secret)}), "r0/0")
        assert job.state == "failed" and "may not read" in job.end_reason, job.end_reason
        assert "hf_victims_secret" not in job.end_reason
        assert not (site / "work" / "checkpoints" / "borrower" / "out").exists()


async def test_a_job_cannot_write_into_another_jobs_control_dir(nats_url, site):
    async with Cluster(nats_url, site) as c:
        host = await _start(c, site, ["r0"], 2)
        await _run(c, "victim", sh("sleep 30", team="a"), "r0/0", done=False)
        control = host.agents["r0"].current("victim").proc.launch.control_dir
        st = control.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid in range(UIDS[0], sum(UIDS))
        script = (f'{{ echo \'{{"path": "/x", "step": 99}}\' > {control}/ack-000000099.json; }} 2>{OUT}; '
                  f'ls {control} >> {OUT} 2>&1; true')
        job = await _run(c, "intruder", sh(script, team="b"), "r0/1")
        assert job.state == "completed", job.end_reason
        assert out(site, "intruder").count("Permission denied") == 2, out(site, "intruder")
        assert not list(control.glob("ack-*"))


INJECT = """
ck=$GPUSCHED_CHECKPOINT_DIR
printf mine > "$ck/w.bin"
printf '{"path": "%s", "step": 5, "sha256": "%s"}' "$ck/w.bin" "$(printf 'a%.0s' $(seq 64))" \\
  > "$GPUSCHED_CONTROL_DIR/.t" && mv "$GPUSCHED_CONTROL_DIR/.t" "$GPUSCHED_CONTROL_DIR/ack-000000005.json"
sleep 1
printf '{"path": "%s", "step": 9}' "$VICTIM_FILE" > "$GPUSCHED_CONTROL_DIR/.t" \\
  && mv "$GPUSCHED_CONTROL_DIR/.t" "$GPUSCHED_CONTROL_DIR/ack-000000009.json"
sleep 1
"""


async def test_an_injected_ack_gets_the_daemons_checksum_and_no_foreign_file(nats_url, site):
    """The ack's claimed sha256 is ignored (the daemon hashes the file itself), and an ack
    naming a file outside the job's own checkpoint dir (a victim's weights) is refused."""
    async with Cluster(nats_url, site) as c:
        await _start(c, site, ["r0"], 1, ack_interval_s=0.0)
        victim = site / "work" / "checkpoints" / "victim"
        victim.mkdir(parents=True)
        (victim / "weights.bin").write_bytes(b"victim weights")
        job = await _run(c, "forger", sh(INJECT, env={"VICTIM_FILE": str(victim / "weights.bin")}), "r0/0")
        assert job.state == "completed", job.end_reason
        await c.refold()
        saved = c.events(ev.CheckpointSaved, "forger")
        assert [(e.step, e.sha256) for e in saved] == [(5, hashlib.sha256(b"mine").hexdigest())]
        assert all("victim" not in e.path for e in saved)


async def test_a_job_cannot_open_a_gpu_it_was_not_granted(nats_url, site):
    async with Cluster(nats_url, site) as c:
        host = await _start(c, site, ["r0"], 2)
        devices = host.agents["r0"].starter.devices
        assert set(devices) == {0, 1}
        script = f"cat {devices[0].path} > {OUT} 2>&1; cat {devices[1].path} >> {OUT} 2>&1; " \
                 f"echo $GPUSCHED_GPU_DEVICES >> {OUT}; true"
        job = await _run(c, "g", sh(script), "r0/1")
        assert job.state == "completed", job.end_reason
        lines = out(site, "g").splitlines()
        assert "Operation not permitted" in lines[0], lines  # GPU 0: the cgroup refuses it
        assert "No such device or address" in lines[1], lines  # GPU 1: its own (no driver behind it)
        assert lines[2] == devices[1].path


async def test_a_mig_job_cannot_open_another_slices_device(nats_url, site):
    """Two 1g.10gb slices of one H100 (the admin's geometry): the job on slice 1 opens its own
    slice's device (ENXIO: no driver behind it) but not slice 0's (EPERM: its cgroup's)."""
    async with Cluster(nats_url, site) as c:
        host = await _start(c, site, ["r0"], 1, mig=True)
        agent = host.agents["r0"]
        caps = agent.starter.slice_devices
        await c.append(ev.MigGeometrySet(at=time.time(), gpu="r0/0", profiles=["1g.10gb", "1g.10gb"]))
        script = f"cat {caps[(0, 0)].path} > {OUT} 2>&1; cat {caps[(0, 1)].path} >> {OUT} 2>&1; " \
                 f"echo $CUDA_VISIBLE_DEVICES $GPUSCHED_MIG_SLICES $GPUSCHED_GPU_DEVICES >> {OUT}; true"
        await c.submit("m", sh(script, mig="1g.10gb"))
        await c.grant("m", ["r0/0"], slices=[1])
        job = await c.wait(lambda s: s.jobs["m"].state in ("completed", "failed") and s.jobs["m"], "m")
        assert job.state == "completed", job.end_reason
        lines = out(site, "m").splitlines()
        assert "Operation not permitted" in lines[0], lines  # slice 0: the cgroup refuses it
        assert "No such device or address" in lines[1], lines  # slice 1: its own
        mig_uuid = slice_uuid(agent.uuids[0], 1)
        assert lines[2] == f"{mig_uuid} 1 {agent.starter.devices[0].path},{caps[(0, 1)].path}"
        assert (await c.refold()).violations() == []


async def test_exceeding_mem_kills_only_the_job(nats_url, site):
    async with Cluster(nats_url, site) as c:
        host = await _start(c, site, ["r0"], 2)
        await _run(c, "neighbour", sh("sleep 30", team="a"), "r0/0", done=False)
        neighbour = host.agents["r0"].current("neighbour").proc.pid
        hog = sh("dd if=/dev/zero of=/dev/null bs=256M count=4", team="b", memory_mb=64, on_failure="fail")
        job = await _run(c, "hog", hog, "r0/1")
        assert job.state == "failed" and "out of memory" in job.end_reason, job.end_reason
        assert alive(neighbour) and c.state.jobs["neighbour"].state == "running"
    left = [p for pattern in ("*/gpusched-i23-test/*", "memory/**/gpusched-i23-test/*")
            for p in Path("/sys/fs/cgroup").glob(pattern) if p.is_dir()]
    assert left == []  # every run's cgroup is removed once its processes are gone


async def test_a_checkpoint_dir_outside_the_roots_is_refused_and_never_created(nats_url, site, tmp_path):
    target = Path("/root/.config") / f"gpusched-i23-{os.getpid()}-{time.time_ns()}"
    problem = submit_problem(None, _submit_cmd(str(target)),  # type: ignore[arg-type]
                             AdmissionConfig(checkpoint_roots=(str(site / "work" / "checkpoints"),)), Capacity())
    assert problem is not None and "outside the cluster's checkpoint roots" in problem, problem
    async with Cluster(nats_url, site) as c:  # a node never trusts admission to have checked
        await _start(c, site, ["r0"], 1)
        job = await _run(c, "planter", sh("true", checkpoint_dir=str(target)), "r0/0")
        assert job.state == "failed" and "outside this node's checkpoint roots" in job.end_reason, job.end_reason
        assert not target.exists()


def _submit_cmd(checkpoint_dir: str):
    from gpusched.core.commands import SubmitJob

    return SubmitJob(request_id="r1", spec=sh("true", checkpoint_dir=checkpoint_dir))
