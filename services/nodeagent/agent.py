"""The node agent: one per node, following the log (one shared `FoldedLog` per host process,
`host.NodeHost`) and making the node match it: a grant that touches its GPUs starts the job's
process (`launch.JobStarter`), a preemption request is passed to the job (control file +
SIGUSR1 to SDK processes), a checkpoint the job acknowledges becomes `CheckpointSaved`
(`handshake.CheckpointHandshake`), a release / cancel / node loss stops the process group. It
reports what only it can see: `JobStarted`, exits (`JobCompleted`, a requeue as
`GpusReleased(process_failed)`, or `JobFailed`: `runs.exit_event`), and heartbeats with the GPUs'
state on core NATS (`registration.Registration`). After a restart it adopts the runs an earlier
daemon started (`adopt`, `adoption.py`); it answers node-control requests (`node_control.NodeControl`).

Only the current attempt's exit is reported, and never the exit of a process the agent itself
stopped. A multi-node job completes when its rank-0 process exits 0; any rank's non-zero exit
fails (or requeues) the attempt.
"""

from __future__ import annotations

import shutil
import signal
import time
import uuid
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

import structlog

from gpusched.bus import subjects
from gpusched.core import events as ev
from gpusched.core.model import gpu_id, split_gpu_id
from gpusched.core.state import ClusterState, Job, stale_live

from . import container, keeper, launcher
from .acks import AckCoalescer, AckLimits
from .adoption import reap, recorded_runs
from .agent_config import AgentConfig
from .backends import GpuBackend, gpus_with_mig
from .handshake import CheckpointHandshake
from .launch import JobStarter, LaunchError, job_nodes, oom_detail, remove_confinement, sharers
from .node_control import NodeControl
from .registration import Registration
from .runs import RunKey, RunningJob, RunRecords, exit_event

if TYPE_CHECKING:
    from .host import NodeHost

log = structlog.get_logger()


