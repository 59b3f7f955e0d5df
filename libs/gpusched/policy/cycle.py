"""One scheduling cycle: the steps of a session, each delegating one question to a policy.

    settle preemptions -> order -> place (reserve + backfill) -> shrink / preempt -> grow -> reasons

`cycle(state, now, config)` returns the events the cycle decides, valid to apply in order to
`state`. It never mutates the state: GPUs granted or released earlier in the same cycle are
tracked on a scratch `Pool` and per-team holdings. `naive_cycle` is the fallback of a dead
placement service: FIFO with gangs, first free GPUs, no preemption.

Within one cycle each running job is touched at most once (one `JobResized`, or one preemption
and its release), and no GPU is granted twice. Reclaim counts what is already coming free: the
GPUs of preemptions in flight (asked in an earlier cycle or earlier in this one) form a second
scratch pool (`coming`) from which blocked jobs claim, in queue order, before any new victim is
chosen; a blocked job whose need is covered triggers no preemption, and the GPUs claimed count
as its team's when judging fairness and limits.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from ..core import events as ev
from ..core.model import PRIORITY_RANK, GpuId
from ..core.state import ClusterState, Job
from . import reasons as rs
from . import unhealthy
from .backfill import Reservation, expected_end, reserve
from .config import PRESETS, PolicyConfig
from .elastic import extras, grow_gpus, shrink_plan
from .fairshare import limit_room, may_preempt, over_share
from .idle import idle_timeouts
from .ordering import queue_index
from .placement import Placement, Pool, explain_no_fit, first_free, place
from .preemption import choose_victims, work_since_checkpoint
from .running import running_index

#: The fallback keeps the cheap ordering decisions (priority classes, fair-share order, limits)
#: and loses the expensive ones (topology, preemption, backfill): otherwise a flood of
#: interactive jobs would wait behind requeued batch jobs for as long as placement is dead.
_NAIVE = PRESETS["gang"].replace(priority=True, fairshare=True)
#: How many candidate victims a preemption decision chooses from (bounds its cost).
_VICTIM_POOL = 48


def cycle(state: ClusterState, now: float, config: PolicyConfig) -> list[ev.Event]:
    """Decide one cycle. Returned events are valid to apply to `state` in order."""
    return _Cycle(state, now, config, "topo" if config.topology else "naive").run()


def naive_cycle(state: ClusterState, now: float) -> list[ev.Event]:
    """Gangs on the first free GPUs in priority and fair-share order, no preemption: what runs
    while placement is dead."""
    return _Cycle(state, now, _NAIVE, "naive").run()


class _Cycle:
    def __init__(self, state: ClusterState, now: float, config: PolicyConfig, placer: str) -> None:
        self.state, self.now, self.config, self.placer = state, now, config, placer
        self.pool = Pool(state)
        self.out: list[ev.Event] = []
        # Holdings per team as this cycle sees them (every job's team is known to the fold).
        self._held: dict[str, int] = {t: u.held for t, u in state.teams.items()}
        self.held = self._held.__getitem__
        self.reasons: dict[str, tuple[str, list[str], float | None]] = {}
        self.blocked: list[Job] = []  # waiting for room (not for a limit), in order
        self.started: list[tuple[Job, list[GpuId]]] = []  # granted this cycle
        self.released: set[str] = set()  # running jobs released this cycle
        self.shrunk: set[str] = set()  # elastic jobs shrunk this cycle
        self.removed: dict[str, list[GpuId]] = {}  # elastic job -> GPUs taken back this cycle
        self.resize_at: dict[str, int] = {}  # elastic job -> index of its JobResized in `out`
        self.preempting: dict[str, list[str]] = {}  # beneficiary -> victims in flight
        self.inflight: dict[str, None] = {}  # running jobs asked to yield, not yet released
        self.leaving: dict[str, int] = {}  # team -> GPUs of its jobs asked to yield
        self.inflight_gpus = 0  # GPUs of preemptions asked in earlier cycles, not yet released
        self.coming: Pool | None = None  # reclaim: the pool plus in-flight GPUs, less claims
        self.incoming: dict[str, int] = {}  # team -> GPUs its blocked jobs claimed from `coming`
        self._fits_now: set[tuple] = set()  # placement questions known to fit `pool` (reasons)
        self.ridx = running_index(state)
        self.borrowed: set[str] = set()  # preemptible jobs backfilled this cycle (they yield)
        self.head: Job | None = None
        self.reservation: Reservation | None = None
        self._outside: Pool | None = None  # the pool less the reservation
        self.strict = config.strict_fifo or not config.gang
        self.limit_stop = False

    # --- scratch accounting ------------------------------------------------------------------

    def _adjust(self, team: str, delta: int) -> None:
        self._held[team] += delta

    def room(self, team: str) -> int | None:
        return limit_room(self.state, team, self.held(team))

    # --- steps -------------------------------------------------------------------------------

    def run(self) -> list[ev.Event]:
        self.expire()
        if self.config.preemption:
            self.settle()
        if self.config.move_off_unhealthy and self.config.preemption:  # off quarantined GPUs
            self.out += unhealthy.moves(self.state, self.now, self.config.checkpoint_grace_s, self.released)
        self.walk()
        if self.blocked and (self.config.preemption or self.config.elastic):
            self.reclaim()
        if self.config.elastic and not self.blocked:
            self.grow()
        self.explain()
        self.out += idle_timeouts(self.state, self.now, self.config, self.out)
        return self.out

    def settle(self) -> None:
        """Release preempted jobs that checkpointed, or whose grace period is over."""
        st, now = self.state, self.now
        jobs = st.jobs
        for jid in [j for j in st.running if jobs[j].preemption is not None and j not in self.released]:
            job = jobs[jid]  # (one that timed out this cycle is already freed)
            p = job.preemption
            ck = job.checkpoint
            if ck is not None and ck.attempt == job.attempt and ck.at >= p.at:
                self._release(job, forced=False, lost=len(job.gpus) * max(0.0, now - ck.at))
            elif now >= p.deadline:
                self._release(job, forced=True, lost=work_since_checkpoint(job, now))
            else:
                self.preempting.setdefault(p.for_job, []).append(jid)
                self.inflight[jid] = None
                self.leaving[job.team] = self.leaving.get(job.team, 0) + len(job.gpus)
                self.inflight_gpus += len(job.gpus)

    def expire(self) -> None:
        """A job past its time limit ends (Slurm's TIMEOUT): reservations and backfill count on
        time limits, so a job that overruns must not push the reserved job's start back."""
        st, now = self.state, self.now
        for jid in list(st.running):
            job = st.jobs[jid]
            limit = job.spec.time_limit_s
            if limit is not None and job.started_at is not None and now >= job.started_at + limit:
                self.out.append(ev.JobTimedOut(at=now, job_id=jid, attempt=job.attempt, limit_s=limit))
                self._free(job)

    def _release(self, job: Job, forced: bool, lost: float) -> None:
        self.out.append(ev.GpusReleased(at=self.now, job_id=job.job_id, reason="preempted", forced=forced,
                                        lost_gpu_s=round(lost, 6)))
        self._free(job)

    def _free(self, job: Job) -> None:
        """The job's GPUs return to this cycle's pool; nothing else may touch the job."""
        self.pool.add(job.gpus)
        if self.coming is not None:
            self.coming.add(job.gpus)
        self._outside = None
        self._adjust(job.team, -len(job.gpus))
        self.released.add(job.job_id)

    def _fit(self, job: Job, pool: Pool, room: int | None) -> Placement | None:
        config, spec = self.config, job.spec
        want = spec.gpus if room is None else min(spec.gpus, room)
        lo = spec.gang_min if config.elastic else spec.gpus
        if want < lo:
            return None
        required = spec.topology.required
        # Jobs alike in what placement reads fail alike: a failure is remembered on the pool
        # until it grows (see Pool.fails), so a long queue costs one placement per shape.
        key = (want, lo, required, spec.topology.preferred)
        if lo > pool.count or key in pool.fails:
            return None
        if self.placer == "naive":
            p = first_free(pool, want, required)
        else:
            p = place(pool, want, required, spec.topology.preferred)
        if p is not None or lo == want:
            if p is None:
                pool.fails.add(key)
            return p
        # elastic: start with what fits now, at least the minimum
        k = min(want - 1, pool.count)
        tries = [k, lo] if k > lo else [lo]
        for k in tries:
            if k < lo:
                continue
            p = first_free(pool, k, required) if self.placer == "naive" else place(pool, k, required)
            if p is not None:
                return p
        pool.fails.add(key)
        return None

    def _fits_pool(self, job: Job, room: int | None) -> bool:
        """Whether `job` could start on the pool as it is (for its reason only; remembered until
        the pool shrinks)."""
        spec = job.spec
        want = spec.gpus if room is None else min(spec.gpus, room)
        key = (want, spec.gang_min if self.config.elastic else spec.gpus, spec.topology.required,
               spec.topology.preferred)
        if key in self._fits_now:
            return True
        if self._fit(job, self.pool, room) is None:
            return False
        self._fits_now.add(key)
        return True

    def _grant(self, job: Job, p: Placement, backfill: bool) -> None:
        self.out.append(ev.GpusGranted(at=self.now, job_id=job.job_id, attempt=job.attempt + 1, gpus=p.gpus,
                                       placer=self.placer, level=p.level, backfill=backfill))
        self.pool.take(p.gpus)
        self._fits_now.clear()
        if self._outside is not None:
            self._outside.remove(p.gpus)
        if self.coming is not None:
            self.coming.remove(p.gpus)  # a GPU an earlier claim counted on: that claim is void
        self._adjust(job.team, len(p.gpus))
        if backfill and job.spec.preemptible:
            self.borrowed.add(job.job_id)
        self.started.append((job, p.gpus))
        self.reasons.pop(job.job_id, None)

    def _reason(self, job: Job, r: tuple[str, list[str]], eta: float | None = None) -> None:
        self.reasons[job.job_id] = (r[0], r[1], eta)

    def walk(self) -> None:
        """Each pending job in order: start it if it fits (and cannot delay the reserved head).
        Once nothing more can start (the strict head is blocked, or no GPU is left and enough
        blocked jobs are known for reclaim), the rest of the queue gets its stable tail reason."""
        st, config, pool = self.state, self.config, self.pool
        idx = queue_index(st, config)
        processed: dict[str, None] = {}
        reclaimers = config.max_preemptors_per_cycle if (config.preemption or config.elastic) else 0
        stopped = False
        for job in idx.ordered(self.now, self.held):
            if self.strict and self.blocked or self.limit_stop:
                break
            if not self.strict and pool.count <= 0 and len(self.blocked) >= reclaimers + self.inflight_gpus:
                break  # (blocked jobs covered by GPUs in flight trigger no preemption: see reclaim)
            processed[job.job_id] = None
            spec = job.spec
            room = self.room(job.team)
            lo = spec.gang_min if config.elastic else spec.gpus
            if room is not None and room < lo:
                self._reason(job, rs.team_limit(job.team, st.teams[job.team].quota.limit or 0, lo))
                if self.strict:
                    self.limit_stop = True
                continue
            if self.head is not None and pool.count >= lo:
                p = self._backfill_fit(job, room)
                if p is not None:
                    self._grant(job, p, backfill=True)
                    continue
                self.blocked.append(job)
                if self._fits_pool(job, room):
                    self._reason(job, rs.would_delay())
                else:
                    self._reason(job, rs.no_room(lo, spec.topology.required))
                continue
            p = self._fit(job, pool, room) if pool.count >= lo else None
            if p is None:
                self.blocked.append(job)
                self._reason(job, rs.no_room(lo, spec.topology.required))
                if config.backfill and self.head is None and not self.strict:
                    self.head = job
                continue
            self._grant(job, p, backfill=False)
        else:
            stopped = True
        self._tail(idx, processed, complete=stopped)

    def _tail(self, idx, processed: dict[str, None], complete: bool) -> None:
        """Reasons of the jobs the walk did not reach; only those whose state does not already
        show it are looked at (the index remembers the settled ones)."""
        st, config = self.state, self.config
        settled = idx.settled
        for jid in processed:
            settled.pop(jid, None)
        if complete:
            return
        rest = st.pending.keys() - settled.keys() - processed.keys()
        if not rest:
            return
        jobs, teams = st.jobs, st.teams
        cache: dict[tuple, tuple[str, list[str]]] = {}
        for jid in sorted(rest):
            job = jobs[jid]
            spec = job.spec
            if self.strict:
                r = rs.fifo_blocked()
            else:
                lo = spec.gang_min if config.elastic else spec.gpus
                room = self.room(job.team)
                if room is not None and room < lo:
                    r = rs.team_limit(job.team, teams[job.team].quota.limit or 0, lo)
                else:
                    k = (lo, spec.topology.required)
                    r = cache.get(k) or cache.setdefault(k, rs.no_room(lo, spec.topology.required))
            if job.pending_reason == r[0] and job.pending_blockers == r[1]:
                t = teams.get(job.team)
                if self.strict or t is None or t.quota.limit is None:
                    settled[jid] = None
            else:
                self._reason(job, r)

    # --- reservation and backfill -----------------------------------------------------------

    def _holders(self) -> Iterator[tuple[float, Job, list[GpuId]]]:
        """Every job holding GPUs as this cycle sees it, soonest expected end first: known ends
        (time limits, preemption deadlines, borrowers) sorted, then unknown ends in start order.
        A borrower yields on demand, so its GPUs count as free within one checkpoint grace: the
        head's reservation stays on the set it lent (counted as an unknown end, the newest of
        all, the set would move to older holders when the rest of it frees, and the loan and
        the GPUs next to it would be taken for good)."""
        st, now, config = self.state, self.now, self.config
        known: list[tuple[float, int, Job, list[GpuId]]] = []
        unknown: list[tuple[float, int, Job, list[GpuId]]] = []
        skip = self.released
        inflight = self.inflight
        lent = self.ridx.borrowers
        soon = now + self._grace()
        for i, jid in enumerate(lent):
            if jid not in skip and jid not in inflight:
                job = st.jobs[jid]
                known.append((min(soon, expected_end(job, now, config)), (1 << 30) + i, job, job.gpus))
        for i, jid in enumerate(self.ridx.timed):
            if jid not in skip and jid not in inflight and jid not in lent:
                job = st.jobs[jid]
                known.append((expected_end(job, now, config), i, job, job.gpus))
        for i, jid in enumerate(inflight):
            if jid not in skip:
                job = st.jobs[jid]
                known.append((expected_end(job, now, config), -1 - i, job, job.gpus))
        for i, (job, gpus) in enumerate(self.started):
            end = expected_end(job, now, config) if job.spec.time_limit_s is not None else math.inf
            if job.job_id in self.borrowed:
                end = min(end, soon)
            (known if end < math.inf else unknown).append((end, (1 << 40) + i, job, gpus))
        timed = self.ridx.timed
        lazy = (st.jobs[jid] for jid in st.running
                if jid not in timed and jid not in inflight and jid not in skip and jid not in lent)
        if config.unknown_runtime_s is not None:  # every end is known: one sorted list
            known.extend((expected_end(j, now, config), (1 << 20) + i, j, j.gpus) for i, j in enumerate(lazy))
            known.extend(unknown)
            lazy, unknown = iter(()), []
        known.sort(key=lambda t: t[:2])
        for end, _, job, gpus in known:
            yield end, job, gpus
        for job in lazy:
            yield math.inf, job, job.gpus
        for end, _, job, gpus in unknown:
            yield end, job, gpus

    def _reserve(self) -> Reservation | None:
        if self.reservation is None and self.head is not None:
            head = self.head
            lo = head.spec.gang_min if self.config.elastic else head.spec.gpus
            self.reservation = reserve(self.state, self.pool, head, lo, self.now, self.config, self._holders())
            self._outside = None
        return self.reservation

    def _backfill_fit(self, job: Job, room: int | None) -> Placement | None:
        """A placement for `job` that cannot delay the reserved head, or None: outside the
        reserved set, or anywhere if its time limit ends before the reservation is due, or if it
        is preemptible and will yield (`borrow`) while the reservation is not yet due."""
        res = self._reserve()
        if res is None:
            return self._fit(job, self.pool, room)  # the head can never fit as the cluster is
        if self._outside is None:
            self._outside = self.pool.without(res.gpus)
        spec = job.spec
        lo = spec.gang_min if self.config.elastic else spec.gpus
        if self._outside.count >= lo:
            q = self._fit(job, self._outside, room)
            if q is not None:
                return q
        if res.known and spec.time_limit_s is not None and self.now + spec.time_limit_s <= res.at:
            return self._fit(job, self.pool, room)
        if self.config.preemption and self.config.borrow and spec.preemptible and not self._due_soon(res):
            t = self.state.teams.get(job.team)
            guaranteed = t.quota.guaranteed if t is not None else 0
            if job.team == self.head.team or self.held(job.team) + lo > guaranteed:
                return self._fit(job, self.pool, room)  # it yields when the head could start
        return None

    def _grace(self) -> float:
        """How long a job asked to yield may take to checkpoint."""
        return self.config.checkpoint_grace_s if self.config.checkpoint else 0.0

    def _due_soon(self, res: Reservation) -> bool:
        """The reserved set is free or comes free within one checkpoint grace (its holders are
        being preempted, are borrowers, or end by their time limit): the GPUs are the head's. A
        borrower would have to yield at once, pushing the head's start back by its checkpoint."""
        return res.known and res.at <= self.now + self._grace()

    # --- shrink and preemption ---------------------------------------------------------------

    def _fits(self, job: Job, need: int):
        """Whether `need` GPUs for `job` fit a pool (failures remembered on the pool)."""
        required = job.spec.topology.required
        key = ("fits", need, required)
        find = first_free if self.placer == "naive" else place

        def fits(pool: Pool) -> bool:
            if pool.count < need or key in pool.fails:
                return False
            if find(pool, need, required) is None:
                pool.fails.add(key)
                return False
            return True

        return fits

    def reclaim(self) -> None:
        """For the first blocked jobs, in order: start on GPUs freed earlier in this cycle; else
        claim GPUs already coming free (preemptions in flight); else shrink elastic jobs; else
        preempt. Without a checkpoint handshake the freed GPUs are granted at once."""
        config = self.config
        max_tries = 1 if self.strict else config.max_preemptors_per_cycle
        tries = 0
        failed: set[tuple] = set()  # jobs alike in what a victim search reads fail alike
        self.coming = self._coming()
        for job in list(self.blocked):
            if tries >= max_tries:
                break
            r = self.reasons.get(job.job_id)
            if r is not None and r[0].startswith("would delay"):
                continue
            lo = job.spec.gang_min if config.elastic else job.spec.gpus
            room = self.room(job.team)
            if room is not None and room - self.incoming.get(job.team, 0) < lo:
                continue  # its team's limit: what is already coming to it is all it may get
            fits = self._fits(job, lo)
            # 1. GPUs freed earlier in this cycle (shrinks, kills without checkpoint)
            if self.pool.count >= lo and fits(self.pool):
                if self._may_start_now(job):
                    self._start_blocked(job, room)
                else:
                    self._reason(job, rs.would_delay())
                continue
            # 2. GPUs already coming free: no new victim for a need they cover
            if self._claim(job, lo):
                continue
            tries += 1
            # 3. extra GPUs of elastic jobs
            if config.elastic and self._shrink(job, fits, room):
                continue
            if not config.preemption:
                continue
            # 4. preemption
            alike = (job.team, job.spec.priority, lo, job.spec.topology.required, job is self.head)
            if alike in failed:
                continue
            victims = self._victims(job, lo, fits)
            if not victims:
                failed.add(alike)
                continue
            for v in victims:
                self._request(v, job, f"preempted for {job.job_id} ({job.spec.priority}, team {job.team})")
            if not config.checkpoint:
                self._start_blocked(job, room)
            else:
                self._claim(job, lo, own=True)
                self._reason(job, rs.preempting([v.job_id for v in victims]))

    def _coming(self) -> Pool:
        """The pool plus the GPUs of preemptions in flight (they come free at their deadline)."""
        coming = self.pool.copy()
        jobs = self.state.jobs
        for jid in self.inflight:
            if jid not in self.released:
                coming.add(jobs[jid].gpus)
        return coming

    def _may_start_now(self, job: Job) -> bool:
        """GPUs freed by reclaim go to the reserved head first."""
        head = self.head
        return head is None or job is head or not any(b is head for b in self.blocked)

    def _claim(self, job: Job, lo: int, own: bool = False) -> bool:
        """Claim GPUs coming free for a blocked job, if they cover its need: they count as its
        team's from now on (fairness, limits), and no later job of the cycle counts on them."""
        coming = self.coming
        required = job.spec.topology.required
        key = ("claim", lo, required)
        if coming is None or coming.count < lo or key in coming.fails:
            return False
        p = first_free(coming, lo, required) if self.placer == "naive" else place(coming, lo, required)
        if p is None:
            coming.fails.add(key)
            return False
        coming.take(p.gpus)
        self.incoming[job.team] = self.incoming.get(job.team, 0) + len(p.gpus)
        if own:
            return True
        mine = self.preempting.get(job.job_id)
        if mine:
            self._reason(job, rs.preempting(mine))
        else:
            gi = self.state.gpus
            self._reason(job, rs.yielding(sorted({h for g in p.gpus if (h := gi[g].holder) is not None})))
        return True

    def _shrink(self, job: Job, fits, room: int | None) -> bool:
        """Take extra GPUs back from elastic jobs (as this cycle sees them) so that `job` starts."""
        st = self.state
        jobs = st.jobs
        cands: list[tuple[Job, list[GpuId]]] = []
        for jid in self.ridx.elastic:
            v = jobs[jid]
            if jid in self.released or jid in self.inflight or v.preemption is not None:
                continue
            taken = self.removed.get(jid)
            gpus = v.gpus if not taken else [g for g in v.gpus if g not in taken]
            if extras(v, gpus) > 0 and (not taken or self._may_extend(v)):
                cands.append((v, gpus))
        if not cands:
            return False
        cands.sort(key=lambda c: (-extras(*c), c[0].job_id))
        plan = shrink_plan(cands, self.pool, fits)
        if plan is None:
            return False
        for victim, removed in plan:
            self._resize_down(victim, removed, job)
        self._outside = None
        self._start_blocked(job, room)
        return True

    def _may_extend(self, victim: Job) -> bool:
        """A job shrunk earlier in this cycle may give back more only by growing its one
        JobResized, which moves the removal earlier in the output: not past a preemption of
        another job of its team for another team (that request was judged with the holding it
        had then, and the fold checks it with the holding when applied)."""
        i = self.resize_at[victim.job_id]
        jobs, team = self.state.jobs, victim.team
        for e in self.out[i + 1:]:
            if (isinstance(e, ev.PreemptionRequested) and jobs[e.job_id].team == team
                    and jobs[e.for_job].team != team):
                return False
        return True

    def _resize_down(self, victim: Job, removed: list[GpuId], job: Job) -> None:
        jid = victim.job_id
        i = self.resize_at.get(jid)
        if i is None:
            self.resize_at[jid] = len(self.out)
            self.removed[jid] = list(removed)
            self.out.append(ev.JobResized(at=self.now, job_id=jid, removed=list(removed),
                                          reason=f"shrink to make room for {job.job_id}"))
        else:  # one JobResized per job and cycle
            self.removed[jid] = self.removed[jid] + list(removed)
            old = self.out[i]
            self.out[i] = ev.JobResized(at=self.now, job_id=jid, removed=self.removed[jid],
                                        reason=f"{old.reason}, {job.job_id}")
        self.pool.add(removed)
        if self.coming is not None:
            self.coming.add(removed)
        self._adjust(victim.team, -len(removed))
        self.shrunk.add(jid)

    def _victims(self, job: Job, need: int, fits) -> list[Job] | None:
        st, now, config = self.state, self.now, self.config
        jobs = st.jobs
        if job is self.head and config.borrow:
            due = self._due(job, need, fits)
            if due:
                return due
        rank = PRIORITY_RANK[job.spec.priority]
        for_held = self.held(job.team) + self.incoming.get(job.team, 0)
        under = config.fairshare and over_share(st, job.team, for_held) < 0
        buckets = []
        for (team, r), bucket in self.ridx.preemptible.items():
            vh = self.held(team) - self.leaving.get(team, 0)
            over = over_share(st, team, vh)
            lower = config.priority and r < rank
            if team == job.team:
                ok = lower
            else:  # reclaim (any priority) from a team over its share; or priority, fairly
                ok = (under and over > 0) or (lower and may_preempt(st, team, vh, job.team, for_held))
            if ok:
                buckets.append((-over, r, team, bucket))
        if not buckets:
            return None
        buckets.sort(key=lambda b: b[:3])
        # Candidates: teams furthest over their share first, oldest start first within a bucket
        # (the ones past `min_runtime_s`); enough of them to choose well from, not all.
        # The set is chosen so that the job fits on free GPUs plus its own victims: GPUs coming
        # free for other jobs serve only jobs they cover entirely (`_claim`), as a job that
        # topped up scattered leftovers with victims elsewhere would span needlessly wide.
        want = max(1, need - self.pool.count)
        cands: list[Job] = []
        gathered = 0
        for _, _, _, bucket in buckets:
            for jid in bucket:
                v = jobs[jid]
                if v.started_at is not None and now - v.started_at < config.min_runtime_s:
                    break  # start order: the rest are younger still
                if v.preemption is not None or jid in self.released or jid in self.shrunk or jid in self.inflight:
                    continue
                cands.append(v)
                gathered += len(v.gpus)
                if len(cands) >= _VICTIM_POOL and gathered >= 2 * want:
                    break
            if len(cands) >= _VICTIM_POOL and gathered >= 2 * want:
                break
        if gathered < want:
            return None
        return choose_victims(st, self.pool, job, need, now, config, cands, self.held, fits, self._scope(job),
                              self.leaving, self.incoming)

    def _due(self, job: Job, need: int, fits) -> list[Job] | None:
        """Backfilled preemptible jobs yield to the blocked head as soon as evicting them lets it
        start: they started ahead of it on the promise not to delay it, so neither priority nor
        `min_runtime_s` protects them (the fold's fairness rule still does). The head's start
        moves by at most the checkpoint grace (none where the set was already due when they
        started: then they may not borrow it, see `_due_soon`).

        One thing does protect them: the eviction must leave the borrower's team ranked after
        the head's (`preemption._Rule.keeps_order`). The head is whoever leads the queue this
        cycle; a borrower pushed its team down the order when it started, and evicting it may
        lift that team back above the head's. Its jobs would then lead the next walk and take
        the freed GPUs (another borrow, or a start ahead of the head), that team would sink
        again, this head lead again and evict again: a livelock within one instant where
        checkpoints take no time (Philly week, ideal runtime, t=340549 s)."""
        st = self.state
        cands = [st.jobs[j] for j in self.ridx.borrowers
                 if j not in self.released and j not in self.inflight and j not in self.shrunk]
        if not cands:
            return None
        # The head's reservation already counts GPUs in flight: so does its claim on borrowers.
        coming = self.coming if self.coming is not None else self.pool
        return choose_victims(st, coming, job, need, self.now, self.config, cands, self.held, fits,
                              self._scope(job), self.leaving, self.incoming, due=True)

    def _scope(self, job: Job):
        """Groups of GPUs at the job's required level (None: the whole cluster)."""
        required = job.spec.topology.required
        if required == "cluster":
            return None
        gi, nodes = self.state.gpus, self.state.nodes
        if required in ("nvlink", "node"):
            return lambda g: gi[g].node
        if required == "rack":
            return lambda g: nodes[gi[g].node].rack
        return lambda g: nodes[gi[g].node].block or nodes[gi[g].node].rack

    def _request(self, victim: Job, job: Job, reason: str) -> None:
        grace = self.config.checkpoint_grace_s if self.config.checkpoint else 0.0
        self.out.append(ev.PreemptionRequested(at=self.now, job_id=victim.job_id, for_job=job.job_id,
                                               reason=reason, deadline=self.now + grace))
        if not self.config.checkpoint:
            self._release(victim, forced=True, lost=work_since_checkpoint(victim, self.now))
        else:
            self.preempting.setdefault(job.job_id, []).append(victim.job_id)
            self.inflight[victim.job_id] = None
            self.leaving[victim.team] = self.leaving.get(victim.team, 0) + len(victim.gpus)
            if self.coming is not None:
                self.coming.add(victim.gpus)

    def _start_blocked(self, job: Job, room: int | None) -> None:
        p = self._fit(job, self.pool, room)
        if p is not None:
            self._grant(job, p, backfill=False)
            self.blocked = [b for b in self.blocked if b is not job]

    # --- grow --------------------------------------------------------------------------------

    def grow(self) -> None:
        """Nothing that could use idle GPUs is waiting: elastic jobs grow into them."""
        st = self.state
        for jid in self.ridx.elastic:
            if self.pool.count <= 0:
                break
            job = st.jobs[jid]
            if (jid in self.released or jid in self.shrunk or jid in self.inflight or job.preemption is not None
                    or len(job.gpus) >= job.spec.gpus):
                continue
            add = grow_gpus(st, self.pool, job, self.room(job.team))
            if add:
                self.out.append(ev.JobResized(at=self.now, job_id=jid, added=add, reason="grow into idle GPUs"))
                self.pool.take(add)
                self._adjust(job.team, len(add))

    # --- why jobs wait -----------------------------------------------------------------------

    def explain(self) -> None:
        """One JobPending per job whose reason or blockers changed; the head gets the detail:
        the free counts that matter, and the jobs whose end would let it start."""
        now = self.now
        head = self.head if any(b is self.head for b in self.blocked) else (
            self.blocked[0] if self.blocked else None)
        if head is not None and self.reasons.get(head.job_id, ("",))[0].startswith("waiting for"):
            lo = head.spec.gang_min if self.config.elastic else head.spec.gpus
            detail = explain_no_fit(self.pool, lo, head.spec.topology.required)
            if self.config.backfill and head is self.head:
                res = self._reserve()
                if res is not None:
                    eta = None if not res.known else max(0.0, res.at - now)
                    self._reason(head, rs.reserved(detail, res.holders), eta)
                    return self._emit()
            # No protected reservation: still name the jobs whose end would let it start.
            lo_res = reserve(self.state, self.pool, head, lo, now, self.config, self._holders())
            self._reason(head, rs.no_fit(detail, lo_res.holders if lo_res is not None else []))
        self._emit()

    def _emit(self) -> None:
        st, now = self.state, self.now
        for jid, (reason, blockers, eta) in self.reasons.items():
            job = st.jobs[jid]
            if job.state != "pending":
                continue
            if job.pending_reason != reason or job.pending_blockers != blockers:
                self.out.append(ev.JobPending(at=now, job_id=jid, reason=reason, blockers=blockers,
                                              eta_s=None if eta is None or not math.isfinite(eta) else round(eta, 3)))


__all__ = ["cycle", "naive_cycle"]
