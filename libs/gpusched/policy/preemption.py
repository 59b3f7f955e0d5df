"""Whom to preempt for a blocked job: the smallest, cheapest, fairest victim set.

A running job is a candidate victim when it is preemptible, has run `min_runtime_s` since its
(re)start (anti-thrash), and is not already being preempted, shrunk or released. It may be taken
for the blocked job when

- it is of the blocked job's own team and of a lower priority class (priority orders work within
  a team), or
- (fair-share reclaim, like Kueue's reclaimWithinCohort) the blocked job's team is below its
  guaranteed share and the victim's team is above its own at that point of the set, whatever the
  two jobs' priority classes, provided the victim's team ends less far below its guarantee than
  the blocked job's team is now (each reclaim lowers the largest shortfall: no ping-pong of a
  big job between two teams near their guarantees), or the blocked job, started, stays within
  its team's guarantee (nothing can reclaim it back, and the hand-over gives it the GPUs: a
  guarantee is reclaimable even from a gang bigger than its owner's guarantee), or
- (`reclaim_to="share"`, opt-in) the victim's team holds more than its fair share
  (`fairshare.fair_shares`) and, as a fraction of it, more than the blocked job's team will
  once it starts (`fairshare.takes_share`), or
- (priority) it is of a lower priority class and the fold's fairness rule allows it, or
- (`las_preempt`, as Tiresias's 2D-LAS) it sits in a later least-attained-service queue than
  the blocked job, and is of the same team (with fair share: across teams only the fair-share
  rules preempt), or, without fair share, the fold's fairness rule allows it; such victims are
  taken from the latest queue first, only when the expected saving beats the victim's
  checkpoint and restore (`las_worth`), and (`las_backoff_max_s`) only once the victim has run
  `min_runtime_s * 2**preemptions` since its (re)start, at most that long.

Across teams (reclaim, or priority) preemption must converge:

- with fair share, the victim's team, once the victim is gone, still ranks strictly after the
  blocked job's team in the queue order (`fairshare.team_rank`, which holds no team name: a
  tie keeps the victim, and never depends on what the teams are called). Otherwise the victim's team would lead
  the next walk and take the freed GPUs straight back (often with the victim itself), and the
  blocked job would ask again: the same job preempted every `min_runtime_s`, each round
  costing a checkpoint and a restore. The same holds for borrowers yielding on demand (`due`).
- (`preempt_backoff_max_s`, `full`: one fair-share horizon, 1 h) the victim has run
  `min_runtime_s * 2**preemptions` since its (re)start, at most that long: a job taken over and
  over is left alone longer each time, up to the cap, which bounds both how often it is taken
  (once per cap at most, once there) and how long it shields a guarantee (docs/policy.md,
  "Preemptions").

With `preempt_predicted` (`full`), LAS, reclaim and a borrower's yielding also ask the run-time
predictions: a victim predicted to end before the blocked job would, by more than its checkpoint
and restore, is left to finish (`outlasts`). Priority classes never ask them.

Holdings are judged as they will be: the victim teams' less the GPUs already asked to yield
(`leaving`) and those taken earlier in the same set; the beneficiary team's plus the GPUs already
coming its way (`incoming`: claimed in-flight releases). The fold checks its rule with the
holdings at the moment a request is applied, which are never less favourable, so it never flags
`unfair_preemption`.

Candidates are taken teams-furthest-over-their-share first, then least work lost since the last
checkpoint, then biggest first (fewest victims); a victim from a team at or below its guarantee
only once the teams over theirs cannot supply. The set is then pruned of victims it does not
need, and among topology groups (one per node/rack/block when the job requires one) the set
taking least from teams at or below their guarantee, then the cheapest, wins.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from ..core import rules
from ..core.model import PRIORITY_RANK, TeamQuota
from ..core.pools import has_models
from ..core.state import ClusterState, Job
from .config import PolicyConfig
from .fairshare import over_share, standing, takes_share, team_rank
from .memo import GpuGroups
from .ordering import las_queue
from .placement import Pool
from .pools import pool_of_gpus
from .predict import Estimate
from .resources import hold, short_nodes

# The one definition of the work a job loses, re-exported for the policies that import it here.
work_since_checkpoint = rules.work_since_checkpoint

#: A job's predicted remaining run time as of the cycle's `now` (policy/predict.py).
Remaining = Callable[[Job], Estimate]
#: A team's GPUs of one pool as the cycle sees them: (held, asked to yield, claimed coming free).
PoolView = Callable[[str, str], tuple[float, float, int]]
#: GPUs a victim set takes, per team and per (team, GPU pool).
Drop = dict[Any, int]


def _quota(state: ClusterState, team: str) -> TeamQuota | None:
    t = state.teams.get(team)
    return t.quota if t is not None else None


def outlasts(victim: Estimate, job: Estimate, config: PolicyConfig, weights: tuple[int, int] = (1, 1)) -> bool:
    """Whether a victim predicted to run `victim.remaining_s` more is worth preempting for a job
    predicted to run `job.remaining_s` on the GPUs it frees: the exchange argument for two jobs
    and one set of GPUs, in the completion times mean JCT sums. Victim first, the two complete
    at v and v + j; the job first, at j and j + v + the victim's checkpoint and restore. The job
    goes first only if v > j + checkpoint + restore; `weights` (victim's, job's) weigh each
    completion, e.g. by the GPUs that wait with it. A victim whose prediction rests on no
    completed job (the Lindy guess) is taken as before: nothing says it ends soon."""
    if victim.samples == 0:
        return True
    wv, wj = weights
    return wj * victim.remaining_s > wv * (job.remaining_s + config.checkpoint_cost_s + config.restore_cost_s)


def back_off_s(v: Job, min_runtime_s: float, cap_s: float) -> float:
    """How long `v` must run since its (re)start before it may be taken again: `min_runtime_s`
    doubled per preemption it has had, at most `cap_s` (and never less than `min_runtime_s`)."""
    return min(max(min_runtime_s, cap_s), min_runtime_s * 2 ** min(v.preemptions, 32))


def too_young(v: Job, now: float, min_runtime_s: float) -> bool:
    """`v` is no victim yet: it has not run `min_runtime_s` since its (re)start, or it was
    granted at this very instant (with `min_runtime_s` 0 and free checkpoints, the tiresias
    preset's, a gang freed GPUs the jobs behind it took at once, then freed them again, time
    standing still). The cycle's candidates (`steps/victims`) and `show`'s count of what may be
    reclaimed (`policy/explain`) ask the same."""
    return v.started_at is not None and (now - v.started_at < min_runtime_s or v.started_at >= now)


def ran_back_off(v: Job, now: float, min_runtime_s: float, cap_s: float) -> bool:
    """Whether `v` has run its back-off (`back_off_s`) since its (re)start: a job taken over and
    over is left alone longer each time. A job not started has nothing to back off from."""
    if v.started_at is None:
        return True
    return now - v.started_at >= back_off_s(v, min_runtime_s, cap_s)


def las_worth(v: Job, attained: float, for_attained: float, now: float, config: PolicyConfig) -> bool:
    """Whether preempting `v` (attained `attained` GPU-seconds) for a job that attained
    `for_attained` is expected to save more than it costs. The saving is LAS's own premise
    (job sizes with a decreasing hazard rate: what a job attained estimates what it has left),
    so running the job first saves about the difference in attained GPU-seconds; the cost is
    the victim's GPUs idle while it saves and later restores its checkpoint
    (`checkpoint_cost_s`, `restore_cost_s`), plus, without the checkpoint handshake, the work
    it loses since its last checkpoint."""
    cost = len(v.gpus) * (config.checkpoint_cost_s + config.restore_cost_s)
    if not config.checkpoint:
        cost += work_since_checkpoint(v, now)
    return attained - for_attained > cost


@dataclass(frozen=True)
class VictimSearch:
    """One search for a blocked job's victims: what every candidate is weighed against."""

    state: ClusterState
    job: Job
    now: float
    config: PolicyConfig
    held: Callable[[str], float]  # GPUs per team as the cycle has them
    fits: Callable[[Pool], bool]  # whether the job fits on a pool (with the victims' GPUs back)
    leaving: dict[str, float] = field(default_factory=dict)  # GPUs per team already asked to yield
    incoming: dict[str, int] = field(default_factory=dict)  # GPUs per team coming free for its blocked jobs
    #: The candidates yield whatever their rank (borrowed reservations), subject only to the
    #: fold's rule and to the queue order (`_Rule.keeps_order`).
    due: bool = False
    #: Predicted remaining run times, for LAS, reclaim and borrowers (`preempt_predicted`).
    left: Remaining | None = None
    #: A team's GPUs on one GPU pool as the cycle sees them (`CyclePlan.pool_view`), for the
    #: teams whose per-model terms judge a victim on its pool (None: totals only).
    pool_view: PoolView | None = None
    #: The job's team, if below its guarantee, may reclaim now (`QueueIndex.owed`, fairness
    #: over a horizon; always without `fair_owed_after_s`).
    owed: bool = True
    #: With `reclaim_to="share"`: each team's fair share now (`QueueIndex.fair_shares`).
    shares: Mapping[str, float] | None = None


