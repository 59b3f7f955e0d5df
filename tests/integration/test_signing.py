"""Signed appends and the audit: every fact carries its writer's signature and chain link, and
`replay --verify` names the first forged, unsigned, foreign, reordered or missing fact by its
sequence, on the live stream and on an export verified without NATS."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from gpusched.bus import subjects
from gpusched.bus.export import export, sealed
from gpusched.bus.log import Conflict, EventLog
from gpusched.cli.replay import audit_stream
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.security import keyring, signing
from gpusched.security.audit import Audit
from gpusched.security.keyring import KeyRing, Principal


def node(name: str, gpus: int = 4) -> ev.NodeRegistered:
    return ev.NodeRegistered(at=1, node=name, rack="r0", gpus=[GpuInfo(index=i, uuid=f"{name}-{i}") for i in range(gpus)])


def submit(job: str, gpus: int = 2) -> ev.JobSubmitted:
    return ev.JobSubmitted(at=2, job_id=job, spec=JobSpec(team="a", gpus=gpus), request_id=f"req-{job}")


def grant(job: str, gpus: list[str]) -> ev.GpusGranted:
    return ev.GpusGranted(at=3, job_id=job, attempt=1, gpus=gpus)


class Writers:
    """One signed log per role, and the keyring that names their keys."""

    def __init__(self) -> None:
        self.ring = KeyRing()
        self.logs: dict[str, EventLog] = {}

    async def open(self, nats_url: str, name: str, role: str, node: str | None = None,
                   revoked_at: float | None = None) -> EventLog:
        signer = signing.Signer.generate()
        self.ring.add(signer.public_key, Principal(name=name, role=role, node=node, revoked_at=revoked_at))
        self.logs[name] = await EventLog.open(nats_url, name=name, signer=signer)
        return self.logs[name]

    async def close(self) -> None:
        for log in self.logs.values():
            await log.close()


@pytest.fixture
async def writers():
    w = Writers()
    yield w
    await w.close()


async def audited(nats_url: str, ring: KeyRing, allow_unsigned: bool = False) -> Audit:
    audit = Audit(ring, allow_unsigned=allow_unsigned)
    await audit_stream(nats_url, audit)
    return audit


async def honest_history(nats_url: str, w: Writers) -> tuple[EventLog, EventLog, EventLog]:
    """Admission, placement and two nodes write a small, legal history: single appends, a
    compare-and-set append, an atomic batch, a lost CAS race and a duplicate retry."""
    adm = await w.open(nats_url, "admission", "admission")
    plc = await w.open(nats_url, "placement", "placement")
    n0 = await w.open(nats_url, "node-n0", "node", node="n0")
    n1 = await w.open(nats_url, "node-n1", "node", node="n1")
    await n0.append(node("n0"))
    await n1.append(node("n1"))
    for job in ("j1", "j2", "j3"):
        await adm.append(submit(job))
    alloc = 2  # the two registrations
    with pytest.raises(Conflict):  # a lost race stores nothing and leaves the chain as it was
        await plc.append(grant("j1", ["n0/0", "n0/1"]), expect_alloc_seq=alloc - 1)
    first = await plc.append(grant("j1", ["n0/0", "n0/1"]), msg_id="grant-j1-1", expect_alloc_seq=alloc)
    assert await plc.append(grant("j1", ["n0/0", "n0/1"]), msg_id="grant-j1-1") == first  # a retry: stored once
    with pytest.raises(Conflict):  # a lost batch race: nothing stored either
        await plc.append_batch([grant("j2", ["n0/2", "n0/3"]), grant("j3", ["n1/0", "n1/1"])], expect_alloc_seq=alloc)
    seqs = await plc.append_batch([grant("j2", ["n0/2", "n0/3"]), grant("j3", ["n1/0", "n1/1"])],
                                  expect_alloc_seq=first)
    assert seqs == [first + 1, first + 2]
    await n0.append(ev.JobStarted(at=4, job_id="j1", attempt=1, node="n0"))
    await n1.append(ev.JobCompleted(at=5, job_id="j3", attempt=1, node="n1"))  # as its agent reports it
    return adm, plc, n0


async def test_signed_history_verifies_and_every_append_carries_its_signature(nats_url, writers):
    adm, plc, n0 = await honest_history(nats_url, writers)
    audit = await audited(nats_url, writers.ring)
    assert audit.findings == []
    assert audit.counts == {"messages": 10, "signed": 10, "unsigned": 0}
    assert audit.state.jobs["j3"].state == "completed" and audit.state.jobs["j1"].state == "running"
    async for msg in adm.raw():
        sig = signing.parse(msg.headers[signing.SIG_HEADER])
        assert writers.ring.principal(sig.signer) is not None
    # the environment hook: a seed in GPUSCHED_SIGNING_SEED, or the nkey in a creds file
    seed = signing.new_seed()
    assert signing.signer_from_env({"GPUSCHED_SIGNING_SEED": seed.decode()}).public_key.startswith("U")
    assert signing.signer_from_env({}) is None


async def test_verify_names_unsigned_forged_foreign_and_revoked_facts(nats_url, writers):
    adm, plc, n0 = await honest_history(nats_url, writers)
    # an admin's connection (NATS lets it publish anything) appends with no signature ...
    admin = await EventLog.open(nats_url, name="admin", signer=None)
    try:
        unsigned = await admin.append(ev.JobCancelled(at=6, job_id="j1", reason="forged"))
        # ... and with a signature that claims placement's key and chain but is not placement's
        forged_grant = grant("j2", ["n1/2", "n1/3"])
        payload = ev.encode_event(forged_grant)
        header = (await _last_header(plc)).rsplit(" ", 1)[0] + " " + "A" * 86
        ack = await admin.js.publish(subjects.event_subject(forged_grant), payload,
                                     headers={signing.SIG_HEADER: header})
        forged = ack.seq
    finally:
        await admin.close()
    # a node's own key, used for a kind only placement may decide, and for another node's job
    node_grant = await n0.append(grant("j2", ["n1/2", "n1/3", "n0/3"]))
    foreign = await n0.append(ev.JobCompleted(at=7, job_id="j3", attempt=1))  # j3 ran on n1
    # a key revoked before it signed
    old = await writers.open(nats_url, "old-placement", "placement", revoked_at=time.time() - 60)
    revoked = await old.append(ev.JobPending(at=8, job_id="j2", reason="forged while revoked"))

    audit = await audited(nats_url, writers.ring)
    named = [(f.seq, f.rule) for f in audit.findings]
    assert named[0] == (unsigned, "unsigned")
    assert (forged, "bad_signature") in named
    assert (node_grant, "forbidden_kind") in named
    assert (foreign, "foreign_node") in named
    assert (revoked, "revoked_signer") in named
    assert (forged, "reordered") in named  # it also claimed a place in placement's chain already taken
    assert len(named) == 6, named
    # legacy logs: --allow-unsigned counts the unsigned fact instead of naming it, nothing else
    lenient = await audited(nats_url, writers.ring, allow_unsigned=True)
    assert lenient.counts["unsigned"] == 1 and lenient.findings[0].seq == forged


async def _last_header(log: EventLog) -> str:
    """The header of the last fact `log`'s own writer signed."""
    last = None
    async for msg in log.raw():
        header = (msg.headers or {}).get(signing.SIG_HEADER, "")
        if header.split(" ")[1:2] == [log.signer.public_key]:
            last = header
    assert last is not None
    return last


