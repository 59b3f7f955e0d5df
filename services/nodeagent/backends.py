"""GPU backends behind one interface: NVML (real GPUs, through `pynvml`) and a simulated one.

A backend answers two questions: which GPUs does this node have (UUID, model, memory, NVLink
domain), and what is happening on them now (memory, utilization, processes, health). The
simulated backend also lets tests and the chaos demo inject stray processes, XIDs and leaked
memory, and takes a job's utilization from its environment (`GPUSCHED_SIM_UTIL`, percent).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec
import structlog

from gpusched.core.heartbeat import GpuSample
from gpusched.core.mig import MigInfo, MigMode, MigProfile, profile_name, published_profiles
from gpusched.core.model import GpuInfo, nvlink_domains

from .devices import MIG_MINORS
from .nvml_mig import MigError, MigSlice, NvmlMig

log = structlog.get_logger()

#: XIDs that mean the GPU needs attention (reset, RMA) rather than an application bug
#: (13, 31, 43, 45 are left out: they follow from what a job did, not from the hardware).
CRITICAL_XIDS = frozenset({48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 121, 140})

#: Pids at or above this are placeholders of simulated jobs, never real (Linux pid_max <= 2**22).
VIRTUAL_PID_BASE = 1 << 22
#: A job's environment variable that sets its simulated GPU utilization (percent; default busy).
SIM_UTIL_ENV = "GPUSCHED_SIM_UTIL"
SIM_BUSY_PCT = 97.0


def sim_util(env: Mapping[str, str] | None) -> float:
    """The utilization a simulated job shows: `GPUSCHED_SIM_UTIL` clamped to 0..100, else busy."""
    raw = (env or {}).get(SIM_UTIL_ENV)
    try:
        return min(100.0, max(0.0, float(raw))) if raw is not None else SIM_BUSY_PCT
    except ValueError:
        return SIM_BUSY_PCT


def mps_memory_limit_mb(env: Mapping[str, str] | None) -> int | None:
    """The MB of `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` ("0=<MB>M", device 0 of the job's
    visible GPUs): a simulated job uses three quarters of it, as a whole-GPU one of its GPU."""
    raw = (env or {}).get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "")
    _, _, size = raw.partition("=")
    try:
        return int(size.removesuffix("M")) if size else None
    except ValueError:
        return None


def _mig_mode(nv, value) -> MigMode:
    return "enabled" if value == getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1) else "disabled"


def gpus_with_mig(backend) -> list[GpuInfo]:
    """The backend's GPUs as a node registers them: with their MIG mode and profiles where MIG
    is enabled or pending (a GPU used whole registers as before)."""
    gpus = backend.gpus()
    read = getattr(backend, "mig", None)
    if read is None:
        return gpus
    mig = read()
    return [msgspec.structs.replace(g, mig=m) if (m := mig.get(g.index)) is not None and "enabled" in (m.mode, m.pending)
            else g for g in gpus]


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this host (no driver, no library); the message says why."""


class GpuBackend(Protocol):
    name: str

    def gpus(self) -> list[GpuInfo]: ...

    def sample(self) -> list[GpuSample]: ...

    def attach(self, indices: Sequence[int], pid: int, env: Mapping[str, str] | None = None) -> None:
        """The agent started `pid` on these GPUs (the simulated backend reports it there, busy
        as its `GPUSCHED_SIM_UTIL` says; `env` None keeps what an earlier attach said)."""

    def detach(self, pid: int) -> None: ...

    def kill(self, pid: int) -> str:
        """SIGKILL a process seen on a GPU: "killed" or "missing"."""

    def reset(self, index: int) -> str:
        """Reset a GPU whose memory leaked: "" on success, else why not."""

    def apply_mig(self, index: int, profiles: list[str]) -> str:
        """Make the GPU's MIG instances the geometry `profiles` (only ever for an idle GPU): ""
        on success, else the error (NVML; a simulated GPU's slices are its geometry already)."""

    def adopt_mig(self, index: int, profiles: list[str], idle: bool) -> str:
        """After a restart: the GPU's instances as they are if they are the geometry, else it
        applied (only if `idle`): "" or the error."""

    def close(self) -> None: ...


