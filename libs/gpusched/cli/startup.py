"""What `gpusched up` needs around its processes: a persistent data dir that one `up` owns at a
time, ports chosen without surprises, readiness by the systemd notify protocol (not log text),
and size-bounded, rotated service logs."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import IO

from gpusched.bus.servers import free_port, port_free

#: What `--fresh` deletes from a data dir (everything `up` writes there).
STORE_PARTS = ("nats", "nats-cluster", "redis", "logs", "work", "stack.json", "stack.json.tmp")


def default_data_dir() -> Path:
    """`$XDG_DATA_HOME/gpusched`, or `~/.local/share/gpusched` (the XDG default)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "gpusched"


def harden_data_dir(data_dir: Path) -> None:
    """The data dir is traversable (0711: its jobs reach their directories under `work`, nobody
    lists it), every other part of it is the owner's alone (0700 directories, 0600 files)."""
    os.chmod(data_dir, 0o711)
    for entry in data_dir.iterdir():
        if entry.is_symlink():
            continue
        if entry.name == "work" and entry.is_dir():
            os.chmod(entry, 0o711)
        elif entry.is_dir():
            os.chmod(entry, 0o700)
        else:
            os.chmod(entry, 0o600)


def claim_data_dir(data_dir: Path, fresh: bool = False) -> IO:
    """Create the data dir (0711, its parts private: `harden_data_dir`) and hold its lock for the
    life of this `up`; with `fresh`, delete the previous store first. Raises RuntimeError when
    another `up` holds it."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = open(data_dir / "up.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise RuntimeError(f"another `gpusched up` (pid {holder}) uses {data_dir}; stop it, or pass "
                           "--data-dir DIR") from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    if fresh:
        stop_leftover_jobs(data_dir)
        for part in STORE_PARTS:
            path = data_dir / part
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    harden_data_dir(data_dir)
    return lock


def stop_leftover_jobs(data_dir: Path) -> None:
    """Jobs a crashed `up` left running (its node agents' state files prove them) would be
    nobody's once `--fresh` deletes the work dir: stop them first."""
    work = data_dir / "work"
    if not (work / "runs").is_dir():
        return
    from gpusched.services.nodeagent.launcher import stop_recorded

    stopped = stop_recorded(work)
    if stopped:
        print(f"gpusched up: --fresh stopped {stopped} job process group(s) a previous `up` left running",
              file=sys.stderr, flush=True)


def choose_port(requested: int | None, default: int, flag: str) -> int:
    """None: `default` if free, else any free port; 0: any free port; an explicit port must be
    free (silently taking another would point the CLI at the wrong server)."""
    if requested is None:
        return default if port_free(default) else free_port()
    if requested == 0:
        return free_port()
    if not port_free(requested):
        raise RuntimeError(f"{flag} {requested}: the port is busy (another gpusched up, or another server?); "
                           f"pick another port, or 0 for any free one")
    return requested


class StartupNotify:
    """A datagram socket speaking systemd's notify protocol: children find it in
    `$NOTIFY_SOCKET` and send `READY=1\\nMAINPID=<pid>` once they serve (an abstract socket:
    nothing on disk, no path length limit)."""

    def __init__(self) -> None:
        self.address = f"@gpusched-up-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.address[1:])
        self.sock.setblocking(False)

    def ready_pids(self) -> list[int]:
        """Pids that said READY=1 since the last call."""
        pids: list[int] = []
        while True:
            try:
                data = self.sock.recv(4096)
            except (BlockingIOError, OSError):
                return pids
            fields = dict(line.split("=", 1) for line in data.decode(errors="replace").splitlines() if "=" in line)
            if fields.get("READY") == "1" and fields.get("MAINPID", "").isdigit():
                pids.append(int(fields["MAINPID"]))

    def close(self) -> None:
        self.sock.close()


class RotatingLog:
    """An append-only file that rotates at `max_bytes` (NAME.log -> NAME.log.1 ... .3): a
    service that logs in a loop fills at most (backups + 1) x max_bytes of disk."""

    def __init__(self, path: Path, max_bytes: int = 10 * 2**20, backups: int = 3):
        self.path, self.max_bytes, self.backups = path, max(4096, max_bytes), backups
        self.out = open(path, "ab")
        self.size = self.out.tell()

    def write(self, data: bytes) -> None:
        if self.size + len(data) > self.max_bytes and self.size > 0:
            self.rotate()
        self.out.write(data)
        self.out.flush()
        self.size += len(data)

    def rotate(self) -> None:
        self.out.close()
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self.out = open(self.path, "ab")
        self.size = 0

    def close(self) -> None:
        self.out.close()


class LogPump(threading.Thread):
    """Copies a child's output into its rotating log, line by line, until the child closes it."""

    def __init__(self, proc: subprocess.Popen, sink: RotatingLog):
        if proc.stdout is None:
            raise ValueError("LogPump copies the output of a child started with stdout=PIPE")
        super().__init__(name=f"log-{proc.pid}", daemon=True)
        self.source, self.sink = proc.stdout, sink
        self.start()

    def run(self) -> None:
        try:
            for line in iter(self.source.readline, b""):
                self.sink.write(line)
        except (OSError, ValueError):
            pass
        finally:
            self.sink.close()
