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
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import structlog
from nats.errors import ConnectionClosedError, NoServersError
from nats.errors import TimeoutError as NatsTimeout

from gpusched import health, metrics, telemetry
from gpusched.bus import connection
from gpusched.bus.log import ServerUnsuitable
from gpusched.services import runtime
from gpusched.services.runtime import FoldedLog

log = structlog.get_logger()

Serve = Callable[[argparse.Namespace, asyncio.Event], Coroutine[Any, Any, None]]  # an `async def`: it runs as a task


def common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", default=None, help="NATS URL (default: $GPUSCHED_NATS_URL or nats://127.0.0.1:4222)")
    parser.add_argument("--redis", default=None,
                        help="Redis URL (default: $GPUSCHED_REDIS_URL or redis://127.0.0.1:6379/0)")
    parser.add_argument("--redis-password-file", default=None, metavar="FILE",
                        help="the Redis password, in a file of mode 0600 or an inherited /dev/fd/N "
                             "(default: $GPUSCHED_REDIS_PASSWORD_FILE)")
    parser.add_argument("--log-level", default=os.environ.get("GPUSCHED_LOG_LEVEL", "info"))
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus /metrics and the probes /healthz, /readyz here (0: off)")
    parser.add_argument("--metrics-addr", default=os.environ.get("GPUSCHED_METRICS_ADDR", "127.0.0.1"),
                        help="address of the --metrics-port server (default: $GPUSCHED_METRICS_ADDR or "
                             "127.0.0.1; 0.0.0.0 in a container, for the kubelet's probes)")


#: Exit codes: the supervisor (`gpusched up`, systemd, Kubernetes) restarts on any non-zero.
EXIT_FAILED, EXIT_UNSUITABLE_SERVER, EXIT_DEAF = 1, 2, 3
#: After SIGTERM a service has this long to leave cleanly; then it is ended regardless (with
#: NATS down a drain would wait forever, and systemd or `up` must not be left with orphans).
STOP_GRACE_S = 8.0


def stop_grace_s(args: argparse.Namespace) -> float:
    """How long an orderly stop may take: a node daemon's stop ends its jobs (SIGTERM, SIGKILL
    after `--kill-grace-s`), so it gets that much longer; else a job that ignores SIGTERM
    would outlive its daemon."""
    return STOP_GRACE_S + float(getattr(args, "kill_grace_s", 0.0) or 0.0)


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


#: Policy knobs that change what the fold computes: a live cluster's are a fact of the log
#: (`FoldSettingsSet`), read by every fold; the simulator's come from its policy.
FOLD_KNOBS = ("half_life_s",)


def refuse_fold_knobs(args: argparse.Namespace) -> None:
    for item in getattr(args, "policy_set", None) or []:
        if item.split("=", 1)[0].strip() in FOLD_KNOBS:
            raise SystemExit(f"--policy-set {item}: the usage half-life is a fold setting, recorded in the log so that "
                             "every fold and every replay use the same: `gpusched fold-settings --half-life DURATION`")


def run(serve: Serve, args: argparse.Namespace, service: str) -> int:
    """Run one service until SIGINT/SIGTERM; exit non-zero when it can no longer work."""
    refuse_fold_knobs(args)
    os.environ.setdefault("GPUSCHED_LOG_LEVEL", getattr(args, "log_level", "info"))
    telemetry.setup(service)

    if getattr(args, "metrics_port", 0):
        metrics.start_metrics_server(args.metrics_port, getattr(args, "metrics_addr", "127.0.0.1"))
        metrics.ENABLED = True  # every fold this process starts drives the cluster gauges

    try:
        code = asyncio.run(_main(serve, args, service))
    except KeyboardInterrupt:
        code = 0
    finally:
        telemetry.shutdown()
    return code


async def _main(serve: Serve, args: argparse.Namespace, service: str) -> int:
    telemetry.set_service(service)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    health.bind_loop(loop)  # /healthz: this loop still turning
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    dead: asyncio.Future[str] = loop.create_future()

    def die(reason: str) -> None:
        if not stop.is_set() and not dead.done():
            dead.set_result(reason)

    runtime.on_fatal = die
    connection.on_closed = lambda name, why: die(f"NATS connection {name} closed for good: {why}")
    task = asyncio.create_task(serve(args, stop), name=f"serve-{service}")
    stopped = asyncio.ensure_future(stop.wait())
    first: set[asyncio.Future[Any]] = {task, dead, stopped}  # futures of different results: asyncio.wait's bound
    await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if task.done():
        stopped.cancel()
        return _outcome(task, service)
    if dead.done():
        code = EXIT_DEAF
        log.error("service_exiting", service=service, reason=dead.result()[:500], exit_code=code)
        stop.set()
    grace_s = stop_grace_s(args)
    done, _ = await asyncio.wait({task}, timeout=grace_s)
    if not done:
        log.warning("service_stop_timeout", service=service, grace_s=grace_s)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2.0)
        if not done:  # something swallows cancellation (a drain with the server gone)
            telemetry.shutdown()
            os._exit(code or EXIT_FAILED)
    if not task.cancelled() and task.exception() is not None and code == 0:
        return _outcome(task, service)
    return code


def _outcome(task: asyncio.Task, service: str) -> int:
    """The exit code of a finished `serve`: one line for a failure, never a traceback for the
    expected ones (server unsuitable or unreachable)."""
    if task.cancelled() or task.exception() is None:
        return 0
    err = task.exception()
    if isinstance(err, ServerUnsuitable):
        print(f"gpusched {service}: {err}", file=sys.stderr, flush=True)
        return EXIT_UNSUITABLE_SERVER
    if isinstance(err, (OSError, NoServersError, NatsTimeout, ConnectionClosedError)):
        log.error("service_failed", service=service, error=f"{type(err).__name__}: {err}"[:500])
    else:
        log.error("service_failed", service=service, exc_info=err)
    return EXIT_FAILED


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
