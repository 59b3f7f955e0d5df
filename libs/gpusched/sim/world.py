"""The simulated world's shapes, shared by the engine and the metrics: the cluster, each job's
run, and the default team quotas of a trace."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

from ..core import events as ev
from ..core.model import GpuInfo, NvlinkLayout, TeamQuota, nvlink_domains
from .traces import TraceJob


@dataclass(frozen=True)
class Cluster:
    """`racks` x `nodes_per_rack` x `gpus_per_node`, with one NVLink layout on every node."""

    racks: int
    nodes_per_rack: int
    gpus_per_node: int
    nvlink: NvlinkLayout = "all"
    #: CPUs and memory (MiB) every node offers jobs (0: not declared, not scheduled: `--node-cpus`)
    cpus: float = 0.0
    memory_mb: int = 0
    #: Each node's GPU model in registration order (`--gpu-types`; empty: one model, "sim").
    models: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str, nvlink: str = "all") -> Cluster:
        try:
            r, n, g = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"cluster {text!r}: expected RxNxG (racks x nodes per rack x GPUs per node), e.g. 2x32x8") from None
        if min(r, n, g) < 1:
            raise ValueError(f"cluster {text!r}: every dimension must be >= 1")
        nvlink_domains(nvlink, g)  # validates the layout name
        return cls(r, n, g, cast(NvlinkLayout, nvlink))

    def __str__(self) -> str:
        mixed = "" if not self.models else " of " + ",".join(
            f"{sum(1 for m in self.models if m == x)}:{x}" for x in dict.fromkeys(self.models))
        return f"{self.racks}x{self.nodes_per_rack}x{self.gpus_per_node}{mixed}"

    @property
    def total_gpus(self) -> int:
        return self.racks * self.nodes_per_rack * self.gpus_per_node

    @property
    def nvlink_size(self) -> int:
        return {"all": self.gpus_per_node, "pairs": 2, "quads": 4, "none": 1}[self.nvlink]

    def best_level(self, gpus: int) -> str:
        """The tightest level any placement of `gpus` GPUs can reach on an empty cluster."""
        if gpus <= min(self.nvlink_size, self.gpus_per_node):
            return "nvlink"
        if gpus <= self.gpus_per_node:
            return "node"
        if gpus <= self.gpus_per_node * self.nodes_per_rack:
            return "rack"
        return "cluster"

    def registrations(self, at: float = 0.0) -> list[ev.NodeRegistered]:
        domains = nvlink_domains(self.nvlink, self.gpus_per_node)
        out = []
        for r in range(self.racks):
            for n in range(self.nodes_per_rack):
                node = f"r{r:02d}n{n:03d}"
                model = self.models[r * self.nodes_per_rack + n] if self.models else "sim"
                gpus = [GpuInfo(index=i, uuid=f"GPU-sim-{node}-{i}", model=model, nvlink_domain=domains[i])
                        for i in range(self.gpus_per_node)]
                out.append(ev.NodeRegistered(at=at, node=node, rack=f"rack{r:02d}", gpus=gpus, nvlink=self.nvlink,
                                             address="sim", cpus=self.cpus, memory_mb=self.memory_mb))
        return out


def default_quotas(jobs: list[TraceJob], total_gpus: int) -> dict[str, TeamQuota]:
    """Each team's guaranteed share is the cluster times its share of the trace's GPU-seconds,
    rounded down; weight 1; no hard limit but the cluster. Documented in docs/results.md."""
    demand: dict[str, float] = {}
    for j in jobs:
        demand[j.team] = demand.get(j.team, 0.0) + j.gpu_s
    total = sum(demand.values()) or 1.0
    return {team: TeamQuota(guaranteed=int(total_gpus * d / total), weight=1.0, limit=None)
            for team, d in sorted(demand.items())}


@dataclass
class _Run:
    """The world's view of one job: its remaining work and what its processes are doing."""

    trace: TraceJob
    remaining: float  # work seconds left as of `since`
    saved: float  # remaining work at the last checkpoint (what a forced kill goes back to)
    held: int = 0
    rate: float = 0.0
    since: float = 0.0
    resume_at: float = 0.0  # progress starts after the restore of a checkpoint
    ckpt_at: float = 0.0  # last checkpoint, or the start of the attempt
    done_at: float = math.inf  # planned completion while running
    mode: str = "pending"  # pending, running, yielding, done
    epoch: int = 0  # bumps on every re-plan: stale heap entries are skipped
    resumed: bool = False  # ran before: the next start restores a checkpoint
    pending_since: float = 0.0
    entitled_since: float | None = None  # this wait began with its team within its guarantee
    queue_s: float = 0.0
    first_start: float | None = None
    finish: float | None = None
    grants: list[tuple[int, str, float]] = field(default_factory=list)  # (gpus, level, slowdown)
    lost_gpu_s: float = 0.0
    overhead_gpu_s: float = 0.0
    preemptions: int = 0
    forced_releases: int = 0
    timed_out: bool = False  # ended by its time limit before its work was done
    idle_ended: bool = False  # ended by its class's idle timeout (action "end")
