"""Nothing that could use idle GPUs is waiting: elastic jobs grow into them."""

from __future__ import annotations

import functools

from ...core.pools import canonical_model
from ...core.state import Job
from ..elastic import grow_gpus
from ..eligibility import restrict
from ..placement import Pool
from ..plan import Context, CyclePlan
from ..pools import pools, restrict_to, within_limits


def run(plan: CyclePlan, ctx: Context) -> None:
    if plan.blocked:
        return
    st = ctx.state
    for jid in ctx.running.elastic:
        if plan.pool.count <= 0:
            break
        job = st.jobs[jid]
        if not plan.touchable(job) or len(job.gpus) >= job.spec.gpus:
            continue
        add = within_limits(st, job.team, grow_gpus(st, _where(plan.pool, job, ctx.now), job, plan.room(job.team)),
                            functools.partial(plan.pool_held, job.team))
        if add:
            plan.grow(job, add)


def _where(pool: Pool, job: Job, now: float) -> Pool:
    """The idle GPUs the job may grow into: those its own placement could have chosen (its GPU
    type and labels, clear of maintenance windows), on the pool of the GPUs it holds (a gang
    lives on one GPU model)."""
    st = pool.state
    pool = restrict(pool, job.spec, now)
    if len(pools(st, pool.topo)) > 1 and job.gpus:
        pool = restrict_to(pool, (None, canonical_model(st.gpus[job.gpus[0]].model)))
    return pool
