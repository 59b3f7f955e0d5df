"""Which running jobs to preempt for a blocked job, as this cycle sees them: the candidates
(`victims`), the borrowers due to yield to the head (`due`, `yields`), and the topology groups a victim
set must fall in (`scope`). The choice among candidates is `preemption.choose_victims`."""

from __future__ import annotations

from collections.abc import Callable

from ...core.model import PRIORITY_RANK
from ...core.pools import has_models
from ...core.reasons import NoFreeCpuMem
from ...core.state import Job
from ..fairshare import may_preempt, over_share, takes_share
from ..memo import GpuGroups
from ..ordering import las_queue
from ..placement import Pool
from ..plan import Context, CyclePlan
from ..pools import choices, pool_of_gpus
from ..predict import Estimate
from ..preemption import Remaining, VictimSearch, admitted, choose_cpu_victims, choose_victims, too_young

#: How many candidate victims a preemption decision chooses from (bounds its cost).
VICTIM_POOL = 48


def victims(plan: CyclePlan, ctx: Context, job: Job, need: int, fits: Callable[[Pool], bool]) -> list[Job] | None:
    st, now, config = ctx.state, ctx.now, ctx.config
    if job is plan.head and config.borrow:
        chosen = due(plan, ctx, job, need, fits)
        if chosen:
            return chosen
    # The set is chosen so that the job fits on free GPUs plus its own victims: GPUs coming
    # free for other jobs serve only jobs they cover entirely (`reclaim._claim`), as a job that
    # topped up scattered leftovers with victims elsewhere would span needlessly wide.
    want = max(1, need - plan.pool.count)
    mine = _las_level(ctx, job)
    if mine is not None and ctx.indexes.las_levels(st, now, config).gpus_above(mine) < want:
        return None  # the jobs of later LAS queues, candidates or not, hold too few GPUs
    buckets = _buckets(plan, ctx, job)
    if not buckets:
        return None
    useful = useful_pools(plan, ctx, job)
    # Candidates: teams furthest over their share first, oldest start first within a bucket
    # (the ones past `min_runtime_s`); enough of them to choose well from, not all.
    cands: list[Job] = []
    gathered = 0
    for bucket in buckets:
        for jid in bucket:
            v = st.jobs[jid]
            if too_young(v, now, config.min_runtime_s):
                break  # start order: the rest are younger still
            if not plan.touchable(v) or (mine is not None and las_queue(v.attained_gpu_s(now), config) <= mine):
                continue
            if useful is not None and useful.isdisjoint(pool_of_gpus(st, v.gpus)):
                continue  # its GPUs are on pools the job is not tried on: taking it frees nothing for it
            cands.append(v)
            gathered += len(v.gpus)
            if len(cands) >= VICTIM_POOL and gathered >= 2 * want:
                break
        if len(cands) >= VICTIM_POOL and gathered >= 2 * want:
            break
    if gathered < want:
        return None
    search = VictimSearch(st, job, now, config, plan.held, fits, plan.leaving, plan.incoming, left=remaining(ctx),
                          pool_view=plan.pool_view, owed=owed(ctx, job.team), shares=ctx.indexes.reclaim_shares(st, config))
    if isinstance(plan.reason_of(job), NoFreeCpuMem):  # its GPUs fit: victims that free CPUs or memory
        return choose_cpu_victims(search, plan.pool, cands)
    return choose_victims(search, plan.pool, need, cands, scope(ctx, job))


def owed(ctx: Context, team: str) -> bool:
    """Whether `team`, if below its guarantee, may reclaim now (`QueueIndex.owed`)."""
    return ctx.config.fair_owed_after_s is None or ctx.indexes.queue(ctx.state, ctx.config).owed(team, ctx.now)


