"""The hot spots of nats-py on gpusched's paths, done cheaper with the same results.

Every message a service folds goes through nats-py's header parsing (our facts carry
`Nats-Msg-Id`, `Gpusched-Sig`, `traceparent`, batch headers: six lines or so), its `next_msg`
and, in `EventLog._messages`, `Msg.metadata` (a dataclass, a datetime) just to learn the stream
sequence; every fact appended goes through nats-py's header encoding, which sanitises each value
with `str.translate` over a dict (about 5 µs for a signature). Under churn these were about a
third of the placement writer's process (py-spy, `bench_e2e.py`).

- `parse_header_lines` is nats-py 2.16's `Client._parse_header_lines` (same output for every
  input: tests/unit/test_fastpath.py checks it against nats-py's own on arbitrary bytes), with
  the per-character whitespace check of each name done by one C call, once per name.
- `send_publish` is nats-py's `Client._send_publish` (same bytes on the wire for every header
  dict, checked the same way), translating a value only when it holds a CR or LF, checking a
  header name against nats-py's pattern once per name, and joining the command in one go.
- `install(nc)` makes one connection use both; nothing else in nats-py changes.
- `Reader(sub).next()` takes a message that is already waiting in a JetStream push
  subscription's queue without nats-py's per-call task, uuid and timer (its `next_msg` makes all
  three even for a message already there), with the same bookkeeping; it waits through nats-py's
  own `next_msg` when the queue is empty, and yields to the loop every `YIELD_EVERY` messages.
- `position(msg)` reads (stream sequence, pending) from a JetStream message's reply subject,
  the tokens `Msg.metadata` reads, without building the rest.
"""

from __future__ import annotations

import types
from typing import Any

from nats.aio import client as _client
from nats.aio.msg import Msg

_CRLF = b"\r\n"
#: The ASCII characters `str.isspace` is true for: a header name holding one is dropped.
_NAME_SPACE = b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"
_V1_TOKENS = 9  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending>


#: Header names already read, by the raw bytes before the colon: a service reads the same few
#: names on every fact. Only valid names; bounded, so arbitrary input cannot grow it.
_READ_NAMES: dict[bytes, str] = {}
_READ_NAMES_MAX = 256


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """`Name: Value` lines as a dict, exactly as nats-py's `_parse_header_lines` reads them:
    lines without a colon, names with non-ASCII bytes or with whitespace inside are skipped;
    values are stripped and decoded as UTF-8 with replacement; a repeated name keeps the last."""
    out: dict[str, str] = {}
    for line in raw.split(_CRLF):
        head, sep, value = line.partition(b":")
        if not sep:
            continue
        name = _READ_NAMES.get(head)
        if name is None:
            key = head.strip()
            if not key.isascii() or len(key.translate(None, _NAME_SPACE)) != len(key):
                continue
            name = key.decode("ascii")
            if len(_READ_NAMES) < _READ_NAMES_MAX:
                _READ_NAMES[head] = name
        out[name] = value.strip().decode("utf-8", "replace")
    return out


_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
_HDR_START = bytes(_client.NATS_HDR_LINE) + _client._CRLF_


#: Header names already checked, as they go on the wire (`b"Name: "`): a service publishes the
#: same few names on every fact. Only names that need no stripping; bounded, so arbitrary names
#: cannot grow it.
_NAMES: dict[str, bytes] = {}
_NAMES_MAX = 256


def _name(k: str) -> bytes | None:
    """`b"Name: "` for header name `k` as nats-py writes it (stripped; None: an empty name,
    skipped), or its `BadHeaderError` for a name outside its pattern."""
    name = _NAMES.get(k)
    if name is not None:
        return name
    key = k.strip()
    if not key:
        return None
    if not _client._HEADER_KEY_RE.fullmatch(key):
        raise _client.errors.BadHeaderError(key)
    name = key.encode() + b": "
    if key == k and len(_NAMES) < _NAMES_MAX:
        _NAMES[k] = name
    return name