class NodeAgent(Registration, NodeControl, CheckpointHandshake):
    """One node: follows the log's facts about it and makes its processes match (`converge`),
    watches them (`poll`), and reports what only it sees."""

    def __init__(self, host: NodeHost, config: AgentConfig, backend: GpuBackend):
        self.host = host
        self.cfg = config
        self.node = config.node
        self.backend = backend
        self.agent_id = uuid.uuid4().hex[:12]
        self.gpu_info = gpus_with_mig(backend)
        self.uuids = {g.index: g.uuid for g in self.gpu_info}
        self.jobs: dict[int, RunningJob] = {}  # by run id: a stopping run and its successor can coexist
        self.launched: dict[str, tuple[int, int]] = {}  # job -> (attempt, generation) started here
        self.deferred: dict[RunKey, float] = {}  # launches waiting for the fence, not before
        self.ended_sent: dict[RunKey, None] = {}
        self.limits = AckLimits(max_bytes=config.max_ack_bytes, max_entries=config.max_control_entries,
                                interval_s=config.ack_interval_s)
        self.records = RunRecords(config.work_dir / "runs" / subjects.token(self.node))
        self.heartbeats = 0
        self.rejoin_at: int | None = None  # heartbeat count at which to register again
        self.crashed = False  # a simulated crash: silent, deaf, its processes gone
        self._subs: list = []
        self._swept = 0.0
        if not config.work_dir.exists():  # traversable for its jobs' directories, never listable
            config.work_dir.mkdir(parents=True, mode=0o711)
        self.starter = JobStarter(config, backend, self.uuids, host.uid_holder)

    # --- following the log ------------------------------------------------------------------

    def on_event(self, e: ev.Event, state: ClusterState, seq: int, launch: bool) -> None:
        if self.crashed:
            return
        if isinstance(e, ev.NodeLost) and e.node == self.node:
            log.warning("node_declared_lost", node=self.node, reason=e.reason,
                        rejoin_after_heartbeats=self.cfg.rejoin_heartbeats)
            self.rejoin_at = self.heartbeats + max(1, self.cfg.rejoin_heartbeats)  # damped: no flapping
        if isinstance(e, ev.PreemptionRequested):
            job = state.jobs.get(e.job_id)
            for run in self.runs_of(e.job_id):
                if job is not None and job.attempt == run.attempt and run.state in ("running", "draining"):
                    self._request_checkpoint(run, str(seq), e.reason, e.deadline, e.for_job)
        if isinstance(e, ev.MigGeometrySet):
            self.apply_geometry(e, state)
        job_id = getattr(e, "job_id", None)
        if job_id is not None:
            self.converge(job_id, state, launch)
        elif isinstance(e, ev.NodeLost):
            for jid in {r.job_id for r in self.jobs.values()}:
                self.converge(jid, state, False)

    def apply_geometry(self, e: ev.MigGeometrySet, state: ClusterState) -> None:
        """A GPU of this node got a MIG geometry: make its instances (NVML; the simulated
        backend's slices exist already). Only as the fold took it: on an idle GPU, and no run
        of this daemon on it."""
        node, index = split_gpu_id(e.gpu)
        rec = state.gpus.get(e.gpu)
        if node != self.node or rec is None:
            return
        if list(rec.geometry) != list(e.profiles) or rec.occupied or self._gpus_busy([index]):
            log.warning("mig_geometry_not_applied", gpu=e.gpu, profiles=list(e.profiles),
                        error="the fold did not take it or the GPU is in use here")
            return
        self.backend.apply_mig(index, list(e.profiles))

    def adopt_geometry(self, state: ClusterState) -> None:
        """At start: each MIG GPU's instances as they are where they are its geometry, else the
        geometry applied where the GPU is idle (`NvmlBackend.adopt_mig`)."""
        for g in self.gpu_info:
            rec = state.gpus.get(gpu_id(self.node, g.index))
            if g.mig is not None and g.mig.mode == "enabled" and rec is not None:
                self.backend.adopt_mig(g.index, list(rec.geometry), not rec.occupied)

    def runs_of(self, job_id: str) -> list[RunningJob]:
        return [r for r in self.jobs.values() if r.job_id == job_id]

    def my_gpus(self, job: Job | None) -> tuple[int, ...]:
        if job is None or not job.holding:
            return ()
        return tuple(sorted(i for n, i in map(split_gpu_id, job.gpus) if n == self.node))

    def converge(self, job_id: str, state: ClusterState, launch: bool) -> None:
        """Make this node's processes of `job_id` match the fold. A resize restarts every rank:
        checkpoint (collective), stop, and start again with the new world size."""
        job = state.jobs.get(job_id)
        mine = self.my_gpus(job)
        held = job if job is not None and job.holding else None  # the job while the fold runs an attempt of it
        current = (held.attempt, held.generation) if held is not None else None
        for run in self.runs_of(job_id):
            if run.state in ("stopping", "draining"):
                continue
            if current is not None and (run.attempt, run.generation) == current and mine == run.gpus:
                continue
            if held is not None and run.attempt == held.attempt and run.generation < held.generation:
                self._drain(run, held)
            else:
                self.stop(run, "released" if current is None else "attempt replaced")
        if held is None:
            self.launched.pop(job_id, None)
            self.starter.forget(job_id)
        elif launch and mine and self.launched.get(job_id) != current:
            key = (job_id, held.attempt, held.generation)
            self.launched[job_id] = key[1:]
            self.deferred[key] = time.monotonic() + self._backoff(held)
            self._try_launch(key, state)

    def _backoff(self, job: Job) -> float:
        """A job requeued after failures restarts later each time (1, 2, 4 ... s, capped)."""
        if job.restarts <= 0 or self.cfg.retry_backoff_s <= 0:
            return 0.0
        return min(self.cfg.retry_backoff_max_s, self.cfg.retry_backoff_s * 2 ** (job.restarts - 1))

    def _try_launch(self, key: RunKey, state: ClusterState) -> None:
        """Launch a deferred run once it is due and fenced: no process of an earlier attempt or
        generation of the job may still run anywhere, nor any other run on these GPUs here."""
        job = state.jobs.get(key[0])
        mine = self.my_gpus(job)
        if job is None or (job.attempt, job.generation) != key[1:] or not mine:
            self.deferred.pop(key, None)
            return
        if time.monotonic() < self.deferred[key] or stale_live(job) or self._gpus_busy(mine, key, sharers(job, state)) \
                or not self.host.fresh_view():
            return
        del self.deferred[key]
        self._launch(job, mine, state)

    def current(self, job_id: str) -> RunningJob | None:
        """The run of `job_id` on this node that is not being stopped."""
        return next((r for r in self.jobs.values() if r.job_id == job_id and r.state not in ("stopping", "draining")),
                    None)

    def _gpus_busy(self, gpus: Iterable[int], key: RunKey | None = None, beside: Collection[str] = ()) -> bool:
        """Another run is on these GPUs (`beside`: the fractional jobs the fold lets share them)."""
        wanted = set(gpus)
        return any(r.key != key and r.state != "exited" and wanted & set(r.gpus) and r.job_id not in beside
                   for r in self.jobs.values())

    def _launch(self, job: Job, mine: tuple[int, ...], state: ClusterState) -> None:
        try:
            spec, proc = self.starter.start(job, mine, state, self.agent_id)
        except LaunchError as err:
            self._launch_failed((job.job_id, job.attempt, job.generation), str(err))
            return
        run = RunningJob(job.job_id, job.attempt, mine, spec.node_rank, proc, generation=job.generation,
                         acks=AckCoalescer(self.limits))
        self._add_run(run)
        log.info("job_started", job=job.job_id, attempt=job.attempt, generation=job.generation, node=self.node,
                 pid=proc.pid, gpus=list(mine), rank=spec.node_rank, resume_from=spec.resume_from)
        started = ev.JobStarted(at=time.time(), job_id=job.job_id, attempt=job.attempt, node=self.node,
                                pids=[proc.pid], rank=spec.node_rank, generation=job.generation,
                                log="" if proc.virtual else str(spec.log_path))
        self.host.submit(started, msg_id=f"started:{job.job_id}:{job.attempt}.{job.generation}:{self.node}")
        if job.preemption is not None:  # asked while the run was waiting for its fence
            self._request_checkpoint(run, f"pre-{job.attempt}", job.preemption.reason, job.preemption.deadline,
                                     job.preemption.for_job)

    def _launch_failed(self, key: RunKey, error: str) -> None:
        """A launch error fails the job at once: no retry would help (`LaunchError`)."""
        log.error("job_launch_error", job=key[0], attempt=key[1], node=self.node, error=error)
        job_id, attempt = key[0], key[1]

        def failed(state: ClusterState) -> ev.Event | None:
            job = state.jobs.get(job_id)
            if job is None or not job.holding or job.attempt != attempt:
                return None
            return ev.JobFailed(at=time.time(), job_id=job_id, attempt=attempt,
                                reason=f"launch error on node {self.node}: {error}", node=self.node)

        self.host.submit(failed, msg_id=f"launch-error:{job_id}:{attempt}")
        self._report_ended(key, None, "launch error")

    def _add_run(self, run: RunningJob) -> None:
        self.jobs[run.id] = run
        self.host.track(run.job_id, self.node, True)
        if run.proc.pid:
            launch = run.proc.launch  # the spec's env and its MPS limits (the sim backend caps its memory by them)
            self.backend.attach(run.gpus, run.proc.pid, env={**launch.env, **launcher.share_env(launch)})
        self._save_record(run)

    def _save_record(self, run: RunningJob) -> None:
        """The state file a restarted daemon adopts this run from."""
        self.records.save(run)
        if not run.proc.virtual:
            keeper.guard(self)  # a process that outlives this daemon: its fence keeper runs

    def _drain(self, run: RunningJob, job: Job) -> None:
        """Resize: ask this rank for the collective checkpoint; `poll` stops it once the
        checkpoint is complete or `resize_grace_s` is over."""
        run.state, run.drain_until = "draining", time.monotonic() + self.cfg.resize_grace_s
        nodes = len(job_nodes(job))
        log.info("job_resize_restart", job=run.job_id, attempt=run.attempt, node=self.node, nodes=nodes)
        self._request_checkpoint(run, f"resize-{job.attempt}.{job.generation}", f"resize to {nodes} node(s)",
                                 time.time() + self.cfg.resize_grace_s, "")

    def stop(self, run: RunningJob, why: str) -> None:
        """SIGTERM the job's process group now, SIGKILL after the grace period (see `poll`)."""
        if run.state == "exited":
            self._forget(run)
            return
        log.info("job_stopping", job=run.job_id, attempt=run.attempt, node=self.node, why=why)
        run.state, run.stop_at = "stopping", time.monotonic()
        run.proc.signal_group(signal.SIGTERM)

    def _forget(self, run: RunningJob) -> None:
        self.jobs.pop(run.id, None)
        self.backend.detach(run.proc.pid)
        self._report_ended(run.key, run.exit_code, "stopped" if run.state == "stopping" else "exited", run)
        self.records.remove(run.key)
        if not run.proc.virtual:
            shutil.rmtree(run.proc.launch.control_dir, ignore_errors=True)
            remove_confinement(run.proc.launch)
        if not any(r.job_id == run.job_id for r in self.jobs.values()):
            self.host.track(run.job_id, self.node, False)

    def _report_ended(self, key: RunKey, exit_code: int | None, reason: str, run: RunningJob | None = None) -> None:
        """Every process of this run is gone: the fact that lets the next attempt start."""
        if run is not None:
            if run.ended:
                return
            run.ended = True
        if key in self.ended_sent:
            return
        self.ended_sent[key] = None
        e = ev.ProcessesEnded(at=time.time(), job_id=key[0], attempt=key[1], generation=key[2], node=self.node,
                              exit_code=exit_code, reason=reason)
        self.host.submit(e, msg_id=f"ended:{key[0]}:{key[1]}.{key[2]}:{self.node}")

    # --- adoption after a restart ----------------------------------------------------------

    def adopt(self, state: ClusterState) -> None:
        """Take back the recorded runs: a run of a job the fold no longer runs here is stopped;
        one that ended meanwhile is reported as ended (its exit too)."""
        for rec, key, proc in recorded_runs(self.records):
            job = state.jobs.get(key[0])
            held = job if job is not None and job.holding and (job.attempt, job.generation) == key[1:] else None
            if proc is None:
                self._adopt_dead(rec, key, held is not None)
                continue
            run = RunningJob(key[0], key[1], tuple(rec.get("gpus", ())), int(rec.get("node_rank", 0)), proc,
                             generation=key[2], acks=AckCoalescer(self.limits))
            self._add_run(run)
            log.info("job_adopted", job=key[0], attempt=key[1], generation=key[2], node=self.node, pid=proc.pid)
            if held is not None:  # the fold still runs this attempt
                self.launched[key[0]] = key[1:]
                if held.preemption is not None:
                    self._request_checkpoint(run, f"pre-{held.attempt}", held.preemption.reason,
                                             held.preemption.deadline, held.preemption.for_job)
            else:
                self.converge(key[0], state, False)

    def _adopt_dead(self, rec: dict, key: RunKey, current: bool) -> None:
        """A recorded run whose process is gone: its exit status (from the wrapper) is reported
        like any exit, and its processes as ended."""
        rc = reap(rec)
        fenced = str(rec.get("fenced") or "")  # stopped by the fence keeper: like the daemon's own fence
        log.warning("job_ended_while_down", job=key[0], attempt=key[1], node=self.node, exit_code=rc, fenced=fenced)
        self._report_ended(key, rc, fenced or "ended while the daemon was down")
        if current:
            self.launched[key[0]] = key[1:]
            if not fenced and not (rc == 0 and int(rec.get("node_rank", 0)) != 0):
                self._report_exit(key[0], key[1], rc)

    # --- processes --------------------------------------------------------------------------

    def poll(self, state: ClusterState) -> None:
        """Called every `poll_s`: acks, exits, resizes, time limits, SIGKILL after the grace,
        deferred launches, and ProcessesEnded for what the fold still thinks may run here."""
        if self.crashed:
            return
        now = time.monotonic()
        for run in list(self.jobs.values()):
            if run.state == "exited":
                continue
            if run.state != "stopping":
                self._collect_acks(run, state)
            rc = run.proc.poll()
            if rc is None:
                self._watch(run, state, now)
                continue
            self._exited(run, rc, state)
        for key in list(self.deferred):
            self._try_launch(key, state)
        if now - self._swept >= 1.0:
            self._swept = now
            self._sweep(state)

    def _watch(self, run: RunningJob, state: ClusterState, now: float) -> None:
        """A live run: SIGKILL after the grace; a draining one stops once its checkpoint is
        complete; a time-limited one is asked to checkpoint before its limit."""
        if run.state == "stopping":
            assert run.stop_at is not None, "`stop` sets it with the state; a run the fence keeper stopped is forgotten"
            if not run.sigkilled and now - run.stop_at >= self.cfg.kill_grace_s:
                log.warning("job_sigkill", job=run.job_id, attempt=run.attempt, node=self.node)
                run.proc.signal_group(signal.SIGKILL)
                run.sigkilled = True
            return
        job = state.jobs.get(run.job_id)
        if run.state == "draining":
            ck = job.checkpoint if job is not None else None
            done = (job is None or not job.holding or job.attempt != run.attempt
                    or (ck is not None and ck.attempt == run.attempt and job.resized_at is not None
                        and ck.at >= job.resized_at))
            if done or now >= (run.drain_until or 0.0):
                self.stop(run, "resize: every rank restarts")
            return
        limit = job.spec.time_limit_s if job is not None else None
        if (job is not None and limit is not None and not run.timeout_asked and job.started_at is not None
                and time.time() >= job.started_at + limit - self.cfg.timeout_checkpoint_s):
            run.timeout_asked = True
            self._request_checkpoint(run, f"timeout-{run.attempt}", f"time limit of {limit:g} s",
                                     job.started_at + limit, "")

    def _sweep(self, state: ClusterState) -> None:
        """Report as ended what the fold says may run here but this daemon does not run (a
        release before the launch, a run lost across a restart): the fence must not wait."""
        mine = {r.key for r in self.jobs.values()}
        for job_id in list(state.node_live.get(self.node, {})):
            job = state.jobs[job_id]
            for x in job.live:
                key = (job_id, x.attempt, x.generation)
                if x.node != self.node or key in mine or key in self.ended_sent:
                    continue
                if job.holding and (x.attempt, x.generation) == (job.attempt, job.generation):
                    if key in self.deferred or self.my_gpus(job) and self.launched.get(job_id) != key[1:]:
                        continue  # about to start here
                self._report_ended(key, None, "not running here")
        live = {(j, x.attempt, x.generation) for j in state.node_live.get(self.node, {})
                for x in state.jobs[j].live if x.node == self.node}
        for key in [k for k in self.ended_sent if k not in live]:
            del self.ended_sent[key]

    def _exited(self, run: RunningJob, rc: int, state: ClusterState) -> None:
        if run.state != "stopping":
            self._collect_acks(run, state)  # an ack written just before the exit still counts
        run.proc.kill_stragglers()
        run.exit_code = rc
        if run.state != "stopping" and keeper.fenced(self.records.path(run.key)):
            run.state = "stopping"  # the fence keeper stopped it (this daemon was silent too long)
        if run.state in ("stopping",):
            self._forget(run)  # stopped by us: never reported
            return
        detail = oom_detail(run.proc.launch) or container.exit_detail(run.proc.launch, rc)
        log.info("job_exited", job=run.job_id, attempt=run.attempt, node=self.node, exit_code=rc, detail=detail)
        if rc == 0 and run.node_rank != 0:
            run.state = "exited"  # its GPUs stay held until rank 0 finishes
            self.backend.detach(run.proc.pid)
            self._report_ended(run.key, rc, "exited", run)
            return
        self._forget(run)
        self._report_exit(run.job_id, run.attempt, rc, detail)

    def _report_exit(self, job_id: str, attempt: int, rc: int, detail: str = "") -> None:
        node = self.node

        def outcome(state: ClusterState) -> ev.Event | None:
            return exit_event(state, job_id, attempt, node, rc, time.time(), detail)

        self.host.submit(outcome, msg_id=f"exit:{job_id}:{attempt}:{node}")

    def stop_all(self, why: str) -> None:
        for run in list(self.jobs.values()):
            if run.state != "stopping":
                self.stop(run, why)