def remaining(ctx: Context, at: float | None = None) -> Remaining | None:
    """With `preempt_predicted`, a job's predicted remaining run time at `now` (or `at`; policy/predict.py:
    the median of what is left of the run times of completed jobs like it that ran longer than
    it already has); else None. Each answer is asked once a cycle (`Context.estimates`): a
    borrower or a victim is weighed again for every blocked job the cycle searches for."""
    if not ctx.config.preempt_predicted:
        return None
    predictor, now = ctx.indexes.predictor(ctx.state), ctx.now if at is None else at
    memo = ctx.estimates

    def left(job: Job) -> Estimate:
        key = (job.job_id, now)
        got = memo.get(key)
        if got is None:
            got = memo[key] = predictor.estimate(job, now)
        return got
    return left


def _las_level(ctx: Context, job: Job) -> float | None:
    """With `las_preempt` (and no priority classes to go by), only jobs of a later LAS queue
    than `job`'s (returned) are candidates; else None."""
    config = ctx.config
    if not (config.las and config.las_preempt) or config.priority:
        return None
    return las_queue(job.service_gpu_s, config)


def _buckets(plan: CyclePlan, ctx: Context, job: Job) -> list[dict[str, None]]:
    """Buckets of preemptible running jobs (by team and priority) that may give to `job`, teams
    furthest over their share first: of its own team, lower priority; of another team, reclaim
    (any priority) from a team over its share (with `reclaim_to="share"`, also from a team
    further over its fair share than the job's team will be: `fairshare.takes_share`), or
    priority, fairly. Where per-model terms judge
    (either team has them), a team's totals say nothing of its standing on one pool: its
    buckets are all candidates, and the rule judges each victim on its pool (`preemption._Rule`)."""
    st, config = ctx.state, ctx.config
    rank = PRIORITY_RANK[job.spec.priority]
    for_held = plan.held(job.team) + plan.incoming.get(job.team, 0)
    under = config.fairshare and over_share(st, job.team, for_held) < 0 and owed(ctx, job.team)
    pooled = _pooled(st, job.team)
    las = config.las and config.las_preempt  # judged per job (`_Rule.las_after`)
    las_across = las and not config.fairshare  # with fair share, LAS never preempts across teams
    entitled = ctx.indexes.reclaim_shares(st, config)
    found = []
    # Per team, once for all its buckets: (GPUs it holds less those leaving, over its share,
    # may give whatever the classes), and whether the fold's rule lets it give to the job's team.
    shares: dict[str, tuple[float, float, bool]] = {}
    fair: dict[str, bool] = {}
    for (team, r), bucket in ctx.running.preemptible.items():
        if not bucket:
            continue  # nothing to take
        share = shares.get(team)
        if share is None:
            vh = plan.held(team) - plan.leaving.get(team, 0)
            over = over_share(st, team, vh)
            gives = pooled or _pooled(st, team) or (under and over > 0)
            if entitled is not None and not gives and team != job.team:
                gives = takes_share(entitled, job.team, for_held + job.spec.gang_min, team, vh)
            share = shares[team] = (vh, over, gives)
        vh, over, gives = share
        lower = config.priority and r < rank
        if team == job.team:
            ok = lower or las
        else:
            ok = gives
            if not ok and (lower or las_across):
                if team not in fair:
                    fair[team] = may_preempt(st, team, vh, job.team, for_held)
                ok = fair[team]
        if ok:
            found.append((-over, r, next(iter(bucket), ""), bucket))
    found.sort(key=lambda b: b[:3])  # equal buckets: by their oldest job's id, never by team name
    return [b[3] for b in found]


def useful_pools(plan: CyclePlan, ctx: Context, job: Job) -> set[str] | None:
    """The GPU pools a job placed on pools (`pools.choices`) is tried on: a victim holding
    nothing there frees nothing for it (None: the job is placed as before pools)."""
    order = choices(ctx.state, job.spec, lambda p: plan.pool_held(job.team, p), topo=plan.pool.topo)
    return None if order is None else {p for _, p in order}


def _pooled(st, team: str) -> bool:
    t = st.teams.get(team)
    return t is not None and has_models(t.quota)