def choose_victims(search: VictimSearch, pool: Pool, need: int, candidates: list[Job],
                   scope: GpuGroups | None) -> list[Job] | None:
    """The victims to preempt so that the job fits (`search.fits(pool)` after their GPUs
    return), or None. `candidates` are already filtered for preemptibility and runtime; `scope`:
    the GPUs' groups at the job's required topology level (None: the whole cluster). `pool` may
    include GPUs already coming free (in-flight preemptions). Within a group, free GPUs plus
    victims' GPUs are counted (exact at every level but a partial NVLink domain); only the
    cheapest groups' sets are checked with a real placement."""
    state, now, config = search.state, search.now, search.config
    if not candidates:
        return None
    # First, cheaply: can any group free enough at all? (Most searches end here.)
    base, spread, totals = _group_counts(pool, candidates, scope)
    feasible = {key for key, t in totals.items() if t + base.get(key, 0) >= need}
    if not feasible:
        return None
    # Then: can any group free enough from the candidates the rules admit at all? Taking more
    # from a team never makes another of its jobs admissible (`_Rule.admits` is monotone in the
    # set), so one refused with nothing taken from its team is in no set: left out, it changes
    # no set, and most searches end here, before anything is sorted. Predictions cost most and
    # only ever refuse: the rules are asked first without them (`_Rule.hopeful`).
    rule = _Rule(search)
    within = [(v, per) for v, per in zip(candidates, spread) if not feasible.isdisjoint(per)]
    passes: list[Callable[[Job], bool]] = [lambda v: rule.admits(v, {})[0]]
    if rule.left is not None:
        passes.insert(0, rule.hopeful)
    for admit in passes:
        within = [(v, per) for v, per in within if admit(v)]
        reach: dict[object, int] = {}  # those candidates' GPUs per group
        for _, per in within:
            for key, k in per.items():
                reach[key] = reach.get(key, 0) + k
        feasible = {key for key in feasible if reach.get(key, 0) + base.get(key, 0) >= need}
        if not feasible:
            return None
        within = [(v, per) for v, per in within if not feasible.isdisjoint(per)]
    # Only the candidates with GPUs in a feasible group are weighed (the same order, fewer to sort).
    within = [(v, per if per.keys() <= feasible else {key: k for key, k in per.items() if key in feasible})
              for v, per in within]
    lost: dict[str, float] = {}  # work each loses since its last checkpoint
    groups: dict[object, list[tuple[Job, int]]] = {}  # per feasible group, its candidates in order
    for v, per in _in_order(state, within, now, config, search.held, search.leaving, lost):
        for key, k in per.items():
            groups.setdefault(key, []).append((v, k))
    options = []
    for key, group in groups.items():
        got = _greedy(rule, group, need - base.get(key, 0), lost)
        if got is not None:
            chosen, protected = got
            options.append(((protected, sum(lost[v.job_id] for v in chosen), len(chosen),
                             sum(len(v.gpus) for v in chosen), [v.job_id for v in chosen]), chosen))
    options.sort(key=lambda o: o[0])
    for _, chosen in options[:4]:
        hyp = pool.copy()
        for v in chosen:
            hyp.add(v.gpus)
            hold(hyp, v.spec, v.gpus, -1)
        if search.fits(hyp):
            return chosen
    return None


