"""What every client command shares: connection options, output formats, filters and times.

Shared parent parsers keep each subcommand's definition short and the same everywhere:
`CONNECTION` (--nats, --redis, --creds), `output_parent(...)` (--json, -o, --format, --no-header),
`FILTERS` (--team --user --state --since --until) and `AT` (--at TIME|SEQ).

Output: on a terminal a listing is a coloured table; in a pipe (or with `-o wide`, `--format`,
`--no-header`) it is plain columns as wide as their widest cell, never truncated, like `squeue`;
`--json` and `-o csv` carry every field.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

# --- parent parsers ----------------------------------------------------------------------------


def connection_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("connection")
    g.add_argument("--nats", default=None, help="NATS URL (default: $GPUSCHED_NATS_URL or nats://127.0.0.1:4222)")
    g.add_argument("--redis", default=None, help="Redis URL of the read models (default: $GPUSCHED_REDIS_URL)")
    g.add_argument("--creds", default=None, metavar="FILE",
                   help="credentials (an nkey seed file; default: $GPUSCHED_CREDS, then the client config)")
    g.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the traceback of an error (default: one line)")
    p.set_defaults(client=True)  # this command fails fast when a server is unreachable
    return p


def output_parent(fields: Iterable[str] = ()) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print every field as JSON")
    g.add_argument("--compact", action="store_true", help="with --json: one line")
    names = ", ".join(fields)
    if names:
        g.add_argument("-o", "--output", choices=["table", "wide", "csv", "json"], default="table",
                       help="table (default), wide (more columns), csv, json")
        g.add_argument("--format", metavar="FIELD,...", default=None,
                       help=f"the columns to print, by name: {names}")
        g.add_argument("--no-header", action="store_true", help="print no header line (for scripts)")
    return p


def filters_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("filters")
    g.add_argument("--team", default=None, help="only this team (comma-separated for several)")
    g.add_argument("--user", default=None, help="only jobs of this submitting user (comma-separated)")
    g.add_argument("--state", default=None, help="only these job states (comma-separated)")
    g.add_argument("--since", metavar="TIME", default=None,
                   help="only jobs alive at or after TIME (ISO-8601, epoch seconds, or an age like 2h, 30m, 7d)")
    g.add_argument("--until", metavar="TIME", default=None, help="only jobs submitted at or before TIME")
    return p


def at_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--at", metavar="TIME|SEQ", default=None,
                   help="the cluster as it was: at a log sequence (digits) or a time (ISO-8601, or an age like 2h); "
                        "a time cuts the log where the server had stored up to it")
    return p


CONNECTION = connection_parent()
FILTERS = filters_parent()
AT = at_parent()


# --- times -------------------------------------------------------------------------------------

_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
#: `90m`, `2h`, `1d2h`, `1h30m15s`, `1.5h`: one or more NUMBER UNIT parts, largest first
_PARTS = re.compile(r"^(?:\d+(?:\.\d+)?\s*[wdhms]\s*)+$")
_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([wdhms])")
#: ISO-8601 durations: `PT2H`, `P1DT2H30M`, `PT90S`, `P1W`
_ISO = re.compile(r"^P(?:(\d+(?:\.\d+)?)W)?(?:(\d+(?:\.\d+)?)D)?"
                  r"(?:T(?:(\d+(?:\.\d+)?)H)?(?:(\d+(?:\.\d+)?)M)?(?:(\d+(?:\.\d+)?)S)?)?$")
DURATION_HELP = "seconds, or a duration like 90m, 2h, 1d2h, 1h30m or ISO-8601 PT2H"


def duration_s(text: str) -> float | None:
    """Seconds from the one duration grammar every option shares: plain seconds (`300`), unit
    parts largest first (`90m`, `1d2h`, `1h30m15s`) or ISO-8601 (`PT2H`, `P1DT2H`); None if
    `text` is none of them."""
    t = text.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", t):
        return float(t)
    if _PARTS.match(t.lower()):
        parts = _PART.findall(t.lower())
        units = [u for _, u in parts]
        if units == sorted(units, key=lambda u: -_UNIT[u]) and len(set(units)) == len(units):
            return sum(float(n) * _UNIT[u] for n, u in parts)
        return None
    iso_match = _ISO.match(t.upper())
    if iso_match and t.upper() not in ("P", "PT"):
        w, d, h, m, sec = (float(x) if x else 0.0 for x in iso_match.groups())
        return w * _UNIT["w"] + d * _UNIT["d"] + h * 3600 + m * 60 + sec
    return None


def duration_arg(text: str) -> float:
    """argparse `type=` for a duration option: seconds, or a precise refusal (exit 2)."""
    seconds = duration_s(text)
    if seconds is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration ({DURATION_HELP})")
    return seconds


def _age(text: str) -> float | None:
    """An age (`2h`, `1d2h`, `PT30M`): a duration with a unit; a bare number is a time instead."""
    return None if re.fullmatch(r"\d+(?:\.\d+)?", text.strip()) else duration_s(text)


def parse_time(text: str, now: float | None = None, option: str = "time") -> float:
    """Epoch seconds from ISO-8601 (UTC unless it says), epoch seconds, or an age (`2h` ago)."""
    text = text.strip()
    age = _age(text)
    if age is not None:
        return (time.time() if now is None else now) - age
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"{option} {text!r}: not an ISO-8601 time, epoch seconds or an age like 2h") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def parse_future(text: str, now: float | None = None, option: str = "time") -> float:
    """Epoch seconds from `+DURATION` (`+2h`: from now), ISO-8601 (UTC unless it says) or epoch seconds."""
    text = text.strip()
    if text.startswith("+"):
        ahead = duration_s(text[1:])
        if ahead is None:
            raise UsageError(f"{option} {text!r}: give +DURATION like +2h, an ISO-8601 time or epoch seconds")
        return (time.time() if now is None else now) + ahead
    if _age(text) is not None:
        raise UsageError(f"{option} {text!r}: a time ahead is +{text} (an age would be in the past)")
    return parse_time(text, now, option)


def parse_at(text: str | None, option: str = "--at") -> tuple[int | None, float | None]:
    """`--at`/`--until` of the log: a sequence (digits only) or a time."""
    if text is None:
        return None, None
    if text.isdigit():
        return int(text), None
    try:
        return None, parse_time(text, option=option)
    except UsageError:
        raise UsageError(f"{option} {text!r} is neither a sequence number nor an ISO time "
                         "(nor epoch seconds, nor an age like 2h)") from None


def display_now(meta: dict[str, Any]) -> float:
    """Ages are shown against the wall clock on a live cluster, against the log's last event
    time when the log is old (an audit of a past day) or the listing is of the past (`--at`)."""
    at = meta.get("at") or 0.0
    if meta.get("past"):
        return at
    wall = time.time()
    return max(at, wall) if abs(wall - at) < 86400 else at


def iso(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


class UsageError(Exception):
    """Bad input on the command line: the message says what and why (exit 2, no traceback)."""


# --- filters -----------------------------------------------------------------------------------


def _set(text: str | None) -> set[str] | None:
    return None if not text else {x.strip() for x in text.split(",") if x.strip()}


def filter_docs(docs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Keep the documents that match --team/--user/--state/--since/--until (absent: all)."""
    teams, users, states = _set(getattr(args, "team", None)), _set(getattr(args, "user", None)), \
        _set(getattr(args, "state", None))
    since = getattr(args, "since", None)
    until = getattr(args, "until", None)
    t0 = None if since is None else parse_time(since, option="--since")
    t1 = None if until is None else parse_time(until, option="--until")
    out = []
    for d in docs:
        if teams is not None and d.get("team") not in teams:
            continue
        if users is not None and d.get("user") not in users:
            continue
        if states is not None and d.get("state") not in states:
            continue
        submitted = d.get("submitted_at")
        if t1 is not None and submitted is not None and submitted > t1:
            continue
        if t0 is not None and d.get("finished_at") is not None and d["finished_at"] < t0:
            continue
        out.append(d)
    return out


