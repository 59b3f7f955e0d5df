"""Image jobs (`spec.image`) through real processes: a root node daemon (dynamic uids, a cgroup
per job) runs them with podman and runc, in a tiny image built here (`container_helpers`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from gpusched.core import events as ev
from gpusched.core.model import JobSpec
from gpusched.services.nodeagent import cgroups, container

from .container_helpers import tiny_image  # noqa: F401 (a fixture)
from .node_helpers import Cluster, alive, wait_gone

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or cgroups.version() is None,
                                reason="needs root (podman rootful, dynamic uids) and a cgroup v1 or v2 hierarchy")

UIDS = (64600, 200)
#: Unique per test process: simulated GPUs' UUIDs (their CDI names) come from the node name, and
#: CDI refuses a name two specs on one host define.
NODE = f"img{os.getpid()}"


@pytest.fixture
def site():
    root = Path(tempfile.mkdtemp(prefix="gpusched-i23img-"))
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def _start(c: Cluster, tiny, gpus: int = 2, **config):
    return await c.start_nodes([NODE], gpus=gpus, uid_range=UIDS, containers_dir=tiny[0], **config)


def in_image(tiny, script: str, **kw) -> JobSpec:
    return JobSpec(team="t", gpus=1, command=["/bin/sh", "-c", script], image=tiny[1], on_failure="fail", **kw)


async def _run(c: Cluster, job_id: str, spec: JobSpec, gpu: str, until=("completed", "failed")):
    await c.submit(job_id, spec)
    await c.grant(job_id, [gpu])
    return await c.wait(lambda s: s.jobs[job_id].state in until and s.jobs[job_id], job_id, timeout=30)


def log_of(c: Cluster, job_id: str) -> str:
    return Path(c.state.jobs[job_id].logs[-1].path).read_text()


async def test_an_image_job_runs_in_its_image_as_its_uid_and_its_exit_code_comes_back(nats_url, site, tiny_image):
    script = ('echo "uid $(id -u) gid $(id -g)"; [ -e /etc/debian_version ] && echo on-host || echo in-image; '
              'echo "job $GPUSCHED_JOB_ID cuda $CUDA_VISIBLE_DEVICES token $HF_TOKEN"; echo "path $PATH"; echo "pwd $(pwd)"; '
              'echo step > "$GPUSCHED_CHECKPOINT_DIR/out"; exit 3')
    secret = site / "token"
    secret.write_text("hf_in_the_box\n")
    os.chmod(secret, 0o644)
    async with Cluster(nats_url, site) as c:
        await _start(c, tiny_image, cwd=str(site))  # the daemon's default working dir is the host's
        job = await _run(c, "boxed", in_image(tiny_image, script, secret_env={"HF_TOKEN": str(secret)}), f"{NODE}/1")
        assert job.state == "failed" and job.end_reason.startswith("exit code 3"), job.end_reason
        text = log_of(c, "boxed")
        uid = int(text.split("uid ")[1].split()[0])
        assert uid in range(UIDS[0], sum(UIDS)) and f"gid {uid}" in text, text  # its dynamic uid, never root
        assert "in-image" in text and "on-host" not in text, text
        assert "job boxed cuda 0 token hf_in_the_box" in text, text  # its one GPU, numbered from 0 inside
        path = text.split("path ")[1].splitlines()[0]
        assert path and path != os.environ["PATH"], path  # podman's default for the image, not the node's
        assert "pwd /\n" in text, text  # the image's working directory
        assert "hf_in_the_box" not in job.end_reason
        out = site / "work" / "checkpoints" / "boxed" / "out"
        assert out.read_text() == "step\n" and out.stat().st_uid == uid  # the mounted checkpoint dir


async def test_an_image_the_node_lacks_is_pulled_and_a_failed_pull_fails_the_job_precisely(nats_url, site, tiny_image):
    async with Cluster(nats_url, site) as c:
        await _start(c, tiny_image)
        spec = JobSpec(team="t", gpus=1, command=["true"], image="localhost:1/gpusched/absent:1", on_failure="fail")
        job = await _run(c, "absent", spec, f"{NODE}/0")
        assert job.state == "failed" and job.end_reason.startswith("exit code 125"), job.end_reason
        assert "podman could not run the image" in job.end_reason, job.end_reason
        assert "Trying to pull localhost:1/gpusched/absent:1" in log_of(c, "absent")  # --pull missing: it tried


async def test_a_checkpoint_request_signals_the_sdk_by_its_pid_inside_the_container(nats_url, site, tiny_image):
    script = ('trap \'echo "usr1 for $$" > "$GPUSCHED_CHECKPOINT_DIR/usr1"; exit 0\' USR1; '
              'echo SIGUSR1 > "$GPUSCHED_CONTROL_DIR/sdk-$$"; while :; do sleep 0.05; done')
    async with Cluster(nats_url, site) as c:
        await _start(c, tiny_image)
        await _run(c, "sdk", in_image(tiny_image, script), f"{NODE}/0", until=("running",))
        control = c.hosts[0].agents[NODE].current("sdk").proc.launch.control_dir
        deadline = time.monotonic() + 15
        while not list(control.glob("sdk-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        (written,) = control.glob("sdk-*")
        asked = time.time()
        await c.append(ev.PreemptionRequested(at=asked, job_id="sdk", for_job="other", reason="test",
                                              deadline=asked + 10))
        job = await c.wait(lambda s: s.jobs["sdk"].state == "completed" and s.jobs["sdk"], "sdk signalled")
        assert job.state == "completed"
        ns_pid = written.name.removeprefix("sdk-")
        assert (site / "work" / "checkpoints" / "sdk" / "usr1").read_text() == f"usr1 for {ns_pid}\n"
        assert int(ns_pid) < 100  # a pid of the container's namespace, which the daemon mapped


async def test_an_image_job_sees_only_its_granted_gpu(nats_url, site, tiny_image):
    async with Cluster(nats_url, site) as c:
        host = await _start(c, tiny_image)
        devices = host.agents[NODE].starter.devices
        script = (f'cat /dev/nvidia1; cat /dev/nvidia0; cat {devices[0].path}; echo "devices $GPUSCHED_GPU_DEVICES"; '
                  'true')
        job = await _run(c, "onegpu", in_image(tiny_image, script), f"{NODE}/1")
        assert job.state == "completed", job.end_reason
        lines = [x for x in log_of(c, "onegpu").splitlines() if not x.startswith("---")]
        assert "/dev/nvidia1: No such device or address" in lines[0], lines  # its own (by CDI; no driver behind)
        assert "/dev/nvidia0: No such file or directory" in lines[1], lines  # GPU 0 never entered
        assert "No such file or directory" in lines[2], lines  # nor GPU 0's host node
        assert lines[3] == "devices /dev/nvidia1", lines


async def test_cancelling_an_image_job_stops_its_container_by_its_cgroup(nats_url, site, tiny_image):
    async with Cluster(nats_url, site) as c:  # a grace longer than the waits: SIGTERM must do it
        host = await c.start_nodes([NODE], gpus=2, uid_range=UIDS, containers_dir=tiny_image[0], kill_grace_s=60)
        await _run(c, "long", in_image(tiny_image, "sleep 60", memory_mb=64), f"{NODE}/0", until=("running",))
        run = host.agents[NODE].current("long")
        cg = run.proc.cgroup
        deadline = time.monotonic() + 15
        while not (inside := [p for p in cg.pids() if _comm(p) == "sleep"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert inside, "the container's process is in the job's cgroup"
        memory = Path(cg.dirs["memory"])
        assert (memory / container.name_of(run.proc.launch)).is_dir()  # the container's cgroup, under the job's
        await c.append(ev.JobCancelled(at=time.time(), job_id="long"))
        await c.wait(lambda s: s.jobs["long"].state == "cancelled", "cancelled")
        for pid in inside:
            await wait_gone(pid, timeout=15)
        await c.wait(lambda s: not host.agents[NODE].jobs, "run forgotten", timeout=15)
        assert not memory.exists()  # the job's cgroup and the container's under it are removed
        name = container.name_of(run.proc.launch)
        env = container.configure(tiny_image[0])
        deadline = time.monotonic() + 15
        while name in _containers(env) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert name not in _containers(env)
        assert not any(alive(p) for p in inside)
        assert not list(Path("/sys/fs/cgroup").glob(f"*/{name}"))  # nor in cpuset, blkio...


#: Rank 0 listens on MASTER_PORT, rank 1 connects to MASTER_ADDR and says hello: perl's socket
#: builtins only (the image holds no perl modules).
RENDEZVOUS = r"""
my $addr = sub { pack("S n a4 x8", 2, $ENV{MASTER_PORT}, pack("C4", split(/\./, $_[0]))) };
if ($ENV{RANK} == 0) {
    socket(S, 2, 1, 6) or die "socket: $!"; setsockopt(S, 1, 2, pack("l", 1));
    bind(S, $addr->("0.0.0.0")) or die "bind: $!"; listen(S, 1) or die "listen: $!";
    accept(C, S) or die "accept: $!"; my $line = <C>;
    open(F, ">", "$ENV{GPUSCHED_CHECKPOINT_DIR}/met") or die "open: $!"; print F $line; close F; exit 0;
}
for (1 .. 200) {
    socket(S, 2, 1, 6) or die "socket: $!";
    if (connect(S, $addr->($ENV{MASTER_ADDR}))) { syswrite(S, "hello from rank $ENV{RANK} of $ENV{WORLD_SIZE}\n"); exit 0 }
    close S; select(undef, undef, undef, 0.05);
}
die "rank $ENV{RANK}: no rendezvous at $ENV{MASTER_ADDR}:$ENV{MASTER_PORT}";
"""


async def test_ranks_in_containers_on_two_nodes_meet_at_master_addr(nats_url, site, tiny_image):
    nodes = [f"{NODE}a", f"{NODE}b"]
    async with Cluster(nats_url, site) as c:
        await c.start_nodes(nodes, gpus=1, uid_range=UIDS, containers_dir=tiny_image[0])
        spec = JobSpec(team="t", gpus=2, command=["/usr/bin/perl", "-e", RENDEZVOUS], image=tiny_image[1],
                       on_failure="fail")
        await c.submit("pair", spec)
        await c.grant("pair", [f"{nodes[0]}/0", f"{nodes[1]}/0"])
        job = await c.wait(lambda s: s.jobs["pair"].state in ("completed", "failed") and s.jobs["pair"], "pair",
                           timeout=30)
        assert job.state == "completed", job.end_reason
        assert (site / "work" / "checkpoints" / "pair" / "met").read_text() == "hello from rank 1 of 2\n"


async def test_a_restarted_daemon_adopts_an_image_job_and_learns_its_exit_code(nats_url, site, tiny_image):
    async with Cluster(nats_url, site) as c:
        first = await _start(c, tiny_image)
        await _run(c, "kept", in_image(tiny_image, "sleep 2; exit 5"), f"{NODE}/0", until=("running",))
        await first.stop(kill_jobs=False)
        c.hosts.remove(first)
        second = await _start(c, tiny_image)
        assert second.agents[NODE].current("kept") is not None  # adopted, not restarted
        job = await c.wait(lambda s: s.jobs["kept"].state == "failed" and s.jobs["kept"], "kept ended", timeout=30)
        assert job.end_reason.startswith("exit code 5"), job.end_reason  # from the wrapper's file, not the job's dir
        assert job.attempt == 1


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _containers(env: dict) -> list[str]:
    out = subprocess.run([container.PODMAN, "ps", "--all", "--format", "{{.Names}}"], env=env, capture_output=True,
                         text=True, check=False).stdout
    return out.split()