def choose_cpu_victims(search: VictimSearch, pool: Pool, candidates: list[Job]) -> list[Job] | None:
    """The victims for a job whose GPUs fit but whose CPUs or memory do not (`resources`): the
    candidates holding GPUs on the nodes short of them, in the candidates' order and under the
    same rules as `choose_victims`, until `search.fits` holds with their GPUs, CPUs and memory back."""
    rule = _Rule(search)
    short = set(short_nodes(pool, search.job.spec))
    hyp = pool.copy()
    drop: Drop = {}
    chosen: list[Job] = []
    for v in candidates:
        if short.isdisjoint(g.rpartition("/")[0] for g in v.gpus):
            continue
        ok, _ = rule.admits(v, drop)
        if not ok:
            continue
        chosen.append(v)
        rule.take(v, drop)
        hyp.add(v.gpus)
        hold(hyp, v.spec, v.gpus, -1)
        if search.fits(hyp):
            return chosen
    return None


def _in_order(state: ClusterState, within: list[tuple[Job, dict[object, int]]], now: float, config: PolicyConfig,
              held: Callable[[str], float], leaving: dict[str, float],
              lost: dict[str, float]) -> list[tuple[Job, dict[object, int]]]:
    """The candidates in the order they are taken (see the module docstring): teams furthest
    over their share first, then (`las_preempt`) the latest LAS queue, then least work lost
    (recorded in `lost`), then biggest; the job id breaks ties."""
    over: dict[str, float] = {}
    keyed = []
    for v, per in within:
        team = v.spec.team
        o = over.get(team)
        if o is None:
            o = over[team] = over_share(state, team, held(team) - leaving.get(team, 0))
        w = lost[v.job_id] = work_since_checkpoint(v, now)
        level = -las_queue(v.attained_gpu_s(now), config) if config.las_preempt else 0.0
        keyed.append(((-o, level, w, -len(v.gpus), v.job_id), v, per))
    keyed.sort(key=itemgetter(0))
    return [(v, per) for _, v, per in keyed]


