"""One cgroup per job run: every process of the job in it, its limits on it, and kill, signal and
adoption by it (Slurm's task/cgroup and ConstrainDevices, a pod's cgroup).

cgroup v2 (`/sys/fs/cgroup/cgroup.controllers` exists): one directory `<root>/<parent>/<run>`
with `memory.max`, `cpu.max`, `pids.max`; `cgroup.kill` ends every process. The v2 device
controller is an eBPF program, which this module does not load: on a v2-only host the GPU
allow-list is not enforced (`Limits.devices` is ignored and `enforces_devices` is False).

cgroup v1 (a controller per mount, `/sys/fs/cgroup/<controller>`): one directory per controller,
nested under the daemon's own cgroup of that controller (so a job never escapes the limits the
node daemon itself runs under); `devices.deny a` then an allow-list, `memory.limit_in_bytes` (and
`memsw`, so swap is no way out), `cpu.cfs_quota_us`, `pids.max`; a kill freezes the job first
(freezer), so nothing forks while it is signalled.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("pids", "memory", "cpu", "devices", "freezer")
CPU_PERIOD_US = 100_000
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")

#: Devices every job may use (runc's default allow-list): null, zero, full, random, urandom,
#: tty, console, ptmx and the pseudo-terminals.
BASE_DEVICES = ("c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm", "c 5:0 rwm", "c 5:1 rwm",
                "c 5:2 rwm", "c 136:* rwm")


class CgroupError(OSError):
    """A job's cgroup cannot be made or used; the message says which file refused what."""


def version(root: Path = ROOT) -> int | None:
    """2 (unified), 1 (a mount per controller), or None (no usable cgroups)."""
    if (root / "cgroup.controllers").exists():
        return 2
    if all((root / c).is_dir() for c in ("pids", "memory")):
        return 1
    return None


