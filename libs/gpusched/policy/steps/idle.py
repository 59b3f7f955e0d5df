"""Idle timeouts (policy/idle.py): jobs idle past their class's `idle_timeout_s` are asked to
yield their GPUs (or end). Last step: the decisions of the steps before it are on the plan, and
a job they touched is left alone, so each job is touched once per cycle."""

from __future__ import annotations

from ..idle import idle_timeouts
from ..plan import Context, CyclePlan


def run(plan: CyclePlan, ctx: Context) -> None:
    plan.events.extend(idle_timeouts(ctx.state, ctx.now, ctx.config, plan.events))
