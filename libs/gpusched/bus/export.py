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
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from typing import IO

from . import subjects
from .log import EventLog, RawMessage

FORMAT = "gpusched-log-export"
VERSION = 1


def message_line(msg: RawMessage) -> str:
    doc: dict = {"seq": msg.seq, "time": msg.time, "subject": msg.subject, "headers": dict(msg.headers or {})}
    try:
        doc["data"] = msg.data.decode("utf-8")
    except UnicodeDecodeError:
        doc["data_b64"] = base64.b64encode(msg.data).decode()
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


async def export(log: EventLog, out: IO[str], until: int | None = None) -> int:
    """Write the stream (through `until`, default: its last sequence now) to `out`; returns the
    number of messages written."""
    info = await log.js.stream_info(subjects.STREAM)
    last = info.state.last_seq if until is None else min(until, info.state.last_seq)
    head = {"format": FORMAT, "version": VERSION, "stream": subjects.STREAM, "first_seq": info.state.first_seq,
            "last_seq": last, "exported_at": time.time()}
    out.write(json.dumps(head) + "\n")
    count = 0
    if last >= 1:
        async for msg in log.raw(1, last):
            out.write(message_line(msg) + "\n")
            count += 1
    return count


class ExportError(ValueError):
    """An export file that cannot be read, with the line that is wrong."""


def read_export(path: str) -> tuple[dict, Iterator[RawMessage]]:
    """The export's header and its messages (read lazily). Raises ExportError on a bad file."""
    f = open(path, encoding="utf-8")  # noqa: SIM115 - closed by the generator
    try:
        head = json.loads(f.readline() or "null")
    except json.JSONDecodeError as err:
        f.close()
        raise ExportError(f"{path}:1: not a {FORMAT} file ({err})") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("version") != VERSION:
        f.close()
        raise ExportError(f"{path}:1: not a {FORMAT} version {VERSION} file")

    def messages() -> Iterator[RawMessage]:
        with f:
            for lineno, line in enumerate(f, start=2):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                    data = (doc["data"].encode("utf-8") if "data" in doc else base64.b64decode(doc["data_b64"]))
                    yield RawMessage(int(doc["seq"]), str(doc["subject"]), dict(doc.get("headers") or {}),
                                     data, float(doc.get("time", 0.0)))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
                    raise ExportError(f"{path}:{lineno}: bad message line ({err})") from None

    return head, messages()
