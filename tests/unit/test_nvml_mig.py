"""MIG geometry on an NVML node (docs/gpu-sharing.md#mig-slices): the backend makes the admin's
GPU and compute instances through a stand-in for the driver that keeps them as state, reads back
each slice's MIG UUID and capability devices (a fake `mig-minors`), and a MIG job's launch uses
them; a failure midway leaves no instance and no usable slice, and is reported."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from gpusched.core import events as ev
from gpusched.core.model import JobSpec, gpu_id
from gpusched.core.state import ClusterState
from gpusched.services.nodeagent import nvml_mig
from gpusched.services.nodeagent.agent import NodeAgent
from gpusched.services.nodeagent.agent_config import AgentConfig
from gpusched.services.nodeagent.backends import NvmlBackend, gpus_with_mig
from gpusched.services.nodeagent.confine import limits_for
from gpusched.services.nodeagent.launch import LaunchError
from gpusched.services.nodeagent.launcher import job_env

from .test_mig import MigNvml

CAPS_MAJOR = 237
CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}  # compute-instance profile -> slices


def cap_minor(gpu: int, gi: int, ci: int | None = None) -> int:
    """The minor the fake driver gives a capability (distinct for every one)."""
    return 3 + gpu * 1000 + gi * 10 + (0 if ci is None else 1 + ci)


class InstanceNvml(MigNvml):
    """MigNvml with GPU and compute instances as state: GPU 0 starts with one 3g.20gb instance
    (GPU instance 1, compute instance 0); `fail_ci_at` fails that compute-instance creation."""

    NVML_ERROR_NOT_FOUND, NVML_ERROR_INSUFFICIENT_RESOURCES, NVML_ERROR_IN_USE = 6, 23, 19
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 9, 0

    def __init__(self):
        super().__init__()
        self.gis: dict[tuple[int, int], dict] = {(0, 1): {"profile": 2, "cis": {0: 2}}}
        self.ci_creates, self.fail_ci_at, self.calls = 0, -1, 0

    def nvmlDeviceGetMinorNumber(self, h): return h
    def nvmlDeviceGetUUID(self, h):
        return f"MIG-{h[1]}-{h[2]}-{h[3]}" if isinstance(h, tuple) else f"GPU-{h}".encode()

    def _gi(self, gi):
        if gi not in self.gis:
            self._err(self.NVML_ERROR_NOT_FOUND)
        return self.gis[gi]

    def nvmlDeviceGetGpuInstanceById(self, h, i):
        self._gi((h, i))
        return (h, i)

    def nvmlGpuInstanceGetComputeInstanceById(self, gi, c):
        if c not in self._gi(gi)["cis"]:
            self._err(self.NVML_ERROR_NOT_FOUND)
        return (*gi, c)

    def nvmlComputeInstanceDestroy(self, ci): del self._gi(ci[:2])["cis"][ci[2]]

    def nvmlGpuInstanceDestroy(self, gi):
        if self._gi(gi)["cis"]:
            self._err(self.NVML_ERROR_IN_USE)
        del self.gis[gi]

    def nvmlDeviceCreateGpuInstance(self, h, p):
        mine = [g["profile"] for (d, _), g in self.gis.items() if d == h]
        if sum(self.PROFILES[q][0] for q in mine) + self.PROFILES[p][0] > 7 or mine.count(p) >= self.PROFILES[p][1]:
            self._err(self.NVML_ERROR_INSUFFICIENT_RESOURCES)
        i = next(i for i in range(1, 15) if (h, i) not in self.gis)
        self.gis[(h, i)] = {"profile": p, "cis": {}}
        return (h, i)

    def nvmlGpuInstanceGetInfo(self, gi): return self.NS(id=gi[1], profileId=self._gi(gi)["profile"])

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi, p, engines):
        if p not in CI_SLICES or CI_SLICES[p] > self.PROFILES[self._gi(gi)["profile"]][0]:
            self._err(self.NVML_ERROR_NOT_SUPPORTED)
        return self.NS(id=p, sliceCount=CI_SLICES[p])

    def nvmlGpuInstanceCreateComputeInstance(self, gi, p):
        self.ci_creates += 1
        if self.ci_creates == self.fail_ci_at:
            self._err(self.NVML_ERROR_INSUFFICIENT_RESOURCES)
        self._gi(gi)["cis"][0] = p
        return (*gi, 0)

    def nvmlComputeInstanceGetInfo(self, ci): return self.NS(id=ci[2])
    def nvmlDeviceGetMaxMigDeviceCount(self, h): return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, k):
        made = sorted((d, g, c) for (d, g), gi in self.gis.items() if d == h for c in gi["cis"])
        if k >= len(made):
            self._err(self.NVML_ERROR_NOT_FOUND)
        return ("mig", *made[k])

    def nvmlDeviceGetGpuInstanceId(self, mh): return mh[2]
    def nvmlDeviceGetComputeInstanceId(self, mh): return mh[3]

    def instances(self, h: int = 0) -> list[tuple[str, int]]:
        """(profile, compute slices of its compute instance) of each GPU instance on GPU `h`."""
        names = {2: "3g.20gb", 5: "2g.10gb", 0: "1g.5gb", 4: "7g.40gb", 3: "4g.20gb", 7: "1g.10gb"}
        return sorted((names[g["profile"]], CI_SLICES[c]) for (d, _), g in self.gis.items() if d == h
                      for c in g["cis"].values())


@pytest.fixture
def nvml(monkeypatch, tmp_path):
    """The stand-in driver, a `mig-minors` listing every capability of 4 GPUs, and the caps major."""
    fake = InstanceNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(nvml_mig, "nvidia_caps_major", lambda: CAPS_MAJOR)
    lines = ["config 1", "monitor 2"] + [
        line for g in range(4) for i in range(15)
        for line in [f"gpu{g}/gi{i}/access {cap_minor(g, i)}"] + [f"gpu{g}/gi{i}/ci{c}/access {cap_minor(g, i, c)}"
                                                                   for c in range(8)]]
    (tmp_path / "mig-minors").write_text("\n".join(lines) + "\n")
    return fake


def backend(tmp_path) -> NvmlBackend:
    return NvmlBackend(mig_minors_path=tmp_path / "mig-minors")


GEOMETRY = ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]


def test_a_geometry_makes_its_gpu_and_compute_instances_and_each_slice_has_its_uuid_and_caps(nvml, tmp_path):
    b = backend(tmp_path)
    assert b.apply_mig(0, GEOMETRY) == ""
    # the 3g.20gb made before is gone; one GPU instance per profile, a compute instance filling each
    assert nvml.instances() == [("1g.5gb", 1), ("1g.5gb", 1), ("2g.10gb", 2), ("3g.20gb", 3)]
    slices = b.mig_slices(0)
    assert [s.profile for s in slices] == GEOMETRY
    assert [s.uuid for s in slices] == [f"MIG-0-{s.gi}-0" for s in slices]
    assert len({s.gi for s in slices}) == 4
    for s in slices:  # its GPU instance's and its compute instance's capability device, by mig-minors
        assert [(d.path, d.major, d.minor) for d in s.devices] == [
            (f"/dev/nvidia-caps/nvidia-cap{cap_minor(0, s.gi)}", CAPS_MAJOR, cap_minor(0, s.gi)),
            (f"/dev/nvidia-caps/nvidia-cap{cap_minor(0, s.gi, 0)}", CAPS_MAJOR, cap_minor(0, s.gi, 0))]
    assert b.sample()[0].health == ""
    assert b.apply_mig(0, []) == ""  # `none`: whole again
    assert nvml.instances() == [] and b.mig_slices(0) == []
    b.close()


def test_a_failure_midway_destroys_what_was_made_and_leaves_no_usable_slice(nvml, tmp_path):
    b = backend(tmp_path)
    nvml.fail_ci_at = 3  # the third compute instance (the first 1g.5gb's)
    error = b.apply_mig(0, GEOMETRY)
    assert error.startswith("creating compute instance in GPU instance ") and "(1g.5gb): 23" in error
    assert nvml.instances() == [] and b.mig_slices(0) is None
    s = b.sample()[0]
    assert not s.healthy and s.health == f"MIG geometry not applied: {error}"  # the reconciler quarantines it
    assert b.apply_mig(0, ["7g.40gb"]) == ""  # the next geometry applies and clears it
    assert nvml.instances() == [("7g.40gb", 7)] and b.sample()[0].health == ""


def test_more_than_the_gpu_holds_or_a_slice_the_driver_lists_no_device_for_is_refused_whole(nvml, tmp_path):
    b = backend(tmp_path)
    assert b.apply_mig(0, ["4g.20gb", "4g.20gb"]).startswith("creating GPU instance 4g.20gb: ")
    assert nvml.instances() == [] and b.mig_slices(0) is None
    (tmp_path / "mig-minors").write_text("config 1\ngpu0/gi1/access 13\n")  # no compute instance's capability
    error = b.apply_mig(0, ["3g.20gb"])
    assert error == "gpu0/gi1/ci0/access not in mig-minors" and nvml.instances() == []


def test_a_restarted_daemon_keeps_instances_that_are_the_geometry_and_leaves_a_busy_gpus_alone(nvml, tmp_path):
    first = backend(tmp_path)
    assert first.apply_mig(0, GEOMETRY) == ""
    before = first.mig_slices(0)
    again = backend(tmp_path)
    assert again.adopt_mig(0, GEOMETRY, idle=False) == ""
    assert again.mig_slices(0) == before  # the same instances, nothing made or destroyed
    kept = nvml.instances()
    assert "are not the geometry and it is in use" in again.adopt_mig(0, ["7g.40gb"], idle=False)
    assert nvml.instances() == kept and again.mig_slices(0) is None  # a job may be on them: untouched, unused
    assert again.sample()[0].health.startswith("MIG geometry not applied: its instances ['1g.5gb', '1g.5gb'")
    assert again.adopt_mig(0, ["7g.40gb"], idle=True) == "" and nvml.instances() == [("7g.40gb", 7)]


def test_the_daemon_applies_the_fold_geometry_and_a_mig_job_launches_on_the_real_slice(nvml, tmp_path):
    b = backend(tmp_path)
    st = ClusterState()
    st.apply(ev.NodeRegistered(at=0, node="n0", rack="r0", block=None, gpus=gpus_with_mig(b)))
    cfg = AgentConfig(node="n0", work_dir=tmp_path / "work")
    agent = NodeAgent(SimpleNamespace(uid_holder=lambda uid: None), cfg, b)
    geometry = ev.MigGeometrySet(at=1, gpu=gpu_id("n0", 0), profiles=GEOMETRY)
    st.apply(geometry)
    agent.apply_geometry(geometry, st)
    assert nvml.instances() == [("1g.5gb", 1), ("1g.5gb", 1), ("2g.10gb", 2), ("3g.20gb", 3)]
    st.apply(ev.JobSubmitted(at=2, job_id="m", spec=JobSpec(team="a", gpus=1, mig="1g.5gb", command=["true"])))
    st.apply(ev.GpusGranted(at=3, job_id="m", attempt=1, gpus=["n0/0"], slices=[3]))
    job, starter = st.jobs["m"], agent.starter
    launch = starter.spec(job, (0,), st)
    made = b.mig_slices(0)[3]
    assert job_env(launch, {})["CUDA_VISIBLE_DEVICES"] == made.uuid == f"MIG-0-{made.gi}-0"
    assert launch.devices[-2:] == tuple(d.path for d in made.devices)  # after its GPU's node, if confined
    allow = limits_for(job, launch, {0: SimpleNamespace(allow="c 195:0 rwm")}, (), None,
                       starter.slices_of(job, (0,), st)[1]).devices
    assert allow == ("c 195:0 rwm", f"c 237:{cap_minor(0, made.gi)} rwm", f"c 237:{cap_minor(0, made.gi, 0)} rwm")
    busy = ev.MigGeometrySet(at=4, gpu=gpu_id("n0", 0), profiles=["7g.40gb"])  # an operator's own append
    st.apply(busy)
    assert [v.rule for v in st.violations()] == ["geometry_of_busy_gpu"]
    agent.apply_geometry(busy, st)  # the fold did not take it: the job's slice stays
    assert len(nvml.instances()) == 4 and b.mig_slices(0)[3] == made
    nvml.fail_ci_at = nvml.ci_creates + 1  # an operator re-applies and it fails: the slice is not handed out
    b.apply_mig(0, GEOMETRY)
    with pytest.raises(LaunchError, match=r"MIG slice\(s\) \[3\] of GPU n0/0 are not usable: creating compute"):
        starter.spec(job, (0,), st)


def test_reading_the_instances_changes_nothing(nvml, tmp_path):
    b = backend(tmp_path)
    slices, error = b.read_mig(0)
    assert error == "" and [(s.profile, s.gi, s.ci, s.uuid) for s in slices] == [("3g.20gb", 1, 0, "MIG-0-1-0")]
    assert nvml.instances() == [("3g.20gb", 3)] and b.mig_slices(0) is None  # seen, not handed out
