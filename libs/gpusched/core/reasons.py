"""Why a job waits: one small typed struct per kind, written by the policy step that decided.

`JobPending` carries the struct (`why`) beside its text (`reason`, `blockers`), so `gpusched
show`, `queue`, the dashboard and the simulator read what the running policy decided instead of
recomputing it. The text is stable (numbers only where they change rarely, or for the head job),
so that `JobPending` is appended when a job's situation changes, not once per cycle: a
queue-wide reason never names a job (a change of head would re-explain thousands of jobs).
"""

from __future__ import annotations

from typing import Union

from msgspec import Struct


class _Reason(Struct, frozen=True, tag_field="kind", gc=False):  # no cycles: never GC-tracked
    @property
    def blockers(self) -> list[str]:
        return []


class QueuedBehind(_Reason, frozen=True, tag="fifo"):
    """Strict FIFO: nothing behind a blocked job may start."""

    @property
    def text(self) -> str:
        return "queued behind earlier jobs (strict FIFO)"


class NoRoom(_Reason, frozen=True, tag="no_room"):
    """Not enough free GPUs in one allowed domain (the queue-wide reason, no job named)."""

    need: int
    required: str

    @property
    def text(self) -> str:
        scope = "" if self.required == "cluster" else f" within one {self.required}"
        return f"waiting for {self.need} free GPUs{scope}"


class NoFreeSlices(_Reason, frozen=True, tag="no_free_slices"):
    """A MIG job: no partitioned GPU has `count` free slices of its profile (an admin lays out
    slices with `gpusched mig set`; placement never changes a geometry)."""

    profile: str
    count: int = 1

    @property
    def text(self) -> str:
        n = f"{self.count} free" if self.count > 1 else "a free"
        return f"waiting for {n} MIG {self.profile} slice{'s' if self.count > 1 else ''} on one GPU"


class TeamLimit(_Reason, frozen=True, tag="team_limit"):
    team: str
    limit: int
    need: int

    @property
    def text(self) -> str:
        # what the team holds now is in the fold, not in the reason: `need` is the job's whole gang
        return f"team {self.team} at its limit {self.limit} with this job's {self.need} GPU(s)"

    @property
    def blockers(self) -> list[str]:
        return [f"team {self.team} limit {self.limit}"]


class BeyondGuarantee(_Reason, frozen=True, tag="beyond_guarantee"):
    """A non-preemptible job that would hold GPUs another team is guaranteed: only preemptible
    jobs may borrow, so that every guarantee stays reclaimable (`policy/guarantee.py`)."""

    team: str
    guaranteed: int
    need: int

    @property
    def text(self) -> str:
        return (f"not preemptible: team {self.team} would exceed its guarantee {self.guaranteed} "
                f"(needs {self.need} GPUs; only preemptible jobs may borrow)")

    @property
    def blockers(self) -> list[str]:
        return [f"team {self.team} guarantee {self.guaranteed}"]


class BehindReservation(_Reason, frozen=True, tag="behind_reservation"):
    """Fits now, but only on GPUs reserved for the blocked head job. The same words whoever the
    head is: a change of head must not re-explain the whole queue."""

    @property
    def text(self) -> str:
        return "would delay the GPUs reserved for the head of the queue"


