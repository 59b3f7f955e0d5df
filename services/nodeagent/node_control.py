"""The requests a node agent answers on its own subjects: the reconciler's kills of processes
it does not run and GPU resets, fault injection on simulated GPUs, and parts of its jobs' logs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import structlog

from gpusched.core.heartbeat import (
    InjectHealth,
    InjectLeak,
    InjectStray,
    KillProcesses,
    LogReply,
    NodeReply,
    ResetGpu,
    SimulateCrash,
    decode_request,
)

from .backends import SimBackend, process_alive
from .logs import serve_log

if TYPE_CHECKING:
    from gpusched.services.runtime import FoldedLog

    from .agent_config import AgentConfig
    from .backends import GpuBackend
    from .host import NodeHost
    from .runs import RunningJob

log = structlog.get_logger()


class NodeControl:
    """Mixed into `NodeAgent`: its node-control and log requests."""

    node: str
    cfg: AgentConfig
    host: NodeHost
    backend: GpuBackend
    crashed: bool
    jobs: dict[int, RunningJob]

    def control(self, data: bytes, only: type | None = None) -> NodeReply:
        """One node-control request. `only`: it came on the subject of that one request kind
        (the kill or reset subject: what the reconciler may send), where every other is refused."""
        try:
            req = decode_request(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            return NodeReply(ok=False, node=self.node, error=str(err))
        if only is not None and not isinstance(req, only):
            return NodeReply(ok=False, node=self.node,
                             error=f"{type(req).__name__} is not accepted on the {only.__name__} subject")
        if self.crashed:
            return NodeReply(ok=False, node=self.node, error="node is down (simulated crash)")
        try:
            if isinstance(req, KillProcesses):
                return self._kill(req)
            if isinstance(req, ResetGpu):
                error = self.backend.reset(req.index)
                log.warning("gpu_reset", node=self.node, index=req.index, reason=req.reason, error=error)
                return NodeReply(ok=not error, node=self.node, error=error)
            if not isinstance(self.backend, SimBackend):
                return NodeReply(ok=False, node=self.node,
                                 error=f"{req.__class__.__name__} needs the simulated backend")
            if isinstance(req, InjectStray):
                self.backend.inject_stray(req.index, req.pid)
            elif isinstance(req, InjectHealth):
                self.backend.inject_health(req.index, req.healthy, req.xid, req.reason)
            elif isinstance(req, InjectLeak):
                self.backend.inject_leak(req.index, req.memory_mb)
            elif isinstance(req, SimulateCrash):
                self.host.crash(self.node, req.revive_after_s)
        except ValueError as err:
            return NodeReply(ok=False, node=self.node, error=str(err))
        return NodeReply(ok=True, node=self.node)

    def _kill(self, req: KillProcesses) -> NodeReply:
        """Kill pids seen on this node's GPUs; never one of a job this agent runs, never a
        process that is on none of its GPUs."""
        on_gpus = {pid for s in self.backend.sample() for pid in s.pids}
        own = {r.proc.pid for r in self.jobs.values() if r.state in ("running", "draining")}
        killed: list[int] = []
        missing: list[int] = []
        refused: list[int] = []
        for pid in req.pids:
            if pid in own:
                refused.append(pid)
            elif pid not in on_gpus:
                (refused if process_alive(pid) else missing).append(pid)
            elif self.backend.kill(pid) == "killed":
                killed.append(pid)
            else:
                missing.append(pid)
        log.warning("zombie_kill", node=self.node, gpu=req.gpu, killed=killed, missing=missing, refused=refused,
                    reason=req.reason)
        return NodeReply(ok=True, node=self.node, killed=killed, missing=missing, refused=refused)

    async def logs(self, data: bytes, folded: FoldedLog) -> LogReply:
        """Serve part of one rank's log of one attempt (`gpusched logs`)."""
        assert self.cfg.log_dir is not None, "AgentConfig.__post_init__ defaults it to <work_dir>/logs"
        return await serve_log(self.node, self.cfg.log_dir, data, folded)
