"""Pure parts of the node side: NVLink domains from NVML answers, the simulated backend, the
job environment, what an exit means, and the reconciler's decisions (tables of named cases)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpusched.core import events as ev
from gpusched.core.heartbeat import SCHEMAS, GpuSample, Heartbeat, JobReport
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.core.state import fold
from gpusched.services.nodeagent.backends import (
    BackendUnavailable,
    NvmlBackend,
    SimBackend,
    domains_from_links,
    domains_from_pairs,
    normalize_bus_id,
)
from gpusched.services.nodeagent.launcher import Launch, job_env, master_port
from gpusched.services.nodeagent.runs import exit_event
from gpusched.services.reconciler import Observations, ReconcilerConfig, decide

# --- NVLink domains from NVML topology answers ------------------------------------------------

PAIRS = {
    "no nvlink": (4, [], [0, 1, 2, 3]),
    "bridged pairs": (4, [(0, 1), (2, 3)], [0, 0, 1, 1]),
    "all to all": (4, [(a, b) for a in range(4) for b in range(a + 1, 4)], [0, 0, 0, 0]),
    "a chain joins one domain": (4, [(0, 1), (1, 2)], [0, 0, 0, 1]),
    "numbered by lowest index": (4, [(1, 3)], [0, 1, 2, 1]),
    "out of range ignored": (2, [(0, 5)], [0, 1]),
}


@pytest.mark.parametrize("count, pairs, want", PAIRS.values(), ids=PAIRS.keys())
def test_domains_from_pairs(count, pairs, want):
    assert domains_from_pairs(count, pairs) == want


BUS = ["00000000:07:00.0", "00000000:0F:00.0", "00000000:47:00.0", "00000000:4E:00.0"]
LINKS = {
    "nvswitch baseboard": ([[("switch", "0000:C1:00.0")]] * 4, [0, 0, 0, 0]),
    "direct links, other spelling": ([[("gpu", "0000:0f:00.0")], [("gpu", "0000:07:00.0")],
                                      [("gpu", "00000000:4e:00.0")], []], [0, 0, 1, 1]),
    "no active links": ([[], [], [], []], [0, 1, 2, 3]),
    "link to an unknown device": ([[("gpu", "0000:99:00.0")], [], [], []], [0, 1, 2, 3]),
}


@pytest.mark.parametrize("links, want", LINKS.values(), ids=LINKS.keys())
def test_domains_from_links(links, want):
    assert domains_from_links(BUS, links) == want


def test_bus_ids_compare_across_spellings():
    assert normalize_bus_id("00000000:0F:00.0") == normalize_bus_id(b"0000:0f:00.0\x00") == "0000:0f:00.0"


def test_nvml_without_a_driver_says_so():
    try:
        backend = NvmlBackend()
    except BackendUnavailable as err:
        assert "NVIDIA driver" in str(err) and "--backend sim" in str(err)
    else:  # a GPU machine: the backend works
        assert backend.gpus() and len(backend.sample()) == len(backend.gpus())
        backend.close()


# --- the simulated backend ---------------------------------------------------------------------


def test_sim_backend_reports_what_runs_and_what_is_injected():
    b = SimBackend("n0", 4, "pairs")
    assert [g.nvlink_domain for g in b.gpus()] == [0, 0, 1, 1]
    assert b.gpus()[0].uuid == SimBackend("n0", 4).gpus()[0].uuid != SimBackend("n1", 4).gpus()[0].uuid
    b.attach([0, 1], 4_200_000)
    stray = subprocess.Popen(["sleep", "30"])
    try:
        b.inject_stray(2, stray.pid)
        b.inject_stray(3, 4_100_000)  # a phantom
        b.inject_health(3, xid=48)
        s = b.sample()
        assert [g.pids for g in s] == [[4_200_000], [4_200_000], [stray.pid], [4_100_000]]
        assert s[0].utilization_pct > 0 and s[0].memory_used_mb > 0 and s[2].utilization_pct == 0
        assert (s[3].healthy, s[3].xid, s[3].health) == (False, 48, "XID 48")
        stray.kill()
        stray.wait()
        assert b.sample()[2].pids == []  # a real stray disappears when it dies
        assert b.kill(4_100_000) == "killed" and b.sample()[3].pids == []
        b.detach(4_200_000)
        b.inject_health(3, healthy=True)
        assert all(g.pids == [] and g.healthy for g in b.sample())
        with pytest.raises(ValueError):
            b.inject_stray(9, 1)
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()


# --- the job's environment -----------------------------------------------------------------------


def test_job_env_is_the_schedulers_over_the_specs_over_the_daemons(tmp_path):
    launch = Launch(job_id="j", attempt=3, node="n1", node_rank=1, num_nodes=2, gpus=(4, 6), gpu_ids=("n1/4", "n1/6"),
                    gpu_uuids=("GPU-a", "GPU-b"), master_addr="10.0.0.1", command=("x",),
                    env={"RANK": "9", "MINE": "1"}, checkpoint_dir=tmp_path / "c", control_dir=tmp_path / "k",
                    log_path=tmp_path / "l", resume_from="/c/ckpt-5.pkl", resume_step=5)
    env = job_env(launch, {"PATH": "/bin", "GPUSCHED_NATS_URL": "nats://secret"})
    assert env["CUDA_VISIBLE_DEVICES"] == "4,6" and env["RANK"] == "1" and env["MINE"] == "1"
    assert env["WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "10.0.0.1" and env["PATH"] == "/bin"
    assert env["GPUSCHED_RESUME_FROM"] == "/c/ckpt-5.pkl" and env["GPUSCHED_RESUME_STEP"] == "5"
    assert env["GPUSCHED_GPU_UUIDS"] == "GPU-a,GPU-b" and "GPUSCHED_NATS_URL" not in env
    assert env["MASTER_PORT"] == str(master_port("j", 3))
    assert master_port("j", 3) == master_port("j", 3) != master_port("j", 4)
    assert all(29500 <= master_port(f"j{i}", 1) < 39500 for i in range(100))


# --- what an exit means ----------------------------------------------------------------------------


def running_state(spec: JobSpec, restarts: int = 0):
    events = [ev.NodeRegistered(at=0, node="n", rack="r", gpus=[GpuInfo(index=0, uuid="u")]),
              ev.JobSubmitted(at=1, job_id="j", spec=spec)]
    attempt = 0
    for _ in range(restarts):
        attempt += 1
        events += [ev.GpusGranted(at=2, job_id="j", attempt=attempt, gpus=["n/0"]),
                   ev.GpusReleased(at=3, job_id="j", reason="process_failed")]
    events.append(ev.GpusGranted(at=4, job_id="j", attempt=attempt + 1, gpus=["n/0"]))
    return fold(events), attempt + 1


EXITS = {
    "exit 0 completes": (JobSpec(team="t", gpus=1), 0, 0, True, ev.JobCompleted),
    "failure requeues": (JobSpec(team="t", gpus=1), 0, 1, True, ev.GpusReleased),
    "no restarts left fails": (JobSpec(team="t", gpus=1, max_restarts=2), 2, 1, True, ev.JobFailed),
    "on_failure=fail fails": (JobSpec(team="t", gpus=1, on_failure="fail"), 0, -9, True, ev.JobFailed),
    "an old attempt says nothing": (JobSpec(team="t", gpus=1), 0, 1, False, type(None)),
}


@pytest.mark.parametrize("spec, restarts, rc, current, want", EXITS.values(), ids=EXITS.keys())
def test_exit_event(spec, restarts, rc, current, want):
    state, attempt = running_state(spec, restarts)
    got = exit_event(state, "j", attempt if current else attempt - 1, "n", rc, 10.0)
    assert isinstance(got, want)
    if isinstance(got, ev.GpusReleased):
        assert got.reason == "process_failed" and got.lost_gpu_s == 6.0
    if isinstance(got, ev.JobFailed):
        assert got.exit_code == rc and f"exit code {rc}" in got.reason


# --- the reconciler's decisions ---------------------------------------------------------------------

CFG = ReconcilerConfig(node_timeout_s=10, no_process_grace_s=5, zombie_grace_s=3)


def cluster(*extra: ev.Event):
    gpus = [GpuInfo(index=i, uuid=f"u{i}") for i in range(2)]
    return fold([ev.NodeRegistered(at=0, node="n", rack="r", gpus=gpus),
                 ev.JobSubmitted(at=0, job_id="j", spec=JobSpec(team="t", gpus=1, max_restarts=1)),
                 ev.GpusGranted(at=100, job_id="j", attempt=1, gpus=["n/0"]), *extra])


def beat(pids0=(), pids1=(), jobs=(), healthy1=True) -> Heartbeat:
    return Heartbeat(node="n", at=0, agent_id="a", seq=1, backend="sim", jobs=list(jobs), gpus=[
        GpuSample(index=0, uuid="u0", pids=list(pids0)),
        GpuSample(index=1, uuid="u1", pids=list(pids1), healthy=healthy1, health="" if healthy1 else "XID 79")])


RUNNING = JobReport(job_id="j", attempt=1, gpus=[0], pids=[11])
# (state extras, [(receipt time, heartbeat)...], decision time, expected event kinds)
DECISIONS = {
    "healthy and busy: nothing": ((), [(101, beat(pids0=[11], jobs=[RUNNING]))], 105, []),
    "silent node is lost": ((), [(101, beat(pids0=[11]))], 111, ["NodeLost"]),
    "no heartbeat yet: timeout counts from start": ((), [], 109, []),
    "no process, within grace": ((), [(101, beat()), (104, beat())], 104, []),
    "no process past grace": ((), [(101, beat()), (107, beat())], 107, ["GpusReleased"]),
    "rank done waiting for rank 0 is alive": (
        (), [(101, beat(jobs=[JobReport(job_id="j", attempt=1, gpus=[0], state="exited", exit_code=0)])),
             (107, beat(jobs=[JobReport(job_id="j", attempt=1, gpus=[0], state="exited", exit_code=0)]))], 107, []),
    "stray on a free GPU, within grace": ((), [(101, beat([11], [66], [RUNNING]))], 102, []),
    "stray on a free GPU past grace": ((), [(101, beat([11], [66], [RUNNING])), (105, beat([11], [66], [RUNNING]))],
                                       105, ["ZombieDetected"]),
    "known zombie gone: reclaimed": ((ev.ZombieDetected(at=101, gpu="n/1", pids=[66]),),
                                     [(102, beat([11], [], [RUNNING]))], 102, ["ZombieReclaimed"]),
    "unhealthy GPU quarantined": ((), [(101, beat([11], [], [RUNNING], healthy1=False))], 101, ["GpuQuarantined"]),
    "already quarantined: nothing": ((ev.GpuQuarantined(at=101, gpu="n/1", reason="health: XID 79"),),
                                     [(102, beat([11], [], [RUNNING], healthy1=False))], 102, []),
    "healthy again: restored": ((ev.GpuQuarantined(at=101, gpu="n/1", reason="health: XID 79"),),
                                [(102, beat([11], [], [RUNNING]))], 102, ["GpuRestored"]),
    "operator quarantine stays": ((ev.GpuQuarantined(at=101, gpu="n/1", reason="operator"),),
                                  [(102, beat([11], [], [RUNNING]))], 102, []),
}


@pytest.mark.parametrize("extra, beats, now, want", DECISIONS.values(), ids=DECISIONS.keys())
def test_reconciler_decides(extra, beats, now, want):
    state = cluster(*extra)
    obs = Observations(started_at=100.0)
    for t, hb in beats:
        obs.observe(hb, t)
        decide(state, obs, t, CFG)  # each heartbeat is followed by a tick
    got = decide(state, obs, now, CFG)
    assert [e.kind for e in got.events] == want
    if want == ["ZombieDetected"]:
        assert got.kills == [("n", "n/1", [66])]


def test_no_restarts_left_fails_the_job():
    state = cluster(ev.GpusReleased(at=101, job_id="j", reason="no_process"),
                    ev.GpusGranted(at=102, job_id="j", attempt=2, gpus=["n/0"]))
    obs = Observations(started_at=100.0)
    for t in (103, 109):
        obs.observe(beat(), t)
        got = decide(state, obs, t, CFG)
    assert [e.kind for e in got.events] == ["JobFailed"] and "no process" in got.events[0].reason


def test_heartbeat_schema_is_exported():
    import msgspec

    assert set(SCHEMAS) == {"heartbeat.schema.json", "node-control.schema.json", "node-control-reply.schema.json",
                            "node-logs.schema.json", "node-logs-reply.schema.json"}
    schema = msgspec.json.schema(SCHEMAS["heartbeat.schema.json"])
    assert "GpuSample" in schema["$defs"] and "JobReport" in schema["$defs"]


def test_systemd_unit_runs_the_daemon():
    unit = (Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "gpusched-nodeagent.service").read_text()
    assert "gpusched service run nodeagent --backend nvml" in unit or "gpusched.services.nodeagent" in unit
    # jobs never run as root nor share one uid (the root daemon's default: a dynamic uid per job),
    # and a crashed daemon's jobs survive for the next one to adopt
    assert "--job-user" not in unit and "--uid-range none" not in unit and "User=root" in unit
    assert "KillMode=process" in unit
    daemonset = (Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "nodeagent.yaml").read_text()
    assert '"--job-user"' not in daemonset and "runAsUser: 0" in daemonset


# --- the NVML backend over a stand-in for the driver -------------------------------------------


class FakeNvml:
    """Just enough of `pynvml` for NvmlBackend: 4 GPUs, NVLink pairs (0,1) (2,3), GPU 3 does
    not support utilization queries, GPU 2 has ECC errors, an XID 79 event on GPU 1."""

    class NVMLError(Exception):
        def __init__(self, value):
            self.value = value

    NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_TIMEOUT, NVML_ERROR_GPU_IS_LOST = 3, 10, 15
    NVML_P2P_CAPS_INDEX_NVLINK, NVML_P2P_STATUS_OK, NVML_NVLINK_MAX_LINKS = 2, 0, 4
    NVML_FEATURE_ENABLED, NVML_NVLINK_DEVICE_TYPE_SWITCH = 1, 2
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, nvmlEventTypeXidCriticalError = 1, 0, 8
    NVML_TEMPERATURE_GPU = 0

    def __init__(self):
        from types import SimpleNamespace as NS

        self.NS = NS
        self.events = [NS(device=1, eventData=79)]

    def _err(self, code=3):
        raise self.NVMLError(code)

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlDeviceGetCount(self): return 4
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetUUID(self, h): return f"GPU-{h}".encode()
    def nvmlDeviceGetName(self, h): return "NVIDIA H100 80GB HBM3"
    def nvmlDeviceGetMemoryInfo(self, h): return self.NS(total=80 * 2**30, used=h * 2**30)
    def nvmlDeviceGetUtilizationRates(self, h): return self.NS(gpu=50) if h != 3 else self._err()
    def nvmlDeviceGetTemperature(self, h, sensor): return 40 + h if h != 3 else self._err()
    def nvmlDeviceGetComputeRunningProcesses(self, h): return [self.NS(pid=1000 + h)] if h == 0 else []
    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter): return 2 if h == 2 else 0
    def nvmlDeviceGetP2PStatus(self, a, b, cap): return 0 if {a, b} in ({0, 1}, {2, 3}) else 1
    def nvmlEventSetCreate(self): return "set"
    def nvmlEventSetFree(self, s): pass
    def nvmlDeviceRegisterEvents(self, h, kinds, s): pass

    def nvmlEventSetWait_v2(self, s, timeout_ms):
        if not self.events:
            self._err(self.NVML_ERROR_TIMEOUT)
        return self.events.pop()


def test_nvml_backend_over_a_fake_driver(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    backend = NvmlBackend()
    gpus = backend.gpus()
    assert [(g.index, g.uuid, g.memory_mb, g.nvlink_domain) for g in gpus] == [
        (0, "GPU-0", 81920, 0), (1, "GPU-1", 81920, 0), (2, "GPU-2", 81920, 1), (3, "GPU-3", 81920, 1)]
    s = backend.sample()
    assert [g.pids for g in s] == [[1000], [], [], []]
    assert [g.utilization_pct for g in s] == [50.0, 50.0, 50.0, 0.0]  # unsupported query: empty, not fatal
    assert [g.healthy for g in s] == [True, False, False, True]
    assert [g.temperature_c for g in s] == [40.0, 41.0, 42.0, None]
    assert (s[1].xid, s[1].health) == (79, "XID 79") and s[2].health == "2 uncorrected ECC errors"
    backend.close()


# --- what a job writes is read within bounds, never through links ---------------------------------


def test_control_files_are_read_within_bounds_and_never_through_links(tmp_path):
    import json as _json

    from gpusched.services.nodeagent.acks import AckCoalescer, AckLimits, read_acks
    from gpusched.services.nodeagent.launcher import EXIT_FILE, read_exit_status

    secret = tmp_path / "secret"
    secret.write_text('{"path": "/etc/shadow", "step": 1}')
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    (ctl / "ack-link.json").symlink_to(secret)
    (ctl / "ack-big.json").write_text(_json.dumps({"path": "x" * 10000, "step": 2}))
    (ctl / "ack-bad.json").write_text('{"path": "/c", "step": -1}')
    (ctl / "ack-ok.json").write_text('{"path": "/c/3", "step": 3, "request": "9"}')
    acks, problems = read_acks(ctl, AckLimits(max_bytes=4096))
    assert [(a.step, a.path, a.request) for a in acks] == [(3, "/c/3", "9")] and len(problems) == 3
    assert list(ctl.iterdir()) == []  # every ack is consumed, good or bad
    (ctl / EXIT_FILE).symlink_to(secret)
    with pytest.raises(OSError):
        read_exit_status(ctl)
    # coalescing: the answer to the current request at once, the rest at most once per interval
    co = AckCoalescer(AckLimits(interval_s=5.0))
    for step in range(10, 20):
        co.add(type(acks[0])(step, f"/c/{step}", "r1" if step == 12 else None))
    assert [a.step for a in co.due(100.0, "r1", set())] == [12, 19]
    co.add(type(acks[0])(20, "/c/20", None))
    assert co.due(101.0, "r1", set()) == [] and [a.step for a in co.due(105.0, None, set())] == [20]
    co.add(type(acks[0])(15, "/c/15", None))  # older than what was said: dropped
    assert co.due(200.0, None, set()) == []


def test_the_daemon_hashes_checkpoints_itself_and_only_inside_the_jobs_dir(tmp_path):
    """An ack's claimed sha256 is dropped; the daemon's digest (the SDK's algorithm, for a file
    and a tree) is the one reported, and a path outside the job's checkpoint dir or a symlink
    in it is refused."""
    import json
    import os

    from gpusched.job import checkpoint_io
    from gpusched.job import env as E
    from gpusched.services.nodeagent.acks import AckLimits, checkpoint_sha256, read_acks

    ctl, ck = tmp_path / "ctl", tmp_path / "ck"
    ctl.mkdir()
    (ck / "tree" / "sub").mkdir(parents=True)
    (ck / "w.bin").write_bytes(b"weights")
    (ck / "tree" / "a").write_bytes(b"A")
    (ck / "tree" / "sub" / "b").write_bytes(b"B")
    (ctl / f"{E.ACK_PREFIX}1.json").write_text(json.dumps({"path": str(ck / "w.bin"), "step": 1, "sha256": "ab" * 32}))
    acks, problems = read_acks(ctl, AckLimits())
    assert problems == [] and acks[0].sha256 == ""  # the job's claim is not even kept
    for name in ("w.bin", "tree"):
        assert checkpoint_sha256(str(ck / name), ck, None) == (str(ck / name), checkpoint_io.sha256_of(ck / name))
    (tmp_path / "elsewhere").write_bytes(b"attacker")
    for bad in (tmp_path / "elsewhere", ck / ".." / "elsewhere"):
        with pytest.raises(ValueError, match="not inside the job's checkpoint directory"):
            checkpoint_sha256(str(bad), ck, None)
    os.symlink(tmp_path / "elsewhere", ck / "tree" / "link")
    with pytest.raises(ValueError, match="symlink"):
        checkpoint_sha256(str(ck / "tree"), ck, None)
    with pytest.raises(ValueError, match="owned by uid"):
        checkpoint_sha256(str(ck / "w.bin"), ck, os.geteuid() + 1)