class Topology(_Reason, frozen=True, tag="topology"):
    """The head job: the free counts of the domains considered (the best three), the jobs whose
    end would let it start, and whether the GPUs are reserved for it."""

    need: int
    required: str
    free: int  # free GPUs in the whole cluster (as the cycle saw them)
    domains: list[tuple[str, int]] = []  # (domain, free GPUs), most free first
    holders: list[str] = []
    reserved: bool = False
    #: On a mixed cluster, the GPU pools the job accepts and those it does not (issue 30).
    pools: list[str] = []
    not_accepted: list[str] = []
    at_limit: list[str] = []  # pools its team's per-model limit bars

    @property
    def text(self) -> str:
        detail = self._detail().replace(" GPUs", f" {' or '.join(self.pools)} GPUs", 1) if self.pools else self._detail()
        detail = f"{detail}; GPUs reserved, waiting for them to free" if self.reserved else detail
        if self.at_limit:
            detail += f"; team at its per-model limit on {', '.join(self.at_limit)}"
        return f"{detail}; {', '.join(self.not_accepted)} not accepted" if self.not_accepted else detail

    def _detail(self) -> str:
        if self.required == "cluster":
            detail = f"waiting for {self.need} GPUs; {self.free} free"
        else:
            level = "node" if self.required in ("nvlink", "node") else self.required
            scope = "one NVLink domain" if self.required == "nvlink" else f"one {self.required}"
            if not self.domains:
                detail = f"waiting for {self.need} GPUs within {scope}; none free"
            else:
                (name, k), rest = self.domains[0], self.domains[1:]
                detail = (f"waiting for {self.need} GPUs within {scope}; {k} free in {level} {name}"
                          + "".join(f", {n} in {d}" for d, n in rest))
        return detail

    @property
    def blockers(self) -> list[str]:
        return list(self.holders)


class WaitingForCheckpoint(_Reason, frozen=True, tag="waiting_for_checkpoint"):
    """Victims were asked to yield for this job; they checkpoint, then release."""

    victims: list[str]

    @property
    def text(self) -> str:
        return f"preempted {len(self.victims)} job(s) for it; they checkpoint and yield"

    @property
    def blockers(self) -> list[str]:
        return list(self.victims)


class ComingFree(_Reason, frozen=True, tag="coming_free"):
    """Covered by GPUs already coming free (preemptions in flight for this or other jobs)."""

    holders: list[str]

    @property
    def text(self) -> str:
        return "GPUs coming free from preempted jobs (they checkpoint and yield)"

    @property
    def blockers(self) -> list[str]:
        return list(self.holders)


class Held(_Reason, frozen=True, tag="held"):
    """Held by its owner or an admin (`gpusched hold`): never placed until released."""

    by: str  # who held it, and why ("alice: waiting for data")

    @property
    def text(self) -> str:
        return f"held by {self.by} (`gpusched release JOB` lets it start)"


class DependencyWait(_Reason, frozen=True, tag="dependency"):
    """Its dependencies have not ended yet (`waiting`: 'afterok:JOB' each, in spec order)."""

    waiting: list[str]

    @property
    def text(self) -> str:
        return f"dependency not satisfied yet: waiting for {', '.join(self.waiting)}"

    @property
    def blockers(self) -> list[str]:
        return [w.partition(":")[2] for w in self.waiting]


class DependencyNever(_Reason, frozen=True, tag="dependency_never"):
    """An `afterok` dependency ended without success: the job can never start (Slurm's
    DependencyNeverSatisfied). It stays pending, saying so, until someone cancels it."""

    failed: list[str]  # 'JOB STATE' each

    @property
    def text(self) -> str:
        return f"dependency can never be satisfied: {', '.join(self.failed)} (cancel the job)"


class NoMatchingNode(_Reason, frozen=True, tag="no_matching_node"):
    """No registered node can ever hold the job: none matches its GPU type and labels with
    enough GPUs (`wants`: the constraint as the user wrote it)."""

    wants: str
    need: int

    @property
    def text(self) -> str:
        return f"no node matches constraint {self.wants} with {self.need} GPUs"


class MaintenanceWindow(_Reason, frozen=True, tag="maintenance_window"):
    """Outside the maintenance windows its time limit would reach into (all of them, for a job
    without a limit), fewer than `need` GPUs may hold the job: it starts when a window is over,
    or sooner with a time limit that ends before one starts (`windows`: 'NODE START..UNTIL' each)."""

    windows: list[str]
    need: int

    @property
    def text(self) -> str:
        return (f"needs {self.need} GPUs outside maintenance windows it would run into: "
                f"{', '.join(self.windows)}")


