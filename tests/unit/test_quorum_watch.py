"""The quorum watch's server choice: after leaving a silent server, the others first, in turn;
the left one still tried (it may be the only one up); a pause once a whole round failed. A
single server gets no watch (nowhere to move to)."""

from __future__ import annotations

from urllib.parse import urlparse

from nats.aio.client import Server

from gpusched.bus.connection import QuorumWatch


def servers(*hosts: str) -> list[Server]:
    return [Server(uri=urlparse(f"tls://{h}:4222")) for h in hosts]


def test_the_left_server_comes_last_and_every_server_in_turn():
    watch = QuorumWatch("t", probe_s=1, lost_s=3)
    watch.left = "nats-0.nats:4222"
    pool = servers("nats-0.nats", "nats-1.nats", "nats-2.nats")
    picks = [watch.choose(pool, {}) for _ in range(4)]
    assert [p.uri.hostname for p, _ in picks] == ["nats-1.nats", "nats-2.nats", "nats-0.nats", "nats-1.nats"]
    assert [delay for _, delay in picks] == [0.0, 0.0, 0.0, 0.5]


def test_a_single_server_gets_no_watch():
    options: dict = {}
    assert QuorumWatch.for_servers(["tls://a:4222"], "t", options).lost_s == 0
    assert options == {}
    assert QuorumWatch.for_servers(["tls://a:4222", "tls://b:4222"], "t", options).lost_s > 0
    assert options["reconnect_to_server_handler"] is not None
