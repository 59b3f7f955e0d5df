"""A blocked head that must run within one node, while enough GPUs are free but scattered over
partly busy nodes: move a few small jobs off the node nearest to fitting it, onto free GPUs
elsewhere, and hand the node to the head (as KAI Scheduler's consolidation action).

Why: small jobs fill every GPU that frees, so a node rarely drains by itself; the head's
reservation protects one node, but its holders are the oldest jobs (the ones with the most left
to run), and the head mostly starts by preempting a job as big as itself, which then waits as
long for a node again (docs/policy.md, "Node-sized gangs"). A moved job loses a checkpoint and
a restore and restarts at once on GPUs that would otherwise idle.

A move is a preemption for the head (`for_job` is the head, so the hand-over gives it the node
once the movers release), bound by every rule a preemption is: the victim is preemptible, past
its back-off (`min_runtime_s` doubled per preemption, capped by `preempt_backoff_max_s`), of a
priority class no higher than the head's, and the fold's fairness rule holds. A node is chosen
only if its movers fit together on the free GPUs off it, each at its own required level.
"""

from __future__ import annotations

from ...core.model import PRIORITY_RANK
from ...core.state import Job
from ..eligibility import constrained
from ..plan import Context, CyclePlan
from ..preemption import ran_back_off
from ..resources import hold
from .reservation import due_soon, head_reservation


def run(plan: CyclePlan, ctx: Context) -> None:
    head = plan.head
    if head is None or head.job_id in plan.preempting or constrained(head.spec) or ctx.state.windows:
        return
    lo = ctx.floor(head)
    if head.spec.topology.required not in ("nvlink", "node") or lo > plan.pool.count:
        return
    res = head_reservation(plan, ctx)
    if res is None or due_soon(res, ctx):
        return  # it can never fit, or its set comes free within a grace anyway
    movers = _cheapest_node(plan, ctx, head, lo)
    for v in movers or ():
        plan.request_preemption(v, head, f"moved to make room for {head.job_id} (one node, {lo} GPUs)")


def _cheapest_node(plan: CyclePlan, ctx: Context, head: Job, lo: int) -> list[Job] | None:
    """The movers of the node that needs the fewest GPUs moved to hold the head (then the
    lowest node index), or None."""
    pool, topo = plan.pool, plan.pool.topo
    counts = pool.node_counts()
    order = sorted((lo - k, i) for i, k in enumerate(counts) if 0 < k < lo and len(topo.nodes[topo.names[i]].gpus) >= lo)
    for _, i in order:
        movers = _movers(plan, ctx, head, topo.names[i], lo - counts[i])
        if movers is not None and _room_elsewhere(plan, ctx, head, topo.names[i], movers, lo):
            return movers
    return None


def _movers(plan: CyclePlan, ctx: Context, head: Job, node: str, deficit: int) -> list[Job] | None:
    """The fewest GPUs of movable jobs wholly on `node` that cover `deficit`, smallest first."""
    st = ctx.state
    on_node = {h for g in st.nodes[node].gpus if (h := st.gpus[g].holder) is not None}
    cands = []
    for jid in on_node:
        v = st.jobs.get(jid)
        if v is None or not _movable(plan, ctx, head, v) or any(st.gpus[g].node != node for g in v.gpus):
            continue
        cands.append(v)
    cands.sort(key=lambda v: (len(v.gpus), v.job_id))
    chosen: list[Job] = []
    got = 0
    for v in cands:
        if got >= deficit:
            break
        chosen.append(v)
        got += len(v.gpus)
    return chosen if got >= deficit else None


def _movable(plan: CyclePlan, ctx: Context, head: Job, v: Job) -> bool:
    config, now = ctx.config, ctx.now
    if not v.spec.preemptible or not plan.touchable(v) or v.started_at is None:
        return False
    if config.priority and PRIORITY_RANK[v.spec.priority] > PRIORITY_RANK[head.spec.priority]:
        return False
    if not ran_back_off(v, now, config.min_runtime_s, config.preempt_backoff_max_s or config.min_runtime_s):
        return False
    return plan.fair(v, head)


def _room_elsewhere(plan: CyclePlan, ctx: Context, head: Job, node: str, movers: list[Job], lo: int) -> bool:
    """The movers fit together on the free GPUs off `node`, and the head fits on the node
    once they leave."""
    st = ctx.state
    elsewhere = plan.pool.without(st.nodes[node].gpus)
    for v in movers:
        p = ctx.placer.place(elsewhere, v.spec, len(v.gpus))
        if p is None:
            return False
        elsewhere.take(p.gpus)
        hold(elsewhere, v.spec, p.gpus)
    hyp = plan.pool.copy()
    for v in movers:
        hyp.add(v.gpus)
        hold(hyp, v.spec, v.gpus, -1)
    return plan.fits(head, lo)(hyp)
