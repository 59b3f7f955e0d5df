"""The one shape of a writer that decides: decide on the fold as it is, keep this writer's
kinds, re-check them with the core's rules, append them as compare-and-set batches against the
view they were decided at, and on a conflict re-check what is left against the fresher fold.
Placement, the preemptor and the fallback services all run `decide_and_append`, and so does the
simulator's composition of them (`sim/composed.py`): what each writer may append is here too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import msgspec
import structlog

from gpusched import metrics, telemetry
from gpusched.bus.cas import Folded, append_cas
from gpusched.core import events as ev
from gpusched.core import rules
from gpusched.core.state import ClusterState

log = structlog.get_logger()

Decide = Callable[[ClusterState, float], list[ev.Event]]

#: What each deciding writer appends (the log's other kinds are admission's, the node
#: daemons' and the reconciler's). Placement: grants, resizes, reasons.
PLACEMENT_KINDS = (ev.GpusGranted, ev.JobResized, ev.JobPending)
#: The preemptor: preemption requests, forced releases, time-limit ends.
PREEMPTOR_KINDS = (ev.PreemptionRequested, ev.GpusReleased, ev.JobFailed, ev.JobTimedOut)
#: The steps of a cycle the preemptor skips: they decide placement's kinds only (reasons, ETAs,
#: placement's), which cost most of a cycle on a long queue.
PREEMPTOR_SKIPS = ("explain",)
#: The fallback, while placement is gone: naive grants (`as_naive`).
FALLBACK_KINDS = (ev.GpusGranted,)


def as_naive(event: ev.Event) -> ev.Event:
    """A fallback's grant says so (`placer="naive"`), for `show` and the audit."""
    if isinstance(event, ev.GpusGranted) and event.placer != "naive":
        return msgspec.structs.replace(event, placer="naive")
    return event


def msg_ids(state: ClusterState) -> Callable[[ev.Event], str | None]:
    """Deterministic message ids for decisions that happen once per job attempt, so that a
    retried append, or the same decision by a second instance, is stored once. Others: None
    (the log uses the content hash)."""

    def msg_id(event: ev.Event) -> str | None:
        job = state.jobs.get(getattr(event, "job_id", ""))
        if isinstance(event, ev.GpusGranted):
            return f"grant-{event.job_id}-{event.attempt}"
        if job is not None and isinstance(event, ev.PreemptionRequested):
            return f"preempt-{event.job_id}-{job.attempt}"
        if job is not None and isinstance(event, ev.GpusReleased):
            return f"release-{event.job_id}-{job.attempt}"
        return None

    return msg_id


def own_decisions(state: ClusterState, events: Iterable[ev.Event], kinds: tuple[type, ...]) -> list[ev.Event]:
    """The events of `kinds` this writer may append, each re-checked by the core's rules
    (`rules.BatchCheck`) against the fold plus the batch's own earlier decisions.

    Expected drops: a grant may use GPUs an earlier event frees on behalf of another writer (a
    forced release is the preemptor's); appended before that release is in the log, it would
    double-book, so it waits for the next cycle. Likewise a preemption request that is fair only
    once another writer's grants of the same cycle are in the log. Anything else is a bug,
    logged as an error."""
    events = list(events)
    check = rules.BatchCheck(state)
    foreign = [e for e in events if not isinstance(e, kinds) and e.ALLOC]
    foreign_freed = rules.freed_by(state, foreign)
    out: list[ev.Event] = []
    for e in events:
        if not isinstance(e, kinds):
            continue
        problem = check.problem(e)
        if problem is None:
            out.append(e)
            continue
        uses = getattr(e, "gpus", None) or getattr(e, "added", None) or []
        expected = any(g in foreign_freed for g in uses) or (isinstance(e, ev.PreemptionRequested) and bool(foreign))
        (log.debug if expected else log.error)(
            "decision_dropped", kind=e.kind, job_id=getattr(e, "job_id", None), problem=problem,
            waits_for_other_writer=expected)
    return out


#: How many times a round carries its decisions over to a fresher view after a conflict.
MAX_REBASES = 5


def budget_reasons(events: list[ev.Event], max_reasons: int | None) -> tuple[list[ev.Event], int]:
    """Keep every decision but at most `max_reasons` `JobPending` (the first ones: the cycle
    explains jobs in queue order, so the head of the queue first). Returns (kept, deferred).
    A policy's reasons can change for thousands of waiting jobs at once (the job they wait behind
    changed); appending them all in one round would delay the grants of the next round by
    seconds. The deferred ones are decided again, and appended, in later rounds."""
    if max_reasons is None:
        return events, 0
    kept: list[ev.Event] = []
    reasons = 0
    for e in events:
        if isinstance(e, ev.JobPending):
            reasons += 1
            if reasons > max_reasons:
                continue
        kept.append(e)
    return kept, max(0, reasons - max_reasons)


async def decide_and_append(folded: Folded, decide: Decide, kinds: tuple[type, ...],
                            transform: Callable[[ev.Event], ev.Event] = lambda e: e,
                            rebase: tuple[type, ...] = (), max_reasons: int | None = None,
                            clock: Callable[[], float] = time.time) -> tuple[int, bool]:
    """One decision round: decide on the fold as it is, keep this writer's (legal) kinds, and
    append them as atomic compare-and-set batches against the view they were decided at
    (`append_cas` returns once the fold includes them, so a decision is never repeated).

    On a conflict the fold is caught up. If every decision left is of a `rebase` kind, the
    round re-checks them against the fresher fold (`own_decisions`: still pending, GPUs still
    free, limits) and appends what is still legal at the new view, instead of deciding the whole
    cycle again. Under steady churn (completions landing every millisecond) a full cycle rarely
    wins the race; a re-check of a few hundred decisions takes microseconds and does. Safety is
    unchanged: the re-check and the compare-and-set see the same view. Returns (appended,
    conflicted): conflicted when decisions were dropped for a new cycle to redo. `clock`: the
    wall clock (the simulator passes its virtual one)."""
    state = folded.state
    view = folded.alloc_seq
    t0 = time.perf_counter()
    # The fold's clock is the server's store time (no writer's `at` moves it): a floor under
    # this host's clock, which runs on between facts (time limits fire in a quiet cluster).
    with metrics.decision_timer(telemetry.current_service()):
        decided = decide(state, max(clock(), state.now))
    events, deferred = budget_reasons(own_decisions(state, decided, kinds), max_reasons)
    log.debug("decided", events=len(events), deferred_reasons=deferred, seconds=round(time.perf_counter() - t0, 4),
              pending=len(state.pending))
    total = 0
    for _ in range(MAX_REBASES + 1):
        if not events:
            return total, False
        appended, conflicted = await append_cas(folded, [transform(e) for e in events], msg_id=msg_ids(state),
                                                view=view)
        total += appended
        if not conflicted:
            return total, False
        rest = events[appended:]
        if not rebase or not all(isinstance(e, rebase) for e in rest):
            return total, True
        view = folded.alloc_seq  # no await from here to the append: the re-check and the CAS agree
        events = own_decisions(state, rest, kinds)
    return total, True
