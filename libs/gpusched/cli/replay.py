"""`gpusched replay` (audit: rebuild the state at any sequence or time, verify the invariants and,
with `--verify`, every fact's signature, writer and place in the log), `gpusched log export`
(the raw stream as JSON lines, for an audit on another machine: `replay --from-file`), and
`gpusched schemas` (regenerate or check the JSON Schemas in `schemas/`)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpusched.bus.log import EventLog
from gpusched.core import schemas
from gpusched.core.state import ClusterState
from gpusched.security import keyring
from gpusched.security.audit import Audit


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


async def audit_stream(nats_url: str | None, audit: Audit, until_seq: int | None = None) -> None:
    """Feed the stored messages, as they are, to the audit (up to a sequence or `audit.until_time`)."""
    log = await EventLog.open(nats_url, name="gpusched-replay", signer=None)
    try:
        last = await log.last_seq() if until_seq is None else until_seq
        if last >= 1:
            async for msg in log.raw(1, last):
                if not audit.feed(msg):
                    break
    finally:
        await log.close()
    audit.finish()


def audit_file(path: str, audit: Audit, until_seq: int | None = None) -> None:
    """The same audit over an export (`gpusched log export`): no NATS needed."""
    from gpusched.bus.export import ExportError, read_export

    try:
        _, messages = read_export(path)
        for msg in messages:
            if until_seq is not None and msg.seq > until_seq:
                break
            if not audit.feed(msg):
                break
    except (ExportError, OSError) as err:
        raise SystemExit(f"gpusched replay: {err}") from None
    audit.finish()


def default_keys_path() -> Path:
    """Where `replay --verify` looks for the public keys without `--keys`: `$GPUSCHED_KEYS`, else
    `keys.json` in `$GPUSCHED_DATA_DIR`, else in `~/.config/gpusched/`."""
    if os.environ.get("GPUSCHED_KEYS"):
        return Path(os.environ["GPUSCHED_KEYS"])
    from gpusched.security import clientconfig

    trust = clientconfig.resolve("trust")
    if trust and (Path(trust) / "keys.json").exists():
        return Path(trust) / "keys.json"
    if os.environ.get("GPUSCHED_DATA_DIR"):
        return Path(os.environ["GPUSCHED_DATA_DIR"]) / "keys.json"
    return Path.home() / ".config" / "gpusched" / "keys.json"


def load_keys(path: str | None) -> tuple[keyring.KeyRing | None, str]:
    """The keyring and where it came from; a missing default is no keyring (named in the report),
    a missing or bad `--keys FILE` is an error."""
    chosen = Path(path) if path else default_keys_path()
    try:
        return keyring.load(chosen), str(chosen)
    except FileNotFoundError:
        if path:
            raise SystemExit(f"gpusched replay: --keys {path}: no such file") from None
        return None, f"none (no {chosen}; pass --keys FILE)"
    except (OSError, ValueError) as err:  # msgspec errors are ValueErrors
        raise SystemExit(f"gpusched replay: {chosen}: not a keyring ({err})") from None


def print_trust(trust: dict, console: Console) -> None:
    unsigned = f", {trust['unsigned']} unsigned (allowed)" if trust["allow_unsigned"] else ""
    console.print(f"signatures: {trust['signed']} of {trust['messages']} messages signed{unsigned}; "
                  f"keyring {trust['keyring']} ({trust['keys']} keys)")
    first = trust["first"]
    if first is None:
        console.print("[green]trust: every fact signed by a writer allowed to write it, none missing or reordered[/]")
        return
    console.print(f"[red]first untrusted fact: seq {first['seq']}: {first['rule']}: {first['detail']}[/]")
    table = Table(title=f"{trust['total_findings']} trust finding(s)")
    for col in ("seq", "rule", "detail"):
        table.add_column(col)
    for f in trust["findings"][:20]:
        table.add_row(str(f["seq"]), f["rule"], f["detail"])
    console.print(table)


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
    if "trust" in summary:
        print_trust(summary["trust"], console)
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
    if args.verify or args.from_file:
        ring, source = load_keys(args.keys) if args.verify else (None, "")
        audit = Audit(ring, allow_unsigned=args.allow_unsigned, trust=args.verify, until_time=until_time)
        if args.from_file:
            audit_file(args.from_file, audit, until_seq)
        else:
            asyncio.run(audit_stream(args.nats, audit, until_seq))
        summary = audit.state.summary()
        if args.verify:
            summary["trust"] = {**audit.summary(), "keyring": source}
    else:
        summary = asyncio.run(rebuild(args.nats, until_seq, until_time)).summary()
    if args.rebuild_views:
        from gpusched.services.projector import rebuild_views

        summary["views"] = asyncio.run(rebuild_views(args.nats, args.redis))
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_summary(summary, Console())
    return 1 if args.verify and (summary["violations"] or summary["trust"]["first"]) else 0


def cmd_export(args) -> int:
    from gpusched.bus.export import export

    async def run() -> int:
        log = await EventLog.open(args.nats, name="gpusched-export", signer=None)
        try:
            return await export(log, sys.stdout, args.until)
        finally:
            await log.close()

    count = asyncio.run(run())
    sys.stdout.flush()
    print(f"gpusched log export: {count} messages", file=sys.stderr)
    return 0


def cmd_schemas(args) -> int:
    directory = Path(args.dir)
    if args.check:
        stale = schemas.drift(directory)
        for name in stale:
            print(f"{directory / name} is out of date: run `gpusched schemas`", file=sys.stderr)
        return 1 if stale else 0
    for path in schemas.write(directory):
        print(path)
    return 0


def register(sub) -> None:
    p = sub.add_parser("replay", help="audit: rebuild the state from the log and verify the invariants")
    p.add_argument("--until", metavar="SEQ|ISO-TIME", help="stop at this sequence or time")
    p.add_argument("--verify", action="store_true",
                   help="also check every fact's signature, signer's role, node scope and place in the log; "
                        "exit 1 naming the first broken invariant or untrusted fact")
    p.add_argument("--keys", metavar="FILE", help="public keys to verify against (default: $GPUSCHED_KEYS, "
                   "$GPUSCHED_DATA_DIR/keys.json or ~/.config/gpusched/keys.json)")
    p.add_argument("--from-file", metavar="FILE", help="replay an export (`gpusched log export`) instead of NATS")
    p.add_argument("--allow-unsigned", action="store_true",
                   help="count unsigned facts instead of naming them (logs written before signing)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--rebuild-views", action="store_true", help="also rebuild the Redis read models")
    p.add_argument("--nats", help="NATS URL (default: $GPUSCHED_NATS_URL or nats://127.0.0.1:4222)")
    p.add_argument("--redis", help="Redis URL for --rebuild-views (default: $GPUSCHED_REDIS_URL)")
    p.set_defaults(func=cmd_replay)

    lg = sub.add_parser("log", help="the raw log: export it for an offline audit")
    lsub = lg.add_subparsers(dest="log_command", required=True, metavar="ACTION")
    e = lsub.add_parser("export", help="write the stream as JSON lines to stdout (verify with "
                        "`replay --from-file FILE --verify`)")
    e.add_argument("--until", type=int, metavar="SEQ", help="stop at this sequence")
    e.add_argument("--nats", help="NATS URL (default: $GPUSCHED_NATS_URL or nats://127.0.0.1:4222)")
    e.set_defaults(func=cmd_export)

    s = sub.add_parser("schemas", help="write (or --check) the JSON Schemas of commands and events")
    s.add_argument("--dir", default="schemas")
    s.add_argument("--check", action="store_true", help="exit 1 when schemas/ drifts from the code")
    s.set_defaults(func=cmd_schemas)
