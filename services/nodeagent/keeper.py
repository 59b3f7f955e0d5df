"""The fence keeper: a dead node agent's jobs stop before the reconciler may run them elsewhere.

A job's processes outlive its agent on purpose (a restarted agent adopts them), so the agent's
own fence (`fencing.py`) cannot cover the agent's death: a daemon killed -9 and back only after
the node timeout would find its job requeued and running on another host beside the old copy.
The keeper is a small process of its own session, one per work dir, that outlives the agent:
the agent renews a lease (`<work_dir>/runs/keeper.json`) every `renew_s` with the time it last
reached the log (its fence's last good probe, CLOCK_MONOTONIC), and when the lease is `after_s`
old (`FenceConfig.keeper_after_s`) the keeper stops every run the work dir's state files prove
alive (SIGTERM to the run's cgroup, or its process group; SIGKILL after the kill grace), writes
`fenced` into each run's state file, and exits. A daemon restarted within `after_s` renews the
lease and keeps every job; one restarted later finds its runs ended by the keeper and reports
them as fenced (`ProcessesEnded`), not as failed exits. A live daemon cut off from the log
fences its jobs itself first (the keeper waits as long as that fence may take).

No checkpoint is asked for: no agent is there to record it in the log, so a new attempt resumes
from the last checkpoint the log holds, as after a machine crash.

The keeper lives while the agent does (a lock in `runs/keeper.lock` says it runs; the agent
starts another when it finds none, e.g. after a kill -9 of the keeper), and ends when the lease
is stale (after fencing) or removed (the agent stopped in order with no job left).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .procs import JobGroup

LEASE, LOCK, LOG = "keeper.json", "keeper.lock", "keeper.log"
#: How often the keeper looks at the lease (within the fence bound's slack: `FenceConfig.keeper_after_s`).
TICK_S = 0.2
#: The keeper's process: this module alone (the package imports nothing), not the daemon.
_BOOT = "import sys; from gpusched.services.nodeagent.keeper import main; sys.exit(main(sys.argv[2:]))"


def _write_atomic(path: Path, obj: object) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _lock_held(path: Path) -> bool:
    """Whether a keeper holds the work dir's lock (a probe that takes it and lets go at once)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the probe's lock


def fenced(record_path: Path) -> str:
    """Why the keeper stopped this run ("" if it did not): the state file says so."""
    try:
        return str(json.loads(record_path.read_text()).get("fenced") or "")
    except (OSError, ValueError, AttributeError):
        return ""


# --- the agent's side --------------------------------------------------------------------------


class Keeper:
    """A node daemon's side of the keeper of one work dir: the lease it renews and the keeper
    process it (re)starts while it has job processes to guard."""

    def __init__(self, work_dir: Path, after_s: float, kill_grace_s: float):
        self.runs = Path(work_dir) / "runs"
        self.after_s, self.kill_grace_s = after_s, kill_grace_s
        self.renew_s = min(1.0, after_s / 4)
        self.wanted = False  # set by the first job process: from then on a keeper must run
        self.renewed: float | None = None  # the lease's time, as last written
        self.proc: subprocess.Popen | None = None

    def renew(self, renewed: float) -> None:
        """`renewed`: when this daemon last reached the log (its fence's last good probe, a
        CLOCK_MONOTONIC time): a cut-off daemon's lease ages with its own fence's clock."""
        self.runs.mkdir(parents=True, exist_ok=True, mode=0o700)
        _write_atomic(self.runs / LEASE, {"renewed": renewed, "after_s": self.after_s,
                                          "kill_grace_s": self.kill_grace_s, "agent_pid": os.getpid()})
        self.renewed = renewed

    def running(self) -> bool:
        if self.proc is not None and self.proc.poll() is None:  # ours (maybe still starting); poll reaps
            return True
        return _lock_held(self.runs / LOCK)

    def ensure(self) -> None:
        """Start the keeper unless one runs (in its own session: a signal to the daemon's group
        or the daemon's death does not reach it). Not on a stale lease (none written yet, or a
        cut-off daemon's): that keeper would only stop what the daemon's own fence stops."""
        self.wanted = True
        if self.renewed is None or time.monotonic() - self.renewed >= self.after_s or self.running():
            return
        with open(self.runs / LOG, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, "gpusched-fence-keeper", str(self.runs)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd="/", start_new_session=True)

    def release(self) -> None:
        """The daemon stopped in order with no job left: the keeper ends at its next look."""
        (self.runs / LEASE).unlink(missing_ok=True)


