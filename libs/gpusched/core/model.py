"""The nouns of the domain: job specs, GPUs, nodes, quotas. Plain msgspec Structs, no behaviour.

A GPU is named `"<node>/<index>"` everywhere (events, state, CLI) so that ids are stable,
readable and JSON-friendly.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from . import limits as L
from .mig import MigInfo

SCHEMA_VERSION = 1
#: How fast past GPU usage is forgotten in fair share, until a `FoldSettingsSet` says otherwise:
#: its one default.
DEFAULT_HALF_LIFE_S = 7 * 24 * 3600.0
#: How long a finished job is kept whole (log time) by the services' folds, until a
#: `FoldSettingsSet` says otherwise; then only its tombstone (docs/operating.md, "Retention").
FORGET_AFTER_S = 90 * 24 * 3600.0

Priority = Literal["interactive", "high", "normal", "low"]
#: Higher rank wins; the order of the classes is part of the public contract.
PRIORITY_RANK: dict[str, int] = {"interactive": 3, "high": 2, "normal": 1, "low": 0}

#: Topology levels from tightest to widest. A job's GPU set "spans" the widest level it crosses.
Level = Literal["nvlink", "node", "rack", "block", "cluster"]
LEVELS: tuple[str, ...] = ("nvlink", "node", "rack", "block", "cluster")
LEVEL_RANK: dict[str, int] = {lvl: i for i, lvl in enumerate(LEVELS)}

#: Intra-node NVLink layouts: one all-to-all switch (DGX-like), pairs, quads, or none (PCIe only).
NvlinkLayout = Literal["all", "pairs", "quads", "none"]

GpuId = str  # "<node>/<index>"
JobId = str
Team = L.Name
PositiveInt = Annotated[int, Meta(ge=1)]


def gpu_id(node: str, index: int) -> GpuId:
    return f"{node}/{index}"


def split_gpu_id(gpu: GpuId) -> tuple[str, int]:
    node, _, index = gpu.rpartition("/")
    return node, int(index)


class TopologyConstraint(Struct, frozen=True, forbid_unknown_fields=True):
    """`required`: the job must not span wider than this level; `preferred`: aim for this one."""

    required: Level = "cluster"
    preferred: Level = "nvlink"


class Preferences(Struct, frozen=True, forbid_unknown_fields=True):
    """Soft placement preferences (`--prefer`): they rank the GPU sets a job may get, never
    decide whether it may get one (`policy/placer.py`). `gpu_type`: a GPU model, matched as
    `gpu_type` is; `labels`: node labels; `spread`: the emptiest nodes rather than best fit."""

    gpu_type: L.GpuType | None = None
    labels: L.Labels = {}
    spread: bool = False


DependencyKind = Literal["afterok", "afterany"]


class Dependency(Struct, frozen=True, forbid_unknown_fields=True):
    """Start only after job `job` ended: `afterok` completed successfully (exit code 0),
    `afterany` ended in any way (Slurm's names)."""

    kind: DependencyKind
    job: Annotated[str, Meta(min_length=1, max_length=L.NAME_MAX + 2, pattern=L.NO_NUL_PATTERN)]


class ArraySpec(Struct, frozen=True, forbid_unknown_fields=True):
    """A job array: one task per index `first..last`, each a job `<id>_<index>` with the index in
    GPUSCHED_ARRAY_INDEX (and SLURM_ARRAY_TASK_ID); at most `max_running` tasks hold GPUs at once."""

    first: Annotated[int, Meta(ge=0, le=1_000_000)]
    last: Annotated[int, Meta(ge=0, le=1_000_000)]
    max_running: PositiveInt | None = None

    @property
    def size(self) -> int:
        return self.last - self.first + 1


class JobSpec(Struct, frozen=True, forbid_unknown_fields=True):
    """What a user asks for. `gpus` is the gang size (the most an elastic job uses);
    `min_gpus` below `gpus` makes the job elastic: it may start and run with fewer."""

    team: Team
    gpus: L.GpuCount
    min_gpus: L.GpuCount | None = None
    priority: Priority = "normal"
    preemptible: bool = False
    topology: TopologyConstraint = TopologyConstraint()
    time_limit_s: L.TimeLimit | None = None
    command: L.Command = []
    #: Stored in plaintext in the log and in Redis: never put secrets here (see `secret_env`).
    env: L.Env = {}
    checkpoint_dir: L.AbsPath | None = None
    #: Which node ranks must save for a checkpoint to be complete: rank 0 alone, or every rank.
    checkpoint: Literal["rank0", "all"] = "rank0"
    #: Where the job runs (absolute; `submit` records its working directory, `--chdir` overrides).
    workdir: L.AbsPath | None = None
    on_failure: Literal["requeue", "fail"] = "requeue"
    max_restarts: L.Restarts = 3
    name: L.JobName = ""
    #: Variable name -> absolute path of a file on the node; the node agent reads the file at
    #: launch and passes its content to the job. Only the path is ever stored.
    secret_env: L.SecretEnv = {}
    #: Jobs that must end (afterok: successfully) before this one may start.
    dependency: Annotated[list[Dependency], Meta(max_length=64)] = []
    #: Only on nodes whose GPU model contains this (case-insensitive: "H100", "A100-SXM4-80GB").
    gpu_type: L.GpuType | None = None
    #: Further GPU types the job accepts, tried in order after `gpu_type` (`--gpu-type H100,A100`);
    #: a reader that predates it places the job on `gpu_type` alone (docs/gpu-pools.md).
    gpu_type_fallback: Annotated[list[L.GpuType], Meta(max_length=7)] = []
    #: Only on nodes carrying every one of these labels (`gpusched node label`, agent `--label`).
    constraints: L.Labels = {}
    #: A job array: admission's one `JobSubmitted` folds into one job per index.
    array: ArraySpec | None = None
    #: CPUs and memory (MiB) per node: the limits of the job's cgroup there (None: no limit),
    #: and what placement reserves on each node the job uses (`policy/resources.py`).
    cpus: L.Cpus | None = None
    memory_mb: L.MemoryMb | None = None
    #: Where it would rather run, when several sets fit (None: no preference).
    prefer: Preferences | None = None
    #: A share of ONE GPU (0 < F < 1, `--gpu-fraction`), co-located with other shares on it,
    #: never beside a whole-GPU job (docs/gpu-sharing.md); needs `gpus == 1`.
    gpu_fraction: L.GpuFraction | None = None
    #: The GPU memory (MiB) it needs of ONE GPU (`--gpu-memory`): placement converts it to the
    #: share of the GPU it lands on (its memory / the GPU's). Exclusive with `gpu_fraction`.
    gpu_memory_mb: L.GpuMemoryMb | None = None
    #: MIG slices of ONE GPU in MIG mode (`--mig 1g.10gb[xN]`): `mig_count` GPU instances of this
    #: profile, each isolated by its own device (docs/gpu-sharing.md#mig-slices); needs `gpus == 1`.
    mig: L.MigProfileName | None = None
    mig_count: L.MigCount = 1

    @property
    def sliced(self) -> bool:
        """A MIG job: slices of one partitioned GPU, not whole GPUs nor a share."""
        return self.mig is not None

    @property
    def partial(self) -> bool:
        """On part of one GPU (a share or MIG slices): it frees no whole GPU and is charged its part."""
        return self.shared or self.sliced

    @property
    def shared(self) -> bool:
        """A fractional job: a share of one GPU, not whole GPUs."""
        return self.gpu_fraction is not None or self.gpu_memory_mb is not None

    def share_on(self, gpu_memory_mb: int) -> float | None:
        """The share of a GPU of `gpu_memory_mb` this job takes (1.0: a whole-GPU job), or None
        when it does not fit there (a memory ask beyond the GPU's, or of unknown memory)."""
        if self.gpu_fraction is not None:
            return self.gpu_fraction
        if self.gpu_memory_mb is None:
            return 1.0
        if gpu_memory_mb <= 0 or self.gpu_memory_mb > gpu_memory_mb:
            return None
        return min(1.0, round(self.gpu_memory_mb / gpu_memory_mb, 6))
    #: Run the command in this OCI image (podman with runc on the node; None: the node's own system).
    image: L.ImageRef | None = None

    @property
    def gang_min(self) -> int:
        return self.min_gpus if self.min_gpus is not None else self.gpus

    @property
    def elastic(self) -> bool:
        return self.gang_min < self.gpus


class GpuInfo(Struct, frozen=True, forbid_unknown_fields=True):
    """One GPU as a node daemon registers it. `nvlink_domain`: GPUs sharing a domain id are
    NVLink-connected to each other."""

    index: Annotated[int, Meta(ge=0)]
    uuid: str
    model: str = "unknown"
    memory_mb: Annotated[int, Meta(ge=0)] = 0
    nvlink_domain: Annotated[int, Meta(ge=0)] = 0
    #: Its MIG mode and GPU-instance profiles, where MIG is (or will be, after a reset) enabled.
    mig: MigInfo | None = None


class FoldSettings(Struct, frozen=True, forbid_unknown_fields=True):
    """What changes what every fold computes, so it is a fact of the log (`FoldSettingsSet`),
    never a process's option: `half_life_s`, the usage half-life of fair share (None: usage
    never decays); `forget_after_s`, how long a finished job is kept whole (None: for ever)."""

    half_life_s: L.FoldSpan | None = DEFAULT_HALF_LIFE_S
    forget_after_s: L.FoldSpan | None = FORGET_AFTER_S


class ModelQuota(Struct, frozen=True, forbid_unknown_fields=True):
    """A team's terms on one GPU pool (`TeamQuota.models`): GPUs of that model it is
    guaranteed, and a hard `limit` of them it never holds more than (None: no per-model limit)."""

    guaranteed: L.QuotaGpus = 0
    limit: L.QuotaGpus | None = None


class TeamQuota(Struct, frozen=True, forbid_unknown_fields=True):
    """Fair-share terms of a team: `guaranteed` GPUs it can always reclaim, a `weight` for
    sharing what is left, and a hard `limit` it never exceeds (None: the whole cluster).
    `models`: per GPU pool (canonical model name, `core/pools.py`) terms; with any, the team's
    `guaranteed` is their sum and each of its jobs runs on one pool (docs/gpu-pools.md)."""

    guaranteed: L.QuotaGpus = 0
    weight: L.Weight = 1.0
    limit: L.QuotaGpus | None = None
    #: The time limit admission gives the team's jobs submitted without one (None: none).
    default_time_limit_s: L.TimeLimit | None = None
    #: The longest time limit a job of the team may ask for (None: no maximum).
    max_time_limit_s: L.TimeLimit | None = None
    #: CPUs and memory (MiB) per node admission gives the team's jobs submitted without
    #: `--cpus` / `--mem` (None: none; the job then reserves none of the node's CPUs or memory).
    default_cpus: L.Cpus | None = None
    default_memory_mb: L.MemoryMb | None = None
    models: Annotated[dict[L.GpuType, ModelQuota], Meta(max_length=8)] = {}


def nvlink_domains(layout: str, count: int) -> list[int]:
    """The NVLink domain of each GPU index for a standard intra-node layout."""
    if layout == "all":
        return [0] * count
    if layout == "pairs":
        return [i // 2 for i in range(count)]
    if layout == "quads":
        return [i // 4 for i in range(count)]
    if layout == "none":
        return list(range(count))
    raise ValueError(f"unknown NVLink layout {layout!r}; expected all, pairs, quads or none")


def encode(obj: object) -> bytes:
    return msgspec.json.encode(obj)
