"""A cycle's tentative world, and the verbs that change it (as Nomad's `Plan`).

`CyclePlan` owns everything a cycle has decided so far: the events it emitted (never edited
once emitted), the pool of GPUs as it now sees them, the holdings of teams, and a status per
running or granted job. Each verb (grant, release, fail, request_preemption, shrink, grow) keeps
all of these in step, so a step never does the bookkeeping itself; `touchable(job)` is the one
answer to "may this running job still be taken from or grown?". The plan never mutates the
state: the fold is the only writer of state, and applies `plan.events` in order.

`Context` holds what a cycle reads but never changes: the state, `now`, the config, the
placer (`placer.py`), chosen once, and the caller's indexes of the state (`memo.Indexes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

from ..core import events as ev
from ..core import rules
from ..core.model import GpuId
from ..core.reasons import Reason
from ..core.state import ClusterState, Job
from .backfill import Reservation
from .config import PolicyConfig
from .fairshare import limit_room, standing
from .guarantee import Firm
from .memo import Indexes
from .mig import SliceIndex
from .placement import Placement, Pool
from .placer import Placer
from .pools import PoolFirm, choices, pool_of_gpus, restrict_to, room_on
from .predict import Estimate
from .resources import asks, busy_reason, by_resources, hold, short_nodes
from .running import RunningIndex
from .sharing import SharePick

#: What a cycle has done to a job so far (absent: untouched).
Status = Literal["granted", "borrowed", "released", "preempting", "shrunk"]
#: Statuses of running jobs a cycle may no longer take from or grow.
_SETTLED: frozenset[str] = frozenset({"released", "preempting", "shrunk"})


class Context:
    """What a cycle reads and never changes."""

    __slots__ = ("state", "now", "config", "placer", "indexes", "running", "strict", "grace", "estimates")

    def __init__(self, state: ClusterState, now: float, config: PolicyConfig, placer: Placer,
                 running: RunningIndex | None = None, indexes: Indexes | None = None) -> None:
        self.state, self.now, self.config, self.placer = state, now, config, placer
        self.indexes = indexes if indexes is not None else Indexes()
        self.running = running if running is not None else self.indexes.running(state)
        #: Nothing behind a blocked job may start (strict FIFO, or gangs may not skip ahead).
        self.strict = config.strict_fifo or not config.gang
        #: How long a job asked to yield may take to checkpoint.
        self.grace = config.checkpoint_grace_s if config.checkpoint else 0.0
        #: Predicted remaining run times asked this cycle, by (job, as of): the state and the
        #: predictor's history stay as they are for the whole cycle (`victims.remaining`).
        self.estimates: dict[tuple[str, float], Estimate] = {}

    def floor(self, job: Job) -> int:
        """The fewest GPUs `job` may start with under this config."""
        return rules.gang_floor(job.spec, self.config.elastic)


class CyclePlan:
    """The tentative world of one cycle (see the module docstring)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        state = ctx.state
        self.events: list[ev.Event] = []
        self.pool = Pool(state, ctx.indexes.topology(state))
        #: The pool plus the GPUs of preemptions in flight, less claims on them (reclaim only).
        self.coming: Pool | None = None
        self.status: dict[str, Status] = {}
        self.team_delta: dict[str, float] = {}
        self.pool_delta: dict[tuple[str, str], float] = {}  # (team, GPU pool) -> change this cycle
        self.share_load: dict[GpuId, float] = {}  # shared GPU -> its shares' sum, where this cycle changed it
        self.slices = SliceIndex(state)  # the partitioned GPUs' MIG slices (looked up when a MIG job asks)
        self.leaving: dict[str, float] = {}  # team -> GPUs of its jobs asked to yield
        self.incoming: dict[str, int] = {}  # team -> GPUs its blocked jobs claimed from `coming`
        self.pool_leaving: dict[tuple[str, str], float] = {}  # `leaving` per (team, GPU pool)
        self.pool_incoming: dict[tuple[str, str], int] = {}  # `incoming` per (team, GPU pool)
        self.inflight: dict[str, None] = {}  # running jobs asked to yield, in the order asked
        self.inflight_gpus = 0  # GPUs of preemptions asked in earlier cycles, not yet released
        self.preempting: dict[str, list[str]] = {}  # beneficiary -> its victims in flight
        self.removed: dict[str, list[GpuId]] = {}  # elastic job -> GPUs taken back this cycle
        self.started: list[tuple[Job, list[GpuId]]] = []  # granted this cycle, in order
        self.reasons: dict[str, tuple[Reason, float | None]] = {}  # job -> why it waits, ETA
        # The walk's findings, read by reclaim and explain.
        self.blocked: list[Job] = []  # waiting for room (not for a limit), in order
        self.head: Job | None = None  # the blocked job the reservation is for
        self.head_limited = False  # the head waits for its own team's limit (walk._limit_head)
        self.reservation: Reservation | None = None
        self.outside: Pool | None = None  # the pool less the reservation
        self.fits_now: set[tuple] = set()  # placement questions known to fit `pool` (reasons)
        self.array_running: dict[str, int] | None = None  # job array -> its tasks holding GPUs (eligibility)
        self._firm: Firm | None = None  # non-preemptible holdings (`job_room`)
        self._pool_firm: PoolFirm | None = None  # the same per GPU pool (`fit`)

    # --- what the plan says ------------------------------------------------------------------

    def held(self, team: str) -> float:
        """GPUs the team holds as this cycle sees them."""
        return self.ctx.state.teams[team].held + self.team_delta.get(team, 0)

    def pool_held(self, team: str, pool: str) -> float:
        """GPUs of `pool` the team holds as this cycle sees them (per-model quotas)."""
        t = self.ctx.state.teams.get(team)
        return (t.pool_held.get(pool, 0) if t is not None else 0) + self.pool_delta.get((team, pool), 0)

    def pool_view(self, team: str, pool: str) -> tuple[float, float, int]:
        """The team's GPUs of `pool` as this cycle sees them: (held, asked to yield, claimed
        coming free), for judging its per-model guarantee there (`fairshare.standing`)."""
        key = (team, pool)
        return self.pool_held(team, pool), self.pool_leaving.get(key, 0), self.pool_incoming.get(key, 0)

    def fair(self, victim: Job, job: Job) -> bool:
        """The fold's fairness rule for asking `victim` to yield for `job` (`rules.fair_between`),
        on the holdings as they will be: the victim's team's less what is already leaving, the
        job's team's plus what is already coming to it; per GPU pool where per-model terms judge."""
        st = self.ctx.state
        pool = rules.pool_of(st, victim.gpus)
        vh, fh = self.held(victim.team) - self.leaving.get(victim.team, 0), self.held(job.team) + self.incoming.get(job.team, 0)
        v_on, v_left, _ = self.pool_view(victim.team, pool) if pool is not None else (0.0, 0.0, 0)
        f_on, _, f_in = self.pool_view(job.team, pool) if pool is not None else (0.0, 0.0, 0)
        return rules.fair_between(victim.team, standing(st, victim.team, vh, pool, v_on - v_left),
                                     job.team, standing(st, job.team, fh, pool, f_on + f_in))

    def claim(self, team: str, gpus: list[GpuId]) -> None:
        """GPUs coming free are claimed for a blocked job of `team` (`reclaim._claim`)."""
        self.incoming[team] = self.incoming.get(team, 0) + len(gpus)
        for pool, n in pool_of_gpus(self.ctx.state, gpus).items():
            self.pool_incoming[(team, pool)] = self.pool_incoming.get((team, pool), 0) + n

    def room(self, team: str) -> int | None:
        """Whole GPUs the team may still take under its hard limit (None: no limit)."""
        room = self.share_room(team)
        return None if room is None else math.floor(room + rules.SHARE_SLACK)

    def share_room(self, team: str) -> float | None:
        """GPUs, shares of GPUs included, the team may still take under its limit (None: no limit)."""
        return limit_room(self.ctx.state, team, self.held(team))

    def job_room(self, job: Job) -> int | None:
        """GPUs `job` may still take: its team's limit room and, for a non-preemptible job where
        reclaim exists, what keeps every guarantee reclaimable (`guarantee.Firm`)."""
        room = self.room(job.team)
        config = self.ctx.config
        if job.spec.preemptible or not (config.fairshare and config.preemption):
            return room  # without reclaim no guarantee is taken back anyway
        if self._firm is None:
            capacity = self.pool.count + math.ceil(sum(self.held(t) for t in self.ctx.state.teams))  # free + held, as seen now
            self._firm = Firm(self.ctx.state, self.started, capacity)
        firm = self._firm
        if not firm.active or firm.never_fits(job.team, self.ctx.floor(job)):
            return room
        return firm.room(job.team) if room is None else min(room, firm.room(job.team))

    def touchable(self, job: Job) -> bool:
        """A running job this cycle may still take GPUs from or grow: not released, not being
        preempted (asked now or earlier), not shrunk."""
        return self.status.get(job.job_id) not in _SETTLED and job.preemption is None

    def gpus_of(self, job: Job) -> list[GpuId]:
        """A running job's GPUs as this cycle sees them (less what shrinks took back)."""
        taken = self.removed.get(job.job_id)
        return job.gpus if not taken else [g for g in job.gpus if g not in taken]

    def reason_of(self, job: Job) -> Reason | None:
        r = self.reasons.get(job.job_id)
        return None if r is None else r[0]

    def note(self, job: Job, reason: Reason, eta: float | None = None) -> None:
        """Record why `job` waits (emitted by the explain step if it changed)."""
        self.reasons[job.job_id] = (reason, eta)

    # --- verbs ---------------------------------------------------------------------------------

    def grant(self, job: Job, p: Placement, backfill: bool, handover: bool = False) -> None:
        ctx = self.ctx
        self.events.append(ev.GpusGranted(at=ctx.now, job_id=job.job_id, attempt=job.attempt + 1, gpus=p.gpus,
                                          placer=ctx.placer.name, level=p.level,  # type: ignore[arg-type]
                                          backfill=backfill, handover=handover))
        self.pool.take(p.gpus)
        hold(self.pool, job.spec, p.gpus)
        self.fits_now.clear()
        if self.outside is not None:
            self.outside.remove(p.gpus)
            hold(self.outside, job.spec, p.gpus)
        if self.coming is not None:
            self.coming.remove(p.gpus)  # a GPU an earlier claim counted on: that claim is void
            hold(self.coming, job.spec, p.gpus)
        self._count_gpus(job.team, p.gpus, 1)
        if self._firm is not None and not job.spec.preemptible:
            self._firm.add(job, len(p.gpus))
        if self._pool_firm is not None and not job.spec.preemptible:
            self._pool_firm.add(job.team, p.gpus, job.spec.gang_min)
        self.status[job.job_id] = "borrowed" if backfill and job.spec.preemptible else "granted"
        self.started.append((job, p.gpus))
        self.reasons.pop(job.job_id, None)

    def grant_share(self, job: Job, pick: SharePick, backfill: bool) -> None:
        """Start a fractional job on its share of one GPU (`policy/sharing.py`)."""
        g = pick.gpu
        if pick.opened:  # its first share: the GPU leaves the pool of whole GPUs
            self.pool.take([g])
            for other in (self.outside, self.coming):
                if other is not None:
                    other.remove([g])
            self.fits_now.clear()
        self.share_load[g] = self.share_load.get(g, self.ctx.state.gpus[g].shared_load) + pick.share
        self.grant_part(job, g, pick.share, backfill)

    def grant_part(self, job: Job, g: GpuId, share: float, backfill: bool, slices: Sequence[int] = ()) -> None:
        """Start a job on part of one GPU (a share; MIG slices, taken from `slices` first): its
        CPUs and memory held on the GPU's node, the team charged its part."""
        ctx = self.ctx
        self.events.append(ev.GpusGranted(at=ctx.now, job_id=job.job_id, attempt=job.attempt + 1, gpus=[g],
                                          placer=ctx.placer.name, level="nvlink",  # type: ignore[arg-type]
                                          backfill=backfill, slices=list(slices)))
        for pool in (self.pool, self.outside, self.coming):
            if pool is not None:
                hold(pool, job.spec, [g])
        self._count(job.team, share)
        self._pool_count(job.team, [g], share)
        self.status[job.job_id] = "granted"
        self.started.append((job, [g]))
        self.reasons.pop(job.job_id, None)

    def release(self, job: Job, forced: bool, lost: float) -> None:
        """A preempted job gives its GPUs back (checkpointed, or its grace is over)."""
        why = job.preemption
        self.events.append(ev.GpusReleased(at=self.ctx.now, job_id=job.job_id, reason="preempted", forced=forced,
                                           lost_gpu_s=round(lost, 6),
                                           for_job=why.for_job if why is not None and why.cause == "preempt" else None))
        self._free(job)

    def fail(self, job: Job, reason: str) -> None:
        """A running job ends (its time limit)."""
        self.events.append(ev.JobFailed(at=self.ctx.now, job_id=job.job_id, attempt=job.attempt, reason=reason))
        self._free(job)

    def time_out(self, job: Job, limit_s: float) -> None:
        """A running job ends: it ran past its time limit (Slurm's TIMEOUT)."""
        self.events.append(ev.JobTimedOut(at=self.ctx.now, job_id=job.job_id, attempt=job.attempt, limit_s=limit_s))
        self._free(job)

    def move(self, job: Job, reason: str) -> None:
        """Ask `job` to checkpoint and yield for itself (it resumes elsewhere): a preemption
        whose beneficiary is the job, in flight like any other."""
        ctx = self.ctx
        self.events.append(ev.PreemptionRequested(at=ctx.now, job_id=job.job_id, for_job=job.job_id,
                                                  reason=reason, deadline=ctx.now + ctx.config.checkpoint_grace_s))
        self.in_flight(job, job.job_id)

    def request_preemption(self, victim: Job, job: Job, reason: str) -> None:
        """Ask `victim` to yield for `job`: at once without the checkpoint handshake, else it is
        in flight until it checkpoints or its grace is over (its GPUs count as coming)."""
        ctx = self.ctx
        self.events.append(ev.PreemptionRequested(at=ctx.now, job_id=victim.job_id, for_job=job.job_id,
                                                  reason=reason, deadline=ctx.now + ctx.grace))
        if not ctx.config.checkpoint:
            self.release(victim, forced=True, lost=rules.work_since_checkpoint(victim, ctx.now))
            return
        self.in_flight(victim, job.job_id)
        if self.coming is not None:
            self.coming.add(victim.gpus)
            hold(self.coming, victim.spec, victim.gpus, -1)

    def in_flight(self, victim: Job, for_job: str) -> None:
        """`victim` was asked to yield for `for_job` (now or in an earlier cycle)."""
        self.preempting.setdefault(for_job, []).append(victim.job_id)
        self.inflight[victim.job_id] = None
        self.status[victim.job_id] = "preempting"
        self.leaving[victim.team] = self.leaving.get(victim.team, 0) + victim.weight
        for pool, n in pool_of_gpus(self.ctx.state, victim.gpus).items():
            key = (victim.team, pool)
            self.pool_leaving[key] = self.pool_leaving.get(key, 0) + n * victim.share

    def shrink(self, victim: Job, removed: list[GpuId], job: Job) -> None:
        """Take extra GPUs back from an elastic job so that `job` starts (one `JobResized` per
        shrink; a job shrunk twice in a cycle gets two)."""
        jid = victim.job_id
        self.events.append(ev.JobResized(at=self.ctx.now, job_id=jid, removed=list(removed),
                                         reason=f"shrink to make room for {job.job_id}"))
        self.removed[jid] = self.removed.get(jid, []) + list(removed)
        self.pool.add(removed)
        if self.coming is not None:
            self.coming.add(removed)
        self.outside = None
        self._count_gpus(victim.team, removed, -1)
        self.status[jid] = "shrunk"

    def grow(self, job: Job, added: list[GpuId]) -> None:
        self.events.append(ev.JobResized(at=self.ctx.now, job_id=job.job_id, added=added,
                                         reason="grow into idle GPUs"))
        self.pool.take(added)
        own = {self.ctx.state.gpus[g].node for g in self.gpus_of(job)}
        hold(self.pool, job.spec, [g for g in added if self.ctx.state.gpus[g].node not in own])
        self._count_gpus(job.team, added, 1)

    def _free(self, job: Job) -> None:
        """The job's GPUs return to this cycle's pool; nothing else may touch the job. A
        fractional job's GPU returns once its last share is gone."""
        if job.spec.partial:
            return self._free_share(job)
        self.pool.add(job.gpus)
        hold(self.pool, job.spec, job.gpus, -1)
        if self.coming is not None:
            self.coming.add(job.gpus)
            hold(self.coming, job.spec, job.gpus, -1)
        self.outside = None
        self._count_gpus(job.team, job.gpus, -1)
        self.status[job.job_id] = "released"

    def _free_share(self, job: Job) -> None:
        """A share, or MIG slices (their GPU stays partitioned: the slices return next cycle)."""
        st = self.ctx.state
        for g in job.gpus if job.spec.shared else ():
            load = self.share_load[g] = self.share_load.get(g, st.gpus[g].shared_load) - job.share
            if load <= rules.SHARE_SLACK:
                self.pool.add([g])
                if self.coming is not None:
                    self.coming.add([g])
        hold(self.pool, job.spec, job.gpus, -1)
        if self.coming is not None:
            hold(self.coming, job.spec, job.gpus, -1)
        self.outside = None
        self._count(job.team, -job.weight)
        self._pool_count(job.team, job.gpus, -job.share)
        self.status[job.job_id] = "released"

    def _count(self, team: str, delta: float) -> None:
        self.team_delta[team] = self.team_delta.get(team, 0) + delta

    def _count_gpus(self, team: str, gpus: list[GpuId], sign: int) -> None:
        """Whole GPUs taken (1) or given back (-1) by a team's job, per pool too."""
        self._count(team, sign * len(gpus))
        self._pool_count(team, gpus, sign)

    def _pool_count(self, team: str, gpus: list[GpuId], amount: float) -> None:
        """Per-pool holdings of a team with per-model terms (`pool_held`): `amount` per GPU."""
        t = self.ctx.state.teams.get(team)
        if t is not None and t.quota.models:
            for pool, n in pool_of_gpus(self.ctx.state, gpus).items():
                self.pool_delta[(team, pool)] = self.pool_delta.get((team, pool), 0) + amount * n

    # --- placement questions ------------------------------------------------------------------

    def fit(self, job: Job, pool: Pool, room: int | None) -> Placement | None:
        """Where `job` starts on `pool` within its team's `room`: on the first of its GPU pools
        with room within its per-model terms there (`pools.choices`), else as one question."""
        order = choices(self.ctx.state, job.spec, lambda p: self.pool_held(job.team, p), topo=pool.topo)
        if order is None:
            return self._fit(job, pool, room)
        rooms = self.pool_rooms(job, order)
        for choice, (limit, firm) in zip(order, rooms):
            p = self._fit(job, restrict_to(pool, choice), _least(room, limit, firm))
            if p is not None:
                return p
        return None

    def pool_rooms(self, job: Job, order: list) -> list[tuple[int | None, int | None]]:
        """Per choice of `order`: GPUs the job may take there under its team's per-model limit,
        and (non-preemptible, where reclaim exists, as `job_room`) under what keeps every
        per-model guarantee reclaimable (`pools.PoolFirm`); None: unbounded."""
        st, team, config = self.ctx.state, job.team, self.ctx.config
        limits = [room_on(st, team, p, self.pool_held(team, p)) for _, p in order]
        if job.spec.preemptible or not (config.fairshare and config.preemption):
            return [(r, None) for r in limits]
        if self._pool_firm is None:
            self._pool_firm = PoolFirm(st, self.started, self.pool.topo)
        firm, need = self._pool_firm, self.ctx.floor(job)
        exempt = all(firm.never_fits(team, p, need) for _, p in order)
        return [(r, firm.room(team, p, need, exempt)) for r, (_, p) in zip(limits, order)]

    def _fit(self, job: Job, pool: Pool, room: int | None) -> Placement | None:
        """Where `job` starts on `pool` within `room`: its whole gang, or (elastic)
        what fits, at least its minimum. Jobs alike in what placement reads fail alike: a failure
        is remembered on the pool until it grows, so a long queue costs one placement per shape."""
        ctx, spec = self.ctx, job.spec
        pool = ctx.placer.feasible(pool, spec)
        want = spec.gpus if room is None else min(spec.gpus, room)
        lo = ctx.floor(job)
        if want < lo:
            return None
        required = spec.topology.required
        key = (want, lo, required, spec.topology.preferred)
        if lo > pool.count or key in pool.fails:
            return None
        p = ctx.placer.best(pool, spec, want)
        if p is not None or lo == want:
            if p is None:
                pool.fails.add(key)
            return p
        k = min(want - 1, pool.count)  # elastic: start with what fits now, at least the minimum
        for k in ([k, lo] if k > lo else [lo]):
            if k >= lo:
                p = ctx.placer.best(pool, spec, k)
                if p is not None:
                    return p
        pool.fails.add(key)
        return None

    def fits_pool(self, job: Job, room: int | None) -> bool:
        """Whether `job` could start on the pool as it is (for its reason only; remembered until
        the pool shrinks)."""
        spec = job.spec
        want = spec.gpus if room is None else min(spec.gpus, room)
        key = (want, self.ctx.floor(job), spec.topology.required, spec.topology.preferred,
               spec.gpu_type, tuple(spec.gpu_type_fallback), tuple(spec.constraints.items()),
               bool(self.ctx.state.windows) and spec.time_limit_s, spec.cpus, spec.memory_mb)
        if key in self.fits_now:
            return True
        if self.fit(job, self.pool, room) is None:
            return False
        self.fits_now.add(key)
        return True

    def fits(self, job: Job, need: int) -> Callable[[Pool], bool]:
        """Whether `need` GPUs for `job` fit a pool (failures remembered on the pool)."""
        required = job.spec.topology.required
        key = ("fits", need, required)
        placer, spec = self.ctx.placer, job.spec

        def fits_one(pool: Pool) -> bool:
            pool = placer.feasible(pool, spec)
            if pool.count < need or key in pool.fails:
                return False
            if placer.best(pool, spec, need) is None:
                pool.fails.add(key)
                return False
            return True

        order = choices(self.ctx.state, spec, lambda p: self.pool_held(job.team, p), topo=self.pool.topo)
        if order is None:
            return fits_one
        st = self.ctx.state
        order = [c for c in order if (r := room_on(st, job.team, c[1], self.pool_held(job.team, c[1]))) is None or r >= need]
        return lambda pool: any(fits_one(restrict_to(pool, c)) for c in order)

    def wait_reason(self, job: Job, lo: int, no_room: Reason) -> Reason:
        """Why a job that did not fit waits: `no_room` (GPUs), or, when its GPUs would fit on
        the pool were it not for CPUs and memory, that (`resources.busy_reason`)."""
        ctx, spec = self.ctx, job.spec
        pool = self.pool
        if not asks(spec) or pool.count < lo or not short_nodes(pool, spec):
            return no_room
        for keep in ctx.placer.filters:
            if keep is not by_resources:
                pool = keep(pool, spec, ctx.now)
        return busy_reason(spec, lo) if ctx.placer.best(pool, spec, lo) is not None else no_room

    def start_blocked(self, job: Job, room: int | None) -> None:
        """Start a blocked job on the pool if it now fits."""
        p = self.fit(job, self.pool, room)
        if p is not None:
            self.grant(job, p, backfill=False)
            self.blocked = [b for b in self.blocked if b is not job]


def _least(*rooms: int | None) -> int | None:
    """The tightest of some rooms (None: unbounded)."""
    bounded = [r for r in rooms if r is not None]
    return min(bounded) if bounded else None


__all__ = ["Context", "CyclePlan", "Placer", "Status"]
