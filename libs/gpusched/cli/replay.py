"""`gpusched replay` (audit: rebuild the state at any sequence or time and verify the invariants)
and `gpusched schemas` (regenerate or check the JSON Schemas in `schemas/`)."""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpusched.bus.log import EventLog
from gpusched.core import schemas
from gpusched.core.state import ClusterState


def parse_until(text: str | None) -> tuple[int | None, float | None]:
    """`--until` is a log sequence (digits) or an ISO-8601 time (UTC when no zone is given)."""
    if text is None:
        return None, None
    if text.isdigit():
        return int(text), None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise SystemExit(f"gpusched replay: --until {text!r} is neither a sequence number nor an ISO time")
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return None, when.timestamp()


async def rebuild(nats_url: str | None, until_seq: int | None = None, until_time: float | None = None) -> ClusterState:
    """Fold the stream from the start up to a sequence or a time (events decided after it)."""
    log = await EventLog.open(nats_url, name="gpusched-replay")
    state = ClusterState()
    try:
        async for seq, event in log.replay(1, until_seq):
            if until_time is not None and event.at > until_time:
                break
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
    p = sub.add_parser("replay", help="audit: rebuild the state from the log and verify the invariants")
    p.add_argument("--until", metavar="SEQ|ISO-TIME", help="stop at this sequence or time")
    p.add_argument("--verify", action="store_true", help="exit 1 when any invariant is broken")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--rebuild-views", action="store_true", help="also rebuild the Redis read models")
    p.add_argument("--nats", help="NATS URL (default: $GPUSCHED_NATS_URL or nats://127.0.0.1:4222)")
    p.add_argument("--redis", help="Redis URL for --rebuild-views (default: $GPUSCHED_REDIS_URL)")
    p.set_defaults(func=cmd_replay)

    s = sub.add_parser("schemas", help="write (or --check) the JSON Schemas of commands and events")
    s.add_argument("--dir", default="schemas")
    s.add_argument("--check", action="store_true", help="exit 1 when schemas/ drifts from the code")
    s.set_defaults(func=cmd_schemas)