async def test_a_message_deleted_from_the_middle_is_named_missing(nats_url, writers, tmp_path):
    """The stream gap names the deleted sequence. The live stream denies delete (only a store
    tampered on disk could lose one), so the deletion is made where an attacker could: in the
    export, keeping every other sequence number as the server stored it."""
    await honest_history(nats_url, writers)
    keys = tmp_path / "keys.json"
    keyring.save(writers.ring, keys)
    dump = run_cli("log", "export", "--nats", nats_url)
    assert dump.returncode == 0, dump.stderr
    lines = dump.stdout.splitlines()
    kept = [line for line in lines[1:-1] if json.loads(line).get("seq") != 7]
    assert len(kept) == len(lines) - 3  # j2's grant, in the middle of a batch
    path = tmp_path / "deleted.jsonl"
    path.write_text(sealed(lines[0], kept))  # as an attacker would: the export's seal redone
    result = run_replay_file(path, keys, {"GPUSCHED_NATS_URL": "nats://127.0.0.1:1"})
    assert result.returncode == 1, result.stdout + result.stderr
    findings = json.loads(result.stdout)["trust"]["findings"]
    assert [(f["seq"], f["rule"]) for f in findings][:2] == [(7, "missing"), (8, "missing")]
    assert "sequence 7 missing" in findings[0]["detail"]
    assert "facts 2..2 of writer chain" in findings[1]["detail"]  # placement's own chain skips one


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpusched.cli.main", *args], capture_output=True, text=True,
                          timeout=60)


