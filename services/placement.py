"""Placement: the normal writer of grants. Follows the log, runs the policy `cycle`, and appends
the `GpusGranted` / `JobResized` / `JobPending` events with compare-and-set over the alloc tree.

Several instances may run: the one holding the Redis lease `gpusched:lease:placement` decides,
the others stand by and take over when it lapses. The lease is only a liveness signal; safety
comes from the compare-and-set, so even two deciders at once can never double-book a GPU.
When it takes (or retakes) the lease while the fold says placement is degraded, it appends
`PlacementRecovered`: topology-aware placement is back.

One cycle decides many grants (batched), then the service waits for its own appends to reach
its fold, then a short debounce, then decides again: throughput does not collapse under load,
and a decision is never repeated from a stale view.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Iterable

import structlog

from gpusched import metrics, telemetry
from gpusched.core import events as ev
from gpusched.core.state import ClusterState
from gpusched.services.runtime import FoldedLog, append_cas

from .lease import PLACEMENT_LEASE_KEY, Lease, connect_redis, owner_id
from .projector import load_snapshot
from .shell import common_arguments, wait_wake

log = structlog.get_logger()

PLACEMENT_KINDS = (ev.GpusGranted, ev.JobResized, ev.JobPending)
Decide = Callable[[ClusterState, float], list[ev.Event]]


def policy_config(name: str, overrides: list[str] | None = None):
    """A policy preset, with `key=value` overrides of its fields (`min_runtime_s=0`)."""
    import msgspec

    from gpusched.policy.config import PRESETS, PolicyConfig

    try:
        config = PRESETS[name]
    except KeyError:
        raise SystemExit(f"unknown policy {name!r}; expected one of {', '.join(PRESETS)}") from None
    changes = {}
    for item in overrides or []:
        key, sep, text = item.partition("=")
        if not sep or key not in PolicyConfig.__struct_fields__:
            raise SystemExit(f"--policy-set {item!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(PolicyConfig.__struct_fields__)}")
        try:
            changes[key] = msgspec.json.decode(text)
        except msgspec.DecodeError:
            changes[key] = text
    try:
        return msgspec.convert({**msgspec.to_builtins(config), **changes}, PolicyConfig)
    except msgspec.ValidationError as err:
        raise SystemExit(f"--policy-set: {err}") from None


def policy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default="full", help="policy preset (default: full)")
    parser.add_argument("--policy-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one field of the preset, e.g. checkpoint_grace_s=30 (repeatable)")


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


class Tracker:
    """Seqs of the latest control-plane transitions, kept by a fold listener, so that the
    transition events get deterministic message ids (exactly once per transition)."""

    def __init__(self, folded: FoldedLog):
        self.degraded_seq = 0
        self.recovered_seq = 0
        folded.listeners.append(self._on)

    def _on(self, rec, state) -> None:
        if isinstance(rec.event, ev.PlacementDegraded):
            self.degraded_seq = rec.seq
        elif isinstance(rec.event, ev.PlacementRecovered):
            self.recovered_seq = rec.seq


def own_decisions(state: ClusterState, events: Iterable[ev.Event], kinds: tuple[type, ...]) -> list[ev.Event]:
    """The events of `kinds` this writer may append, each checked against the fold plus the
    batch's own earlier decisions. The compare-and-set checks freshness, not content: it is this
    check that keeps an illegal decision out of the log.

    Two kinds of events are dropped. Expected: a cycle's events are valid in order, and a grant
    may use GPUs that an earlier event frees on behalf of another writer (a forced release is the
    preemptor's); appended before that release is in the log, the grant would double-book, so it
    waits for the next cycle. Not expected (logged as an error): a decision that is illegal on
    its own (a GPU granted twice in one batch, a shrink of GPUs the job does not hold, ...)."""
    changed: dict[str, str | None] = {}  # GPU -> holder after this batch's own decisions
    job_gpus: dict[str, list[str]] = {}  # job -> its GPUs after this batch's own decisions
    team_delta: dict[str, int] = {}
    granted: set[str] = set()
    foreign_freed: set[str] = set()
    out: list[ev.Event] = []

    def placeable(g: str) -> bool:
        rec = state.gpus.get(g)
        if rec is None or (changed[g] if g in changed else rec.holder) is not None:
            return False
        return state.nodes[rec.node].usable and rec.quarantined is None and rec.zombie_pids is None

    def gpus_of(job_id: str) -> list[str]:
        return job_gpus[job_id] if job_id in job_gpus else list(state.jobs[job_id].gpus)

    def over_limit(team: str, add: int) -> bool:
        t = state.teams.get(team)
        return (t is not None and t.quota.limit is not None and add > 0
                and t.held + team_delta.get(team, 0) + add > t.quota.limit)

    for e in events:
        if not isinstance(e, kinds):
            if isinstance(e, (ev.GpusReleased, ev.JobFailed, ev.JobTimedOut)) and e.job_id in state.jobs:
                foreign_freed.update(state.jobs[e.job_id].gpus)
            elif isinstance(e, ev.JobResized):
                foreign_freed.update(e.removed)
            continue
        problem = None
        job = state.jobs.get(getattr(e, "job_id", ""))
        if isinstance(e, ev.GpusGranted):
            if job is None or job.state != "pending" or e.job_id in granted:
                problem = f"grant to a job that is not pending ({job.state if job else 'unknown'})"
            elif len(set(e.gpus)) != len(e.gpus) or not all(placeable(g) for g in e.gpus):
                problem = "grant of GPUs that are not free"
            elif not job.spec.gang_min <= len(e.gpus) <= job.spec.gpus:
                problem = f"grant of {len(e.gpus)} GPUs, gang needs {job.spec.gang_min}..{job.spec.gpus}"
            elif over_limit(job.team, len(e.gpus)):
                problem = f"grant beyond team {job.team}'s limit"
            else:
                for g in e.gpus:
                    changed[g] = e.job_id
                job_gpus[e.job_id] = list(e.gpus)
                team_delta[job.team] = team_delta.get(job.team, 0) + len(e.gpus)
                granted.add(e.job_id)
        elif isinstance(e, ev.JobResized):
            current = gpus_of(e.job_id) if job is not None and (job.holding or e.job_id in granted) else None
            if current is None:
                problem = "resize of a job that holds nothing"
            elif not set(e.removed) <= set(current):
                problem = "shrink of GPUs the job does not hold"
            elif len(set(e.added)) != len(e.added) or not all(placeable(g) for g in e.added):
                problem = "grow into GPUs that are not free"
            elif not job.spec.gang_min <= len(current) - len(e.removed) + len(e.added) <= job.spec.gpus:
                problem = "resize outside the gang's range"
            elif over_limit(job.team, len(e.added) - len(e.removed)):
                problem = f"grow beyond team {job.team}'s limit"
            else:
                for g in e.removed:
                    changed[g] = None
                for g in e.added:
                    changed[g] = e.job_id
                job_gpus[e.job_id] = [g for g in current if g not in e.removed] + list(e.added)
                team_delta[job.team] = team_delta.get(job.team, 0) + len(e.added) - len(e.removed)
        elif isinstance(e, (ev.GpusReleased, ev.JobFailed, ev.JobTimedOut)):
            if job is None or not job.holding:
                problem = "release of a job that holds nothing"
            else:
                for g in gpus_of(e.job_id):
                    changed[g] = None
                team_delta[job.team] = team_delta.get(job.team, 0) - len(gpus_of(e.job_id))
                job_gpus[e.job_id] = []
        if problem is not None:
            uses = getattr(e, "gpus", None) or getattr(e, "added", None) or []
            expected = any(g in foreign_freed for g in uses)
            (log.debug if expected else log.error)(
                "decision_dropped", kind=e.kind, job_id=getattr(e, "job_id", None), problem=problem,
                waits_for_other_writer=expected)
            continue
        out.append(e)
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


async def decide_and_append(folded: FoldedLog, decide: Decide, kinds: tuple[type, ...],
                            transform: Callable[[ev.Event], ev.Event] = lambda e: e,
                            rebase: tuple[type, ...] = (), max_reasons: int | None = None) -> tuple[int, bool]:
    """One decision round: decide on the fold as it is, keep this writer's (legal) kinds, and
    append them as atomic compare-and-set batches against the view they were decided at
    (`append_cas` returns once the fold includes them, so a decision is never repeated).

    On a conflict the fold is caught up. If every decision left is of a `rebase` kind, the
    round re-checks them against the fresher fold (`own_decisions`: still pending, GPUs still
    free, limits) and appends what is still legal at the new view, instead of deciding the whole
    cycle again. Under steady churn (completions landing every millisecond) a full cycle rarely
    wins the race; a re-check of a few hundred decisions takes microseconds and does. Safety is
    unchanged: the re-check and the compare-and-set see the same view. Returns (appended,
    conflicted): conflicted when decisions were dropped for a new cycle to redo."""
    state = folded.state
    view = folded.alloc_seq
    t0 = time.perf_counter()
    with metrics.decision_timer(telemetry.current_service()):
        decided = decide(state, max(time.time(), state.now))
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


class Placement:
    def __init__(self, folded: FoldedLog, lease: Lease, decide: Decide, debounce_s: float = 0.002, tick_s: float = 5.0,
                 max_reasons: int | None = 250):
        self.folded = folded
        self.lease = lease
        self.decide = decide
        self.debounce_s = debounce_s
        self.tick_s = tick_s
        self.max_reasons = max_reasons
        self.tracker = Tracker(folded)
        self.grants = 0
        self.conflicts = 0

    async def recover_if_degraded(self) -> None:
        state = self.folded.state
        if not state.placement_degraded:
            return
        event = ev.PlacementRecovered(at=max(time.time(), state.now), reason=f"placement lease held by {self.lease.owner}")
        seq = await self.folded.log.append(event, msg_id=f"recovered-{self.tracker.degraded_seq}")
        log.info("placement_recovered", seq=seq)
        await self.folded.catch_up()

    async def run(self, stop: asyncio.Event) -> None:
        def on_lease(held: bool) -> None:
            if held:
                self.folded.changed.set()  # a standby that takes over decides at once

        keeper = asyncio.create_task(self.lease.keep(stop, on_change=on_lease), name="placement-lease")
        try:
            while not stop.is_set():
                await wait_wake(self.folded, stop, self.tick_s, self.debounce_s)
                if stop.is_set() or not self.lease.held:
                    continue
                try:
                    await self.recover_if_degraded()
                    started = time.perf_counter()
                    appended, conflicted = await decide_and_append(self.folded, self.decide, PLACEMENT_KINDS,
                                                                   rebase=PLACEMENT_KINDS, max_reasons=self.max_reasons)
                    if appended >= 100:
                        took = time.perf_counter() - started
                        log.info("placement_round", appended=appended, conflicted=conflicted, seconds=round(took, 3),
                                 per_s=round(appended / took), seq=self.folded.seen_seq)
                except Exception:
                    log.exception("placement_round_failed")
                    await asyncio.sleep(0.5)
                    continue
                self.grants += appended
                if conflicted:
                    self.conflicts += 1
                    self.folded.changed.set()  # decide again at once, on the caught-up fold
                elif appended:
                    # Events that arrived while appending had their wake-up consumed by the wait
                    # for our own appends; deferred reasons wait too. One more round settles both.
                    self.folded.changed.set()
        finally:
            await keeper


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser)
    policy_arguments(parser)
    parser.add_argument("--lease-key", default=PLACEMENT_LEASE_KEY)
    parser.add_argument("--lease-ttl-ms", type=int, default=3000)
    parser.add_argument("--debounce-ms", type=float, default=2.0,
                        help="after the fold moves, wait this long so one cycle covers a burst of events")
    parser.add_argument("--tick-ms", type=float, default=5000.0,
                        help="run a cycle at least this often even if nothing happened")
    parser.add_argument("--max-reasons", type=int, default=250,
                        help="JobPending events appended per round at most (the rest in later rounds)")


def topo_decider(policy: str, overrides: list[str] | None = None) -> Decide:
    from gpusched.policy.cycle import cycle

    config = policy_config(policy, overrides)
    return lambda state, now: cycle(state, now, config)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    decide = topo_decider(args.policy, args.policy_set)
    redis = connect_redis(args.redis)
    # snapshot + tail: a restarted (or standby) placement is ready in the time of the tail
    folded = await FoldedLog.open(args.nats, name="gpusched-placement", snapshot=await load_snapshot(redis))
    lease = Lease(redis, args.lease_key, owner_id("placement"), args.lease_ttl_ms)
    placement = Placement(folded, lease, decide, debounce_s=args.debounce_ms / 1000.0, tick_s=args.tick_ms / 1000.0,
                          max_reasons=args.max_reasons)
    log.info("placement_ready", seq=folded.seen_seq, policy=args.policy, lease=args.lease_key)
    try:
        await placement.run(stop)
    finally:
        await folded.close()
        await redis.aclose()