def _group_counts(pool: Pool, candidates: list[Job], scope: GpuGroups | None,
                  ) -> tuple[dict[object, int], list[dict[object, int]], dict[object, int]]:
    """Free GPUs per topology group, each candidate's GPUs per group (in the candidates'
    order), and all the candidates' GPUs per group: the feasibility test and the groups'
    victim lists read the same counts."""
    if scope is None:
        return ({None: pool.count}, [{None: len(v.gpus)} for v in candidates],
                {None: sum(len(v.gpus) for v in candidates)})
    spread = [scope.spread(v) for v in candidates]
    totals: dict[object, int] = {}
    for per in spread:
        for key, k in per.items():
            totals[key] = totals.get(key, 0) + k
    cnt, names = pool.node_counts(), pool.topo.names
    if scope.by_node:  # a group is a node: only the nodes the candidates hold GPUs on matter
        index = pool.topo.index
        return {key: k for key in totals if (k := cnt[index[key]]) > 0}, spread, totals  # type: ignore[index]
    base: dict[object, int] = {}
    for i, k in enumerate(cnt):
        if k > 0:
            key = scope.of_node[names[i]]
            base[key] = base.get(key, 0) + k
    return base, spread, totals


class _Rule:
    """May this victim be taken for the job, given what the set already takes from its team?"""

    def __init__(self, search: VictimSearch) -> None:
        state, job, config, held, incoming = search.state, search.job, search.config, search.held, search.incoming
        self.state, self.job, self.held, self.leaving, self.due = state, job, held, search.leaving, search.due
        self.pool_view = search.pool_view
        self.pooled = search.pool_view is not None and has_models(_quota(state, job.spec.team))
        self.config, self.now = config, search.now
        self.rank = PRIORITY_RANK[job.spec.priority]
        self.priority = config.priority
        self.team = job.spec.team
        self.for_held = held(self.team) + incoming.get(self.team, 0)
        self.owed = search.owed
        self.shares = search.shares
        quota = _quota(state, self.team)
        # The job, started, leaves its team within its guarantee: nothing can reclaim those
        # GPUs from it, and what its victims free is handed to it (`steps/handover`).
        self.within = quota is not None and self.for_held + job.spec.gang_min <= quota.guaranteed
        self._for_rank: tuple | None = None
        self.las_level = las_queue(job.service_gpu_s, config) if config.las_preempt and config.las else None
        self.left = search.left
        self._for_left: Estimate | None = None
        self._alone: dict[str, tuple[bool, bool, bool]] = {}  # job -> `_verdict` with nothing taken from its team
        self._outlasts: dict[str, bool] = {}  # job -> `outlasts`
        self._after: dict[tuple[str, float], bool] = {}  # (team, holding) -> `keeps_order` on totals
        self._by_pool: dict[str, bool] = {}  # team -> judged on its GPU pool (`judged_pool`)
        self._for_standing: rules.Standing | None = None  # the job's team's on totals

    def hopeful(self, v: Job) -> bool:
        """Whether `admits` may take `v` with nothing taken from its team if its prediction says
        so: one refused here is refused there, without a prediction asked."""
        outright, if_outlasts, _ = self._verdict_alone(v)
        return outright or if_outlasts

    def outlasts(self, v: Job) -> bool:
        """With predictions (`preempt_predicted`), whether `v` is predicted to outlast the job by
        more than its checkpoint and restore (`outlasts`); without, always."""
        if self.left is None:
            return True
        got = self._outlasts.get(v.job_id)
        if got is None:
            if self._for_left is None:
                self._for_left = self.left(self.job)
            # a borrower (`due`) and the head are weighed by their gangs: the head's whole reserved set waits with it
            weights = (len(v.gpus), self.job.spec.gpus) if self.due else (1, 1)
            got = self._outlasts[v.job_id] = outlasts(self.left(v), self._for_left, self.config, weights)
        return got

    def las_after(self, v: Job) -> bool:
        """With `las_preempt`: `v` sits in a later LAS queue than the job (it attained more), and
        taking it is worth its checkpoint and restore (`las_worth`). With predictions, `admits`
        also asks `outlasts` (attained service alone takes long-running jobs near their end),
        last: a prediction costs more than every other test."""
        if self.las_level is None:
            return False
        attained = v.attained_gpu_s(self.now)
        return (las_queue(attained, self.config) > self.las_level
                and las_worth(v, attained, self.job.service_gpu_s, self.now, self.config))

    def backed_off(self, v: Job, cap_s: float | None = None) -> bool:
        """Whether `v` has run its back-off since its (re)start: `min_runtime_s` doubled per
        preemption it has had, at most `cap_s` (default `preempt_backoff_max_s`; None: no
        back-off, the candidates already ran `min_runtime_s`)."""
        cap_s = self.config.preempt_backoff_max_s if cap_s is None else cap_s
        return cap_s is None or ran_back_off(v, self.now, self.config.min_runtime_s, cap_s)

    def keeps_order(self, team: str, after: float, on: tuple[rules.Standing, rules.Standing] | None = None) -> bool:
        """With fair share, whether the victim's team, holding `after` once the victim is gone,
        still ranks after the job's team (`fairshare.team_rank`, as the queue is ordered).
        Otherwise the freed GPUs go to the victim's team, whose jobs now come first in the next
        walk (the victim itself, requeued, among them), not to the job, and the job asks again:
        a job preempted every `min_runtime_s` for another team each round (Philly week, 194
        times), or, where borrowers are evicted on demand and checkpoints take no time, a
        livelock within one instant.

        Names never decide: the ranks hold none (a team further below its guarantee in GPUs
        ranks first at an equal fraction of it), and an exact tie keeps the victim: the queue
        would order the two teams by their head jobs, and the victim, requeued with its
        original submission time, may well lead.

        `on`: (the victim's team's standing once the victim is gone, the job's team's) on the
        victim's GPU pool, where per-model terms judge (`standings`): the ranks then compare
        per-model guarantees, and the hand-over gives the freed GPUs to the job
        (`steps/handover`), so the victim's team does not take them back."""
        if not self.config.fairshare or team == self.team:
            return True
        st, config = self.state, self.config
        if on is not None:
            return (team_rank(st, team, after, st.team_usage(team, self.now), config, on[0])
                    > team_rank(st, self.team, self.for_held, st.team_usage(self.team, self.now), config, on[1],
                                owed=self.owed))
        if self._for_rank is None:
            self._for_rank = team_rank(st, self.team, self.for_held, st.team_usage(self.team, self.now), config,
                                       owed=self.owed)
        # the victim's team as if owed: if it would then lead, the freed GPUs may go back to it
        got = self._after.get((team, after))
        if got is None:  # the same for every victim of that team and size
            got = self._after[(team, after)] = (team_rank(st, team, after, st.team_usage(team, self.now), config)
                                                > self._for_rank)
        return got

    def victim_held(self, team: str, drop: Drop) -> float:
        return self.held(team) - self.leaving.get(team, 0) - drop.get(team, 0)

    def take(self, v: Job, drop: Drop) -> None:
        """Count `v` in the set: its team gives up its GPUs (per pool too)."""
        drop[v.spec.team] = drop.get(v.spec.team, 0) + len(v.gpus)
        for pool, n in pool_of_gpus(self.state, v.gpus).items():
            drop[(v.spec.team, pool)] = drop.get((v.spec.team, pool), 0) + n

    def judged_pool(self, v: Job) -> str | None:
        """The GPU pool `v` is judged on: its one pool where the job's or the victim's team has
        per-model terms (None: the teams' totals, as before pools)."""
        if self.pool_view is None:
            return None
        team = v.spec.team
        by_pool = self._by_pool.get(team)
        if by_pool is None:
            by_pool = self._by_pool[team] = self.pooled or has_models(_quota(self.state, team))
        return rules.pool_of(self.state, v.gpus) if by_pool else None

    def standings(self, v: Job, drop: Drop) -> tuple[rules.Standing, rules.Standing, float]:
        """(the victim's team's standing before `v` is taken, the job's team's, the victim's
        team's total holding) as the set sees them (`fairshare.standing`)."""
        st, team = self.state, v.spec.team
        vh = self.victim_held(team, drop)
        pool = self.judged_pool(v)
        if pool is None:
            if self._for_standing is None:
                self._for_standing = standing(st, self.team, self.for_held)
            return standing(st, team, vh), self._for_standing, vh
        assert self.pool_view is not None
        held, leaving, _ = self.pool_view(team, pool)
        f_held, _, f_incoming = self.pool_view(self.team, pool)
        return (standing(st, team, vh, pool, held - leaving - drop.get((team, pool), 0)),
                standing(st, self.team, self.for_held, pool, f_held + f_incoming), vh)

    def lower(self, v: Job, las_allowed: bool) -> tuple[bool, bool]:
        """(`v` ranks below the job outright: a lower priority class; it does if it is predicted
        to outlast the job: where LAS may preempt (`las_allowed`), a later LAS queue
        (`las_after`, backed off as LAS alone decides))."""
        if self.priority and PRIORITY_RANK[v.spec.priority] < self.rank:
            return True, False
        las = las_allowed and self.las_after(v)
        if las and self.config.las_backoff_max_s is not None:
            las = self.backed_off(v, self.config.las_backoff_max_s)  # LAS alone: anti-thrash
        return False, las

    def admits(self, v: Job, drop: Drop) -> tuple[bool, bool]:
        """(may take it, its team is at or below its guarantee before it is taken), given what
        the set already takes (`drop`). Guarantees are judged on the victim's GPU pool where
        per-model terms apply (`standings`), else on the teams' totals. It reads `drop` only for
        the victim's team, and taking more from that team only lowers its standing (and its rank,
        `keeps_order`): a victim refused with nothing taken from its team is refused in every set.
        The answer with nothing taken from the team is the common one, and is remembered."""
        outright, if_outlasts, at_or_under = self._verdict(v, drop) if v.spec.team in drop else self._verdict_alone(v)
        return outright or (if_outlasts and self.outlasts(v)), at_or_under

    def _verdict_alone(self, v: Job) -> tuple[bool, bool, bool]:
        got = self._alone.get(v.job_id)
        if got is None:
            got = self._alone[v.job_id] = self._verdict(v, {})
        return got

    def _verdict(self, v: Job, drop: Drop) -> tuple[bool, bool, bool]:
        """`admits` before any prediction is asked: (may take it outright, may take it if it is
        predicted to outlast the job (`outlasts`), its team is at or below its guarantee).
        Predictions cost most, and only ever refuse: `choose_victims` prunes on this alone."""
        team = v.spec.team
        if team == self.team and not self.due:
            # Within a team the fold's rule always allows, and no guarantee protects: the ranks decide.
            return *self.lower(v, True), False
        vs, fs, vh = self.standings(v, drop)
        at_or_under = vs[0] <= vs[1]
        if not rules.fair_between(team, vs, self.team, fs):
            return False, False, at_or_under
        n = len(v.gpus)
        on = None if self.judged_pool(v) is None else ((vs[0] - n, vs[1]), fs)
        if self.due:
            return False, self.keeps_order(team, vh - n, on), at_or_under
        # LAS preempts within a team's entitlement; across teams only the fair-share rules do.
        by_class, las = self.lower(v, not self.config.fairshare)
        # Reclaim, whatever the priorities: from a team over its share, and only if that team
        # ends less far below its guarantee than the reclaiming team is now (every reclaim then
        # lowers the largest shortfall, so reclaims never ping-pong between two teams), or the
        # job, started, stays within its team's guarantee (`within`): then no reclaim can take
        # its GPUs back, whatever the victim's team's shortfall; else a gang bigger than its
        # owner's guarantee could borrow another team's guarantee for good.
        under = self.config.fairshare and fs[0] < fs[1] and self.owed
        owned = self.within and on is None  # (per-model terms judge on the pool: the shortfall rule)
        reclaim = under and not at_or_under and (vs[0] - n - vs[1] > fs[0] - fs[1] or owned)
        if not reclaim and self.shares is not None and on is None and self.config.fairshare:
            reclaim = takes_share(self.shares, self.team, self.for_held + self.job.spec.gang_min, team, vh)
        if not (by_class or las or reclaim):
            return False, False, at_or_under
        # Hysteresis across teams: never preempt what the victim's team would win straight back
        # (a job within its guarantee gets what it reclaimed: the hand-over), and, if
        # configured, leave a job taken over and over alone longer each time.
        if not (self.backed_off(v) and ((reclaim and owned) or self.keeps_order(team, vh - n, on))):
            return False, False, at_or_under
        # With predictions, a victim predicted to end first is left to finish: its GPUs come
        # back before the reclaiming job, started now, would have ended.
        return by_class, las or reclaim, at_or_under


