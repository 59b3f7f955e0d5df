"""Nothing that could use idle GPUs is waiting: elastic jobs grow into them."""

from __future__ import annotations

from ..elastic import grow_gpus
from ..plan import Context, CyclePlan


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
        add = plan.within_model_limits(job.team, grow_gpus(st, plan.pool, job, plan.room(job.team)))
        if add:
            plan.grow(job, add)