class ArrayLimit(_Reason, frozen=True, tag="array_limit"):
    """A task of a job array whose `max_running` tasks already hold GPUs (`--array 0-99%10`)."""

    array: str
    max_running: int

    @property
    def text(self) -> str:
        return f"array {self.array} has {self.max_running} tasks running, its limit"


def _amounts(cpus: float, memory_mb: int) -> str:
    """'64 CPUs', '16G memory', '64 CPUs and 16G memory' (memory in G from 1024 MiB up)."""
    mem = f"{memory_mb / 1024:g}G" if memory_mb >= 1024 else f"{memory_mb}M"
    parts = ([f"{cpus:g} CPUs"] if cpus else []) + ([f"{mem} memory"] if memory_mb else [])
    return " and ".join(parts)


class NoFreeCpuMem(_Reason, frozen=True, tag="no_free_cpu_mem"):
    """Its GPUs would fit, but no node it could use has its per-node CPUs and memory free
    (`policy/resources.py`): it starts when jobs there end."""

    cpus: float
    memory_mb: int
    need: int

    @property
    def text(self) -> str:
        return f"fits on GPUs but no node has {_amounts(self.cpus, self.memory_mb)} free (per node; needs {self.need} GPUs)"


class NoNodeCpuMem(_Reason, frozen=True, tag="no_node_cpu_mem"):
    """No registered node can ever hold the job: it asks more CPUs or memory per node than the
    nodes that would hold its gang have (`largest_*`: the most any node offers)."""

    cpus: float
    memory_mb: int
    need: int
    largest_cpus: float = 0.0
    largest_memory_mb: int = 0

    @property
    def text(self) -> str:
        have = _amounts(self.largest_cpus if self.cpus else 0.0, self.largest_memory_mb if self.memory_mb else 0)
        return (f"no node can hold {_amounts(self.cpus, self.memory_mb)} per node for {self.need} GPUs"
                f"{f' (the largest node offers {have})' if have else ''}")


class NoRoomOnPools(_Reason, frozen=True, tag="no_room_on_pools"):
    """Not enough free GPUs on any GPU pool the job accepts (issue 30): which pools it would
    take, in order, which it does not accept, and those its team's per-model limit bars."""

    need: int
    required: str
    pools: list[str]
    not_accepted: list[str] = []
    at_limit: list[str] = []
    #: Pools where a non-preemptible job would hold GPUs other teams are guaranteed (`PoolFirm`).
    guaranteed_to_others: list[str] = []

    @property
    def text(self) -> str:
        scope = "" if self.required == "cluster" else f" within one {self.required}"
        out = f"waiting for {self.need} free {' or '.join(self.pools) or 'matching'} GPUs{scope}"
        if self.at_limit:
            out += f"; team at its per-model limit on {', '.join(self.at_limit)}"
        if self.guaranteed_to_others:
            out += f"; non-preemptible beyond its guarantee on {', '.join(self.guaranteed_to_others)} (the rest is guaranteed)"
        if self.not_accepted:
            out += f"; {', '.join(self.not_accepted)} not accepted"
        return out


Reason = Union[QueuedBehind, NoRoom, NoRoomOnPools, NoFreeSlices, TeamLimit, BeyondGuarantee, BehindReservation, Topology, WaitingForCheckpoint, ComingFree,
               Held, DependencyWait, DependencyNever, NoMatchingNode, MaintenanceWindow, ArrayLimit, NoFreeCpuMem, NoNodeCpuMem]

__all__ = ["ArrayLimit", "BehindReservation", "BeyondGuarantee", "ComingFree", "DependencyNever", "DependencyWait", "Held", "MaintenanceWindow", "NoFreeCpuMem", "NoFreeSlices", "NoMatchingNode", "NoNodeCpuMem", "NoRoom", "NoRoomOnPools",
           "QueuedBehind", "Reason", "TeamLimit", "Topology", "WaitingForCheckpoint"]