def admitted(search: VictimSearch, v: Job, gone: list[Job]) -> bool:
    """Whether the rules let `v` be taken for the search's job once the jobs `gone` gave up their
    GPUs (counted as a set already taken: their teams' holdings without them)."""
    rule = _Rule(search)
    drop: Drop = {}
    for g in gone:
        rule.take(g, drop)
    return rule.admits(v, drop)[0]


def takeable(search: VictimSearch, candidates: list[Job]) -> list[Job]:
    """The candidates one victim set may take for the search's job, wherever their GPUs lie:
    in the order sets take them (`_in_order`), those of teams at or below their guarantee last
    (`_greedy`), each judged with the ones before it gone (taking from a team lowers its
    standing: the rules may refuse its next job). What `show` counts as reclaimable
    (`policy.explain`), by the rules themselves, not a second copy of them."""
    rule = _Rule(search)
    drop: Drop = {}
    taken: list[Job] = []
    later: list[Job] = []
    within: list[tuple[Job, dict[object, int]]] = [(v, {}) for v in candidates]
    for v, _ in _in_order(search.state, within, search.now, search.config, search.held, search.leaving, {}):
        ok, protected = rule.admits(v, drop)
        if ok and protected:
            later.append(v)
        elif ok:
            taken.append(v)
            rule.take(v, drop)
    for v in later:
        if rule.admits(v, drop)[0]:
            taken.append(v)
            rule.take(v, drop)
    return taken


