"""The knobs of the scheduling policies, and the presets that tell the design story.

Each preset adds one capability to the one before it, so the simulator can measure what each
step buys against the baseline measured in the same run:

    fifo -> gang -> topo -> preempt -> fairshare -> full
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import Struct, field, structs

from ..core.model import DEFAULT_HALF_LIFE_S, Priority


class PolicyConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a scheduling cycle may do. All decisions stay pure functions of (state, now, config)."""

    #: Gangs may skip ahead: a job that does not fit does not block the ones behind it.
    #: (Grants are always all-or-nothing: the fold requires it.)
    gang: bool = True
    #: Topology-aware placement (tightest set, then least fragmentation); else first free GPUs.
    topology: bool = True
    #: Strict head-of-line FIFO: nothing behind a blocked job may start.
    strict_fifo: bool = False
    #: Order by priority class (interactive > high > normal > low) before submission time.
    priority: bool = True
    #: Preempt preemptible running jobs for blocked higher-priority (or under-share) jobs.
    preemption: bool = True
    #: Order teams by fair share (guaranteed share first, then decayed borrowing beyond it ÷ weight).
    fairshare: bool = True
    #: Preemption asks the job to checkpoint and waits `checkpoint_grace_s`; else it kills at once.
    checkpoint: bool = True
    #: Elastic jobs start small when space is short, grow into idle GPUs, shrink on demand.
    elastic: bool = True
    #: Reserve GPUs for the blocked head job; others start only if they cannot delay it.
    backfill: bool = True
    #: Backfill: preemptible jobs may also start on the reserved GPUs, and yield (preempted for
    #: the head, whatever their priority) when the reservation comes due.
    borrow: bool = True
    #: Least-attained-service order among jobs of equal priority (a lever for mean JCT).
    las: bool = False
    #: Discretized LAS (Tiresias's 2D-LAS): with `las`, jobs are ordered by the queue their
    #: attained GPU-seconds fall in (below the first threshold: queue 0, ...), FIFO by submission
    #: within a queue, instead of by attained service itself. Empty: continuous LAS.
    las_queues_gpu_s: list[float] = []
    #: With `las`, a blocked job may preempt preemptible running jobs of a later LAS queue (more
    #: attained service), its own team's or, subject to the fold's fairness rule, another's.
    las_preempt: bool = False
    #: Tiresias's starvation knob (STARVE), with discretized LAS: a job waiting (since its
    #: submission or last requeue) at least this many times its run so far goes back to the
    #: first queue. None: off (as in Tiresias's published runs).
    las_starve_factor: float | None = None
    #: Checkpoint-cost-aware LAS preemption: the expected wall seconds a preemption costs the
    #: victim, to save a checkpoint and to restore it on its next start. A job is preempted for
    #: LAS only when the expected saving (its attained GPU-seconds beyond the blocked job's: LAS's
    #: premise, a job's expected remaining service grows with what it attained) exceeds its GPUs x
    #: these. Defaults: the simulator's realistic model (30 s save, 60 s restore); `gpusched sim`
    #: sets both from its runtime model (`ideal`: 0) unless `--set` gives them.
    checkpoint_cost_s: float = 30.0
    restore_cost_s: float = 60.0
    #: Anti-thrash for LAS preemption: a job may be taken for LAS only after running
    #: `min_runtime_s * 2**preemptions` since its (re)start, at most this long (None: off).
    las_backoff_max_s: float | None = None
    #: Preemption asks the run-time predictions (policy/predict.py, learned from completed
    #: jobs): a victim predicted to end before the blocked job would, by more than its
    #: checkpoint and restore, is left to finish (`preemption.outlasts`, the exchange argument
    #: for two jobs on one set of GPUs). For LAS, reclaim to a guarantee, and a borrower
    #: yielding to the reserved head; never for priority classes (a stated importance, not a
    #: guess at run times).
    preempt_predicted: bool = False
    #: With `las`, pending jobs are ordered (within team and priority class) by their predicted
    #: remaining GPU-seconds instead of their LAS queue: the median of what is left of the run
    #: times of completed jobs like them (policy/predict.py) that ran longer than they already
    #: did, times their gang; shortest first (SRPT on predictions, with attained service
    #: entering through the conditioning). Frozen when the job enters the queue, from the jobs
    #: completed before then: a function of the log (`predict.FrozenEstimates`). Preemption
    #: still goes by LAS queue. Off by default (docs/sim.md, "Predicted order": measured).
    las_predicted: bool = False

    #: Fair share: the fold's usage half-life (the state is folded with it; kept here for reports).
    half_life_s: float = DEFAULT_HALF_LIFE_S
    #: Fair share: a team's current holding counts as this many seconds of future usage, so that
    #: grants made within one cycle move the team down the order.
    fairshare_horizon_s: float = 3600.0
    #: Fair share: what orders the teams at or over their guarantee, per unit of weight:
    #: "borrowed" (decayed usage and holding beyond the guarantee, `fairshare.borrowed`: the
    #: entitlement's split of what guarantees leave) or "usage" (all of it, the rule before).
    fairshare_by: Literal["borrowed", "usage"] = "borrowed"
    #: Fair share: what reclaim restores. "guarantee": a team below its guaranteed share takes
    #: GPUs back from teams over theirs. "share": also, a team below its fair share (guarantee,
    #: then the rest water-filled by weight over the teams' demand: `fairshare.fair_shares`,
    #: KAI's fair share) takes from a team over its own fair share, if that team ends less far
    #: below its share than the taking team is now (the reclaim rule's own convergence).
    reclaim_to: Literal["guarantee", "share"] = "guarantee"
    #: Fairness over a horizon (issue 26, docs/policy.md "Fairness over a horizon"): instead of
    #: every team below its guarantee going first and reclaiming at once, teams take turns by
    #: the LAS level of their next job, then by decayed usage relative to their entitlement (the
    #: guarantee; weight for a team without one), so a team's short jobs run ahead now and its
    #: usage repays the others later. A team below its guarantee is owed (goes first, reclaims,
    #: its head reserves at once) if it did not run ahead over the horizon, else once its oldest
    #: waiting job has waited this long. None: second by second (every team below its guarantee
    #: is owed at once). Opt-in (`full+fair_owed_after_s=3600+reserve_after_s=86400`): measured,
    #: it lowers avg JCT on saturated clusters but cost Jain on one unsaturated week (docs/
    #: price-of-fairness.md).
    fair_owed_after_s: float | None = None
    #: With `fair_owed_after_s`: a team's oldest waiting job that has waited this long leads its
    #: team's queue (whatever its priority class or LAS level), so no job is starved by its own
    #: team's later jobs (the 1.6M-s wait of a low-priority job on 1x16x8, issue 26). None: off.
    starve_after_s: float | None = None
    #: Backfill: the first blocked job gets a reservation only once it has waited this long
    #: (since it entered the queue); until then jobs behind it start wherever they fit. None:
    #: at once (a reservation for every blocked head).
    reserve_after_s: float | None = None
    #: Anti-thrash: a job runs at least this long after (re)start before it can be preempted.
    min_runtime_s: float = 300.0
    #: Anti-thrash across teams: a job may be taken for another team (reclaim, or priority
    #: across teams) only after running `min_runtime_s * 2**preemptions` since its (re)start,
    #: at most this long (None: off; `min_runtime_s` alone applies). `full`: one fair-share
    #: horizon (`fairshare_horizon_s`, 1 h): the bound on how long such a job shields a guarantee.
    preempt_backoff_max_s: float | None = None
    #: How long a preempted job has to checkpoint before its GPUs are taken back.
    checkpoint_grace_s: float = 60.0
    #: GPUs a preemption freed go first to the job they were freed for, when no other team's job
    #: is first in line (steps/handover.py), not to whoever leads the next walk in its team (who
    #: would leave that job to preempt again). Off in `tiresias`, whose simulator hands GPUs out
    #: in queue order.
    hand_over: bool = True
    #: Jobs on a quarantined GPU are asked to checkpoint and move (preemptible ones; see unhealthy.py).
    move_off_unhealthy: bool = True
    #: How many blocked jobs per cycle may trigger preemption (bounds the cost of a cycle).
    max_preemptors_per_cycle: int = 4
    #: How many blocked jobs per cycle reclaim may search victims for, and the walk hands it
    #: (None: `max_preemptors_per_cycle`, so a failed search uses a trigger's turn). Larger, a
    #: cycle's triggers go to the blocked jobs that can act, not the first teams' gangs no set
    #: frees (docs/policy.md, "Saturated clusters").
    max_victim_searches_per_cycle: int | None = None
    #: Backfill: treat a running job without a time limit as ending after this long (None: never).
    unknown_runtime_s: float | None = None
    #: A blocked head that must run within one node, while enough GPUs are free but scattered,
    #: moves small jobs off the node nearest to holding it onto free GPUs elsewhere, and takes
    #: the node (steps/consolidate.py; KAI Scheduler's consolidation). Each move is a preemption.
    #: Off: on the bundled week it shortens the 8-GPU jobs' queue at the small jobs' expense,
    #: mean JCT even, more preemptions (docs/policy.md, "Node-sized gangs").
    consolidate: bool = False

    # --- run-time prediction (policy/predict.py): learned from completed jobs, never an oracle
    #: Opt-in: ETAs from the reservation plan with predicted run times (ends of jobs without a
    #: time limit), shown as a range when uncertain. Changes what `gpusched show` says, no
    #: decision. Off by default: on the bundled week it does not yet beat the reservation's
    #: own ETA (docs/results.md, "Run-time prediction").
    predict_runtimes: bool = False
    #: Backfill, opt-in: a job with a time limit may start on the head's reserved GPUs when the
    #: reservation has no known time and the limit ends before the earliest predicted end (low
    #: quantile) of the reserved set's holders. A wrong prediction costs the head at most that
    #: job's time limit (the job ends by it); a job without a limit never backfills this way.
    backfill_predicted: bool = False
    #: ETAs from a plan of the queue (policy/forecast.py): the policy's own cycle run forward on
    #: a copy of the state, running jobs ending at their predicted run times, no arrivals. A new
    #: plan when the last is this many seconds old (policy time) or its state is gone; None: off
    #: (the head alone gets the reservation's ETA). Changes what `gpusched show` says, no decision.
    eta_plan_every_s: float | None = None
    #: The plan's bound: the first this many waiting jobs in the policy's order, and at most
    #: this many cycles; a job behind them, or not started within them, gets no ETA.
    eta_plan_jobs: int = 32
    #: How far the plan looks ahead (seconds): a job it does not start within this gets no ETA
    #: (an ETA beyond it is mostly wrong: arrivals and misjudged run times move it).
    eta_plan_horizon_s: float = 1800.0
    #: A plan that went wrong (a start it planned is past and the job still waits) is made
    #: again once it is this old (seconds; None: only on `eta_plan_every_s`). Half the period
    #: by default: a plan then costs at most twice as much, and every estimate resting on the
    #: wrong guess is put right within this long.
    eta_replan_stale_s: float | None = 900.0

    #: Idle: a job whose GPUs all stay under this utilization (percent) ...
    idle_util_pct: float = 5.0
    #: ... for this long is idle (the reconciler appends `JobIdle`; it reads these two knobs).
    idle_after_s: float = 600.0
    #: Idle timeout per priority class: a job idle this long (from the start of its idle
    #: evidence) is reclaimed; a class not listed has none (batch classes by default).
    idle_timeout_s: dict[Priority, float] = field(default_factory=lambda: {"interactive": 1800.0})
    #: What the idle timeout does, per class: "requeue" (checkpoint, then back to the queue,
    #: behind the jobs waiting: the default) or "end" (the job fails with the idle reason).
    idle_action: dict[Priority, Literal["requeue", "end"]] = {}

    def searches_per_cycle(self) -> int:
        """How many blocked jobs reclaim may search victims for in one cycle (the walk hands it
        that many): `max_victim_searches_per_cycle`, never below `max_preemptors_per_cycle`."""
        n = self.max_victim_searches_per_cycle
        return self.max_preemptors_per_cycle if n is None else max(n, self.max_preemptors_per_cycle)

    def replace(self, **changes) -> PolicyConfig:
        return structs.replace(self, **changes)