async def test_export_verifies_offline_and_tampering_with_the_file_is_named(nats_url, writers, tmp_path):
    await honest_history(nats_url, writers)
    keys = tmp_path / "keys.json"
    keyring.save(writers.ring, keys)
    dump = run_cli("log", "export", "--nats", nats_url)
    assert dump.returncode == 0, dump.stderr
    lines = dump.stdout.splitlines()
    assert json.loads(lines[0])["format"] == "gpusched-log-export" and len(lines) == 12  # + the seal line
    exported = tmp_path / "log.jsonl"
    exported.write_text(dump.stdout)
    offline = {"GPUSCHED_NATS_URL": "nats://127.0.0.1:1"}  # no NATS on the auditor's machine
    ok = run_replay_file(exported, keys, offline)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    trust = json.loads(ok.stdout)["trust"]
    assert trust["first"] is None and trust["signed"] == 10

    docs = [json.loads(line) for line in lines[1:-1]]

    def tampered(name: str, msgs: list[dict]) -> dict:
        path = tmp_path / f"{name}.jsonl"
        path.write_text(sealed(lines[0], [json.dumps(m) for m in msgs]))  # as a forger writes it
        result = run_replay_file(path, keys, offline)
        assert result.returncode == 1, result.stdout + result.stderr
        trust = json.loads(result.stdout)["trust"]
        return {**trust["first"], "all": [(f["seq"], f["rule"]) for f in trust["findings"]]}

    # a fact's payload rewritten: j1's grant moved to other GPUs
    altered = [dict(m) for m in docs]
    altered[5]["data"] = altered[5]["data"].replace("n0/1", "n1/3")
    first = tampered("altered", altered)
    assert (first["seq"], first["rule"]) == (6, "bad_signature")
    # a fact removed and the rest renumbered to hide the gap: placement's chain skips one
    removed = [dict(m) for m in docs[:6]] + [{**m, "seq": m["seq"] - 1} for m in docs[7:]]
    first = tampered("removed", removed)
    assert (first["seq"], first["rule"]) == (7, "missing")
    # two facts of one writer swapped (renumbered): its chain skips ahead, then goes back
    swapped = [dict(m) for m in docs]
    swapped[6], swapped[7] = {**docs[7], "seq": 7}, {**docs[6], "seq": 8}
    first = tampered("swapped", swapped)
    assert first["all"][:2] == [(7, "missing"), (8, "reordered")]
    # an export cut at a sequence verifies as the prefix it is
    head = run_cli("log", "export", "--nats", nats_url, "--until", "5")
    assert len(head.stdout.splitlines()) == 7


def run_replay_file(path, keys, env_extra: dict) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-m", "gpusched.cli.main", "replay", "--from-file", str(path),
                           "--keys", str(keys), "--verify", "--json"], capture_output=True, text=True,
                          timeout=60, env=env)


async def test_export_from_the_library_matches_the_stream(nats_url, writers, tmp_path):
    import io

    await honest_history(nats_url, writers)
    log = writers.logs["admission"]
    out = io.StringIO()
    assert await export(log, out, until=4) == 4
    from gpusched.bus.export import read_export

    path = tmp_path / "x.jsonl"
    path.write_text(out.getvalue())
    head, messages = read_export(str(path))
    got = list(messages)
    assert head["last_seq"] == 4 and [m.seq for m in got] == [1, 2, 3, 4]
    assert [m.data async for m in log.raw(1, 4)] == [m.data for m in got]


async def test_concurrent_appends_each_keep_a_chain_in_stream_order(nats_url, writers):
    """Admission appends many submissions at once: each in-flight append takes a chain of its
    own, so pipelining stays (no lock across round trips) and every chain is still exact."""
    import asyncio

    adm = await writers.open(nats_url, "admission", "admission")
    await asyncio.gather(*(adm.append(submit(f"c{i}")) for i in range(200)))
    await asyncio.gather(*(adm.append(submit(f"c{i}")) for i in range(0, 200, 7)))  # duplicates: stored once
    await adm.append(submit("after"))
    audit = await audited(nats_url, writers.ring)
    assert audit.findings == [] and audit.counts["messages"] == 201
    assert 1 < len(audit.chains) <= 200