def _own_v1(controller: str) -> str:
    """The daemon's own cgroup of a v1 controller ("/" when at the root)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if controller in ctrls.split(","):
                return path
    except OSError:
        pass
    return "/"



def signal_each(pids, sig: int) -> list[int]:
    """Send `sig` to each pid; the ones that were signalled (gone or not ours: skipped)."""
    done = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            done.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return done

@dataclass(frozen=True)
class Limits:
    cpus: float | None = None
    memory_bytes: int | None = None
    pids_max: int | None = None
    #: "c MAJOR:MINOR rwm" lines beyond BASE_DEVICES (the granted GPUs and their control devices);
    #: None: no device allow-list at all.
    devices: tuple[str, ...] | None = None


@dataclass(frozen=True)
class JobCgroup:
    """The directories of one run's cgroup (one per v1 controller, one on v2)."""

    version: int
    dirs: dict[str, str] = field(default_factory=dict)  # controller ("unified" on v2) -> directory

    @property
    def procs_files(self) -> list[str]:
        """Where a process writes its pid to join (every controller's cgroup.procs)."""
        return [str(Path(d) / "cgroup.procs") for d in self.dirs.values()]

    @property
    def enforces_devices(self) -> bool:
        return "devices" in self.dirs

    def _dir(self, controller: str) -> Path:
        return Path(self.dirs["unified" if self.version == 2 else controller])

    def pids(self) -> set[int]:
        """Every process in the job's cgroup and the cgroups below it (a container's), read from
        the pids controller, which always holds all."""
        out: set[int] = set()
        for top, _, _ in os.walk(self._dir("pids")):
            try:
                out.update(int(x) for x in (Path(top) / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return out

    def signal(self, sig: int) -> list[int]:
        return signal_each(sorted(self.pids()), sig)

    def kill(self) -> None:
        """SIGKILL every process of the job; none can fork meanwhile (frozen, or cgroup.kill)."""
        if self.version == 2 and (self._dir("unified") / "cgroup.kill").exists():
            _write(self._dir("unified") / "cgroup.kill", "1", quiet=True)
            return
        freezer = self.dirs.get("freezer")
        if freezer:
            _write(Path(freezer) / "freezer.state", "FROZEN", quiet=True)
        self.signal(signal.SIGKILL)
        if freezer:
            _write(Path(freezer) / "freezer.state", "THAWED", quiet=True)  # the killed then die

    def oom_kills(self) -> int:
        """How many of the job's processes the kernel killed for exceeding its memory limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            text = (self._dir("memory") / name).read_text()
        except (OSError, KeyError):
            return 0
        m = re.search(r"^oom_kill (\d+)$", text, re.M)
        return int(m.group(1)) if m else 0

    def remove(self, timeout_s: float = 1.0) -> bool:
        """Delete the directories once empty (after `kill`); False if some stay (retried later)."""
        deadline = time.monotonic() + timeout_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        ok = True
        for d in self.dirs.values():
            for top, _, _ in sorted(os.walk(d), key=lambda t: -len(t[0])):  # children (a container's) first
                try:
                    os.rmdir(top)
                except FileNotFoundError:
                    pass
                except OSError:
                    ok = False
        return ok

    def to_json(self) -> dict:
        return {"version": self.version, "dirs": dict(self.dirs)}

    @classmethod
    def from_json(cls, d: dict) -> JobCgroup:
        return cls(int(d["version"]), {str(k): str(v) for k, v in d["dirs"].items()})


def remove_parent(parent: str, root: Path = ROOT) -> None:
    """Remove the (empty) parent cgroups `create` made, where no run is left under them."""
    if version(root) == 2:
        dirs = [root / parent]
    else:
        dirs = [root / c / _own_v1(c).lstrip("/") / parent for c in V1_CONTROLLERS]
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            pass


def _write(path: Path, value: str, quiet: bool = False) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as err:
        if not quiet:
            raise CgroupError(f"cgroup: cannot write {value!r} to {path}: {err.strerror}") from None


def create(parent: str, name: str, limits: Limits, root: Path = ROOT) -> JobCgroup:
    """Make the run's cgroup `<parent>/<name>` with its limits (CgroupError if the host refuses)."""
    if not _NAME.match(name) or not all(_NAME.match(p) for p in parent.split("/") if p):
        raise CgroupError(f"cgroup: bad name {parent}/{name}")
    v = version(root)
    if v is None:
        raise CgroupError(f"cgroup: no cgroup v1 or v2 hierarchy under {root}")
    if v == 2:
        cg = JobCgroup(2, {"unified": str(_make_v2(root, parent, name))})
    else:
        ctrls = [c for c in V1_CONTROLLERS if (root / c).is_dir()]
        if limits.devices is None:
            ctrls = [c for c in ctrls if c != "devices"]
        dirs = {}
        for c in ctrls:
            d = root / c / _own_v1(c).lstrip("/") / parent / name
            d.mkdir(parents=True, exist_ok=True)
            dirs[c] = str(d)
        cg = JobCgroup(1, dirs)
    try:
        _apply(cg, limits)
    except CgroupError:
        cg.remove(0)
        raise
    return cg


def _make_v2(root: Path, parent: str, name: str) -> Path:
    """v2: controllers must be enabled in every ancestor's subtree_control, and a cgroup that
    holds processes cannot enable them: the parent must be an empty (delegated) cgroup."""
    here = root
    for part in [p for p in parent.split("/") if p]:
        wanted = set((here / "cgroup.controllers").read_text().split()) & {"memory", "cpu", "pids"}
        _write(here / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(wanted)))
        here = here / part
        here.mkdir(exist_ok=True)
    wanted = set((here / "cgroup.controllers").read_text().split()) & {"memory", "cpu", "pids"}
    _write(here / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(wanted)))
    d = here / name
    d.mkdir(exist_ok=True)
    return d


def _apply(cg: JobCgroup, limits: Limits) -> None:
    if cg.version == 2:
        d = cg._dir("unified")
        if limits.memory_bytes is not None:
            _write(d / "memory.max", str(limits.memory_bytes))
            _write(d / "memory.swap.max", "0", quiet=True)
        if limits.cpus is not None:
            _write(d / "cpu.max", f"{max(1000, int(limits.cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}")
        if limits.pids_max is not None:
            _write(d / "pids.max", str(limits.pids_max))
        return
    if limits.memory_bytes is not None and "memory" in cg.dirs:
        mem = cg._dir("memory")
        _write(mem / "memory.limit_in_bytes", str(limits.memory_bytes))
        if (mem / "memory.memsw.limit_in_bytes").exists():
            _write(mem / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
    if limits.cpus is not None and "cpu" in cg.dirs:
        _write(cg._dir("cpu") / "cpu.cfs_period_us", str(CPU_PERIOD_US))
        _write(cg._dir("cpu") / "cpu.cfs_quota_us", str(max(1000, int(limits.cpus * CPU_PERIOD_US))))
    if limits.pids_max is not None and "pids" in cg.dirs:
        _write(cg._dir("pids") / "pids.max", str(limits.pids_max))
    if limits.devices is not None and "devices" in cg.dirs:
        dev = cg._dir("devices")
        _write(dev / "devices.deny", "a")
        for line in (*BASE_DEVICES, *limits.devices):
            _write(dev / "devices.allow", line)


__all__ = ["BASE_DEVICES", "CgroupError", "JobCgroup", "Limits", "create", "remove_parent", "version"]