#: `full`'s attained-service knobs, none fitted to a trace: the queue limits are Tiresias's
#: published simulator defaults (SymbioticLab/Tiresias, `dlas-gpu`). STARVE stays off: with 1
#: (a requeued job waits at most as long as it has already run before it leads its team's
#: queue) the saturated 1x16x8 week went from 512,506 s to 865,331 s avg JCT; the bound is
#: `--set las_starve_factor=1` (docs/results.md), big gangs rely on the reservation. The LAS
#: back-off is capped at one periodic checkpoint interval (the realistic model's 30 min): a job
#: taken over and over still runs up to a checkpoint's worth of progress between preemptions.
_FULL_LAS: dict = {"las_preempt": True, "las_queues_gpu_s": [3250.0, 7200.0, 18000.0],
                   "las_backoff_max_s": 1800.0}

#: `full`'s preemption restraint (issue 12, docs/policy.md "Preemptions"): the exchange test on
#: predicted run times, and the back-off across teams doubling per preemption, capped at one
#: fair-share horizon (`fairshare_horizon_s`: the hour fair share already counts a holding as
#: future usage). A job taken over and over for other teams is then taken at most once per
#: horizon once its back-off reaches the cap, so it pays at most one checkpoint and restore per
#: hour of its run (90 s at the realistic costs: 2.5%), and a team below its guarantee whose
#: GPUs are held by such jobs gets them back within the cap plus the checkpoint grace. The cap
#: was fair share's usage half-life (a week): on saturated clusters a team then stayed below its
#: guarantee for days behind jobs shielded that long (issue 26).
_FULL_RESTRAINT: dict = {"preempt_predicted": True, "preempt_backoff_max_s": PolicyConfig().fairshare_horizon_s}

