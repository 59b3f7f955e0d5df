"""Placement: the normal writer of grants. Follows the log, runs the policy `cycle`, and appends
the `GpusGranted` / `JobResized` / `JobPending` events with compare-and-set over the alloc tree.

Several instances may run: the one holding the lease `placement` (in the NATS key-value bucket
only placement may write: services/lease.py) decides, the others stand by and take over when it
lapses. The lease is only a liveness signal; safety
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

import structlog

from gpusched.core import events as ev
from gpusched.decider import PLACEMENT_KINDS, Decide, decide_and_append
from gpusched.services.runtime import FailedRounds, FoldedLog, Tracker, notify_ready

from .lease import PLACEMENT_LEASE_KEY, Lease, lease_key, open_bucket, owner_id
from .shell import common_arguments, policy_arguments, policy_of, wait_wake

log = structlog.get_logger()



def policy_config(name: str, overrides: list[str] | None = None):
    """A policy preset, with `key=value` overrides of its fields (`min_runtime_s=0`)."""
    return policy_of(argparse.Namespace(policy=name, policy_set=overrides or []))




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
        self.failures = FailedRounds("placement")

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
                    if self.failures.failed():
                        return
                    await asyncio.sleep(0.5)
                    continue
                self.failures.ok()
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
    parser.add_argument("--lease-key", type=lease_key, default=PLACEMENT_LEASE_KEY,
                        help="its key in the lease bucket: 'placement' or 'placement.NAME'")
    parser.add_argument("--lease-ttl-ms", type=int, default=3000)
    parser.add_argument("--debounce-ms", type=float, default=2.0,
                        help="after the fold moves, wait this long so one cycle covers a burst of events")
    parser.add_argument("--tick-ms", type=float, default=5000.0,
                        help="run a cycle at least this often even if nothing happened")
    parser.add_argument("--max-reasons", type=int, default=250,
                        help="JobPending events appended per round at most, and reasons a cycle works out for "
                             "the queue beyond its walk (the rest in later rounds)")


def topo_decider(policy: str, overrides: list[str] | None = None, max_reasons: int | None = None) -> Decide:
    from gpusched.policy.cycle import cycle
    from gpusched.policy.memo import Indexes

    config = policy_config(policy, overrides)
    # this service's indexes of its fold, kept across its cycles; a cycle explains no more of
    # the queue than a round appends (the rest in later cycles)
    indexes = Indexes(tail_reasons=max_reasons)
    return lambda state, now: cycle(state, now, config, indexes)


#: Young-generation threshold of the cyclic collector once the fold is in memory (Python's: 700).
GC_YOUNG = 10_000


def settle_heap() -> None:
    """The fold built at start lives as long as the process: take it out of the cyclic
    collector's sight (`gc.freeze`), and collect young objects less often. In `bench_e2e.py` at
    1,000 nodes (start, backlog fill, 10 s of churn) the collector took 1.26 of the process's
    7.4 CPU-seconds, a single full pass over the fold 0.5 s; with this, 0.16 s (the collection
    here). Reference counting still frees what the fold drops."""
    import gc

    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG, older, oldest)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    policy_config(args.policy, args.policy_set)  # a bad --policy-set stops the start
    decide = topo_decider(args.policy, args.policy_set, args.max_reasons)
    # snapshot (JetStream's, verified) + tail: a restarted (or standby) placement is ready in the time of the tail
    folded = await FoldedLog.open(args.nats, name="gpusched-placement")
    lease = Lease(await open_bucket(folded.log.nc), args.lease_key, owner_id("placement"), args.lease_ttl_ms)
    placement = Placement(folded, lease, decide, debounce_s=args.debounce_ms / 1000.0, tick_s=args.tick_ms / 1000.0,
                          max_reasons=args.max_reasons)
    settle_heap()
    log.info("placement_ready", seq=folded.seen_seq, policy=args.policy, lease=args.lease_key)
    notify_ready()
    try:
        await placement.run(stop)
    finally:
        await folded.close()
