"""Signing and the audit without servers: what is signed, how a chain links, and that the audit
names exactly the fact that was forged, altered, removed or moved, however deep in a chain."""

from __future__ import annotations

import msgspec
import pytest

from gpusched.bus import subjects
from gpusched.bus.log import RawMessage
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.core.state import ClusterState
from gpusched.security import roles, signing, snapshots
from gpusched.security.audit import CHECK_EVERY, Audit
from gpusched.security.keyring import KeyRing, Principal


def test_every_event_kind_has_a_writer_role():
    for kind in ev.EVENT_TYPES:
        assert roles.EVENT_WRITERS.get(kind), f"no role may write {kind}"
    assert roles.may_write("projector", "SnapshotTaken") and not roles.may_write("placement", "SnapshotTaken")


def test_a_signature_covers_subject_payload_and_place_in_the_chain():
    signer = signing.Signer.generate()
    chain = signing.Chain(signer)
    (header,), end = chain.sign([("gpusched.evt.info.JobPending.j1", b'{"x":1}')], first_cas=7)
    sig = signing.parse(header)
    assert (sig.signer, sig.n, sig.prev, sig.cas) == (signer.public_key, 1, "-", "7")
    verifier = signing.Verifier()
    assert verifier.valid(sig.signer, sig.input("gpusched.evt.info.JobPending.j1", b'{"x":1}'), sig.sig)
    assert not verifier.valid(sig.signer, sig.input("gpusched.evt.info.JobPending.j1", b'{"x":2}'), sig.sig)
    assert not verifier.valid(sig.signer, sig.input("gpusched.evt.info.JobPending.j2", b'{"x":1}'), sig.sig)
    assert not verifier.valid("UNOTAKEY", b"", sig.sig)
    chain.advance(1, end)
    headers, _ = chain.sign([("a", b"1"), ("b", b"2")])
    first, last = (signing.parse(h) for h in headers)
    assert (first.n, first.prev, first.sig, last.n, last.prev) == (2, end, b"", 3, signing.digest(first.input("a", b"1")))
    for bad in ("v2 x", "v1 U c 0 - - s", "v1 U c 1 - x s"):
        with pytest.raises(ValueError):
            signing.parse(bad)


def test_the_signing_key_comes_from_the_environment_or_a_creds_file(tmp_path):
    seed = signing.new_seed()
    creds = tmp_path / "placement.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\neyJ0eXAi\n------END NATS USER JWT------\n\n"
                     f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n")
    from_file = signing.signer_from_env({"GPUSCHED_CREDS": str(creds)})
    assert from_file.public_key == signing.Signer.from_seed(seed).public_key
    assert signing.signer_from_env({"GPUSCHED_SIGNING_SEED": seed.decode()}).public_key == from_file.public_key
    assert signing.signer_from_env({}) is None
    (tmp_path / "empty").write_text("nothing here")
    with pytest.raises(ValueError):
        signing.signer_from_env({"GPUSCHED_SIGNING_SEED_FILE": str(tmp_path / "empty")})


def _messages(n_jobs: int) -> tuple[list[RawMessage], KeyRing]:
    """A node's registration, then admission's submissions one by one and placement's grants
    in batches of 10: messages as the stream would store them."""
    ring, out = KeyRing(), []
    chains = {}
    for role in ("node", "admission", "placement"):
        signer = signing.Signer.generate()
        ring.add(signer.public_key, Principal(name=role, role=role, node="n0" if role == "node" else None))
        chains[role] = signing.Chain(signer)

    def store(role: str, events: list[ev.Event]) -> None:
        facts = [(subjects.event_subject(e), ev.encode_event(e)) for e in events]
        headers, end = chains[role].sign(facts)
        chains[role].advance(len(facts), end)
        for (subject, payload), header in zip(facts, headers):
            out.append(RawMessage(len(out) + 1, subject, {signing.SIG_HEADER: header}, payload, 100.0))

    store("node", [ev.NodeRegistered(at=1, node="n0", rack="r", gpus=[GpuInfo(index=i, uuid=f"u{i}") for i in range(n_jobs)])])
    for i in range(n_jobs):
        store("admission", [ev.JobSubmitted(at=2, job_id=f"j{i}", spec=JobSpec(team="a", gpus=1))])
    for i in range(0, n_jobs, 10):
        store("placement", [ev.GpusGranted(at=3, job_id=f"j{k}", attempt=1, gpus=[f"n0/{k}"]) for k in range(i, i + 10)])
    return out, ring


