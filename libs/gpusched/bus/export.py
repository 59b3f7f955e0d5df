"""Exports of the stream for offline audit (`gpusched log export`, `replay --from-file`).

Format: JSON lines, UTF-8. The first line describes the export:

    {"format": "gpusched-log-export", "version": 1, "stream": "GPUSCHED", "first_seq": 1,
     "last_seq": N, "exported_at": UNIX_SECONDS}

then one line per stored message, in stream order:

    {"seq": 7, "time": UNIX_SECONDS, "subject": "gpusched.evt.alloc.GpusGranted.s12",
     "headers": {"Gpusched-Sig": "v1 U... ...", "Nats-Msg-Id": "..."}, "data": "{\\"type\\":...}"}

`time` is when the server stored it; `data` is the payload exactly as stored (events are JSON;
a payload that is not valid UTF-8 is written as `data_b64`, base64, instead). Headers are all
the stored headers, so the signatures can be checked anywhere with the keyring alone.

Version 2 adds the segment's seal, a last line:

    {"end": true, "messages": N, "sha256": HEX}

the SHA-256 of every message line before it (each with its newline): a file cut short or
edited shows at read time, before any fact is believed. An export is one segment of the log,
`first_seq..last_seq` (`gpusched log export --from SEQ --until SEQ|TIME`); segments verify in
order (`replay --from-file SEG1 --from-file SEG2 ... --verify`), from seq 1, and the audit
continues into the live stream with `--and-stream` (docs/operating.md, "Retention").
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Iterator
from typing import IO

from . import subjects
from .log import EventLog, RawMessage

FORMAT = "gpusched-log-export"
VERSION = 2
READABLE = (1, 2)  # version 1: no seal line


def message_line(msg: RawMessage) -> str:
    doc: dict = {"seq": msg.seq, "time": msg.time, "subject": msg.subject, "headers": dict(msg.headers or {})}
    try:
        doc["data"] = msg.data.decode("utf-8")
    except UnicodeDecodeError:
        doc["data_b64"] = base64.b64encode(msg.data).decode()
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


async def export(log: EventLog, out: IO[str], until: int | None = None, start: int | None = None) -> int:
    """Write the segment `start` (default: the stream's first sequence) through `until` (default:
    its last sequence now) to `out`, sealed; returns the number of messages written."""
    info = await log.js.stream_info(subjects.STREAM)
    last = info.state.last_seq if until is None else min(until, info.state.last_seq)
    first = max(start or 1, info.state.first_seq, 1)
    head = {"format": FORMAT, "version": VERSION, "stream": subjects.STREAM, "first_seq": first,
            "last_seq": last, "stream_first_seq": info.state.first_seq, "exported_at": time.time()}
    out.write(json.dumps(head) + "\n")
    count = 0
    digest = hashlib.sha256()
    if last >= first:
        async for msg in log.raw(first, last):
            line = message_line(msg) + "\n"
            digest.update(line.encode("utf-8"))
            out.write(line)
            count += 1
    out.write(_seal_line(count, digest.hexdigest()))
    return count


def _seal_line(count: int, sha256_hex: str) -> str:
    return json.dumps({"end": True, "messages": count, "sha256": sha256_hex}) + "\n"


def sealed(head_line: str, message_lines: list[str]) -> str:
    """A whole export file from its head line and message lines, sealed as `export` seals it
    (what an operator splicing segments, or a test forging one, must produce)."""
    body = "".join(line + "\n" for line in message_lines)
    return head_line + "\n" + body + _seal_line(len(message_lines), hashlib.sha256(body.encode("utf-8")).hexdigest())


class ExportError(ValueError):
    """An export file that cannot be read, with the line that is wrong."""


def read_export(path: str) -> tuple[dict, Iterator[RawMessage]]:
    """The export's header and its messages (read lazily). Raises ExportError on a bad file,
    and, for a sealed (version 2) file, before its first message when the seal does not match."""
    head = _head(path)
    if head["version"] >= 2:
        _check_seal(path)
    f = open(path, encoding="utf-8")  # noqa: SIM115 - closed by the generator
    f.readline()

    def messages() -> Iterator[RawMessage]:
        with f:
            for lineno, line in enumerate(f, start=2):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                    if doc.get("end") is True:
                        return
                    data = (doc["data"].encode("utf-8") if "data" in doc else base64.b64decode(doc["data_b64"]))
                    yield RawMessage(int(doc["seq"]), str(doc["subject"]), dict(doc.get("headers") or {}),
                                     data, float(doc.get("time", 0.0)))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
                    raise ExportError(f"{path}:{lineno}: bad message line ({err})") from None

    return head, messages()


def _head(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        try:
            head = json.loads(f.readline() or "null")
        except json.JSONDecodeError as err:
            raise ExportError(f"{path}:1: not a {FORMAT} file ({err})") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("version") not in READABLE:
        raise ExportError(f"{path}:1: not a {FORMAT} file of version {' or '.join(map(str, READABLE))}")
    return head


def _check_seal(path: str) -> None:
    """The last line seals every message line: count and SHA-256."""
    digest, count, seal = hashlib.sha256(), 0, None
    with open(path, "rb") as f:
        f.readline()
        for raw in f:
            if seal is not None:
                raise ExportError(f"{path}: lines after the seal")
            if raw.startswith(b'{"end"'):
                try:
                    seal = json.loads(raw)
                except json.JSONDecodeError as err:
                    raise ExportError(f"{path}: the seal line does not parse ({err})") from None
                continue
            digest.update(raw)
            count += 1
    if seal is None:
        raise ExportError(f"{path}: no seal line: the export is cut short")
    if seal.get("messages") != count or seal.get("sha256") != digest.hexdigest():
        raise ExportError(f"{path}: the seal does not match its {count} message lines (altered or cut)")