_FIFO = PolicyConfig(
    gang=False, topology=False, strict_fifo=True, priority=False, preemption=False,
    fairshare=False, checkpoint=False, elastic=False, backfill=False, las=False,
)

#: The design story, one capability per step.
PRESETS: dict[str, PolicyConfig] = {
    # Baseline: strict FIFO head-of-line, first free GPUs. With strict head-of-line blocking a
    # job that grabbed GPUs one at a time and held them while it waited is observably the same as
    # one that waits for enough free GPUs (nothing behind the head may start either way), and the
    # fold requires all-or-nothing grants; so fifo = strict FIFO + naive first-free placement.
    "fifo": _FIFO,
    # Plain FIFO with gangs (the literature baseline): a job that does not fit does not block
    # the ones behind it (greedy skip-ahead); all-or-nothing gangs; naive first-free placement.
    "gang": _FIFO.replace(strict_fifo=False, gang=True),
    # + topology-aware placement: tightest GPU set, best fit, keep whole nodes and racks free.
    "topo": _FIFO.replace(strict_fifo=False, gang=True, topology=True),
    # + priority classes and preemption of preemptible lower-priority jobs (killed at once).
    "preempt": _FIFO.replace(strict_fifo=False, gang=True, topology=True, priority=True, preemption=True),
    # + team fair share: guaranteed share first, decayed borrowing ÷ weight, hard limits, reclaim.
    "fairshare": _FIFO.replace(
        strict_fifo=False, gang=True, topology=True, priority=True, preemption=True, fairshare=True
    ),
    # + checkpoint handshake, elastic jobs, backfill behind a reservation for the blocked head,
    # and least attained service inside fair share (issue 12): within a team and a priority
    # class, jobs go by 2D-LAS queue and preempt jobs of a later queue of their own team when
    # the saving beats the checkpoint + restore cost; a requeued job that waited
    # `las_starve_factor` times its run so far goes first in its team (the starvation bound).
    "full": PolicyConfig(las=True, **_FULL_LAS, **_FULL_RESTRAINT),
}

