"""The simulator running the live services' composition instead of one whole cycle.

`Simulation` applies a cycle's whole output at once. Live, the output is split by kind: the
placement service appends grants, resizes and reasons, the preemptor requests, releases and
time-limit ends, the fallback naive grants while placement is gone; each decides on its own
fold and appends with compare-and-set, re-checking on a conflict. `ComposedSimulation` runs
exactly that code (`decider.decide_and_append` with each service's kinds, rebase and
reason budget) on the in-memory event log (`bus.memory.MemoryEventLog`), on the simulator's
clock and trace: every fact, the world's and the writers', goes through the one log, and the
world's fold (the metrics' truth) is a fold of that log.

Each writer's fold moves only when the simulator says so: at the start of a round all writers
have seen the log as it is, then they decide and append one after the other, so a writer that
decided before another's append lands conflicts and decides again, as two live services that
decide at the same moment do. The writers' clock moves on by a microsecond per round within an
instant of the trace, as a live clock does between rounds: two decisions of one instant are two
different facts (the log deduplicates identical content). What it does not model: leases, debounce timers, network
latency (a round is instantaneous on the virtual clock) and process restarts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from ..bus.log import Record
from ..bus.memory import MemoryEventLog
from ..core import events as ev
from ..core.state import ClusterState
from .engine import Simulation

#: How far the writers' clock moves on per round within one instant of the trace.
ROUND_S = 1e-6


class LogFold:
    """A writer's fold of the in-memory log that moves only when asked: the interface of
    `bus.cas.Folded` that `decide_and_append` uses (state, alloc_seq, log,
    catch_up, wait_seq, listeners)."""

    def __init__(self, log: MemoryEventLog, half_life_s: float | None):
        self.log = log
        self.state = ClusterState(half_life_s=half_life_s)
        self.seen_seq = 0
        self.alloc_seq = 0
        self.listeners: list[Callable[[Record, ClusterState], None]] = []

    def advance(self, target: int | None = None) -> None:
        records = self.log.records_
        end = len(records) if target is None else min(target, len(records))
        while self.seen_seq < end:
            rec = records[self.seen_seq]
            self.state.apply(rec.event, rec.seq, rec.time)
            for listener in self.listeners:
                listener(rec, self.state)
            self.seen_seq = rec.seq
            if rec.event.ALLOC:
                self.alloc_seq = rec.seq

    async def catch_up(self, timeout: float = 10.0) -> None:
        self.advance()

    async def wait_seq(self, target: int, timeout: float = 10.0) -> None:
        self.advance(target)


@dataclass
class Writer:
    """One deciding service as the live shell runs it: its kinds, what it re-checks after a
    conflict instead of deciding again, its reason budget, and how it marks its events."""

    name: str
    fold: LogFold
    decide: Callable
    kinds: tuple[type, ...]
    rebase: tuple[type, ...] = ()
    max_reasons: int | None = None
    transform: Callable[[ev.Event], ev.Event] = lambda e: e
    appended: int = 0
    conflicts: int = 0
    rounds: int = 0
    active: Callable[[], bool] = field(default=lambda: True)


class ComposedSimulation(Simulation):
    """A `Simulation` whose decisions come from placement, the preemptor and the fallback
    appending separately to one in-memory log (see the module docstring).

    `placement_down`: (start, end) seconds during which placement decides nothing; the fallback
    then appends `PlacementDegraded` and places naively, and placement appends
    `PlacementRecovered` when it is back, as the live services do around a lease lapse."""

    def __init__(self, *args, placement_down: tuple[float, float] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = MemoryEventLog(clock=lambda: self.now)  # stores at the virtual clock
        self.folded_seq = 0  # how far the world's fold (self.state) has read the log
        self.placement_down = placement_down
        self.writers = self._writers()
        self._loop = asyncio.new_event_loop()
        self._world_ids = 0
        self._folding = False
        self._instant, self._ticks = -1.0, 0

    def _writers(self) -> list[Writer]:
        from gpusched.decider import FALLBACK_KINDS, PLACEMENT_KINDS, PREEMPTOR_KINDS, PREEMPTOR_SKIPS, as_naive
        from gpusched.policy.cycle import cycle, naive_cycle
        from gpusched.policy.memo import Indexes

        half_life, config = self.state.half_life_s, self.config

        def policy(indexes: Indexes, skip: tuple[str, ...] = ()) -> Callable:  # each service: its own indexes
            return lambda state, now: cycle(state, now, config, indexes, skip)

        fallback_indexes = Indexes()
        placement = Writer("placement", LogFold(self.log, half_life), policy(Indexes()), PLACEMENT_KINDS,
                           rebase=PLACEMENT_KINDS, max_reasons=250, active=lambda: not self._placement_is_down())
        preemptor = Writer("preemptor", LogFold(self.log, half_life), policy(Indexes(), PREEMPTOR_SKIPS), PREEMPTOR_KINDS)
        fallback = Writer("fallback", LogFold(self.log, half_life),
                          lambda state, now: naive_cycle(state, now, fallback_indexes), FALLBACK_KINDS,
                          rebase=FALLBACK_KINDS, transform=as_naive, active=self._placement_is_down)
        return [placement, preemptor, fallback]

    def _placement_is_down(self) -> bool:
        down = self.placement_down
        return down is not None and down[0] <= self.now < down[1]

    # --- the log: every fact goes through it ----------------------------------------------

    def _apply(self, event: ev.Event) -> None:
        """A fact of the world (node daemons, users, the reconciler): appended to the log, then
        folded with everything before it."""
        self._world_ids += 1
        self.log.append_now(event, f"world-{self._world_ids}")
        if not self._folding:  # else the fold in progress reads it in its turn
            self._fold_log()

    def _fold_log(self, started: list[str] | None = None) -> None:
        """Fold the log's new records into the world's state; writers' decisions get the
        world's reaction (`started` collects the jobs granted)."""
        self._folding = True
        try:
            while self.folded_seq < len(self.log.records_):
                rec = self.log.records_[self.folded_seq]
                self.folded_seq = rec.seq
                super()._apply(rec.event)
                if started is not None and not (rec.headers or {}).get("Nats-Msg-Id", "").startswith("world-"):
                    self._react(rec.event, self.now, started)
        finally:
            self._folding = False

    # --- a decision round -----------------------------------------------------------------

    def _schedule(self, t: float) -> None:
        """One round: every writer has seen the log as it is now, then each decides and appends
        in turn (a later one conflicts if an earlier one's append moved the alloc tree)."""
        self.cycles += 1
        for w in self.writers:
            w.fold.advance()
        before = len(self.log.records_)
        self._loop.run_until_complete(self._round(t))
        self._last_decided.append([r.event for r in self.log.records_[before:]])
        started: list[str] = []
        self._fold_log(started)
        self._start(started, t)

    async def _round(self, t: float) -> None:
        from gpusched.decider import decide_and_append

        if t != self._instant:
            self._instant, self._ticks = t, 0
        for w in self.writers:
            if not w.active():
                continue
            await self._mark_placement(w, t)
            w.rounds += 1
            self._ticks += 1
            now = t + self._ticks * ROUND_S
            appended, conflicted = await decide_and_append(
                w.fold, w.decide, w.kinds, transform=w.transform, rebase=w.rebase, max_reasons=w.max_reasons,
                clock=lambda: now)
            w.appended += appended
            w.conflicts += conflicted
            if appended or conflicted:
                self._dirty = True  # the live services decide again at once after either

    async def _mark_placement(self, w: Writer, t: float) -> None:
        """The fallback says placement is degraded before placing; placement says it recovered."""
        degraded = w.fold.state.placement_degraded
        if w.name == "fallback" and not degraded:
            event: ev.Event = ev.PlacementDegraded(at=t, reason="placement down (simulated)")
        elif w.name == "placement" and degraded:
            event = ev.PlacementRecovered(at=t, reason="placement back (simulated)")
        else:
            return
        await self.log.append(event, msg_id=f"{event.kind}-{self.log.alloc_seq}-{t}")
        await w.fold.catch_up()

    # --- results --------------------------------------------------------------------------

    def summary(self) -> dict:
        out = super().summary()
        out["mode"] = "services"
        out["writers"] = {w.name: {"rounds": w.rounds, "appended": w.appended, "conflicts": w.conflicts}
                          for w in self.writers}
        return out

    def run(self) -> dict:
        try:
            return super().run()
        finally:
            self._loop.close()


__all__ = ["ComposedSimulation", "LogFold", "Writer"]