# --- tables ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """A column: its `--format` name, header and text from one document (and `now`)."""

    name: str
    header: str
    text: Callable[[dict[str, Any], float], str]
    wide: bool = False  # only with `-o wide` (or named in --format)
    right: bool = False


def columns(fields: list[Field], args: argparse.Namespace) -> list[Field]:
    chosen = getattr(args, "format", None)
    if chosen:
        by_name = {f.name: f for f in fields}
        wanted = [x.strip() for x in chosen.split(",") if x.strip()]
        unknown = [x for x in wanted if x not in by_name]
        if unknown:
            raise UsageError(f"--format: unknown field(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
        return [by_name[x] for x in wanted]
    wide = getattr(args, "output", "table") == "wide"
    return [f for f in fields if wide or not f.wide]


def plain_table(rows: list[list[str]], headers: list[str] | None, right: list[bool] | None = None) -> str:
    """Columns padded to their widest cell, two spaces apart; the last column is not padded."""
    table = ([headers] if headers else []) + rows
    if not table:
        return ""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    right = right or [False] * len(widths)
    lines = []
    for r in table:
        cells = [c.rjust(w) if rt else c.ljust(w) for c, w, rt in zip(r, widths, right)]
        if cells and not right[-1]:
            cells[-1] = r[-1]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"


def plain_wanted(args: argparse.Namespace) -> bool:
    """Plain columns unless a terminal shows the default table."""
    return (not sys.stdout.isatty() or getattr(args, "output", "table") != "table"
            or bool(getattr(args, "format", None)) or getattr(args, "no_header", False))


def emit(docs: list[dict[str, Any]], fields: list[Field], args: argparse.Namespace, now: float,
         rich_print: Callable[[], None] | None = None, footer: str | None = None) -> None:
    """Print documents in the format asked for. `footer`: a line under the plain table (what
    the rich table's caption says), left out with `--no-header` (a script's rows only) and in
    CSV and JSON (there the documents carry it)."""
    mode = getattr(args, "output", "table")
    if getattr(args, "json", False) or mode == "json":
        json.dump(docs, sys.stdout, indent=None if getattr(args, "compact", False) else 2, default=str)
        sys.stdout.write("\n")
        return
    cols = columns(fields, args)
    rows = [[f.text(d, now) for f in cols] for d in docs]
    if mode == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        if not getattr(args, "no_header", False):
            writer.writerow([f.name for f in cols])
        writer.writerows(rows)
        return
    if rich_print is not None and not plain_wanted(args):
        rich_print()
        return
    headers = None if getattr(args, "no_header", False) else [f.header for f in cols]
    sys.stdout.write(plain_table(rows, headers, [f.right for f in cols]))
    if footer and headers is not None:
        sys.stdout.write(footer + "\n")


__all__ = ["CONNECTION", "FILTERS", "AT", "output_parent", "Field", "emit", "filter_docs", "parse_time",
           "parse_at", "iso", "display_now", "duration_s", "duration_arg", "UsageError", "plain_table", "columns"]