def due(plan: CyclePlan, ctx: Context, job: Job, need: int, fits: Callable[[Pool], bool]) -> list[Job] | None:
    """Backfilled preemptible jobs yield to the blocked head as soon as evicting them lets it
    start: they started ahead of it on the promise not to delay it, so neither priority nor
    `min_runtime_s` protects them (the fold's fairness rule still does). The head's start
    moves by at most the checkpoint grace (none where the set was already due when they
    started: then they may not borrow it, see `reservation.due_soon`).

    One thing does protect them: the eviction must leave the borrower's team ranked after
    the head's (`preemption._Rule.keeps_order`). The head is whoever leads the queue this
    cycle; a borrower pushed its team down the order when it started, and evicting it may
    lift that team back above the head's. Its jobs would then lead the next walk and take
    the freed GPUs (another borrow, or a start ahead of the head), that team would sink
    again, this head lead again and evict again: a livelock within one instant where
    checkpoints take no time (Philly week, ideal runtime, t=340549 s).

    With `preempt_predicted`, a borrower is asked to yield only if it is predicted to outlast
    the head (`preemption.outlasts`), each weighted by its gang: while the head waits, its whole
    reserved set waits with it (no one may borrow a set that is due), so the head's wait costs
    its GPUs x the borrower's remaining run time, the eviction the borrower's GPUs x (the head's
    run + checkpoint + restore). The prediction grows as the borrower runs (run times are
    heavy-tailed), so one that overstays its prediction is asked later."""
    st = ctx.state
    useful = useful_pools(plan, ctx, job)
    cands = [v for j in ctx.running.borrowers if _due_candidate(plan, ctx, useful, v := st.jobs[j])]
    if not cands:
        return None
    # The head's reservation already counts GPUs in flight: so does its claim on borrowers. A
    # borrower predicted to end first is left to finish (`_Rule.outlasts`, asked last: only of
    # the borrowers a set would take).
    coming = plan.coming if plan.coming is not None else plan.pool
    return choose_victims(_due_search(plan, ctx, job, fits), coming, need, cands, scope(ctx, job))


def yields(plan: CyclePlan, ctx: Context, head: Job, borrower: Job, gone: list[Job], at: float) -> bool:
    """Whether `due` would ask `borrower` to yield to the head at `at`, once the jobs `gone` (the
    rest of the head's set) gave up their GPUs, as far as now knows (teams' holdings as now less
    `gone`, predictions as now, aged to `at`): the head's ETA counts a borrower it would leave
    (its team would lead the next walk, or it is predicted to end first) at its own end
    (`reservation.freed_at`)."""
    config = ctx.config
    if not (config.preemption and config.borrow) or not _due_candidate(plan, ctx, useful_pools(plan, ctx, head),
                                                                        borrower):
        return False
    return admitted(_due_search(plan, ctx, head, lambda _: True, at), borrower, gone)


def _due_candidate(plan: CyclePlan, ctx: Context, useful: set[str] | None, v: Job) -> bool:
    """A borrower `due` may ask: not settled this cycle, on a pool the head is tried on."""
    return plan.touchable(v) and (useful is None or not useful.isdisjoint(pool_of_gpus(ctx.state, v.gpus)))


def _due_search(plan: CyclePlan, ctx: Context, head: Job, fits: Callable[[Pool], bool],
                at: float | None = None) -> VictimSearch:
    """The search `due` makes for the head now (or, `yields`, as it would at `at`)."""
    at = ctx.now if at is None else at
    return VictimSearch(ctx.state, head, at, ctx.config, plan.held, fits, plan.leaving, plan.incoming, due=True,
                        left=remaining(ctx, at), pool_view=plan.pool_view, owed=owed(ctx, head.team))


def scope(ctx: Context, job: Job) -> GpuGroups | None:
    """The GPUs' groups at the job's required level (None: the whole cluster)."""
    required = job.spec.topology.required
    if required == "cluster":
        return None
    return ctx.indexes.gpu_groups(ctx.state, "node" if required == "nvlink" else required)
