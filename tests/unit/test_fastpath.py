"""The read path's cheaper header parse and stream position give nats-py's own answers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.msg import Msg

from gpusched.bus import fastpath

FACT_HEADERS = (b"Nats-Msg-Id: grant-j-00001234-1\r\nGpusched-Sig: v1.AbC/+=\r\n"
                b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
                b"Nats-Batch-Id: 3f2a1b4c\r\nNats-Batch-Sequence: 12\r\n\r\n")

ODD = [
    b"",
    b"\r\n\r\n",
    b"NoColon\r\nA: 1\r\n",
    b"A:1\r\nB:\tv \r\nC :  spaced  \r\n",
    b"Bad Name: x\r\nTab\tName: y\r\nSep\x1cName: z\r\n\x1f: w\r\n",
    b"Caf\xc3\xa9: non-ascii name\r\nOk: caf\xc3\xa9\r\nBroken: \xff\xfe\r\n",
    b": empty name\r\n   : blank name\r\nDup: 1\r\nDup: 2\r\n",
    b"Lone\nNewline: x\r\nCR\rInside: y\r\nColons: a:b:c\r\n",
    b" \x0b\x0cPadded\x0b : v\r\n",
]


def test_a_facts_headers_parse_as_nats_py_parses_them():
    assert fastpath.parse_header_lines(FACT_HEADERS) == Client._parse_header_lines(FACT_HEADERS)
    assert fastpath.parse_header_lines(FACT_HEADERS)["Gpusched-Sig"] == "v1.AbC/+="


def test_odd_header_blocks_parse_as_nats_py_parses_them():
    for raw in ODD:
        assert fastpath.parse_header_lines(raw) == Client._parse_header_lines(raw), raw


# bytes drawn mostly from the characters that matter: separators, whitespace, non-ASCII
_pieces = st.sampled_from([b"\r\n", b":", b" ", b"\t", b"\n", b"\r", b"\x0b", b"\x0c", b"\x1c", b"\x1f", b"\x85",
                           b"\xc3\xa9", b"\xff", b"A", b"Nats-Msg-Id", b"x", b"-", b"0"])


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.binary(max_size=80), st.lists(_pieces, max_size=30).map(b"".join)))
def test_any_bytes_parse_as_nats_py_parses_them(raw):
    assert fastpath.parse_header_lines(raw) == Client._parse_header_lines(raw)


def test_install_changes_one_connection_only():
    nc, other = Client(), Client()
    fastpath.install(nc)
    assert nc._parse_header_lines(FACT_HEADERS) == Client._parse_header_lines(FACT_HEADERS)
    assert nc._parse_header_lines is fastpath.parse_header_lines
    assert other._parse_header_lines is not fastpath.parse_header_lines
    assert Client._parse_header_lines is not fastpath.parse_header_lines


def _msg(reply: str) -> Msg:
    return Msg(_client=None, subject="gpusched.evt.x", reply=reply, data=b"{}")  # type: ignore[arg-type]


def test_position_reads_the_tokens_metadata_reads():
    replies = [
        "$JS.ACK.GPUSCHED.ordered-x1.1.48211.17.1764570000123456789.9",  # v1
        "$JS.ACK.GPUSCHED.c.3.1.1.1764570000123456789.0",
        "$JS.ACK._.ACCHASH.GPUSCHED.c.1.77.5.1764570000123456789.3.tok",  # v2, no domain
        "$JS.ACK.hub.ACCHASH.GPUSCHED.c.1.78.6.1764570000123456789.0.tok",  # v2, a domain
    ]
    for reply in replies:
        meta = _msg(reply).metadata
        assert fastpath.position(_msg(reply)) == (meta.sequence.stream, meta.num_pending), reply


def test_position_of_a_message_not_from_jetstream_is_refused_as_metadata_refuses_it():
    import pytest
    from nats.errors import NotJSMessageError

    for reply in ("", "_INBOX.abc", "$JS.ACK.short"):
        with pytest.raises(NotJSMessageError):
            fastpath.position(_msg(reply))


async def _publish_bytes(nc: Client, headers, subject: str = "gpusched.evt.x", reply: str = "") -> bytes | type:
    sent: list[bytes] = []

    async def capture(cmd: bytes, priority: bool = False) -> None:
        sent.append(bytes(cmd))

    nc._send_command = capture  # type: ignore[method-assign]
    nc._flush_queue = None
    try:
        await nc._send_publish(subject, reply, b'{"kind":"x"}', 12, headers)
    except Exception as err:  # the same refusal is part of the same behaviour
        return type(err)
    return b"".join(sent)


async def _both(headers, subject: str = "gpusched.evt.x", reply: str = "") -> tuple:
    fast = Client()
    fastpath.install(fast)
    assert fast._send_publish.__func__ is fastpath.send_publish
    return await _publish_bytes(fast, headers, subject, reply), await _publish_bytes(Client(), headers, subject, reply)


async def test_a_signed_facts_publish_is_the_same_bytes_as_nats_py_sends():
    headers = {"Nats-Msg-Id": "grant-j-1-1", "Gpusched-Sig": "v1." + "AbC+/=" * 20, "Nats-Batch-Id": "3f2a",
               "Nats-Batch-Sequence": "2", "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
    fast, plain = await _both(headers)
    assert fast == plain and fast.startswith(b"HPUB gpusched.evt.x ")
    assert await _both(None) == await _both(None)  # no headers: nats-py's own PUB
    fast, plain = await _both(headers, reply="_INBOX.r")
    assert fast == plain


async def test_odd_headers_publish_as_nats_py_publishes_them():
    for headers in ({" Padded ": " v ", "": "skipped", "  ": "skipped"}, {"A": "line\r\nbreak\rx\ny"},
                    {"Caf\u00e9": "x"}, {"Bad Name": "x"}, {"Ok": "caf\u00e9 \u2028 \u0085"}, {}):
        fast, plain = await _both(headers)
        assert fast == plain, headers


_names = st.text(alphabet=st.sampled_from(list("Ab-_.:~ \t\r\n\u00e9!#")), max_size=8)
_values = st.text(alphabet=st.sampled_from(list("aZ09+/= \t\r\n\u0085\u2028\u00e9:")), max_size=24)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_names, _values, max_size=5))
def test_any_headers_publish_as_nats_py_publishes_them(headers):
    import asyncio

    fast, plain = asyncio.run(_both(headers))
    assert fast == plain


async def test_names_seen_before_read_and_publish_as_the_first_time():
    # the second pass goes through the caches of names already checked
    for _ in range(2):
        for raw in (FACT_HEADERS, *ODD):
            assert fastpath.parse_header_lines(raw) == Client._parse_header_lines(raw), raw
        for headers in ({"Nats-Msg-Id": "a", " Padded ": " v "}, {"Bad Name": "x"}, {"Caf\u00e9": "x"}):
            fast, plain = await _both(headers)
            assert fast == plain, headers
    assert "Nats-Msg-Id" in fastpath._NAMES and " Padded " not in fastpath._NAMES
    assert fastpath._READ_NAMES[b"Gpusched-Sig"] == "Gpusched-Sig"
