"""The fallback: naive first-free placement while the placement service is gone.

Its own small process (`gpusched service run fallback`), so that killing placement (or its
host) does not take the fallback with it, and placement stays a pure topology-aware writer.
It watches the placement lease (services/lease.py: a key in the NATS key-value bucket that only
placement's credentials may write). When the lease has been absent or lapsed for `--grace-ms`
(and this process has been up that long, so a stack that is still starting is not "degraded"),
it appends `PlacementDegraded` once (the fold's `placement_degraded` is checked first, the
message id is derived from the last recovery's sequence) and then places with `naive_cycle`,
with the same compare-and-set as placement: a double booking is impossible even if placement
comes back mid-append. Its grants carry `placer="naive"`. When a placement instance holds the
lease again, the fallback stops at once and placement appends `PlacementRecovered`.

Several fallbacks may run: the one holding its own lease `fallback` acts (compare-and-set again
if two ever do). The lease bucket lives in the same NATS as the log: a fallback that cannot ask
it cannot append either, so it never acts without its own lease.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time

import structlog

from gpusched.core import events as ev
from gpusched.decider import FALLBACK_KINDS, as_naive, decide_and_append
from gpusched.services.runtime import FailedRounds, FoldedLog, Tracker, notify_ready

from .lease import FALLBACK_LEASE_KEY, PLACEMENT_LEASE_KEY, Lease, Watch, lease_key, open_bucket, owner_id
from .shell import common_arguments, policy_arguments, wait_wake

log = structlog.get_logger()


#: What a placement process writes as the lease's holder (`lease.owner_id("placement")`).
PLACEMENT_OWNER = re.compile(r"placement@[A-Za-z0-9._-]{1,255}:[0-9]{1,10}:[0-9a-f]{6}")


class Fallback:
    def __init__(self, folded: FoldedLog, placement: Watch, own: Lease, grace_s: float,
                 debounce_s: float = 0.005, tick_s: float | None = None):
        from gpusched.policy.cycle import naive_cycle
        from gpusched.policy.memo import Indexes

        self.folded = folded
        self.placement = placement
        self.placement_key = placement.key
        self.own = own
        self.grace_s = grace_s
        self.debounce_s = debounce_s
        self.tick_s = tick_s if tick_s is not None else max(0.05, grace_s / 4)
        self.indexes = Indexes()  # its indexes of its fold, kept across its rounds
        self.decide = lambda state, now: naive_cycle(state, now, self.indexes)
        self.tracker = Tracker(folded)
        self.failures = FailedRounds("fallback")
        self._foreign_said = -1e18
        self.started = time.monotonic()
        self.last_seen_placement = time.monotonic()
        self.grants = 0

    async def placement_lapsed(self) -> str | None:
        """Why placement is considered gone, or None while it is alive (or still starting)."""
        holder = await self.placement.holder()
        now = time.monotonic()
        if holder and not PLACEMENT_OWNER.fullmatch(holder):
            self._foreign(holder)
            holder = None  # only placement may write the key; still, a holder must name one
        if holder:
            self.last_seen_placement = now
            return None
        gone = now - self.last_seen_placement
        if gone < self.grace_s:
            return None
        if holder == "":
            return f"lease bucket unreachable for {gone:.1f}s: placement cannot hold its lease"
        return f"placement lease {self.placement_key} absent or lapsed for {gone:.1f}s"

    def _foreign(self, holder: str) -> None:
        """Say once a minute that the placement lease is held by no placement process."""
        now = time.monotonic()
        if now - self._foreign_said >= 60.0:
            self._foreign_said = now
            log.warning("placement_lease_foreign_holder", key=self.placement_key, holder=holder[:80])

    async def round(self) -> None:
        reason = await self.placement_lapsed()
        if reason is None:
            return
        if not self.own.held:
            return
        state = self.folded.state
        if not state.placement_degraded:
            event = ev.PlacementDegraded(at=max(time.time(), state.now), reason=reason)
            seq = await self.folded.log.append(event, msg_id=f"degraded-{self.tracker.recovered_seq}")
            log.warning("placement_degraded", seq=seq, reason=reason)
            await self.folded.catch_up()
        appended, conflicted = await decide_and_append(
            self.folded, lambda s, now: self.decide(s, now), FALLBACK_KINDS, transform=as_naive,
            rebase=FALLBACK_KINDS,
        )
        self.grants += appended
        if appended or conflicted:
            self.folded.changed.set()

    async def run(self, stop: asyncio.Event) -> None:
        keeper = asyncio.create_task(self.own.keep(stop), name="fallback-lease")
        try:
            while not stop.is_set():
                await wait_wake(self.folded, stop, self.tick_s, self.debounce_s)
                if stop.is_set():
                    break
                try:
                    await self.round()
                except Exception:
                    if self.failures.failed():
                        return
                    await asyncio.sleep(0.5)
                    continue
                self.failures.ok()
        finally:
            await keeper


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser)
    policy_arguments(parser)  # the usage half-life of the running policy: naive order is by fair share
    parser.add_argument("--placement-lease-key", type=lease_key, default=PLACEMENT_LEASE_KEY,
                        help="the placement lease it watches (a key in the lease bucket)")
    parser.add_argument("--lease-key", type=lease_key, default=FALLBACK_LEASE_KEY,
                        help="its own key in the lease bucket: 'fallback' or 'fallback.NAME'")
    parser.add_argument("--lease-ttl-ms", type=int, default=3000)
    parser.add_argument("--grace-ms", type=int, default=None,
                        help="how long the placement lease must be absent before taking over (default: its TTL)")


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    folded = await FoldedLog.open(args.nats, name="gpusched-fallback")
    bucket = await open_bucket(folded.log.nc)
    own = Lease(bucket, args.lease_key, owner_id("fallback"), args.lease_ttl_ms)
    grace_s = (args.grace_ms if args.grace_ms is not None else args.lease_ttl_ms) / 1000.0
    placement = Watch(bucket, args.placement_lease_key, args.lease_ttl_ms)
    fallback = Fallback(folded, placement, own, grace_s)
    log.info("fallback_ready", seq=folded.seen_seq, watching=args.placement_lease_key, grace_s=grace_s)
    notify_ready()
    try:
        await fallback.run(stop)
    finally:
        await folded.close()
