"""What signing costs: appends, grants and replays with signatures against the unsigned path,
measured in the same run on the same server. Target (issue 8): within 15% of unsigned.

    python bench/bench_sign.py            # 4,000 appends, 20,000-event replay
    python bench/bench_sign.py --quick    # 1,000 appends, 5,000-event replay

1. ed25519 through nkeys (PyNaCl / libsodium): µs per sign and per verify, alone.
2. single appends, one in flight (a writer's compare-and-set chain at best): appends/s.
3. grants as atomic batches of 64 (a placement cycle): grants/s.
4. replay of a stream written signed vs one written unsigned (fetch + decode + fold, what a
   restarting service does; it does not verify): events/s.
5. `replay --verify` (every signature, chain link, role and invariant checked) vs the plain
   replay of the same signed stream: events/s.
Each pair alternates unsigned/signed rounds (best of `--rounds`), so a noisy machine hits both.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from gpusched.bus.log import EventLog
from gpusched.bus.servers import start_nats
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.core.state import ClusterState
from gpusched.security import signing
from gpusched.security.audit import Audit
from gpusched.security.keyring import KeyRing, Principal

GPUS_PER_NODE = 8


def node(i: int) -> ev.NodeRegistered:
    return ev.NodeRegistered(at=1, node=f"n{i:04d}", rack=f"r{i // 16:02d}",
                             gpus=[GpuInfo(index=g, uuid=f"n{i}-{g}") for g in range(GPUS_PER_NODE)])


def jobs(prefix: str, n: int) -> tuple[list[ev.Event], list[ev.Event]]:
    """n single-GPU jobs: their submissions and their grants, on nodes of 8 GPUs."""
    subs = [ev.JobSubmitted(at=2, job_id=f"{prefix}{i}", spec=JobSpec(team=f"t{i % 4}", gpus=1)) for i in range(n)]
    grants = [ev.GpusGranted(at=3, job_id=f"{prefix}{i}", attempt=1, gpus=[f"n{i // GPUS_PER_NODE:04d}/{i % GPUS_PER_NODE}"])
              for i in range(n)]
    return subs, grants


def crypto_us(n: int) -> tuple[float, float]:
    signer = signing.Signer.generate()
    data = b"x" * 300
    t = time.perf_counter()
    for _ in range(n):
        sig = signer.sign(data)
    sign_us = (time.perf_counter() - t) / n * 1e6
    verifier = signing.Verifier()
    t = time.perf_counter()
    for _ in range(n):
        verifier.valid(signer.public_key, data, sig)
    return sign_us, (time.perf_counter() - t) / n * 1e6


async def single_rate(log: EventLog, events: list[ev.Event]) -> float:
    t = time.perf_counter()
    for e in events:
        await log.append(e)
    return len(events) / (time.perf_counter() - t)


async def batch_rate(log: EventLog, events: list[ev.Event], size: int = 64) -> float:
    t = time.perf_counter()
    for i in range(0, len(events), size):
        await log.append_batch(events[i:i + size])
    return len(events) / (time.perf_counter() - t)


async def fill(url: str, n_jobs: int, ring: KeyRing | None) -> EventLog:
    """Nodes, submissions and grants, each written by its own role's key when `ring` is given."""
    keys = {}
    for role in ("node", "admission", "placement"):
        keys[role] = signing.Signer.generate() if ring is not None else None
        if ring is not None:
            ring.add(keys[role].public_key, Principal(name=f"bench-{role}", role=role, node="n*" if role == "node" else None))
    logs = {role: await EventLog.open(url, name=role, signer=k) for role, k in keys.items()}
    regs = [node(i) for i in range(n_jobs // GPUS_PER_NODE + 1)]
    for i in range(0, len(regs), 500):
        await logs["node"].append_batch(regs[i:i + 500])
    subs, grants = jobs("r", n_jobs)
    for i in range(0, n_jobs, 500):
        await logs["admission"].append_batch(subs[i:i + 500])
        await logs["placement"].append_batch(grants[i:i + 500])
    for role in ("node", "admission"):
        await logs[role].close()
    return logs["placement"]


async def fold_rate(log: EventLog) -> float:
    state = ClusterState()
    t = time.perf_counter()
    async for rec in log.records():
        state.apply(rec.event, rec.seq)
    return state.events / (time.perf_counter() - t)


async def verify_rate(log: EventLog, ring: KeyRing) -> float:
    audit = Audit(ring)
    t = time.perf_counter()
    async for msg in log.raw():
        audit.feed(msg)
    audit.finish()
    rate = audit.counts["messages"] / (time.perf_counter() - t)
    assert not audit.findings, audit.findings[:3]
    return rate


def line(what: str, unsigned: float, signed: float, unit: str) -> None:
    print(f"{what:52s} unsigned {unsigned:9.0f} {unit}   signed {signed:9.0f} {unit}   ratio {signed / unsigned:.2f}")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--appends", type=int, default=None)
    ap.add_argument("--replay", type=int, default=None, help="jobs in the replayed stream (2 events each)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n_app = args.appends or (1000 if args.quick else 4000)
    n_replay = args.replay or (2500 if args.quick else 10000)

    sign_us, verify_us = crypto_us(2000)
    print(f"ed25519 (nkeys -> PyNaCl/libsodium): sign {sign_us:.1f} us, verify {verify_us:.1f} us")

    signer = signing.Signer.generate()
    servers = [start_nats() for _ in range(3)]
    try:
        plain = await EventLog.open(servers[0].url, name="plain", signer=None)
        signed = await EventLog.open(servers[0].url, name="signed", signer=signer)
        best = {"single": [0.0, 0.0], "batch": [0.0, 0.0]}
        for r in range(args.rounds):
            for i, log in enumerate((plain, signed)):
                subs, grants = jobs(f"a{r}{i}-", n_app)
                best["single"][i] = max(best["single"][i], await single_rate(log, subs))
                best["batch"][i] = max(best["batch"][i], await batch_rate(log, grants))
        line(f"single appends, one in flight ({n_app})", *best["single"], "appends/s")
        line(f"grants in atomic batches of 64 ({n_app})", *best["batch"], "grants/s")

        src_plain = await fill(servers[1].url, n_replay, None)
        ring = KeyRing()
        src_signed = await fill(servers[2].url, n_replay, ring)
        folds = [0.0, 0.0]
        verify = 0.0
        for _ in range(args.rounds):
            folds[0] = max(folds[0], await fold_rate(src_plain))
            folds[1] = max(folds[1], await fold_rate(src_signed))
            verify = max(verify, await verify_rate(src_signed, ring))
        events = await src_signed.last_seq()
        line(f"replay: fetch + decode + fold ({events} events)", *folds, "events/s")
        print(f"{'replay --verify of the signed stream':52s} plain replay {folds[1]:9.0f} events/s   "
              f"verified {verify:9.0f} events/s   ratio {verify / folds[1]:.2f}")
        for log in (plain, signed, src_plain, src_signed):
            await log.close()
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    asyncio.run(main())
