"""Nothing that could use idle GPUs is waiting: elastic jobs grow into them."""

from __future__ import annotations

import functools

from ..elastic import grow_gpus
from ..plan import Context, CyclePlan
from ..pools import within_limits


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
        add = within_limits(st, job.team, grow_gpus(st, plan.pool, job, plan.room(job.team)),
                            functools.partial(plan.pool_held, job.team))
        if add:
            plan.grow(job, add)
