"""One scheduling cycle: the steps of a session, each delegating one question to a policy.

    settle preemptions -> order -> place (reserve + backfill) -> shrink / preempt -> grow -> reasons

`cycle(state, now, config)` returns the events the cycle decides, valid to apply in order to
`state`. It never mutates the state: GPUs granted or released earlier in the same cycle are
tracked on a scratch `Pool` and per-team holdings. `naive_cycle` is the fallback of a dead
placement service: FIFO with gangs, first free GPUs, no preemption.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from ..core import events as ev
from ..core.model import PRIORITY_RANK, GpuId
from ..core.state import ClusterState, Job
from . import reasons as rs
from .backfill import Reservation, expected_end, reserve
from .config import PRESETS, PolicyConfig
from .elastic import extras, grow_gpus, shrink_plan
from .fairshare import limit_room, over_share
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
        self.shrunk: set[str] = set()  # elastic jobs shrunk to their minimum this cycle
        self.preempting: dict[str, list[str]] = {}  # beneficiary -> victims in flight
        self.inflight: dict[str, None] = {}  # running jobs asked to yield, not yet released
        self.leaving: dict[str, int] = {}  # team -> GPUs of its jobs asked to yield
        self.ridx = running_index(state)
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
        if self.config.preemption:
            self.settle()
        self.walk()
        if self.blocked and (self.config.preemption or self.config.elastic):
            self.reclaim()
        if self.config.elastic and not self.blocked:
            self.grow()
        self.explain()
        return self.out

    def settle(self) -> None:
        """Release preempted jobs that checkpointed, or whose grace period is over."""
        st, now = self.state, self.now
        jobs = st.jobs
        for jid in [j for j in st.running if jobs[j].preemption is not None]:
            job = jobs[jid]
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

    def _release(self, job: Job, forced: bool, lost: float) -> None:
        self.out.append(ev.GpusReleased(at=self.now, job_id=job.job_id, reason="preempted", forced=forced,
                                        lost_gpu_s=round(lost, 6)))
        self.pool.add(job.gpus)
        if self._outside is not None:
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
        if self.placer == "naive":
            p = first_free(pool, want, required)
        else:
            p = place(pool, want, required, spec.topology.preferred)
        if p is not None or lo == want:
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
        return None

    def _grant(self, job: Job, p: Placement, backfill: bool) -> None:
        self.out.append(ev.GpusGranted(at=self.now, job_id=job.job_id, attempt=job.attempt + 1, gpus=p.gpus,
                                       placer=self.placer, level=p.level, backfill=backfill))
        self.pool.take(p.gpus)
        if self._outside is not None:
            self._outside = self._outside.without(p.gpus)
        self._adjust(job.team, len(p.gpus))
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
            if not self.strict and pool.count <= 0 and len(self.blocked) >= reclaimers:
                break
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
                if self._fit(job, pool, room) is not None:
                    self._reason(job, rs.would_delay(self.head.job_id))
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
        (time limits, preemption deadlines) sorted, then unknown ends in start order."""
        st, now, config = self.state, self.now, self.config
        known: list[tuple[float, int, Job, list[GpuId]]] = []
        unknown: list[tuple[float, int, Job, list[GpuId]]] = []
        skip = self.released
        inflight = self.inflight
        for i, jid in enumerate(self.ridx.timed):
            if jid not in skip and jid not in inflight:
                job = st.jobs[jid]
                known.append((expected_end(job, now, config), i, job, job.gpus))
        for i, jid in enumerate(inflight):
            if jid not in skip:
                job = st.jobs[jid]
                known.append((expected_end(job, now, config), -1 - i, job, job.gpus))
        for i, (job, gpus) in enumerate(self.started):
            end = expected_end(job, now, config) if job.spec.time_limit_s is not None else math.inf
            (known if end < math.inf else unknown).append((end, (1 << 40) + i, job, gpus))
        timed = self.ridx.timed
        lazy = (st.jobs[jid] for jid in st.running if jid not in timed and jid not in inflight and jid not in skip)
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
        is preemptible and will yield (`borrow`)."""
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
        if self.config.preemption and self.config.borrow and spec.preemptible:
            t = self.state.teams.get(job.team)
            guaranteed = t.quota.guaranteed if t is not None else 0
            if job.team == self.head.team or self.held(job.team) + lo > guaranteed:
                return self._fit(job, self.pool, room)  # it yields when the head could start
        return None

    # --- shrink and preemption ---------------------------------------------------------------

    def _fits(self, job: Job, need: int):
        required = job.spec.topology.required
        if self.placer == "naive":
            return lambda pool: pool.count >= need and first_free(pool, need, required) is not None
        return lambda pool: pool.count >= need and place(pool, need, required) is not None

    def reclaim(self) -> None:
        """For the first blocked jobs: wait for preemptions in flight, else shrink elastic jobs,
        else preempt; without a checkpoint handshake the freed GPUs are granted at once."""
        config, st = self.config, self.state
        tries = 0
        failed: set[tuple] = set()  # jobs alike in what a victim search reads fail alike
        for job in list(self.blocked):
            if tries >= (1 if self.strict else config.max_preemptors_per_cycle):
                break
            if job.job_id in self.reasons and self.reasons[job.job_id][0].startswith("would delay"):
                continue
            tries += 1
            lo = job.spec.gang_min if config.elastic else job.spec.gpus
            room = self.room(job.team)
            if room is not None and room < lo:
                continue
            inflight = self.preempting.get(job.job_id)
            if inflight:
                self._reason(job, rs.preempting(inflight))
                continue
            fits = self._fits(job, lo)
            if config.elastic:
                cands = [st.jobs[j] for j in self.ridx.elastic
                         if j not in self.released and j not in self.shrunk and st.jobs[j].preemption is None
                         and extras(st.jobs[j]) > 0]
                cands.sort(key=lambda j: (-extras(j), j.job_id))
                plan = shrink_plan(cands, self.pool, fits)
                if plan is not None:
                    for victim, removed in plan:
                        self.out.append(ev.JobResized(at=self.now, job_id=victim.job_id, removed=removed,
                                                      reason=f"shrink to make room for {job.job_id}"))
                        self.pool.add(removed)
                        self._adjust(victim.team, -len(removed))
                        self.shrunk.add(victim.job_id)
                    self._outside = None
                    self._start_blocked(job, room)
                    continue
            if not config.preemption:
                continue
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
                self._reason(job, rs.preempting([v.job_id for v in victims]))

    def _victims(self, job: Job, need: int, fits) -> list[Job] | None:
        st, now, config = self.state, self.now, self.config
        jobs = st.jobs
        if job is self.head and config.borrow:
            due = self._due(job, need, fits)
            if due:
                return due
        rank = PRIORITY_RANK[job.spec.priority]
        under = config.fairshare and over_share(st, job.team, self.held(job.team)) < 0
        buckets = []
        for (team, r), bucket in self.ridx.preemptible.items():
            over = over_share(st, team, self.held(team) - self.leaving.get(team, 0))
            if (config.priority and r < rank) or (under and team != job.team and r <= rank and over > 0):
                buckets.append((-over, r, team, bucket))
        if not buckets:
            return None
        buckets.sort(key=lambda b: b[:3])
        # Candidates: teams furthest over their share first, oldest start first within a bucket
        # (the ones past `min_runtime_s`); enough of them to choose well from, not all.
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
                              self.leaving)

    def _due(self, job: Job, need: int, fits) -> list[Job] | None:
        """Backfilled preemptible jobs yield to the blocked head as soon as evicting them lets it
        start: they started ahead of it on the promise not to delay it, so neither priority nor
        `min_runtime_s` protects them (the fold's fairness rule still does). The head's start
        moves by at most the checkpoint grace."""
        st = self.state
        cands = [st.jobs[j] for j in self.ridx.borrowers
                 if j not in self.released and j not in self.inflight and j not in self.shrunk]
        if not cands:
            return None
        return choose_victims(st, self.pool, job, need, self.now, self.config, cands, self.held, fits,
                              self._scope(job), self.leaving)

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
            if (jid in self.released or jid in self.shrunk or job.preemption is not None
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