async def send_publish(nc: Any, subject: str, reply: str, payload: bytes, payload_size: int,
                       headers: dict[str, Any] | None) -> None:
    """nats-py's `Client._send_publish` with headers encoded as it encodes them (names checked
    against its pattern, values stripped, CR and LF turned into spaces) and its `HPUB` command
    built in one join; anything else is its own."""
    if headers is None or subject == "":
        return await type(nc)._send_publish(nc, subject, reply, payload, payload_size, headers)
    parts = [_HDR_START]
    for k, v in headers.items():
        name = _name(k)
        if name is None:
            continue
        value = v.strip()
        if "\r" in value or "\n" in value:
            value = value.translate(_NEWLINES)
        parts += (name, value.encode(), _CRLF)
    parts.append(_CRLF)
    hdr = b"".join(parts)
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += payload_size
    size = len(hdr)
    await nc._send_command(b"".join((f"HPUB {subject} {reply} {size} {size + len(payload)}\r\n".encode(), hdr,
                                     payload, _CRLF)))
    if nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()


#: The nats-py internals `send_publish` relies on: with any missing, nats-py publishes as it does.
_PUBLISH_NEEDS = ("NATS_HDR_LINE", "_CRLF_", "_HEADER_KEY_RE", "errors")


def install(nc: Any) -> None:
    """Make connection `nc` parse headers with `parse_header_lines` and encode them with
    `send_publish` (instance attributes: the class, other connections and nats-py's other
    parser, `fast_mail_parser` when installed, are left alone). A nats-py without the methods
    these stand in for keeps its own."""
    cls = type(nc)
    if hasattr(cls, "_parse_header_lines"):
        nc._parse_header_lines = parse_header_lines
    if hasattr(cls, "_send_publish") and all(hasattr(_client, name) for name in _PUBLISH_NEEDS):
        nc._send_publish = types.MethodType(send_publish, nc)


def position(msg: Msg) -> tuple[int, int]:
    """(stream sequence, messages pending) of a message a JetStream consumer delivered: what
    `msg.metadata.sequence.stream` and `msg.metadata.num_pending` say, read from the reply
    subject's tokens alone (either ack format; anything else: nats-py's own parse decides)."""
    tokens = (msg.reply or "").split(".")
    if len(tokens) == _V1_TOKENS and tokens[0] == "$JS" and tokens[1] == "ACK":
        return int(tokens[5]), int(tokens[8])
    meta = msg.metadata
    return meta.sequence.stream, meta.num_pending


def stored_at(msg: Msg) -> float:
    """The server's store time of a message a JetStream consumer delivered (epoch seconds):
    `msg.metadata.timestamp`, read from the reply subject's nanoseconds token alone when it is
    there (either ack format; anything else: nats-py's own parse decides)."""
    tokens = (msg.reply or "").split(".")
    if len(tokens) == _V1_TOKENS and tokens[0] == "$JS" and tokens[1] == "ACK":
        return int(tokens[7]) / 1e9
    return msg.metadata.timestamp.timestamp()


#: A reader taking queued messages without waiting lets the other tasks run this often.
YIELD_EVERY = 64


class Reader:
    """Reads one JetStream push subscription (no callback) in order: `await reader.next()`."""

    def __init__(self, sub: Any):
        self.sub = sub
        self.taken = 0
        inner = getattr(sub, "_sub", None)
        #: nats-py's internals this relies on; any missing: every read goes through `next_msg`.
        self.fast = inner is not None and getattr(inner, "_cb", None) is None and all(
            hasattr(inner, name) for name in ("_pending_queue", "_pending_size", "_jsi", "_conn"))

    async def next(self) -> Msg:
        if not self.fast:
            return await self.sub.next_msg(timeout=None)
        inner = self.sub._sub
        queue = inner._pending_queue
        self.taken += 1
        if queue.empty() or inner._conn.is_closed or self.taken % YIELD_EVERY == 0:
            return await self.sub.next_msg(timeout=None)  # waits (or raises) as nats-py does
        msg = queue.get_nowait()
        # what Subscription.next_msg and PushSubscription.next_msg do after their get
        inner._pending_size -= len(msg.data)
        queue.task_done()
        jsi = inner._jsi
        if jsi:
            jsi._active = True
            if jsi.get_js_delivered() >= jsi._fciseq and jsi._fcr:
                await inner._conn.publish(jsi._fcr)
                jsi._fcr = None
        return msg
