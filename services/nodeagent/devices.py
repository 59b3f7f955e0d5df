"""GPU device nodes and the device allow-list of a job's cgroup.

On NVML nodes a GPU is `/dev/nvidia<minor>` (major 195, the minor NVML reports); every job also
gets the control devices NVIDIA's container runtime allows (`nvidiactl`, `nvidia-uvm`,
`nvidia-uvm-tools`, `nvidia-modeset`). A simulated GPU gets a real character device under the
work dir (`dev/<node>/nvidia<i>`, major 242 of the range Linux keeps for local use, a minor per
node and GPU): no driver answers it (opening it fails with ENXIO), but the cgroup decides
first, so a job that opens a GPU it was not granted gets EPERM, as on a real node.

A MIG slice is a device of its own: NVIDIA gives each GPU instance a capability device
(`/dev/nvidia-caps/nvidia-cap<N>`), and a process opens its slice through it beside its parent
GPU's node. A simulated GPU gets one such device per possible slice (`dev/<node>/nvidia-caps/
nvidia-cap<gpu>-<slice>`, major 243), so a job on slice A that opens slice B's device is denied
by its cgroup as on a real MIG node. On an NVML node a slice is two such devices, its GPU
instance's and its compute instance's, whose minors the driver lists in
`/proc/driver/nvidia-caps/mig-minors` (`gpu<minor>/gi<id>/access <N>`, `.../ci<id>/access <N>`).
"""

from __future__ import annotations

import os
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path

NVIDIA_MAJOR = 195
NVIDIA_CONTROL_MINORS = (255, 254)  # nvidiactl, nvidia-modeset
SIM_MAJOR = 242
SIM_MIG_MAJOR = 243
MIG_MINORS = Path("/proc/driver/nvidia-caps/mig-minors")
NVIDIA_CAPS_DIR = "/dev/nvidia-caps"
MIG_SLOTS = 8  # slice devices per GPU (a GPU has at most 7 slices); minors of a node: 512 per node


@dataclass(frozen=True)
class GpuDevice:
    path: str
    major: int
    minor: int

    @property
    def allow(self) -> str:
        return f"c {self.major}:{self.minor} rwm"


def nvidia_devices(minors: dict[int, int]) -> dict[int, GpuDevice]:
    """GPU index -> its /dev/nvidiaN, from the minor numbers NVML reports."""
    return {i: GpuDevice(f"/dev/nvidia{m}", NVIDIA_MAJOR, m) for i, m in minors.items()}


def _proc_major(name: str) -> int | None:
    try:
        for line in Path("/proc/devices").read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == name and parts[0].isdigit():
                return int(parts[0])
    except OSError:
        pass
    return None


def nvidia_control_allow() -> tuple[str, ...]:
    """The control devices every GPU job needs (none of them is a GPU)."""
    out = [f"c {NVIDIA_MAJOR}:{m} rwm" for m in NVIDIA_CONTROL_MINORS]
    uvm = _proc_major("nvidia-uvm")
    if uvm is not None:
        out += [f"c {uvm}:0 rwm", f"c {uvm}:1 rwm"]
    return tuple(out)


def _mknod(dev: GpuDevice) -> None:
    """The character device `dev` at its path (replacing anything else there), mode 0666 like
    /dev/nvidia*: only the cgroup keeps other jobs out."""
    path = Path(dev.path)
    try:
        st = path.lstat()
        if not stat.S_ISCHR(st.st_mode) or st.st_rdev != os.makedev(dev.major, dev.minor):
            path.unlink()
            raise FileNotFoundError
    except FileNotFoundError:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(dev.major, dev.minor))
    os.chmod(path, 0o666)


def _mkdir(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o755)


def sim_devices(dev_dir: Path, node: str, count: int) -> dict[int, GpuDevice]:
    """Create (or find) one character device per simulated GPU; {} where mknod is refused."""
    base = (zlib.crc32(f"{dev_dir.resolve()}/{node}".encode()) % 16000) * 64
    out = {}
    try:
        _mkdir(dev_dir)
        for i in range(count):
            out[i] = GpuDevice(str(dev_dir / f"nvidia{i}"), SIM_MAJOR, base + i)
            _mknod(out[i])
    except OSError:
        return {}
    return out


def sim_slice_devices(dev_dir: Path, node: str, gpus: list[int]) -> dict[tuple[int, int], GpuDevice]:
    """(GPU index, slice) -> the capability device of each possible MIG slice of these simulated
    GPUs (at most 64 GPUs a node); {} where mknod is refused."""
    base = (zlib.crc32(f"{dev_dir.resolve()}/{node}/mig".encode()) % 2000) * 64 * MIG_SLOTS
    caps = dev_dir / "nvidia-caps"
    out = {}
    try:
        _mkdir(caps)
        for i in gpus:
            for s in range(MIG_SLOTS - 1):
                out[(i, s)] = GpuDevice(str(caps / f"nvidia-cap{i}-{s}"), SIM_MIG_MAJOR, base + (i % 64) * MIG_SLOTS + s)
                _mknod(out[(i, s)])
    except OSError:
        return {}
    return out


def mig_cap_minors(text: str) -> dict[str, int]:
    """The driver's `mig-minors` file as {"gpu0/gi1/access": 12, ...}."""
    pairs = (line.split() for line in text.splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


def mig_cap_devices(minors: dict[str, int], gpu_minor: int, gi: int, ci: int, major: int) -> tuple[GpuDevice, ...]:
    """The two capability devices a process opens to use one MIG slice (its GPU instance's and
    its compute instance's); LookupError naming what the driver does not list."""
    keys = [f"gpu{gpu_minor}/gi{gi}/access", f"gpu{gpu_minor}/gi{gi}/ci{ci}/access"]
    missing = [k for k in keys if k not in minors]
    if missing:
        raise LookupError(f"{', '.join(missing)} not in {MIG_MINORS.name}")
    return tuple(GpuDevice(f"{NVIDIA_CAPS_DIR}/nvidia-cap{minors[k]}", major, minors[k]) for k in keys)


def nvidia_caps_major() -> int | None:
    """The major of /dev/nvidia-caps/* (dynamic: /proc/devices names it `nvidia-caps`)."""
    return _proc_major("nvidia-caps")


__all__ = ["MIG_MINORS", "MIG_SLOTS", "GpuDevice", "mig_cap_devices", "mig_cap_minors", "nvidia_caps_major",
           "nvidia_control_allow", "nvidia_devices", "sim_devices", "sim_slice_devices"]
