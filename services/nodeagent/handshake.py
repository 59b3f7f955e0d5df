"""The checkpoint handshake between a node agent and its jobs: the daemon writes a request into
the run's control directory (and signals the SDK processes that asked for it), the job answers
with acknowledgements naming the files it saved, and the daemon reports each as `CheckpointSaved`
with the SHA-256 it computed itself from the file (`acks.checkpoint_sha256`, in a thread)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from gpusched.core import events as ev
from gpusched.core.state import ClusterState
from gpusched.job import env as E

from .acks import Ack, AckLimits, checkpoint_sha256, read_acks

if TYPE_CHECKING:
    from .host import NodeHost
    from .runs import RunningJob

log = structlog.get_logger()


class CheckpointHandshake:
    """Mixed into `NodeAgent`: requests, acks, and the checksummed `CheckpointSaved` reports."""

    node: str
    limits: AckLimits
    host: NodeHost

    def _request_checkpoint(self, run: RunningJob, request: str, reason: str, deadline: float, for_job: str) -> None:
        """Write the request to the job's control dir and SIGUSR1 the processes that asked for
        it, if they are members of the job's own process group."""
        run.request = request
        if run.proc.virtual:
            if run.proc.checkpoint_after is not None:
                run.sim_checkpoint_at = time.monotonic() + run.proc.checkpoint_after
            return
        control = run.proc.launch.control_dir
        try:
            _write_json(control / E.REQUEST, {"id": request, "reason": reason, "deadline": deadline,
                                              "for_job": for_job})
        except OSError as err:
            log.warning("checkpoint_request_failed", job=run.job_id, node=self.node, error=str(err))
            return
        pids = []
        try:
            with os.scandir(control) as it:
                for n, entry in enumerate(it):
                    if n >= self.limits.max_entries:
                        break
                    suffix = entry.name[len(E.SDK_PREFIX):]
                    if entry.name.startswith(E.SDK_PREFIX) and suffix.isdigit() and len(suffix) < 10:
                        pids.append(int(suffix))
        except OSError:
            pass
        signalled = run.proc.signal_pids(pids, signal.SIGUSR1) if pids else []
        refused = sorted(set(pids) - set(signalled))
        log.info("checkpoint_requested", job=run.job_id, attempt=run.attempt, node=self.node, request=request,
                 signalled=signalled, refused=refused)

    def _collect_acks(self, run: RunningJob, state: ClusterState) -> None:
        if run.proc.virtual:
            if run.sim_checkpoint_at is not None and time.monotonic() >= run.sim_checkpoint_at:
                run.sim_checkpoint_at = None
                step = int(time.monotonic() - run.proc.started) + (run.proc.launch.resume_step or 0)
                self._report_checkpoint(run, Ack(step, f"sim://{run.job_id}/{run.attempt}/{step}", run.request))
            return
        acks, problems = read_acks(run.proc.launch.control_dir, self.limits)
        if problems:
            log.warning("bad_checkpoint_acks", job=run.job_id, node=self.node, count=len(problems), first=problems[0])
        for ack in acks:
            run.acks.add(ack)
        job = state.jobs.get(run.job_id)
        partial = set(job.partial) if job is not None and job.attempt == run.attempt else set()
        for ack in run.acks.due(time.monotonic(), run.request, partial):
            self._report_checkpoint(run, ack)

    def _report_checkpoint(self, run: RunningJob, ack: Ack) -> None:
        """Hash the acknowledged checkpoint (in a thread: it may be large), then report it with
        the daemon's own checksum; an ack naming a file outside the job's checkpoint dir is refused."""
        if run.proc.virtual:
            self._report_hashed(run, ack)
            return
        launch = run.proc.launch
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        job = (ack.path, launch.checkpoint_dir, launch.uid if launch.uid is not None and launch.uid != os.geteuid()
               else None)
        if loop is None:
            self._hashed(run, ack, job, None)
            return
        future = loop.run_in_executor(None, checkpoint_sha256, *job)
        future.add_done_callback(lambda f: self._hashed(run, ack, job, f))

    def _hashed(self, run: RunningJob, ack: Ack, job: tuple, future: asyncio.Future | None) -> None:
        try:
            real, digest = future.result() if future is not None else checkpoint_sha256(*job)
        except (OSError, ValueError) as err:
            log.warning("checkpoint_ack_refused", job=run.job_id, attempt=run.attempt, node=self.node, step=ack.step,
                        error=str(err)[:300])
            return
        self._report_hashed(run, dataclasses.replace(ack, path=real, sha256=digest))

    def _report_hashed(self, run: RunningJob, ack: Ack) -> None:
        log.info("checkpoint_saved", job=run.job_id, attempt=run.attempt, node=self.node, path=ack.path, step=ack.step)
        event = ev.CheckpointSaved(at=time.time(), job_id=run.job_id, attempt=run.attempt, path=ack.path,
                                   step=ack.step, rank=run.node_rank, generation=run.generation,
                                   node=self.node, sha256=ack.sha256)
        self.host.submit(event, msg_id=f"ckpt:{run.job_id}:{run.attempt}:{self.node}:{ack.step}")


def _write_json(path: Path, obj: object) -> None:
    """Atomically, and safely in a directory the job owns: a fresh temp file (never through a
    name the job may have planted), readable by the job, renamed over the target."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)  # the job may only read it
    try:
        os.write(fd, json.dumps(obj).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
