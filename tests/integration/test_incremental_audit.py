"""`replay --verify --checkpoint FILE`: an audit that goes on from its own checkpoint audits only
the tail, and finds exactly what a full audit from the start finds; a checkpoint that does not
join the stream (re-created, rewritten) is refused."""

from __future__ import annotations

import msgspec
import pytest

from gpusched.bus import subjects
from gpusched.bus.log import EventLog
from gpusched.cli.replay import audit_from_checkpoint, audit_stream
from gpusched.core import events as ev
from gpusched.security import signing
from gpusched.security.audit import Audit, Checkpoint

from .test_signing import Writers, _last_header, grant, honest_history, submit


@pytest.fixture
async def writers():
    w = Writers()
    yield w
    await w.close()


async def full_audit(nats_url: str, ring) -> Audit:
    audit = Audit(ring)
    await audit_stream(nats_url, audit)
    return audit


async def test_an_audit_from_its_checkpoint_finds_what_a_full_audit_finds(nats_url, writers, tmp_path):
    adm, plc, n0 = await honest_history(nats_url, writers)
    path = tmp_path / "audit.ckpt"
    first = Audit(writers.ring)
    assert await audit_from_checkpoint(nats_url, first, path) == 1
    assert first.findings == [] and path.exists()
    checked = first.last_seq

    # more history, some of it forged: an unsigned cancel and a grant claiming placement's chain
    await adm.append(submit("j4"))
    await plc.append(grant("j4", ["n1/2", "n1/3"]), expect_alloc_seq=await _alloc_seq(plc))
    admin = await EventLog.open(nats_url, name="admin", signer=None)
    try:
        unsigned = await admin.append(ev.JobCancelled(at=6, job_id="j1", reason="forged"))
        forged_grant = grant("j2", ["n1/0", "n1/1"])
        header = await _last_header(plc)
        forged = (await admin.js.publish(subjects.event_subject(forged_grant), ev.encode_event(forged_grant),
                                         headers={signing.SIG_HEADER: header.rsplit(" ", 1)[0] + " " + "A" * 86})).seq
    finally:
        await admin.close()
    await n0.append(ev.JobStarted(at=9, job_id="j1", attempt=1, node="n0", rank=0))

    again = Audit(writers.ring)
    assert await audit_from_checkpoint(nats_url, again, path) == checked + 1  # the tail only
    whole = await full_audit(nats_url, writers.ring)
    named = [(f.seq, f.rule) for f in again.findings]
    assert named == [(f.seq, f.rule) for f in whole.findings]
    assert (unsigned, "unsigned") in named and (forged, "bad_signature") in named
    assert again.counts == whole.counts and again.state.summary() == whole.state.summary()

    nothing_new = Audit(writers.ring)
    assert await audit_from_checkpoint(nats_url, nothing_new, path) == whole.last_seq + 1
    assert [(f.seq, f.rule) for f in nothing_new.findings] == named


async def test_a_checkpoint_that_does_not_join_the_stream_is_refused(nats_url, writers, tmp_path):
    await honest_history(nats_url, writers)
    path = tmp_path / "audit.ckpt"
    await audit_from_checkpoint(nats_url, Audit(writers.ring), path)
    cp = msgspec.msgpack.decode(path.read_bytes(), type=Checkpoint)
    path.write_bytes(msgspec.msgpack.encode(msgspec.structs.replace(cp, last_digest="0" * 64)))
    with pytest.raises(SystemExit, match="re-created or rewritten"):
        await audit_from_checkpoint(nats_url, Audit(writers.ring), path)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match="not an audit checkpoint"):
        await audit_from_checkpoint(nats_url, Audit(writers.ring), path)


async def _alloc_seq(log: EventLog) -> int:
    last = 0
    async for msg in log.raw():
        if msg.subject.startswith("gpusched.evt.alloc."):
            last = msg.seq
    return last


async def test_the_cli_audits_the_tail_from_its_checkpoint(event_log, nats_url, tmp_path):
    import json
    import subprocess
    import sys

    from gpusched.core.model import JobSpec

    def replay(*extra: str) -> dict:
        run = subprocess.run([sys.executable, "-m", "gpusched.cli.main", "replay", "--nats", nats_url, "--verify",
                              "--json", *extra], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr
        return json.loads(run.stdout)

    for i in range(5):
        await event_log.append(ev.JobSubmitted(at=float(i), job_id=f"j-{i}", spec=JobSpec(team="t", gpus=1)))
    path = tmp_path / "audit.ckpt"
    first = replay("--checkpoint", str(path))
    assert first["trust"]["audited_from_seq"] == 1 and first["last_seq"] == 5
    for i in range(5, 8):
        await event_log.append(ev.JobSubmitted(at=float(i), job_id=f"j-{i}", spec=JobSpec(team="t", gpus=1)))
    tail = replay("--checkpoint", str(path))
    whole = replay()
    assert tail["trust"]["audited_from_seq"] == 6 and tail["trust"]["messages"] == whole["trust"]["messages"] == 8
    assert tail["jobs"] == whole["jobs"] and tail["violations"] == whole["violations"] == []
