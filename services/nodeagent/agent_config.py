"""A node agent's settings: its node, where it keeps its state, and how it runs jobs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gpusched.core.model import NvlinkLayout

from .users import UserMap


def default_work_dir() -> Path:
    return Path(os.environ.get("GPUSCHED_WORK_DIR") or Path.home() / ".local" / "state" / "gpusched")


@dataclass
class AgentConfig:
    node: str
    rack: str = "rack0"
    block: str | None = None
    address: str = ""
    nvlink: NvlinkLayout | Literal["custom"] = "custom"  # the layout name registered (informational)
    work_dir: Path = field(default_factory=default_work_dir)
    log_dir: Path | None = None  # default <work_dir>/logs: <log_dir>/<job>/<attempt>-<node>.log
    checkpoint_root: Path | None = None  # default <work_dir>/checkpoints/<job> (use a shared FS)
    kill_grace_s: float = 10.0
    cwd: str | None = None  # where a job without `spec.workdir` runs (None: the daemon's directory)
    ack_interval_s: float = 5.0  # at most one CheckpointSaved per run per interval (answers excepted)
    max_ack_bytes: int = 4096
    max_control_entries: int = 256
    resize_grace_s: float = 30.0  # a resize waits this long for the collective checkpoint
    timeout_checkpoint_s: float = 30.0  # a time-limited job is asked to checkpoint this long before
    retry_backoff_s: float = 1.0  # a requeued failure restarts after 1, 2, 4 ... s
    retry_backoff_max_s: float = 60.0
    job_user: str | None = None  # run every job without an account or team user as this one (single tenant)
    team_users: dict[str, str] = field(default_factory=dict)  # team -> its service account
    #: Dynamic uids (first, count) for jobs with no account (users.UserMap); None: none.
    uid_range: tuple[int, int] | None = None
    submitter_accounts: bool = True  # run as the submitter's account when this node has it
    #: A cgroup per run (limits, GPU allow-list, kill by cgroup): None = where the host allows (root).
    cgroups: bool | None = None
    cgroup_parent: str = "gpusched"
    pids_max: int | None = 8192  # per job
    #: More directories where jobs may name their checkpoint_dir (besides `checkpoint_root`).
    checkpoint_roots: tuple[str, ...] = ()
    rejoin_heartbeats: int = 3  # after a NodeLost of itself, re-register after this many heartbeats
    labels: dict[str, str] = field(default_factory=dict)  # announced at registration (`--label K=V`)
    #: podman's configuration and image storage for image jobs (`container`); default <work_dir>/containers.
    containers_dir: Path | None = None
    #: CPUs and memory (MiB) offered to jobs, announced at registration (None: not declared,
    #: then placement does not count them here; `main.host_resources` gives the host's).
    cpus: float | None = None
    memory_mb: int | None = None

    def __post_init__(self) -> None:
        self.work_dir = Path(self.work_dir)
        self.log_dir = Path(self.log_dir) if self.log_dir else self.work_dir / "logs"
        self.checkpoint_root = Path(self.checkpoint_root) if self.checkpoint_root else self.work_dir / "checkpoints"
        self.containers_dir = Path(self.containers_dir) if self.containers_dir else self.work_dir / "containers"

    def user_for(self, team: str) -> str | None:
        return self.team_users.get(team, self.job_user)

    def user_map(self) -> UserMap:
        return UserMap(job_user=self.job_user, team_users=dict(self.team_users),
                       submitter_accounts=self.submitter_accounts, uid_range=self.uid_range)

    def all_checkpoint_roots(self) -> tuple[str, ...]:
        return (str(self.checkpoint_root), *self.checkpoint_roots)
