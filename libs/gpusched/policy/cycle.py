"""One scheduling cycle: a short list of steps over one plan, each delegating a question to a
policy (as Volcano's actions over a session).

    expire -> settle -> handover -> unhealthy -> walk -> consolidate -> reclaim -> grow -> explain -> idle

`cycle(state, now, config)` returns the events the cycle decides, valid to apply in order to
`state`. It never mutates the state: every step changes the cycle's tentative world, the
`CyclePlan` (policy/plan.py), through its verbs, and reads what it is given in a `Context`.
Each step lives in its own module of `policy/steps/` and is gated by the config in `STEPS`:
adding a step is one line there. `naive_cycle` is the fallback of a dead placement service:
FIFO with gangs, first free GPUs, no preemption.

Within one cycle no GPU is granted twice, and a running job is released, asked to yield or
grown at most once (`CyclePlan.touchable`); an elastic job may be shrunk for several blocked
jobs, one `JobResized` each.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import NamedTuple

from ..core import events as ev
from ..core.state import ClusterState
from . import unhealthy
from .config import PRESETS, PolicyConfig
from .memo import Indexes
from .plan import Context, CyclePlan, Placer
from .running import RunningIndex
from .steps import consolidate, expire, explain, grow, handover, idle, reclaim, settle, walk

#: The fallback keeps the cheap ordering decisions (priority classes, fair-share order, limits)
#: and loses the expensive ones (topology, preemption, backfill): otherwise a flood of
#: interactive jobs would wait behind requeued batch jobs for as long as placement is dead.
_NAIVE = PRESETS["gang"].replace(priority=True, fairshare=True)

class Step(NamedTuple):
    """One step of a cycle: its name (as the docs list it), the config knobs that switch it
    on, and what it does to the plan."""

    name: str
    enabled: Callable[[PolicyConfig], bool]
    run: Callable[[CyclePlan, Context], None]


def _always(config: PolicyConfig) -> bool:
    return True


#: The steps of a cycle, in order: the one list the module docstrings and the README name
#: (`tests/unit/test_structure.py` checks they agree).
STEPS: list[Step] = [
    Step("expire", _always, expire.run),  # jobs past their time limit end
    Step("settle", lambda c: c.preemption, settle.run),  # preemptions in flight: release or wait
    Step("handover", lambda c: c.preemption and c.checkpoint and c.hand_over,
         handover.run),  # freed GPUs to the job they were freed for
    Step("unhealthy", lambda c: c.move_off_unhealthy and c.preemption, unhealthy.run),  # off quarantined GPUs
    Step("walk", _always, walk.run),  # the queue in order: start, backfill, or record why not
    Step("consolidate", lambda c: c.consolidate and c.preemption and c.backfill,
         consolidate.run),  # a node for the head: move small jobs off it
    Step("reclaim", lambda c: c.preemption or c.elastic, reclaim.run),  # blocked jobs: claim, shrink, preempt
    Step("grow", lambda c: c.elastic, grow.run),  # nothing waits: elastic jobs grow
    Step("explain", _always, lambda plan, ctx: explain.run(plan, ctx, cycle)),  # JobPending: reasons, ETAs
    Step("idle", _always, idle.run),  # jobs idle past their timeout yield their GPUs (or end)
]


def decide(state: ClusterState, now: float, config: PolicyConfig, placer: str | None = None,
           running: RunningIndex | None = None, indexes: Indexes | None = None,
           skip: Collection[str] = ()) -> CyclePlan:
    """Run one cycle and return its plan: the events (`plan.events`) and the typed reason
    recorded for every job it looked at (`plan.reasons`). The placement strategy is chosen
    here, once: `placer` "topo" or "naive" (default: by `config.topology`). `indexes`: the
    caller's indexes of `state`, kept across its cycles (default: built for this one). `skip`:
    names of steps a caller that keeps none of their decisions does not run (the preemptor
    skips `explain`: the reasons and ETAs of the queue are placement's question)."""
    ctx = Context(state, now, config, Placer(placer or ("topo" if config.topology else "naive"), now),  # type: ignore[arg-type]
                  running, indexes)
    plan = CyclePlan(ctx)
    for step in STEPS:
        if step.enabled(config) and step.name not in skip:
            step.run(plan, ctx)
    if plan.started:
        ctx.indexes.started([job.job_id for job, _ in plan.started])
    return plan


def cycle(state: ClusterState, now: float, config: PolicyConfig, indexes: Indexes | None = None,
          skip: Collection[str] = ()) -> list[ev.Event]:
    """Decide one cycle. Returned events are valid to apply to `state` in order. A caller that
    runs cycles on one fold passes its `Indexes` (see `policy.memo`); `skip`: see `decide`."""
    return decide(state, now, config, indexes=indexes, skip=skip).events


def naive_cycle(state: ClusterState, now: float, indexes: Indexes | None = None) -> list[ev.Event]:
    """Gangs on the first free GPUs in priority and fair-share order, no preemption: what runs
    while placement is dead."""
    return decide(state, now, _NAIVE, "naive", indexes=indexes).events


__all__ = ["STEPS", "Step", "cycle", "decide", "naive_cycle"]
