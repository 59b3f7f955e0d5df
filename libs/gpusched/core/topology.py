"""The topology model: GPU -> NVLink domain -> node -> rack -> (block) -> cluster.

A GPU set "spans" the widest level it crosses; the distance of a level is the relative cost of
communication across it (used to rank candidate placements, and by the simulator's runtime
model). Nodes and GPUs are records of the fold; this module only reasons about them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from msgspec import Struct

from .mig import MigInfo
from .model import LEVEL_RANK, LEVELS, GpuId, Level

#: Relative communication distance of each level (NVLink = 1). Placement ranks sets by it.
LEVEL_DISTANCE: dict[str, int] = {"nvlink": 1, "node": 2, "rack": 3, "block": 4, "cluster": 5}


class Gpu(Struct):
    id: GpuId
    node: str
    index: int
    uuid: str
    model: str = "unknown"
    memory_mb: int = 0
    nvlink_domain: int = 0
    holder: str | None = None
    quarantined: str | None = None  # reason, while the GPU is unhealthy
    zombie_pids: list[int] | None = None  # while a stray process holds it
    #: Fractional holders (job -> share of this GPU, summing to at most 1) while it is shared;
    #: a shared GPU has no whole `holder` and is never placeable for a whole-GPU job.
    shares: dict[str, float] = {}
    mig: MigInfo | None = None  # as its node registered it (MIG enabled, or pending)
    #: Its MIG geometry, one profile per slice (the admin's `MigGeometrySet`); while it has one it
    #: is partitioned: never placeable whole nor shared, only slice by slice.
    geometry: list[str] = []
    slices: dict[int, str] = {}  # slice index -> the MIG job holding it

    @property
    def occupied(self) -> bool:
        """Some job holds it, whole, a share or a slice of it."""
        return self.holder is not None or bool(self.shares) or bool(self.slices)

    @property
    def holders(self) -> list[str]:
        """Who holds it: its whole holder, or its fractional holders, or its slices' holders."""
        if self.holder is not None:
            return [self.holder]
        return list(self.shares) + list(dict.fromkeys(self.slices.values()))

    def free_slices(self, profile: str, taken: Iterable[int] = ()) -> list[int]:
        """Its slices of `profile` nobody holds (nor `taken`, a cycle's own grants), in order."""
        busy = set(taken)
        return [i for i, p in enumerate(self.geometry) if p == profile and i not in self.slices and i not in busy]

    @property
    def shared_load(self) -> float:
        """The share of it its fractional holders hold together (0 when not shared)."""
        return sum(self.shares.values())


class Node(Struct):
    name: str
    rack: str
    block: str | None
    gpus: list[GpuId]
    address: str = ""
    nvlink: str = "custom"
    registered_at: float = 0.0
    lost: bool = False
    drained: bool = False
    partitioned: bool = False  # in a declared partition: no new work, its jobs kept (not requeued)
    #: Placeable GPUs of this node, an insertion-ordered set kept by the fold.
    free: dict[GpuId, None] = {}
    #: key=value labels jobs may ask for (`constraints`): from registration, and from admins.
    labels: dict[str, str] = {}
    #: CPUs and memory (MiB) it offers jobs (0: not declared, not counted: old agents, the
    #: simulator without them), and what the jobs holding its GPUs reserve there, each its
    #: per-node `cpus` / `memory_mb` (kept by the fold; `policy/resources.py` reads them).
    cpus: float = 0.0
    memory_mb: int = 0
    cpus_used: float = 0.0
    memory_used_mb: int = 0

    @property
    def usable(self) -> bool:
        return not self.lost and not self.drained


def span_level(gpus: Iterable[GpuId], gpu_index: Mapping[GpuId, Gpu], nodes: Mapping[str, Node]) -> Level:
    """The widest topology level a set of GPUs crosses."""
    node_names: set[str] = set()
    domains: set[tuple[str, int]] = set()
    for g in gpus:
        rec = gpu_index[g]
        node_names.add(rec.node)
        domains.add((rec.node, rec.nvlink_domain))
    if len(node_names) <= 1:
        return "nvlink" if len(domains) <= 1 else "node"
    racks = {nodes[n].rack for n in node_names}
    if len(racks) == 1:
        return "rack"
    blocks = {nodes[n].block for n in node_names}
    if len(blocks) == 1 and None not in blocks:
        return "block"
    return "cluster"


def within(level: str, limit: str) -> bool:
    """True when `level` is no wider than `limit`."""
    return LEVEL_RANK[level] <= LEVEL_RANK[limit]


__all__ = ["LEVELS", "LEVEL_DISTANCE", "Gpu", "Node", "span_level", "within"]
