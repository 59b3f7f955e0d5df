"""A repeated audit: `replay --verify` from the start (baseline) vs from the audit's own
checkpoint (`replay --verify --checkpoint FILE`), after a tail of new facts.

Writes --events facts of the churn of bench_startup.py (signed atomic batches), audits them
once from the start writing a checkpoint, appends --tail more, then audits again both ways:
the whole log from the start, and the tail from the checkpoint. Prints both times, their ratio,
the checkpoint's size, and checks that both give the same findings and summary.

    python bench/bench_audit.py [--events 100000] [--tail 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from bench_startup import NODES, build, nodes_batch

from gpusched.bus.log import MAX_BATCH, EventLog
from gpusched.bus.servers import start_nats
from gpusched.cli.replay import audit_from_checkpoint, audit_stream
from gpusched.security.audit import Audit
from gpusched.security.keyring import KeyRing, Principal
from gpusched.security.signing import Signer


async def main(n: int, tail: int) -> None:
    server = start_nats()
    try:
        signer = Signer.generate()
        ring = KeyRing()
        ring.add(signer.public_key, Principal(name="bench", role="admin"))
        log = await EventLog.open(server.url, name="bench-audit", signer=signer)
        await log.append_batch(nodes_batch())
        batches = max(1, (n - NODES) // MAX_BATCH)
        await build(log, 0, batches, 1000.0, 4)
        path = Path(tempfile.mkdtemp()) / "audit.ckpt"
        t = time.perf_counter()
        await audit_from_checkpoint(server.url, Audit(ring), path)
        first = time.perf_counter() - t
        await build(log, batches, max(1, tail // MAX_BATCH), 1000.0, 4)
        last = await log.last_seq()
        t = time.perf_counter()
        whole = Audit(ring)
        await audit_stream(server.url, whole)
        full = time.perf_counter() - t
        t = time.perf_counter()
        again = Audit(ring)
        start = await audit_from_checkpoint(server.url, again, path)
        incremental = time.perf_counter() - t
        assert [(f.seq, f.rule) for f in again.findings] == [(f.seq, f.rule) for f in whole.findings]
        assert again.state.summary() == whole.state.summary() and again.counts == whole.counts
        print(f"log: {last} facts; first audit (from the start, writing the checkpoint): {first:.1f} s")
        print(f"full audit from seq 1:                 {full:7.1f} s")
        print(f"audit from the checkpoint (seq {start}..{last}): {incremental:7.1f} s   "
              f"ratio full / incremental: {full / incremental:.1f}x; checkpoint {path.stat().st_size / 1e6:.1f} MB; "
              f"{len(whole.findings)} findings either way")
        await log.close()
    finally:
        server.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--tail", type=int, default=5000)
    a = ap.parse_args()
    asyncio.run(main(a.events, a.tail))
