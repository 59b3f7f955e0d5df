"""Which OS processes belong to a job: the node daemon's proof before it signals, kills or adopts.

A job's launcher leads its own process group. The daemon records the leader's pid, its process
group and its start time (field 22 of `/proc/<pid>/stat`, in clock ticks since boot) with the
boot id; a pid is the job's only while all of these match. Members of the group are the job's
when they are in that group, started no earlier than the leader, and carry the job's id and
attempt in their environment. Nothing a job writes (a pid file) ever widens that set.

A job with a cgroup (`cgroups.JobCgroup`) is simpler and stricter: its members are the
processes of its cgroup, which no process of the job can leave (a `setsid` or a double fork
escapes a process group, not a cgroup); signals and kills go to the cgroup.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from gpusched.job import env as E

from .cgroups import JobCgroup, signal_each

PROC = Path("/proc")


def boot_id() -> str:
    try:
        return (PROC / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class ProcStat:
    pid: int
    state: str
    pgid: int
    start_ticks: int

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")


def stat(pid: int) -> ProcStat | None:
    """The fields of /proc/<pid>/stat the daemon trusts (the command name may hold anything,
    so parsing starts after its last ')')."""
    try:
        raw = (PROC / str(pid) / "stat").read_bytes()
    except (OSError, ValueError):
        return None
    rest = raw[raw.rfind(b")") + 2:].split()
    try:
        return ProcStat(pid, rest[0].decode(), int(rest[2]), int(rest[19]))
    except (IndexError, ValueError):
        return None


def _environ_has(pid: int, wanted: dict[str, str]) -> bool:
    try:
        entries = (PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return False
    found = {}
    for item in entries:
        key, _, value = item.partition(b"=")
        k = key.decode(errors="replace")
        if k in wanted:
            found[k] = value.decode(errors="replace")
    return found == wanted


@dataclass(frozen=True)
class JobGroup:
    """The process group of one job's launcher on this node, as recorded at start."""

    pid: int
    pgid: int
    start_ticks: int
    boot: str
    job_id: str
    attempt: int
    cgroup: JobCgroup | None = None

    @classmethod
    def of(cls, pid: int, job_id: str, attempt: int, cgroup: JobCgroup | None = None) -> JobGroup | None:
        s = stat(pid)
        if s is None:
            return None
        return cls(pid, s.pgid, s.start_ticks, boot_id(), job_id, attempt, cgroup)

    @classmethod
    def from_record(cls, record: dict) -> JobGroup:
        """The group a run's state file records (`launcher.record`): what adoption and the fence
        keeper prove a process by."""
        launch = record["launch"]
        cgroup = JobCgroup.from_json(launch["cgroup"]) if launch.get("cgroup") is not None else None
        return cls(int(record["pid"]), int(record["pgid"]), int(record["start_ticks"]), str(record["boot"]),
                   str(launch["job_id"]), int(launch["attempt"]), cgroup)

    def leader_alive(self) -> bool:
        """The recorded leader still runs: same boot, pid, group and start time."""
        if self.boot and self.boot != boot_id():
            return False
        s = stat(self.pid)
        return s is not None and s.alive and s.pgid == self.pgid and s.start_ticks == self.start_ticks

    def members(self) -> list[int]:
        """Live processes of the group that are provably this job's."""
        if self.boot and self.boot != boot_id():
            return []
        if self.cgroup is not None:
            return sorted(self.cgroup.pids())
        wanted = {E.JOB_ID: self.job_id, E.ATTEMPT: str(self.attempt)}
        out = []
        for entry in os.scandir(PROC):
            if not entry.name.isdigit():
                continue
            s = stat(int(entry.name))
            if (s is not None and s.alive and s.pgid == self.pgid and s.start_ticks >= self.start_ticks
                    and (s.pid == self.pid and s.start_ticks == self.start_ticks or _environ_has(s.pid, wanted))):
                out.append(s.pid)
        return sorted(out)

    def alive(self) -> bool:
        return self.leader_alive() or bool(self.members())

    def signal(self, sig: int) -> list[int]:
        """Signal the group while its leader is provably ours, else each provable member
        (with a cgroup: every process in it; SIGKILL through a frozen cgroup)."""
        if self.cgroup is not None:
            if self.boot and self.boot != boot_id():
                return []
            if sig == signal.SIGKILL:
                self.cgroup.kill()
                return [self.pid]
            return self.cgroup.signal(sig)
        if self.leader_alive():
            try:
                os.killpg(self.pgid, sig)
                return [self.pgid]
            except (ProcessLookupError, PermissionError):
                pass
        return self.signal_pids(self.members(), sig)

    def signal_pids(self, pids: list[int], sig: int) -> list[int]:
        """Signal those of `pids` that are members of the group; the rest are refused."""
        members = set(self.members())
        return signal_each([pid for pid in pids if pid in members], sig)


__all__ = ["JobGroup", "ProcStat", "boot_id", "stat"]