def _audit(msgs: list[RawMessage], ring: KeyRing) -> list[tuple[int, str]]:
    audit = Audit(ring)
    for m in msgs:
        audit.feed(m)
    audit.finish()
    return [(f.seq, f.rule) for f in audit.findings]


def _altered(msg: RawMessage, old: bytes, new: bytes) -> RawMessage:
    assert old in msg.data
    return RawMessage(msg.seq, msg.subject, msg.headers, msg.data.replace(old, new), msg.time)


N = 3 * CHECK_EVERY  # deeper than one verification window


def test_an_honest_log_has_no_findings_and_checks_few_signatures(monkeypatch):
    msgs, ring = _messages(N)
    checked = []
    valid = signing.Verifier.valid
    monkeypatch.setattr(signing.Verifier, "valid", lambda self, *a: checked.append(1) or valid(self, *a))
    assert _audit(msgs, ring) == []
    assert len(checked) < len(msgs) / 8  # one check per window of each chain, not one per fact


@pytest.mark.parametrize("where", ["admission's deep in its chain", "placement's signed batch tip",
                                   "placement's unsigned batch link"])
def test_an_altered_fact_is_named_wherever_it_is(where):
    msgs, ring = _messages(N)
    first_grant = 1 + N + 1
    index = {"admission's deep in its chain": 1 + CHECK_EVERY + 5,  # a submission (one signed fact)
             "placement's signed batch tip": first_grant + 10 * 7 + 9,  # the 8th batch's last grant
             "placement's unsigned batch link": first_grant + 10 * 7 + 3}[where] - 1
    seq = msgs[index].seq
    msgs[index] = _altered(msgs[index], b'"team":"a"' if "admission" in where else b'"attempt":1', b'"team":"b"'
                           if "admission" in where else b'"attempt":2')
    found = _audit(msgs, ring)
    assert found, "the alteration went unnoticed"
    expected = {"admission's deep in its chain": (seq, "bad_signature"),
                "placement's signed batch tip": (seq - 9, "bad_signature"),  # the batch it vouched for
                "placement's unsigned batch link": (seq, "altered")}[where]  # its successor's link disagrees
    assert found[0] == expected, found


def test_removed_and_moved_facts_are_named():
    msgs, ring = _messages(N)

    def renumber(ms: list[RawMessage]) -> list[RawMessage]:
        return [RawMessage(i + 1, m.subject, m.headers, m.data, m.time) for i, m in enumerate(ms)]

    gap = msgs[:20] + msgs[21:]
    assert _audit(gap, ring)[0] == (21, "missing")  # the stream's own sequence
    assert _audit(renumber(gap), ring)[0] == (21, "missing")  # admission's chain skips a fact
    swapped = msgs[:20] + [msgs[21], msgs[20]] + msgs[22:]
    assert _audit(renumber(swapped), ring)[:2] == [(21, "missing"), (22, "reordered")]


def test_a_snapshot_digest_survives_the_round_trip_through_bytes():
    state = ClusterState(half_life_s=3600.0)
    state.apply(ev.NodeRegistered(at=1.5, node="n0", rack="r", gpus=[GpuInfo(index=0, uuid="u")]), 1)
    state.apply(ev.JobSubmitted(at=2.25, job_id="j", spec=JobSpec(team="a", gpus=1, time_limit_s=1.5)), 2)
    state.apply(ev.GpusGranted(at=3.125, job_id="j", attempt=1, gpus=["n0/0"]), 3)
    restored = ClusterState.restore(state.snapshot())
    assert snapshots.digest(restored) == snapshots.digest(state)
    assert snapshots.seal(state) == ev.SnapshotTaken(at=3.125, seq=3, digest=snapshots.digest(state))
    restored.gpus["n0/0"] = msgspec.structs.replace(restored.gpus["n0/0"], holder=None)
    assert snapshots.digest(restored) != snapshots.digest(state)
