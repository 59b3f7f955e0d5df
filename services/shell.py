"""What the control-plane service processes share: common options, logging, signal handling,
and a loop that wakes on fold changes (debounced) or on a timer.

A service module exposes `add_arguments(parser)` and `async def serve(args, stop)`; `run`
starts it with SIGINT/SIGTERM setting `stop` so that it leaves cleanly (leases released,
connections drained).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Awaitable, Callable

import structlog

from gpusched import metrics, telemetry
from gpusched.services.runtime import FoldedLog

log = structlog.get_logger()

Serve = Callable[[argparse.Namespace, asyncio.Event], Awaitable[None]]


def common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", default=None, help="NATS URL (default: $GPUSCHED_NATS_URL or nats://127.0.0.1:4222)")
    parser.add_argument("--redis", default=None,
                        help="Redis URL (default: $GPUSCHED_REDIS_URL or redis://127.0.0.1:6379/0)")
    parser.add_argument("--log-level", default=os.environ.get("GPUSCHED_LOG_LEVEL", "info"))
    parser.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics here (0: off)")


def policy_arguments(parser: argparse.ArgumentParser) -> None:
    """`--policy` and `--policy-set`: the running policy, for every service that decides or
    explains with it (placement, preemptor, projector) and the CLI views."""
    parser.add_argument("--policy", default="full", help="policy preset (default: full)")
    parser.add_argument("--policy-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one field of the preset, e.g. checkpoint_grace_s=30 (repeatable)")


def policy_of(args: argparse.Namespace):
    """The PolicyConfig the arguments name (exits with the parser's message on bad input)."""
    from gpusched.policy.config import parse_policy

    try:
        return parse_policy(getattr(args, "policy", "full"), getattr(args, "policy_set", None) or [])
    except ValueError as err:
        raise SystemExit(f"--policy-set: {err}") from None


def run(serve: Serve, args: argparse.Namespace, service: str) -> int:
    """Run one service until SIGINT/SIGTERM."""
    os.environ.setdefault("GPUSCHED_LOG_LEVEL", getattr(args, "log_level", "info"))
    telemetry.setup(service)

    if getattr(args, "metrics_port", 0):
        metrics.start_metrics_server(args.metrics_port)
        metrics.ENABLED = True  # every fold this process starts drives the cluster gauges

    async def main() -> None:
        telemetry.set_service(service)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(args, stop)

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        telemetry.shutdown()
    return 0


async def wait_wake(folded: FoldedLog, stop: asyncio.Event, tick_s: float, debounce_s: float) -> None:
    """Sleep until the fold moves (then a short debounce so one decision covers a burst of
    events), the timer ticks, or `stop` is set."""
    if stop.is_set():
        return
    changed = asyncio.ensure_future(folded.changed.wait())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({changed, stopped}, timeout=tick_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        changed.cancel()
        stopped.cancel()
    if folded.changed.is_set() and debounce_s > 0 and not stop.is_set():
        await asyncio.sleep(debounce_s)
    folded.changed.clear()