# Tiresias's 2D-LAS as published (Gu et al., NSDI 2019; SymbioticLab/Tiresias `dlas-gpu`):
# queues on attained GPU-time with its simulator's default limits, preemptive, GPU-count
# placement, no priority classes, no fair share, no backfill. For calibration against the peer.
PRESETS["tiresias"] = _FIFO.replace(
    strict_fifo=False, gang=True, preemption=True, checkpoint=True, las=True,
    las_queues_gpu_s=[3250.0, 7200.0, 18000.0], las_preempt=True, min_runtime_s=0.0,
    max_preemptors_per_cycle=64, hand_over=False,
)

# `full` plans its queue for ETAs every half hour of policy time (issue 12, docs/sim.md).
PRESETS["full"] = PRESETS["full"].replace(eta_plan_every_s=1800.0)

DEFAULT = PRESETS["full"]

_WORDS = {"yes": "true", "on": "true", "no": "false", "off": "false", "none": "null"}


def _value(key: str, raw: str) -> object:
    """A `--policy-set` value: JSON for a mapping (`idle_timeout_s={"interactive": 1800}`), else
    the text (yes/no/none words normalized), typed from the field when converted."""
    if raw.startswith(("{", "[")):
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError:
            raise ValueError(f"{key}={raw}: expected a JSON object") from None
    return _WORDS.get(raw.lower(), raw)


def parse_policy(name: str, overrides: list[str] | dict[str, str] | None = None) -> PolicyConfig:
    """A preset with `KEY=VALUE` overrides of its fields, typed from the field (`las=true`,
    `min_runtime_s=0`, `unknown_runtime_s=none`, `idle_timeout_s={"interactive": 1800}`): the one parser of the services' `--policy-set`
    and the simulator's `--set`. A bad name, field or value raises ValueError naming it."""
    if name not in PRESETS:
        raise ValueError(f"unknown policy {name!r}; presets are {', '.join(PRESETS)}")
    if isinstance(overrides, dict):
        items = list(overrides.items())
    else:
        items = []
        for item in overrides or []:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ValueError(f"{item!r}: expected KEY=VALUE")
            items.append((key.strip(), raw.strip()))
    fields = PolicyConfig.__struct_fields__
    changes: dict[str, object] = {}
    for key, raw in items:
        if key not in fields:
            raise ValueError(f"{key}: not a PolicyConfig field; fields are {', '.join(fields)}")
        changes[key] = _value(key, raw)
    try:
        return msgspec.convert({**msgspec.to_builtins(PRESETS[name]), **changes}, PolicyConfig, strict=False)
    except msgspec.ValidationError as err:
        raise ValueError(f"{err}") from None


__all__ = ["DEFAULT", "PRESETS", "PolicyConfig", "parse_policy"]
