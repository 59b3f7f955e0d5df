"""A run: one attempt (and generation) of a job's processes on one node; the state file a
restarted daemon adopts it from; and what its exit means for the job."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gpusched.bus import subjects
from gpusched.core import events as ev
from gpusched.core.rules import work_since_checkpoint
from gpusched.core.state import ClusterState

from . import launcher
from .acks import AckCoalescer
from .handshake import _write_json

RunKey = tuple[str, int, int]  # job, attempt, generation

RunProcess = launcher.JobProcess | launcher.VirtualProcess | launcher.AdoptedProcess

_run_ids = itertools.count(1)


@dataclass
class RunningJob:
    job_id: str
    attempt: int
    gpus: tuple[int, ...]
    node_rank: int
    proc: RunProcess
    generation: int = 0
    # draining: a resize (checkpoint, then stop); exited: rank != 0 done, its GPUs still held
    state: Literal["running", "draining", "stopping", "exited"] = "running"
    stop_at: float | None = None
    sigkilled: bool = False
    exit_code: int | None = None
    sim_checkpoint_at: float | None = None
    request: str | None = None  # the checkpoint request written to the job, by id
    drain_until: float | None = None
    timeout_asked: bool = False
    ended: bool = False  # ProcessesEnded reported
    acks: AckCoalescer = field(kw_only=True)  # every run's, with its node's limits
    id: int = field(default_factory=lambda: next(_run_ids))

    @property
    def key(self) -> RunKey:
        return (self.job_id, self.attempt, self.generation)


class RunRecords:
    """The state files of one node's runs (`<work_dir>/runs/<node>/`): the daemon's alone."""

    def __init__(self, runs_dir: Path):
        self.dir = runs_dir

    def path(self, key: RunKey) -> Path:
        return self.dir / f"{subjects.token(key[0])}.{key[1]}.{key[2]}.json"

    def save(self, run: RunningJob) -> None:
        rec = launcher.record(run.proc)
        rec.update(gpus=list(run.gpus), node_rank=run.node_rank, generation=run.generation)
        if not self.dir.exists():
            self.dir.mkdir(parents=True, mode=0o700)  # jobs never read them
            os.chmod(self.dir.parent, 0o700)
        _write_json(self.path(run.key), rec)

    def remove(self, key: RunKey) -> None:
        try:
            self.path(key).unlink()
        except OSError:
            pass

    def files(self) -> list[Path]:
        try:
            return sorted(self.dir.glob("*.json"))
        except OSError:
            return []


def exit_event(state: ClusterState, job_id: str, attempt: int, node: str, rc: int, now: float,
               detail: str = "") -> ev.Event | None:
    """What a process exit means, decided against the fold at the moment of appending: nothing
    if the attempt already ended; completion on exit 0; else requeue while restarts remain."""
    job = state.jobs.get(job_id)
    if job is None or not job.holding or job.attempt != attempt:
        return None
    if rc == 0:
        return ev.JobCompleted(at=now, job_id=job_id, attempt=attempt, exit_code=0, node=node)
    if job.spec.on_failure == "requeue" and job.restarts < job.spec.max_restarts:
        return ev.GpusReleased(at=now, job_id=job_id, reason="process_failed",
                               lost_gpu_s=round(work_since_checkpoint(job, now), 3), node=node)
    reason = f"exit code {rc} on node {node}" + (f" ({detail})" if detail else "")
    return ev.JobFailed(at=now, job_id=job_id, attempt=attempt, reason=reason, exit_code=rc,
                        node=node)