def start(host: Any) -> None:
    """Before a starting `NodeHost` adopts anything: one keeper side per work dir of its agents
    (none when fencing is off). Its lease is renewed only once the daemon heartbeats (`tasks`):
    a keeper left by the last daemon goes on counting while this one folds the log."""
    from . import fencing

    host.keepers = {}
    cfg = fencing.config(host)
    if cfg is None:
        return
    kill = max((a.cfg.kill_grace_s for a in host.agents.values()), default=10.0)
    after = cfg.keeper_after_s(kill, host.heartbeat_s)
    for agent in host.agents.values():
        if agent.cfg.work_dir not in host.keepers:
            host.keepers[agent.cfg.work_dir] = Keeper(agent.cfg.work_dir, after, kill)


def guard(agent: Any) -> None:
    """A job process was started or adopted: its work dir's keeper must run (if it cannot be
    started now, the renewal tries again within a second)."""
    keeper = getattr(agent.host, "keepers", {}).get(agent.cfg.work_dir)
    if keeper is not None:
        try:
            keeper.ensure()
        except OSError as err:
            import structlog

            structlog.get_logger().warning("fence_keeper_not_started", dir=str(keeper.runs), error=str(err))


def tasks(host: Any) -> list:
    """The lease's renewal for a started host, with its fence (`fencing.tasks`) running."""
    import asyncio

    import structlog

    async def renew() -> None:
        log = structlog.get_logger()
        while True:
            for keeper in host.keepers.values():
                try:
                    keeper.renew(host.fence.last_ok)
                    if keeper.wanted:
                        keeper.ensure()
                except OSError as err:
                    log.warning("fence_keeper_lease_failed", dir=str(keeper.runs), error=str(err))
            await asyncio.sleep(min(k.renew_s for k in host.keepers.values()))

    return [asyncio.create_task(renew(), name="nodeagent-keeper")] if getattr(host, "keepers", None) else []


def stop(host: Any) -> None:
    """A daemon stopping: where none of its job processes is left, its keeper may end; where
    some are (`--keep-jobs`), the lease stays and the next daemon renews it, or the keeper
    fences them."""
    for work_dir, keeper in getattr(host, "keepers", {}).items():
        if not any(not r.proc.virtual for a in host.agents.values() if a.cfg.work_dir == work_dir
                   for r in a.jobs.values()):
            keeper.release()


# --- the keeper process ------------------------------------------------------------------------


def _say(event: str, **fields: object) -> None:
    print(json.dumps({"at": round(time.time(), 3), "event": event, **fields}), flush=True)


def _read_lease(runs: Path) -> dict | None:
    try:
        lease = json.loads((runs / LEASE).read_text())
        return lease if isinstance(lease, dict) and isinstance(lease.get("renewed"), float) else None
    except (OSError, ValueError):
        return None


def fence(runs: Path, why: str, kill_grace_s: float) -> list[str]:
    """Stop every run the state files under `runs` prove alive: mark it fenced, SIGTERM, SIGKILL
    after the grace. Returns the state files of the runs it stopped."""
    stopped: list[tuple[Path, JobGroup]] = []
    for path in sorted(runs.glob("*/*.json")):
        try:
            rec = json.loads(path.read_text())
            group = None if rec.get("virtual") else JobGroup.from_record(rec)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if group is None or not group.alive():  # its leader, or what it left in its cgroup or group
            continue
        _write_atomic(path, {**rec, "fenced": why})  # before the signal: whoever sees the exit knows why
        group.signal(signal.SIGTERM)
        stopped.append((path, group))
    deadline = time.monotonic() + kill_grace_s
    while any(g.alive() for _, g in stopped) and time.monotonic() < deadline:
        time.sleep(0.05)
    for _, group in stopped:
        group.signal(signal.SIGKILL)
    return [p.name for p, _ in stopped]


def watch(runs: Path) -> int:
    """The keeper's loop: nothing while the lease is fresh; fence once it is stale; end."""
    while True:
        lease = _read_lease(runs)
        if lease is None:
            _say("keeper_done", why="no lease: the agent stopped in order")
            return 0
        age = time.monotonic() - lease["renewed"]
        if age >= float(lease["after_s"]):
            why = (f"fenced: the node agent (pid {lease.get('agent_pid')}) silent for {age:.1f}s, "
                   f"its jobs stopped by the fence keeper")
            stopped = fence(runs, why, float(lease.get("kill_grace_s", 10.0)))
            _say("keeper_fenced", lease_age_s=round(age, 2), after_s=lease["after_s"], runs=stopped)
            return 0
        time.sleep(TICK_S)


def main(argv: list[str]) -> int:
    """`keeper RUNS_DIR` (what `Keeper.ensure` starts): watch until done; at once if another
    keeper holds the lock."""
    runs = Path(argv[0])
    fd = os.open(runs / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())  # the pidfile: who guards this work dir
    _say("keeper_started", pid=os.getpid(), runs=str(runs))
    return watch(runs)


__all__ = ["Keeper", "fence", "fenced", "guard", "main", "start", "stop", "tasks", "watch"]