def process_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a killed child not yet reaped is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    state = stat[stat.rfind(b")") + 2: stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def kill_pid(pid: int) -> str:
    if pid >= VIRTUAL_PID_BASE:
        return "missing"
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return "missing"
    return "killed"


# --- simulated ------------------------------------------------------------------------------


class SimBackend:
    """GPUs that exist only in memory. Processes on a GPU are the ones the agent attached
    there plus injected strays: a stray that is a live OS process disappears when it dies;
    a stray pid that is no process at all (a phantom) stays until it is killed."""

    name = "sim"

    def __init__(self, node: str, count: int = 8, nvlink: str = "all", *, model: str = "SIM-H100-80GB",
                 memory_mb: int = 81920, domains: Sequence[int] | None = None, mig: bool = False):
        self.node, self.mig_enabled = node, mig
        domains = list(domains) if domains is not None else nvlink_domains(nvlink, count)
        if len(domains) != count:
            raise ValueError(f"{count} GPUs but {len(domains)} NVLink domains")
        self._gpus = [
            GpuInfo(index=i, uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'gpusched-sim:{node}/{i}')}",
                    model=model, memory_mb=memory_mb, nvlink_domain=d)
            for i, d in enumerate(domains)
        ]
        self._jobs: dict[int, tuple[int, ...]] = {}  # pid -> GPU indices
        self._strays: dict[int, dict[int, bool]] = {}  # index -> {pid: is a real process}
        self._health: dict[int, tuple[int | None, str]] = {}  # index -> (xid, reason) while unhealthy
        self._util: dict[int, float] = {}  # pid -> utilization it shows
        self._leaks: dict[int, int] = {}  # index -> MB in use by no process
        self._cap: dict[int, int | None] = {}  # pid -> its MPS memory limit (a fractional job's), if any

    def gpus(self) -> list[GpuInfo]:
        return list(self._gpus)

    def mig(self) -> dict[int, MigInfo]:
        """Each GPU's MIG mode and the published profiles of its model (`core/mig.py`)."""
        out = {}
        for g in self._gpus:
            profiles = published_profiles(g.model, g.memory_mb)
            mode: MigMode = "unsupported" if not profiles else "enabled" if self.mig_enabled else "disabled"
            out[g.index] = MigInfo(mode, mode, profiles)
        return out

    def attach(self, indices: Sequence[int], pid: int, env: Mapping[str, str] | None = None) -> None:
        self._jobs[pid] = tuple(indices)
        if env is not None or pid not in self._util:
            self._util[pid] = sim_util(env)
            self._cap[pid] = mps_memory_limit_mb(env)

    def detach(self, pid: int) -> None:
        self._jobs.pop(pid, None)  # its utilization is forgotten at the next sample

    def inject_leak(self, index: int, memory_mb: int) -> None:
        self._check_index(index)
        if memory_mb > 0:
            self._leaks[index] = min(memory_mb, self._gpus[index].memory_mb)
        else:
            self._leaks.pop(index, None)

    def reset(self, index: int) -> str:
        """A GPU reset frees leaked memory; refused while a process is on the GPU."""
        self._check_index(index)
        if any(index in gpus for gpus in self._jobs.values()) or self._strays.get(index):
            return "refused: processes on the GPU"
        self._leaks.pop(index, None)
        return ""

    def apply_mig(self, index: int, profiles: list[str]) -> str:
        """Nothing to make: a simulated MIG GPU's slices are the geometry the fold holds."""
        return ""

    def adopt_mig(self, index: int, profiles: list[str], idle: bool) -> str:
        return ""

    def inject_stray(self, index: int, pid: int) -> None:
        self._check_index(index)
        self._strays.setdefault(index, {})[pid] = process_alive(pid)

    def inject_health(self, index: int, healthy: bool = False, xid: int | None = 79, reason: str = "") -> None:
        self._check_index(index)
        if healthy:
            self._health.pop(index, None)
        else:
            self._health[index] = (xid, reason or (f"XID {xid}" if xid is not None else "unhealthy"))

    def kill(self, pid: int) -> str:
        for strays in self._strays.values():
            if pid in strays:
                real = strays.pop(pid)
                return kill_pid(pid) if real else "killed"
        return kill_pid(pid)

    def sample(self) -> list[GpuSample]:
        on_gpu: dict[int, list[int]] = {}
        for pid, indices in self._jobs.items():
            for i in indices:
                on_gpu.setdefault(i, []).append(pid)
        for pid in [p for p in self._util if p not in self._jobs]:
            del self._util[pid]
            self._cap.pop(pid, None)
        out = []
        for g in self._gpus:
            jobs = on_gpu.get(g.index, [])
            strays = self._strays.get(g.index, {})
            for pid in [p for p, real in strays.items() if real and not process_alive(p)]:
                del strays[pid]
            pids = sorted(jobs + list(strays))
            used = min(g.memory_mb, sum((self._cap.get(p) or g.memory_mb) * 3 // 4 for p in jobs) + len(strays) * 512
                       + self._leaks.get(g.index, 0))
            xid, reason = self._health.get(g.index, (None, ""))
            out.append(GpuSample(
                index=g.index, uuid=g.uuid, memory_used_mb=used, memory_total_mb=g.memory_mb,
                utilization_pct=max((self._util.get(p, SIM_BUSY_PCT) for p in jobs), default=0.0),
                temperature_c=72.0 if jobs else 34.0, pids=pids,
                healthy=g.index not in self._health, health=reason, xid=xid,
            ))
        return out

    def close(self) -> None:
        pass

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self._gpus):
            raise ValueError(f"node {self.node} has no GPU {index}")


