"""How a node agent announces its node: `NodeRegistered` (at start, and again after a
`NodeLost` of itself, damped by heartbeats), and its heartbeats with the GPUs' state."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from gpusched.core import events as ev
from gpusched.core.heartbeat import Heartbeat, JobReport
from gpusched.core.model import GpuInfo
from gpusched.core.state import ClusterState

from .runs import RunningJob

if TYPE_CHECKING:
    from .agent_config import AgentConfig
    from .backends import GpuBackend
    from .host import NodeHost

log = structlog.get_logger()


class Registration:
    """Mixed into `NodeAgent`: its registration and heartbeats (`heartbeats` counts them;
    `rejoin_at` is the count at which to register again)."""

    node: str
    cfg: AgentConfig
    host: NodeHost
    backend: GpuBackend
    agent_id: str
    gpu_info: list[GpuInfo]
    jobs: dict[int, RunningJob]
    heartbeats: int
    rejoin_at: int | None

    def registration(self) -> ev.NodeRegistered:
        return ev.NodeRegistered(at=time.time(), node=self.node, rack=self.cfg.rack, gpus=self.gpu_info,
                                 block=self.cfg.block, nvlink=self.cfg.nvlink, address=self.cfg.address,
                                 labels=dict(self.cfg.labels), cpus=self.cfg.cpus or 0.0,
                                 memory_mb=self.cfg.memory_mb or 0)

    def needs_registration(self, state: ClusterState) -> bool:
        """Unknown, lost, or offering other CPUs or memory than the log says (a restart with other
        `--cpus`/`--mem`, or the first start of a daemon that declares them)."""
        node = state.nodes.get(self.node)
        offers = (self.cfg.cpus or 0.0, self.cfg.memory_mb or 0)
        return node is None or node.lost or (any(offers) and offers != (node.cpus, node.memory_mb))

    def leftovers(self) -> list[RunningJob]:
        """Runs being stopped (SIGTERM sent, SIGKILL after the grace, see `poll`): while any
        is alive, its GPUs are not usable and the node must not register."""
        return [r for r in self.jobs.values() if r.state == "stopping"]

    def defer_registration(self) -> bool:
        """True while a leftover run of this node still lives: its registration waits for the next
        heartbeat, so the node is never announced usable with an earlier attempt on its GPUs."""
        stopping = self.leftovers()
        if stopping:
            self.rejoin_at = self.heartbeats + 1
            log.info("registration_deferred", node=self.node, stopping=[r.job_id for r in stopping])
        return bool(stopping)

    def register(self) -> bool:
        """(Re-)register, e.g. after a `NodeLost` of this node: the fold makes it usable again.
        Not while a leftover run still lives: then retried at the next heartbeat."""
        if self.defer_registration():
            return False
        self.rejoin_at = None
        event = self.registration()

        def build(state: ClusterState) -> ev.Event | None:
            if not self.needs_registration(state):
                return None
            if self.leftovers():  # a stop began meanwhile: try again at the next heartbeat
                self.rejoin_at = self.heartbeats + 1
                return None
            return event

        self.host.submit(build)
        return True

    def heartbeat(self) -> Heartbeat:
        """The next heartbeat (registering again first, when due)."""
        self.heartbeats += 1
        if self.rejoin_at is not None and self.heartbeats >= self.rejoin_at:
            self.register()
        jobs = [JobReport(job_id=r.job_id, attempt=r.attempt, gpus=list(r.gpus), pids=[r.proc.pid] if r.proc.pid else [],
                          state="running" if r.state == "draining" else r.state, exit_code=r.exit_code)
                for r in self.jobs.values()]
        return Heartbeat(node=self.node, at=time.time(), agent_id=self.agent_id, seq=self.heartbeats,
                         backend=self.backend.name, gpus=self.backend.sample(), jobs=jobs)
