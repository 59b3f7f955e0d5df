"""Heartbeats are bounded per writer at the reconciler: a node flooding its own subject is
remembered at most once per `HEARTBEAT_MIN_GAP_S`, and an oversized heartbeat is dropped unread.
Before, every heartbeat was decoded and appended to each GPU's 60 s sample window (654,000 in
60 s grew the reconciler from 60 to 268 MB, still 250 MB after). A real nats-server with the
generated permissions; the flood comes from a node's own credential."""

from __future__ import annotations

import asyncio
import time

import msgspec

from gpusched.bus import subjects
from gpusched.bus.log import EventLog, connect
from gpusched.core import events as ev
from gpusched.core.heartbeat import GpuSample, Heartbeat
from gpusched.core.model import GpuInfo
from gpusched.services.reconciler import HEARTBEAT_MIN_GAP_S, MAX_HEARTBEAT_BYTES, Reconciler, ReconcilerConfig

NODE = "node05"  # one of the simulated nodes the session's node-host identity speaks for


def beat(seq: int, pids: int = 0) -> bytes:
    gpus = [GpuSample(index=i, uuid=f"G-{i}", utilization_pct=50.0, pids=list(range(pids))) for i in range(8)]
    return msgspec.json.encode(Heartbeat(node=NODE, at=time.time(), agent_id="a", seq=seq, backend="sim", gpus=gpus))


async def test_a_heartbeat_flood_from_one_node_is_bounded_per_node(nats_url, trust):
    log = await EventLog.open(nats_url, name="hb-flood-admin")
    await log.append(ev.NodeRegistered(at=time.time(), node=NODE, rack="r0",
                                       gpus=[GpuInfo(index=i, uuid=f"G-{i}") for i in range(8)]))
    rec = Reconciler(await EventLog.open(nats_url, name="hb-flood"), ReconcilerConfig())
    await rec.start()
    node = await connect(nats_url, creds=str(trust.creds("nodeagent")))
    try:
        await rec.folded.wait_seq(1)
        sent, started = 0, time.monotonic()
        for i in range(6000):  # as fast as one connection publishes
            await node.publish(subjects.heartbeat_subject(NODE), beat(i))
            sent += 1
        huge = beat(99999, pids=30000)  # 8 GPUs x 30,000 pids: over the size bound
        assert len(huge) > MAX_HEARTBEAT_BYTES
        await node.publish(subjects.heartbeat_subject(NODE), huge)
        await node.flush()
        took = time.monotonic() - started
        for _ in range(100):
            if rec.ignored.get("heartbeat_too_large"):
                break
            await asyncio.sleep(0.05)
        remembered = len(rec.obs.samples[f"{NODE}/0"])
        assert remembered <= took / HEARTBEAT_MIN_GAP_S + 2, (remembered, took)
        assert remembered < sent / 10
        assert rec.ignored["heartbeat_too_frequent"] >= sent - remembered - 1
        assert rec.ignored["heartbeat_too_large"] == 1 and rec.obs.heartbeats[NODE].seq != 99999
        assert list(rec._heard) == [subjects.heartbeat_subject(NODE)]  # one entry per registered node
    finally:
        await node.close()
        await rec.stop()
        await log.close()
