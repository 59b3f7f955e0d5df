"""`gpusched replay` (audit: rebuild the state at any sequence or time and verify the invariants)
and `gpusched schemas` (regenerate or check the JSON Schemas in `schemas/`)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpusched.bus.log import EventLog
from gpusched.core import schemas
from gpusched.core.state import ClusterState


def parse_until(text: str | None) -> tuple[int | None, float | None]:
    """`--until` is a log sequence (digits) or a time (ISO-8601, UTC when no zone is given)."""
    from .output import parse_at

    return parse_at(text, option="--until")


async def rebuild(nats_url: str | None, until_seq: int | None = None, until_time: float | None = None) -> ClusterState:
    """Fold the stream from the start up to a sequence, or up to what the server had stored at a
    time (its store timestamps grow with the sequence; the events' own `at` need not)."""
    log = await EventLog.open(nats_url, name="gpusched-replay")
    state = ClusterState()
    try:
        if until_time is not None:
            until_seq = await log.seq_at_time(until_time)
        if until_seq is None or until_seq > 0:
            async for seq, event in log.replay(1, until_seq):
                state.apply(event, seq)
    finally:
        await log.close()
    return state


def print_summary(summary: dict, console: Console) -> None:
    jobs = ", ".join(f"{k} {v}" for k, v in summary["jobs"].items() if v) or "none"
    gpus = summary["gpus"]
    console.print(f"log up to seq {summary['last_seq']} ({summary['events']} events)")
    console.print(f"jobs: {jobs}")
    console.print(f"GPUs: {gpus['total']} total, {gpus['held']} held, {gpus['free']} free, "
                  f"{gpus['unavailable']} unavailable; nodes {summary['nodes']['total']} "
                  f"({summary['nodes']['lost']} lost, {summary['nodes']['drained']} drained)")
    if summary["placement_degraded"]:
        console.print("[yellow]placement degraded: naive first-free placement is active[/]")
    if not summary["violations"]:
        console.print("[green]invariants: all hold[/]")
        return
    table = Table(title=f"{len(summary['violations'])} invariant violation(s)")
    for col in ("seq", "rule", "detail", "jobs", "gpus"):
        table.add_column(col)
    for v in summary["violations"]:
        table.add_row(str(v["seq"]), v["rule"], v["detail"], ", ".join(v["jobs"]), ", ".join(v["gpus"]))
    console.print(table)


def cmd_replay(args) -> int:
    until_seq, until_time = parse_until(args.until)
    state = asyncio.run(rebuild(args.nats, until_seq, until_time))
    summary = state.summary()
    if args.rebuild_views:
        from gpusched.services.projector import rebuild_views

        summary["views"] = asyncio.run(rebuild_views(args.nats, args.redis))
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_summary(summary, Console())
    return 1 if args.verify and summary["violations"] else 0


def cmd_schemas(args) -> int:
    from gpusched.bus import asyncapi

    directory = Path(args.dir)
    if args.check:
        stale = schemas.drift(directory) + asyncapi.drift(directory)
        for name in stale:
            print(f"{directory / name} is out of date: run `gpusched schemas`", file=sys.stderr)
        return 1 if stale else 0
    for path in schemas.write(directory):
        print(path)
    print(asyncapi.write(directory))
    return 0


def register(sub) -> None:
    from .output import CONNECTION

    p = sub.add_parser("replay", help="audit: rebuild the state from the log and verify the invariants",
                       parents=[CONNECTION])
    p.add_argument("--until", metavar="SEQ|TIME",
                   help="stop at this log sequence, or at what the server had stored at this time (ISO-8601)")
    p.add_argument("--verify", action="store_true", help="exit 1 when any invariant is broken")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--rebuild-views", action="store_true", help="also rebuild the Redis read models")
    p.set_defaults(func=cmd_replay)

    s = sub.add_parser("schemas", help="write (or --check) the JSON Schemas and the AsyncAPI document of the bus")
    s.add_argument("--dir", default="schemas", help="the directory to write (default: schemas)")
    s.add_argument("--check", action="store_true", help="exit 1 when schemas/ drifts from the code")
    s.set_defaults(func=cmd_schemas)
