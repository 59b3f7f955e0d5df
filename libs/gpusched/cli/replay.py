"""`gpusched replay` (audit: rebuild the state at any sequence or time, verify the invariants and,
with `--verify`, every fact's signature, writer and place in the log), `gpusched log export`
(the raw stream as JSON lines, for an audit on another machine: `replay --from-file`), and
`gpusched schemas` (regenerate or check the JSON Schemas in `schemas/`)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpusched.bus import subjects
from gpusched.bus.log import EventLog
from gpusched.core import schemas
from gpusched.core.state import ClusterState
from gpusched.security import keyring
from gpusched.security.audit import Audit


def parse_until(text: str | None) -> tuple[int | None, float | None]:
    """`--until` is a log sequence (digits) or a time (ISO-8601, UTC when no zone is given)."""
    from .output import parse_at

    return parse_at(text, option="--until")


async def rebuild(nats_url: str | None, until_seq: int | None = None, until_time: float | None = None,
                  creds: str | None = None) -> ClusterState:
    """Fold the stream from the start up to a sequence, or up to what the server had stored at a
    time (its store timestamps grow with the sequence; the events' own `at` need not)."""
    log = await EventLog.open(nats_url, name="gpusched-replay", creds=creds)
    state = ClusterState()
    try:
        await _whole_stream(log, 1)
        if until_time is not None:
            until_seq = await log.seq_at_time(until_time)
        if until_seq is None or until_seq > 0:
            async for rec in log.records(1, until_seq):
                state.apply(rec.event, rec.seq, rec.time, rec.position)
    finally:
        await log.close()
    return state


async def _whole_stream(log: EventLog, start: int) -> None:
    """Refuse a replay that would silently skip facts aged out of a bounded stream."""
    first = await log.first_seq()
    if first > start and await log.last_seq() > 0:
        raise SystemExit(f"gpusched replay: the stream starts at seq {first} (older facts aged out behind a "
                         f"snapshot); replay the exported segments: --from-file SEG ... [--and-stream]")


async def audit_stream(nats_url: str | None, audit: Audit, until_seq: int | None = None, start: int = 1,
                       finish: bool = True, creds: str | None = None) -> None:
    """Feed the stored messages from `start`, as they are, to the audit (up to a sequence or
    `audit.until_time`), read as `creds`."""
    log = await EventLog.open(nats_url, name="gpusched-replay", signer=None, creds=creds)
    try:
        await _whole_stream(log, start)
        if until_seq is None and audit.until_time is not None:  # what the server had stored by then
            until_seq = await log.seq_at_time(audit.until_time)
        last = await log.last_seq() if until_seq is None else until_seq
        if last >= start:
            async for msg in log.raw(start, last):
                if not audit.feed(msg):
                    break
    finally:
        await log.close()
    if finish:
        audit.finish()


async def audit_from_checkpoint(nats_url: str | None, audit: Audit, path: Path, creds: str | None = None) -> int:
    """`replay --verify --checkpoint FILE`: go on from the audit's checkpoint in FILE (if any)
    after checking that the stream still holds, at its sequence, the message it ended on; audit
    the tail; write the new checkpoint (atomically). Returns the first sequence audited."""
    from gpusched.security.audit import message_digest

    start = 1
    if path.exists():
        try:
            audit.resume(path.read_bytes())
        except (OSError, ValueError) as err:
            raise SystemExit(f"gpusched replay: --checkpoint {path}: {err}") from None
        start = audit.last_seq + 1
        if audit.last_seq:
            log = await EventLog.open(nats_url, name="gpusched-replay", signer=None, creds=creds)
            try:
                joined = [m async for m in log.raw(audit.last_seq, audit.last_seq)]
            finally:
                await log.close()
            if not joined or message_digest(joined[0]) != audit.last_digest:
                raise SystemExit(f"gpusched replay: --checkpoint {path}: the stream's seq {audit.last_seq} is not the "
                                 "message this checkpoint ended on (stream re-created or rewritten): audit from the "
                                 "start (remove the file)")
    await audit_stream(nats_url, audit, start=start, finish=False, creds=creds)
    data = audit.checkpoint()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    audit.finish()
    return start


def audit_file(paths: str | list[str], audit: Audit, until_seq: int | None = None, finish: bool = True) -> bool:
    """The same audit over exports (`gpusched log export`), segments in order: no NATS needed.
    False when it stopped early (at `until_seq` or the audit's time)."""
    from gpusched.bus.export import ExportError, read_export

    try:
        for path in [paths] if isinstance(paths, str) else paths:
            _, messages = read_export(path)
            for msg in messages:
                if (until_seq is not None and msg.seq > until_seq) or not audit.feed(msg):
                    return False
    except (ExportError, OSError) as err:
        raise SystemExit(f"gpusched replay: {err}") from None
    finally:
        if finish:
            audit.finish()
    return True


def default_keys_path() -> Path:
    """Where `replay --verify` looks for the public keys without `--keys`: `$GPUSCHED_KEYS`, else
    the client config's trust dir, else `trust/keys.json` in `$GPUSCHED_DATA_DIR` (where `up`
    writes it), else `~/.config/gpusched/keys.json`."""
    if os.environ.get("GPUSCHED_KEYS"):
        return Path(os.environ["GPUSCHED_KEYS"])
    from gpusched.security import clientconfig

    trust = clientconfig.resolve("trust")
    if trust and (Path(trust) / "keys.json").exists():
        return Path(trust) / "keys.json"
    if os.environ.get("GPUSCHED_DATA_DIR"):
        return Path(os.environ["GPUSCHED_DATA_DIR"]) / "trust" / "keys.json"
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
    if trust.get("audited_from_seq", 1) > 1:
        console.print(f"audited from seq {trust['audited_from_seq']} on (the head: by the checkpoint's earlier audit)")
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
    if args.checkpoint:
        summary = _verify_incremental(args)
    elif args.verify or args.from_file:
        ring, source = load_keys(args.keys) if args.verify else (None, "")
        audit = Audit(ring, allow_unsigned=args.allow_unsigned, trust=args.verify, until_time=until_time)
        if args.from_file and args.and_stream:  # archived segments, then the live stream after them
            if audit_file(args.from_file, audit, until_seq, finish=False):
                asyncio.run(audit_stream(args.nats, audit, until_seq, start=audit.last_seq + 1, creds=args.creds))
            else:
                audit.finish()
        elif args.from_file:
            audit_file(args.from_file, audit, until_seq)
        else:
            asyncio.run(audit_stream(args.nats, audit, until_seq, creds=args.creds))
        summary = audit.state.summary()
        if args.verify:
            summary["trust"] = {**audit.summary(), "keyring": source}
    else:
        summary = asyncio.run(rebuild(args.nats, until_seq, until_time, args.creds)).summary()
    if args.rebuild_views:
        from gpusched.services.projector import rebuild_views

        summary["views"] = asyncio.run(rebuild_views(args.nats, args.redis, args.creds))
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_summary(summary, Console(width=None if sys.stdout.isatty() else 100_000))  # a pipe: never cut
    return 1 if args.verify and (summary["violations"] or summary["trust"]["first"]) else 0


def _verify_incremental(args) -> dict:
    """The audit from a checkpoint to the end of the stream (see `audit_from_checkpoint`)."""
    from gpusched.store import fold_horizon

    if not args.verify or args.from_file or args.until:
        raise SystemExit("gpusched replay: --checkpoint goes with --verify over the live stream (no --from-file, "
                         "no --until)")
    ring, source = load_keys(args.keys)
    audit = Audit(ring, allow_unsigned=args.allow_unsigned, forget_after_s=fold_horizon())
    start = asyncio.run(audit_from_checkpoint(args.nats, audit, Path(args.checkpoint), args.creds))
    summary = audit.state.summary()
    summary["trust"] = {**audit.summary(), "keyring": source, "audited_from_seq": start}
    return summary


def cmd_export(args) -> int:
    from gpusched.bus.export import export

    until_seq, until_time = parse_until(args.until)

    async def run() -> int:
        log = await EventLog.open(args.nats, name="gpusched-export", signer=None, creds=args.creds)
        try:
            until = await log.seq_at_time(until_time) if until_time is not None else until_seq
            return await export(log, sys.stdout, until, start=args.start)
        finally:
            await log.close()

    count = asyncio.run(run())
    sys.stdout.flush()
    print(f"gpusched log export: {count} messages", file=sys.stderr)
    return 0


def cmd_retention(args) -> int:
    """Admin: show or set the live stream's limits (the server drops the oldest facts past them)."""
    async def run() -> dict:
        log = await EventLog.open(args.nats, name="gpusched-retention", signer=None, creds=args.creds)
        try:
            if args.max_age is not None or args.max_msgs is not None or args.max_bytes is not None:
                await log.set_retention(args.max_age,
                                        args.max_msgs, args.max_bytes)
            info = await log.js.stream_info(subjects.STREAM)
            from gpusched.store import SnapshotStore

            metas = await SnapshotStore(log).metas()
            return {"max_age_s": info.config.max_age or 0, "max_msgs": info.config.max_msgs,
                    "max_bytes": info.config.max_bytes, "first_seq": info.state.first_seq,
                    "last_seq": info.state.last_seq, "bytes": info.state.bytes,
                    "newest_snapshot_seq": metas[0].seq if metas else None}
        finally:
            await log.close()

    doc = asyncio.run(run())
    print(json.dumps(doc, indent=2))
    covered = doc["newest_snapshot_seq"] is not None and doc["newest_snapshot_seq"] >= doc["first_seq"] - 1
    if doc["first_seq"] > 1 and not covered:
        print("warning: the stream's head is gone and no snapshot covers it: processes cannot start", file=sys.stderr)
        return 1
    return 0


def cmd_schemas(args) -> int:
    from gpusched import openapi
    from gpusched.bus import asyncapi

    directory = Path(args.dir)
    if args.check:
        stale = schemas.drift(directory) + asyncapi.drift(directory) + openapi.drift(directory)
        for name in stale:
            print(f"{directory / name} is out of date: run `gpusched schemas`", file=sys.stderr)
        return 1 if stale else 0
    for path in schemas.write(directory):
        print(path)
    print(asyncapi.write(directory))
    print(openapi.write(directory))
    return 0


def register(sub) -> None:
    from .output import CONNECTION, DURATION_HELP, duration_arg

    p = sub.add_parser("replay", help="audit: rebuild the state from the log and verify the invariants",
                       parents=[CONNECTION])
    p.add_argument("--until", metavar="SEQ|TIME",
                   help="stop at this log sequence, or at what the server had stored at this time (ISO-8601)")
    p.add_argument("--verify", action="store_true",
                   help="also check every fact's signature, signer's role, node scope and place in the log; "
                        "exit 1 naming the first broken invariant or untrusted fact")
    p.add_argument("--keys", metavar="FILE", help="public keys to verify against (default: $GPUSCHED_KEYS, "
                   "$GPUSCHED_DATA_DIR/trust/keys.json or ~/.config/gpusched/keys.json)")
    p.add_argument("--from-file", metavar="FILE", action="append",
                   help="replay an export (`gpusched log export`) instead of NATS; repeat for segments, in order")
    p.add_argument("--and-stream", action="store_true",
                   help="with --from-file: go on with the live stream after the last exported sequence "
                        "(the whole history of a bounded log)")
    p.add_argument("--checkpoint", metavar="FILE",
                   help="with --verify: go on from the audit checkpoint in FILE (if it exists), audit only the "
                        "tail, and write the new checkpoint there: a repeated audit costs the tail only")
    p.add_argument("--allow-unsigned", action="store_true",
                   help="count unsigned facts instead of naming them (logs written before signing)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--rebuild-views", action="store_true", help="also rebuild the Redis read models")
    p.set_defaults(func=cmd_replay)

    lg = sub.add_parser("log", help="the raw log: export it for an offline audit")
    lsub = lg.add_subparsers(dest="log_command", required=True, metavar="ACTION")
    e = lsub.add_parser("export", parents=[CONNECTION], help="write the stream as JSON lines to stdout (verify with "
                        "`replay --from-file FILE --verify`)")
    e.add_argument("--from", dest="start", type=int, metavar="SEQ",
                   help="start at this sequence (a segment; default: the stream's first)")
    e.add_argument("--until", metavar="SEQ|TIME",
                   help="stop at this sequence, or at what the server had stored at this time (ISO-8601, or an age: 90d)")
    e.set_defaults(func=cmd_export)
    r = lsub.add_parser("retention", parents=[CONNECTION], help="admin: show or bound the live stream "
                        "(max age/messages/bytes; the oldest facts go once exported and behind a snapshot)")
    r.add_argument("--max-age", metavar="AGE", type=duration_arg,
                   help=f"keep facts this long ({DURATION_HELP}; 0: forever)")
    r.add_argument("--max-msgs", type=int, metavar="N", help="keep at most N facts (0: no limit)")
    r.add_argument("--max-bytes", type=int, metavar="N", help="keep at most N bytes (0: no limit)")
    r.set_defaults(func=cmd_retention)

    s = sub.add_parser("schemas", help="write (or --check) the JSON Schemas and the AsyncAPI document of the bus")
    s.add_argument("--dir", default="schemas", help="the directory to write (default: schemas)")
    s.add_argument("--check", action="store_true", help="exit 1 when schemas/ drifts from the code")
    s.set_defaults(func=cmd_schemas)