# --- NVML -----------------------------------------------------------------------------------


def domains_from_pairs(count: int, pairs: Iterable[tuple[int, int]]) -> list[int]:
    """NVLink domains as connected components of the NVLink graph, numbered by their lowest
    GPU index. (A hybrid cube-mesh, not all-to-all, still comes out as one domain.)"""
    parent = list(range(count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in pairs:
        if 0 <= a < count and 0 <= b < count:
            ra, rb = root(a), root(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    numbering: dict[int, int] = {}
    return [numbering.setdefault(root(i), len(numbering)) for i in range(count)]


def normalize_bus_id(bus_id: str | bytes) -> str:
    """NVML writes PCI bus ids with 4 or 8 domain digits and either case."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    text = text.strip().lower().rstrip("\x00")
    try:
        domain, bus, rest = text.split(":")
        dev, fn = rest.split(".")
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn, 16)}"
    except ValueError:
        return text


def domains_from_links(bus_ids: Sequence[str], links: Sequence[Sequence[tuple[str, str]]]) -> list[int]:
    """NVLink domains from each GPU's active links, given as (remote kind, remote bus id) with
    kind "gpu" or "switch": GPUs linked directly share a domain, and so do all GPUs that reach
    an NVSwitch (the switches of one baseboard form one fabric)."""
    index = {normalize_bus_id(b): i for i, b in enumerate(bus_ids)}
    pairs: list[tuple[int, int]] = []
    on_switch: list[int] = []
    for i, gpu_links in enumerate(links):
        for kind, remote in gpu_links:
            if kind == "switch":
                on_switch.append(i)
            elif (j := index.get(normalize_bus_id(remote))) is not None:
                pairs.append((i, j))
    pairs += [(on_switch[0], j) for j in on_switch[1:]]
    return domains_from_pairs(len(bus_ids), pairs)


class NvmlBackend:
    """Real GPUs through NVML. Every query is guarded on its own: a query the driver or the
    GPU does not support leaves its field empty instead of stopping the agent."""

    name = "nvml"

    def __init__(self, critical_xids: frozenset[int] = CRITICAL_XIDS, mig_minors_path: Path = MIG_MINORS):
        try:
            import pynvml
        except ImportError as err:  # pragma: no cover - nvidia-ml-py is a dependency
            raise BackendUnavailable("pynvml is missing: pip install nvidia-ml-py") from err
        self.nv = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise BackendUnavailable(
                f"NVML is not available on this host ({err}): is the NVIDIA driver installed and "
                "loaded (does `nvidia-smi` work)? Use `--backend sim` on machines without GPUs."
            ) from err
        self.critical_xids = critical_xids
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self._xid: dict[int, int] = {}
        self._lost: set[int] = set()
        self._events = self._register_xid_events()
        self._static: list[GpuInfo] | None = None
        self.mig_minors_path = mig_minors_path
        self._mig: NvmlMig | None = None

    def _call(self, fn, *args, default=None):
        try:
            return fn(*args)
        except self.nv.NVMLError as err:
            if getattr(err, "value", None) == self.nv.NVML_ERROR_GPU_IS_LOST and args:
                for i, h in enumerate(self.handles):
                    if h is args[0]:
                        self._lost.add(i)
            return default

    def _register_xid_events(self):
        nv = self.nv
        event_set = self._call(nv.nvmlEventSetCreate)
        if event_set is None:
            return None
        for h in self.handles:
            self._call(nv.nvmlDeviceRegisterEvents, h, nv.nvmlEventTypeXidCriticalError, event_set)
        return event_set

    def _drain_xids(self) -> None:
        if self._events is None:
            return
        nv = self.nv
        for _ in range(1000):
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError:  # NVML_ERROR_TIMEOUT: nothing pending (or unsupported)
                return
            for i, h in enumerate(self.handles):
                if self._same_handle(h, data.device):
                    self._xid[i] = int(data.eventData)
                    log.warning("gpu_xid", index=i, xid=int(data.eventData))

    def _same_handle(self, a, b) -> bool:
        try:
            return self._text(self.nv.nvmlDeviceGetUUID(a)) == self._text(self.nv.nvmlDeviceGetUUID(b))
        except self.nv.NVMLError:
            return False

    @staticmethod
    def _text(value) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def nvlink_pairs(self) -> list[tuple[int, int]]:
        """Pairs of GPUs that can talk peer-to-peer over NVLink."""
        nv = self.nv
        pairs = []
        for i, a in enumerate(self.handles):
            for j in range(i + 1, len(self.handles)):
                status = self._call(nv.nvmlDeviceGetP2PStatus, a, self.handles[j], nv.NVML_P2P_CAPS_INDEX_NVLINK)
                if status == nv.NVML_P2P_STATUS_OK:
                    pairs.append((i, j))
        return pairs

    def nvlink_links(self) -> tuple[list[str], list[list[tuple[str, str]]]]:
        """Each GPU's PCI bus id and its active NVLinks as (remote kind, remote bus id)."""
        nv = self.nv
        bus_ids, links = [], []
        for h in self.handles:
            pci = self._call(nv.nvmlDeviceGetPciInfo, h)
            bus_ids.append(self._text(pci.busId) if pci is not None else "")
            gpu_links = []
            for link in range(nv.NVML_NVLINK_MAX_LINKS):
                state = self._call(nv.nvmlDeviceGetNvLinkState, h, link)
                if state is None:
                    break  # no such link (or NVLink unsupported)
                if state != nv.NVML_FEATURE_ENABLED:
                    continue
                kind = self._call(nv.nvmlDeviceGetNvLinkRemoteDeviceType, h, link)
                remote = self._call(nv.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
                remote_id = self._text(remote.busId) if remote is not None else ""
                gpu_links.append(("switch" if kind == nv.NVML_NVLINK_DEVICE_TYPE_SWITCH else "gpu", remote_id))
            links.append(gpu_links)
        return bus_ids, links

    def nvlink_domains(self) -> list[int]:
        count = len(self.handles)
        pairs = self.nvlink_pairs()
        if pairs:
            return domains_from_pairs(count, pairs)
        bus_ids, links = self.nvlink_links()
        return domains_from_links(bus_ids, links)

    def mig(self) -> dict[int, MigInfo]:
        """Each GPU's MIG mode (current, pending) and GPU-instance profiles from the driver:
        `nvmlDeviceGetMigMode`, `nvmlDeviceGetGpuInstanceProfileInfo` for every profile id, and
        in MIG mode `nvmlDeviceGetGpuInstanceRemainingCapacity`. A GPU without MIG (or a driver
        that cannot say) is `unsupported`."""
        nv = self.nv
        out = {}
        for i, h in enumerate(self.handles):
            modes = self._call(nv.nvmlDeviceGetMigMode, h)
            if modes is None:
                out[i] = MigInfo("unsupported", "unsupported")
                continue
            current, pending = (_mig_mode(nv, m) for m in modes)
            out[i] = MigInfo(current, pending, self._mig_profiles(h, current == "enabled"))
        return out

    def _profile_infos(self, h) -> list[tuple[str, Any]]:
        """(name, NVML profile info) of each GPU-instance profile the GPU offers."""
        nv = self.nv
        out = []
        for p in range(int(getattr(nv, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0))):
            info = self._call(nv.nvmlDeviceGetGpuInstanceProfileInfo, h, p)
            if info is None or not info.instanceCount:
                continue  # a profile this GPU does not offer
            name = self._text(getattr(info, "name", b"")) or profile_name(int(info.sliceCount), int(info.memorySizeMB))
            out.append((name, info))
        return out

    def _mig_profiles(self, h, enabled: bool) -> list[MigProfile]:
        profiles = []
        for name, info in self._profile_infos(h):
            count = int(info.instanceCount)
            left = self._call(self.nv.nvmlDeviceGetGpuInstanceRemainingCapacity, h, info.id, default=0) \
                if enabled else count
            profiles.append(MigProfile(name, int(info.sliceCount), int(info.memorySizeMB), count, int(left)))
        return profiles

    def _instances(self) -> NvmlMig:
        if self._mig is None:
            self._mig = NvmlMig(self.nv, self.handles, self.minor_numbers(), self.mig_minors_path)
        return self._mig

    def _offered(self, index: int) -> dict[str, tuple[int, int]]:
        return {name: (int(info.id), int(info.sliceCount)) for name, info in self._profile_infos(self.handles[index])}

    def apply_mig(self, index: int, profiles: list[str]) -> str:
        """Make the GPU's MIG instances the geometry `profiles` (only ever called for an idle
        GPU): "" on success, else the error, and the GPU has no usable slice (`nvml_mig`)."""
        return self._instances().apply(index, list(profiles), self._offered(index))

    def adopt_mig(self, index: int, profiles: list[str], idle: bool) -> str:
        """After a restart: the GPU's instances as they are if they are the geometry, else it
        applied (only if `idle`)."""
        return self._instances().adopt(index, list(profiles), self._offered(index), idle)

    def read_mig(self, index: int) -> tuple[list[MigSlice], str]:
        """The GPU's MIG instances as they are (nothing changed), or why they cannot be read."""
        try:
            return self._instances().read(index, self._offered(index)), ""
        except MigError as err:
            return [], str(err)

    def mig_slices(self, index: int) -> list[MigSlice] | None:
        """The GPU's slices as made here (geometry order), or None: not applied or failed."""
        return self._instances().slices.get(index)

    def mig_error(self, index: int) -> str:
        return self._instances().errors.get(index, "") if self._mig is not None else ""

    def minor_numbers(self) -> dict[int, int]:
        """GPU index -> the minor number of its /dev/nvidiaN (the job cgroup's device allow-list)."""
        out = {}
        for i, h in enumerate(self.handles):
            minor = self._call(self.nv.nvmlDeviceGetMinorNumber, h)
            if minor is not None:
                out[i] = int(minor)
        return out

    def gpus(self) -> list[GpuInfo]:
        if self._static is None:
            nv = self.nv
            domains = self.nvlink_domains()
            out = []
            for i, h in enumerate(self.handles):
                mem = self._call(nv.nvmlDeviceGetMemoryInfo, h)
                out.append(GpuInfo(
                    index=i, uuid=self._text(self._call(nv.nvmlDeviceGetUUID, h, default=f"GPU-unknown-{i}")),
                    model=self._text(self._call(nv.nvmlDeviceGetName, h, default="unknown")),
                    memory_mb=int(mem.total // 2**20) if mem is not None else 0, nvlink_domain=domains[i],
                ))
            self._static = out
        return list(self._static)

    def sample(self) -> list[GpuSample]:
        nv = self.nv
        self._drain_xids()
        out = []
        for g, h in zip(self.gpus(), self.handles):
            mem = self._call(nv.nvmlDeviceGetMemoryInfo, h)
            util = self._call(nv.nvmlDeviceGetUtilizationRates, h)
            temp = self._call(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
            procs = self._call(nv.nvmlDeviceGetComputeRunningProcesses, h, default=[]) or []
            ecc = self._call(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                             nv.NVML_VOLATILE_ECC, default=0) or 0
            xid = self._xid.get(g.index)
            reasons = []
            if g.index in self._lost:
                reasons.append("GPU is lost")
            if xid is not None and xid in self.critical_xids:
                reasons.append(f"XID {xid}")
            if ecc:
                reasons.append(f"{ecc} uncorrected ECC errors")
            if mig_error := self.mig_error(g.index):
                reasons.append(f"MIG geometry not applied: {mig_error}")
            out.append(GpuSample(
                index=g.index, uuid=g.uuid,
                memory_used_mb=int(mem.used // 2**20) if mem is not None else 0,
                memory_total_mb=int(mem.total // 2**20) if mem is not None else g.memory_mb,
                utilization_pct=float(util.gpu) if util is not None else 0.0,
                temperature_c=float(temp) if temp is not None else None,
                pids=sorted({int(p.pid) for p in procs}),
                healthy=not reasons, health="; ".join(reasons), xid=xid, ecc_errors=int(ecc),
            ))
        return out

    def attach(self, indices: Sequence[int], pid: int, env: Mapping[str, str] | None = None) -> None:
        pass  # NVML sees real processes by itself

    def reset(self, index: int) -> str:
        """`nvidia-smi --gpu-reset` (NVML has no reset call); refused while NVML sees a process
        on the GPU. Needs root and no other client on the GPU; the error says what failed."""
        h = self.handles[index]
        procs = self._call(self.nv.nvmlDeviceGetComputeRunningProcesses, h, default=[]) or []
        if procs:
            return f"refused: {len(procs)} process(es) on the GPU"
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return "nvidia-smi not found"
        done = subprocess.run([smi, "--gpu-reset", "-i", str(index)], capture_output=True, text=True, timeout=60)
        return "" if done.returncode == 0 else (done.stderr or done.stdout).strip()[:300]

    def detach(self, pid: int) -> None:
        pass

    def kill(self, pid: int) -> str:
        return kill_pid(pid)

    def close(self) -> None:
        try:
            if self._events is not None:
                self.nv.nvmlEventSetFree(self._events)
            self.nv.nvmlShutdown()
        except self.nv.NVMLError:
            pass

