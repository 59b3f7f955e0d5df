"""Every service by name: what `gpusched service run NAME` and `gpusched up` start.

A service module exposes `add_arguments(parser)` and `async def serve(args, stop)`. A service whose module is not installed
(yet) is reported as missing and skipped by `gpusched up`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Service:
    name: str
    module: str
    about: str
    #: Started by `gpusched up` (in this order).
    in_stack: bool = True


SERVICES: dict[str, Service] = {s.name: s for s in (
    Service("admission", "gpusched.services.admission", "answers commands; appends accepted facts"),
    Service("placement", "gpusched.services.placement", "topology-aware placement (lease: active/standby)"),
    Service("fallback", "gpusched.services.fallback", "naive placement while the placement lease is lapsed"),
    Service("preemptor", "gpusched.services.preemptor", "preemption requests and releases"),
    Service("quota_ledger", "gpusched.services.quota_ledger", "team usage and standings (Redis, gpusched.q.shares)"),
    Service("reconciler", "gpusched.services.reconciler", "heartbeats vs allocations: lost nodes, zombies"),
    Service("nodeagent", "gpusched.services.nodeagent.main", "node daemons (simulated GPUs unless NVML is found)"),
    Service("projector", "gpusched.services.projector", "read models in Redis for the CLI and dashboard"),
    Service("dashboard", "gpusched.services.dashboard", "web dashboard"),
    Service("api", "gpusched.services.api", "the HTTP API (OpenAPI): the bus's commands and reads as each caller",
            in_stack=False),
    Service("reader", "gpusched.services.reader", "answers tenants' and platforms' reads, scoped to their teams"),
)}


@dataclass(frozen=True)
class Entry:
    add_arguments: Callable[[argparse.ArgumentParser], None]
    serve: Callable[[argparse.Namespace, asyncio.Event], Awaitable[None]]


def available(name: str) -> bool:
    try:
        load(name)
    except (ModuleNotFoundError, AttributeError):
        return False
    return True


def load(name: str) -> Entry:
    """The entry point of a service; ModuleNotFoundError when it is not installed."""
    service = SERVICES[name]
    module = importlib.import_module(service.module)
    add = getattr(module, "add_arguments", None)
    serve = getattr(module, "serve", None)
    if add is None or serve is None:
        raise AttributeError(f"{service.module} has no add_arguments/serve")
    return Entry(add, serve)
