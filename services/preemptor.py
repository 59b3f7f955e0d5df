"""Preemptor: runs the same policy `cycle` as placement on its own fold and appends only the
`PreemptionRequested` and `GpusReleased` events it decides.

One decision function, each service appends its own kinds: the preemptor asks preemptible jobs
to checkpoint and yield (naming the job each request serves), and releases their GPUs when the
job acknowledged with `CheckpointSaved`, or forcibly at the deadline (the lost work counted).
Releases are compare-and-set over the alloc tree like grants, so a stale decision (the job
finished meanwhile) is refused and decided again. It wakes on every fold change and on a short
timer, because deadlines pass without any event. Several instances may run: their requests and
releases carry deterministic message ids (one per job attempt), so duplicates are stored once.
"""

from __future__ import annotations

import argparse
import asyncio

import structlog

from gpusched.decider import PREEMPTOR_KINDS, PREEMPTOR_SKIPS, decide_and_append
from gpusched.services.runtime import FailedRounds, FoldedLog, notify_ready

from .shell import common_arguments, policy_arguments, policy_of, wait_wake

log = structlog.get_logger()



class Preemptor:
    def __init__(self, folded: FoldedLog, config, debounce_s: float = 0.01, tick_s: float = 0.5):
        from gpusched.policy.cycle import cycle
        from gpusched.policy.memo import Indexes

        self.folded = folded
        self.indexes = Indexes()  # its indexes of its fold, kept across its cycles
        self.decide = lambda state, now: cycle(state, now, config, self.indexes, skip=PREEMPTOR_SKIPS)
        self.debounce_s = debounce_s
        self.tick_s = tick_s
        self.appended = 0
        self.failures = FailedRounds("preemptor")

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await wait_wake(self.folded, stop, self.tick_s, self.debounce_s)
            if stop.is_set():
                break
            try:
                appended, conflicted = await decide_and_append(self.folded, self.decide, PREEMPTOR_KINDS)
            except Exception:
                if self.failures.failed():
                    return
                await asyncio.sleep(0.5)
                continue
            self.failures.ok()
            if appended:
                log.info("preemptions_decided", appended=appended)
            self.appended += appended
            if appended or conflicted:
                self.folded.changed.set()  # decide again on the fold that now includes them


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser)
    policy_arguments(parser)
    parser.add_argument("--tick-ms", type=float, default=500.0, help="how often deadlines are checked")


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    config = policy_of(args)
    folded = await FoldedLog.open(args.nats, name="gpusched-preemptor")
    preemptor = Preemptor(folded, config, tick_s=args.tick_ms / 1000.0)
    log.info("preemptor_ready", seq=folded.seen_seq, policy=args.policy)
    notify_ready()
    try:
        await preemptor.run(stop)
    finally:
        await folded.close()
