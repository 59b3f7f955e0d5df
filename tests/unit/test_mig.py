"""MIG discovery (docs/gpu-sharing.md): the NVML backend over a stand-in for the driver, and the
simulated backend's published A100 40GB / H100 80GB profiles."""

from __future__ import annotations

import sys

import msgspec

from gpusched.core.mig import PUBLISHED, MigInfo, profile_name, published_profiles
from gpusched.services.nodeagent.backends import NvmlBackend, SimBackend

from .test_node_side import FakeNvml

MIB = {1: 4864, 2: 9856, 3: 19968, 4: 19968, 7: 40192}  # an A100 40GB's driver, by slices


class MigNvml(FakeNvml):
    """GPU 0 in MIG mode (one 3g.20gb instance made), GPU 1 with MIG enabling at its next reset,
    GPUs 2 and 3 without MIG (the driver refuses the query)."""

    NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_ENABLE, NVML_GPU_INSTANCE_PROFILE_COUNT = 0, 1, 8
    # profile id -> (slices, instances); id 1 (2 slices with 8) and 6 the A100 does not offer
    PROFILES = {0: (1, 7), 2: (3, 2), 3: (4, 1), 4: (7, 1), 5: (2, 3), 7: (1, 4)}

    def nvmlDeviceGetName(self, h): return "NVIDIA A100-SXM4-40GB"

    def nvmlDeviceGetMigMode(self, h):
        return {0: (1, 1), 1: (0, 1)}.get(h) or self._err(self.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h, p):
        if p not in self.PROFILES:
            self._err(self.NVML_ERROR_NOT_SUPPORTED)
        slices, count = self.PROFILES[p]
        memory = 9856 if p == 7 else MIB[slices]
        return self.NS(id=p, sliceCount=slices, instanceCount=count, memorySizeMB=memory)

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, h, p):
        return {2: 1, 4: 0, 3: 0}.get(p, self.PROFILES[p][1] - 1)  # a 3g.20gb is made


def test_the_nvml_backend_reports_each_gpus_mig_mode_and_profiles(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", MigNvml())
    backend = NvmlBackend()
    mig = backend.mig()
    assert [(m.mode, m.pending) for m in mig.values()] == [
        ("enabled", "enabled"), ("disabled", "enabled"), ("unsupported", "unsupported"), ("unsupported", "unsupported")]
    names = [(p.name, p.slices, p.instances, p.remaining) for p in mig[0].profiles]
    assert names == [("1g.5gb", 1, 7, 6), ("3g.20gb", 3, 2, 1), ("4g.20gb", 4, 1, 0), ("7g.40gb", 7, 1, 0),
                     ("2g.10gb", 2, 3, 2), ("1g.10gb", 1, 4, 3)]
    assert all(p.remaining == p.instances for p in mig[1].profiles)  # not in MIG mode yet: nothing made
    assert mig[2].profiles == []
    backend.close()


def test_profile_names_follow_nvidias_from_the_drivers_memory():
    assert [profile_name(s, MIB[s]) for s in (1, 2, 3, 4, 7)] == ["1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"]
    assert profile_name(7, 80 * 1024) == "7g.80gb" and profile_name(1, 10 * 1024) == "1g.10gb"


def test_the_simulated_backend_models_the_published_a100_and_h100_profiles():
    h100 = SimBackend("n0", count=2, mig=True).mig()  # the default simulated GPU is an H100 80GB
    assert set(h100) == {0, 1} and all(m.mode == "enabled" for m in h100.values())
    assert [(p.name, p.slices, p.instances) for p in h100[0].profiles] == [
        ("1g.10gb", 1, 7), ("1g.20gb", 1, 4), ("2g.20gb", 2, 3), ("3g.40gb", 3, 2), ("4g.40gb", 4, 1), ("7g.80gb", 7, 1)]
    a100 = SimBackend("n1", count=1, model="SIM-A100-SXM4-40GB", memory_mb=40960).mig()[0]
    assert a100 == MigInfo("disabled", "disabled", PUBLISHED["A100-40GB"])
    assert [p.name for p in a100.profiles] == ["1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"]
    l4 = SimBackend("n2", count=1, model="SIM-L4", memory_mb=24576).mig()[0]
    assert (l4.mode, l4.profiles) == ("unsupported", [])
    assert published_profiles("NVIDIA H100 80GB HBM3", 81559) == PUBLISHED["H100-80GB"]


def test_a_node_registers_the_mig_mode_and_profiles_of_its_mig_gpus_and_the_fold_shows_them():
    from gpusched import readmodel
    from gpusched.core import events as ev
    from gpusched.core.state import ClusterState
    from gpusched.services.nodeagent.backends import gpus_with_mig

    assert all(g.mig is None for g in gpus_with_mig(SimBackend("plain", count=2)))  # used whole: as before
    gpus = gpus_with_mig(SimBackend("n0", count=2, mig=True))
    assert [g.mig.mode for g in gpus] == ["enabled", "enabled"]
    st = ClusterState()
    registered = ev.NodeRegistered(at=0, node="n0", rack="r0", gpus=gpus)
    st.apply(ev.decode_event(msgspec.json.encode(registered)))  # as the log stores and reads it
    assert st.gpus["n0/1"].mig == gpus[1].mig
    doc = readmodel.node_doc(st, "n0")["gpus"][0]["mig"]
    assert doc == {"mode": "enabled", "pending": "enabled",
                   "profiles": ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
                   "geometry": [], "slices": {}}  # not partitioned yet (`gpusched mig set`)


def test_a_geometry_on_a_gpu_registered_without_mig_still_reads():
    """The fold keeps a MigGeometrySet it is given for a GPU that registered no MIG info (an
    operator's own append: admission refuses a GPU not in MIG mode). The node document once
    raised AttributeError on it (`rec.mig.mode` with no `rec.mig`), so every projector flush of
    that node failed; it shows the geometry with an unknown mode."""
    from gpusched import readmodel
    from gpusched.core import events as ev
    from gpusched.core.state import ClusterState

    st = ClusterState()
    st.apply(ev.NodeRegistered(at=0, node="n0", rack="r0", gpus=SimBackend("n0", count=1).gpus()))
    st.apply(ev.MigGeometrySet(at=1, gpu="n0/0", profiles=["3g.40gb"], reason="operator append"))
    assert st.gpus["n0/0"].mig is None and st.gpus["n0/0"].geometry == ["3g.40gb"]
    doc = readmodel.node_doc(st, "n0")["gpus"][0]
    assert doc["status"] == "mig"
    assert doc["mig"] == {"mode": None, "pending": None, "profiles": [], "geometry": ["3g.40gb"], "slices": {}}