def _greedy(rule: _Rule, group: list[tuple[Job, int]], want: int, lost) -> tuple[list[Job], int] | None:
    """Take victims in order until they free `want` GPUs in the group, never one the rules
    forbid; victims of teams at or below their guarantee only after every other candidate; then
    drop the ones the set does not need, the most expensive first. Returns (victims, GPUs taken
    from teams at or below their guarantee)."""
    if want <= 0:
        return None  # it fits already: not a preemption question
    drop: Drop = {}  # GPUs each victim team gives up in this set (and per pool)
    chosen: list[tuple[Job, int, bool]] = []
    freed = 0
    later: list[tuple[Job, int]] = []
    for v, k in group:
        ok, protected = rule.admits(v, drop)
        if not ok:
            continue
        if protected:
            later.append((v, k))  # only if the teams over their share cannot supply
            continue
        chosen.append((v, k, False))
        rule.take(v, drop)
        freed += k
        if freed >= want:
            break
    if freed < want:
        for v, k in later:
            ok, protected = rule.admits(v, drop)
            if not ok:
                continue
            chosen.append((v, k, protected))
            rule.take(v, drop)
            freed += k
            if freed >= want:
                break
        else:
            return None
    for v, k, _ in sorted(chosen, key=lambda c: (c[2], lost[c[0].job_id]), reverse=True):
        if len(chosen) > 1 and freed - k >= want:
            chosen = [c for c in chosen if c[0] is not v]
            freed -= k
    return [v for v, _, _ in chosen], sum(len(v.gpus) for v, _, p in chosen if p)
