"""The audit of a log: fold it and check that every fact is where it should be and was written
by someone allowed to write it. Pure (no I/O): `gpusched replay --verify` feeds it the live
stream or an export file; an auditor's machine needs nothing but the file and `keys.json`.

For each stored message, in stream order, `Audit.feed` checks:
- `missing`: its stream sequence follows the previous one (a deleted message leaves a gap), and
  its writer's chain number follows that writer's previous fact (a removed fact of a writer);
- `unsigned`, `malformed_signature`, `bad_signature`: it carries a valid `Gpusched-Sig`;
- `unknown_signer`, `revoked_signer`: the key is in the keyring and was not revoked when the
  server stored the message;
- `forbidden_kind`: the signer's role may decide this kind (`roles.may_write`);
- `foreign_node`: a node states facts only about its own node and the jobs it runs in their
  current attempt (`core.fold.checks.node_report_problem`, which the fold applies too), signed or
  not: an unsigned fact on a node's subject is that node's, and one only nodes write that names
  no node is no one's (`--allow-unsigned` counts unsigned facts, it never skips these checks);
- `wrong_subject`: the payload is the fact its subject is for (`subjects.subject_problem`); the
  live readers dead-letter such a message, so the audit does not fold it either;
- `reordered`: its chain number does not go back, and a compare-and-set append was stored right
  after the alloc-tree sequence it was decided at;
- `altered`: the fact is what its writer's next fact committed to (the `prev` digest);
- `undecodable`: it decodes as an event (otherwise it is dead-lettered and not folded).
The invariant violations of the fold (`ClusterState.broken`) are reported as before.

An audit can stop and go on later (`checkpoint` / `resume`, `replay --verify --checkpoint
FILE`): the checkpoint holds the fold and everything the checks carry from one message to the
next (each writer chain's number, digest and unchecked signatures, the findings so far), so a repeated audit costs the tail only. The tail's first fact of each
writer must commit to the digest of that writer's last audited fact, which ties the tail to the
audited head; what the checkpoint vouches for is the head *as it was audited* (re-audit from
the start, or keep the sealed exports, to re-check the head itself).
"""

from __future__ import annotations

import fnmatch
import hashlib
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from gpusched.bus import subjects
from gpusched.core import events as ev
from gpusched.core.fold.checks import NODE_REPORTS, node_report_problem
from gpusched.core.state import ClusterState

from . import roles, signing
from .keyring import KeyRing, Principal

ALLOC_PREFIX = "gpusched.evt.alloc."
#: Signed facts of one chain between two signature checks: a valid signature vouches for every
#: fact before it in its chain (the `prev` links), so checking one in 64 finds any forgery and
#: costs ~1/64 of a verification per fact; a failed check then checks the 64 one by one.
CHECK_EVERY = 64


@dataclass
class _Chain:
    n: int = 0  # the chain's highest fact number so far
    digest: str = "-"  # digest of its last fact
    seq: int = 0  # stream sequence of its last fact
    window: list[tuple[int, int, bytes, bytes, str]] = field(default_factory=list)  # signed, unchecked:
    # (seq, first seq it vouches for, signing input, signature, signer)
    unvouched: int | None = None  # first link since the last signed fact


class Message(Protocol):
    """A stored message (`bus.log.RawMessage`, or a line of an export): read, never written."""

    @property
    def seq(self) -> int: ...
    @property
    def subject(self) -> str: ...
    @property
    def headers(self) -> dict[str, str] | None: ...
    @property
    def data(self) -> bytes: ...
    @property
    def time(self) -> float: ...


class Finding(msgspec.Struct, frozen=True):
    seq: int
    rule: str
    detail: str
    signer: str = ""


class Checkpoint(msgspec.Struct, frozen=True):
    """An audit's place in the log (`Audit.checkpoint`): encoded with msgpack, kept by the auditor."""

    version: int
    last_seq: int
    last_digest: str  # of the last message audited: a resume checks it is still that message
    alloc_seq: int
    allow_unsigned: bool
    counts: dict[str, int]
    chains: list[tuple[str, str, int, str, int, list[tuple[int, int, bytes, bytes, str]], int | None]]
    findings: list[Finding]
    state: bytes


CHECKPOINT_VERSION = 2  # 2: no `placed` (a node's facts are checked against the fold's current placement)


def message_digest(msg: Message) -> str:
    """What a checkpoint records of the last message it audited (subject, signature, data)."""
    sig = ((msg.headers or {}).get(signing.SIG_HEADER) or "").encode()
    return hashlib.sha256(msg.subject.encode() + b"\0" + sig + b"\0" + msg.data).hexdigest()


class Audit:
    """Folds messages and collects trust findings. `keyring` None: no key is known, so every
    signed fact is `unknown_signer`. `allow_unsigned`: count unsigned facts instead of naming
    them (legacy logs written before signing)."""

    def __init__(self, keyring: KeyRing | None, allow_unsigned: bool = False, trust: bool = True,
                 until_time: float | None = None,
                 forget_after_s: float | None = None):
        self.keyring = keyring or KeyRing()
        self.allow_unsigned = allow_unsigned
        self.trust = trust  # False: fold only (a plain replay of an export)
        self.until_time = until_time
        self.state = ClusterState(forget_after_s=forget_after_s)  # the log's FoldSettingsSet facts change both
        self.findings: list[Finding] = []
        self.verifier = signing.Verifier()
        self.last_seq = 0
        self.alloc_seq = 0
        self.chains: dict[tuple[str, str], _Chain] = {}  # (signer, chain id) -> where it stands
        self.counts = {"messages": 0, "signed": 0, "unsigned": 0}
        self.last_digest = ""  # `message_digest` of the last message fed (a checkpoint's join)

    def feed(self, msg: Message) -> bool:
        """Check one message and fold it. False: the message was decided after `until_time`;
        it is not folded and the replay stops there."""
        if not self.trust:
            return self._fold(msg)
        self.counts["messages"] += 1
        if msg.seq != self.last_seq + 1:
            first, last = self.last_seq + 1, msg.seq - 1
            gap = f"sequence {first}" if first == last else f"sequences {first}..{last}"
            if msg.seq <= self.last_seq:
                self._find(msg.seq, "reordered", f"sequence {msg.seq} after {self.last_seq}")
            else:
                self._find(first, "missing", f"{gap} missing from the stream (deleted?)")
        try:
            event: ev.Event | None = ev.decode_event(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            event = None
            self._find(msg.seq, "undecodable", str(err)[:200])
        if self.until_time is not None and msg.time > self.until_time:
            return False
        if event is not None:
            problem = subjects.subject_problem(msg.subject, event)
            if problem is not None:
                self._find(msg.seq, "wrong_subject", problem)
                event = None  # dead-lettered by every live reader: not part of the fold
        self._check_signature(msg, event)
        if msg.seq > self.last_seq:
            self.last_digest = message_digest(msg)
        self.last_seq = max(self.last_seq, msg.seq)
        if msg.subject.startswith(ALLOC_PREFIX):
            self.alloc_seq = msg.seq
        if event is not None:
            self.state.apply(event, msg.seq, msg.time, signing.position(msg.subject, msg.headers))
        return True

    def _fold(self, msg: Message) -> bool:
        try:
            event = ev.decode_event(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return True  # as the live replay: an undecodable message is skipped
        if self.until_time is not None and msg.time > self.until_time:
            return False
        if subjects.subject_problem(msg.subject, event) is None:  # else dead-lettered live: not folded
            self.state.apply(event, msg.seq, msg.time, signing.position(msg.subject, msg.headers))
        return True

    def _find(self, seq: int, rule: str, detail: str, signer: str = "") -> None:
        self.findings.append(Finding(seq, rule, detail, signer))

    def _check_signature(self, msg: Message, event: ev.Event | None) -> None:
        header = (msg.headers or {}).get(signing.SIG_HEADER)
        if header is None:
            self.counts["unsigned"] += 1
            if not self.allow_unsigned:
                self._find(msg.seq, "unsigned", f"{_kind(event, msg)} carries no {signing.SIG_HEADER} header")
            if event is not None:
                self._check_unsigned(msg, event)
            return
        self.counts["signed"] += 1
        try:
            sig = signing.parse(header)
        except ValueError as err:
            self._find(msg.seq, "malformed_signature", str(err))
            return
        principal = self.keyring.principal(sig.signer)
        if principal is None:
            self._find(msg.seq, "unknown_signer", f"{_kind(event, msg)} signed by {sig.signer[:12]}..., "
                       "a key not in the keyring", sig.signer)
            return
        self._check_chain(msg, sig, sig.input(msg.subject, msg.data))
        self._check_principal(msg, event, principal, sig.signer)

    def _check_chain(self, msg: Message, sig: signing.Signature, data: bytes) -> None:
        """The fact's place in its writer's chain; its signature joins the chain's window."""
        chain = self.chains.setdefault((sig.signer, sig.chain), _Chain())
        name = f"writer chain {sig.chain}"
        if sig.n <= chain.n:
            self._find(msg.seq, "reordered", f"fact {sig.n} of {name} comes after fact {chain.n}", sig.signer)
        elif sig.n > chain.n + 1:
            self._find(msg.seq, "missing", f"facts {chain.n + 1}..{sig.n - 1} of {name} are missing before this one",
                       sig.signer)
        elif sig.prev != chain.digest and not self._settle(chain):
            self._find(chain.seq, "altered", f"fact {chain.n} of {name} is not what its writer's next fact "
                       f"(seq {msg.seq}) committed to", sig.signer)
        if sig.cas != "-" and int(sig.cas) != self.alloc_seq:
            self._find(msg.seq, "reordered", f"decided at alloc sequence {sig.cas}, stored after "
                       f"{self.alloc_seq}", sig.signer)
        chain.n, chain.digest, chain.seq = max(chain.n, sig.n), signing.digest(data), msg.seq
        if not sig.sig:  # a link: vouched for by the next signed fact of the chain
            chain.unvouched = chain.unvouched or msg.seq
            return
        chain.window.append((msg.seq, chain.unvouched or msg.seq, data, sig.sig, sig.signer))
        chain.unvouched = None
        if len(chain.window) >= CHECK_EVERY:
            self._settle(chain)

    def _settle(self, chain: _Chain) -> bool:
        """Check the window's newest signature: valid, it vouches (through the links) for every
        fact before it; if not, check each and name the facts that are not the writer's. True
        when something was named."""
        if not chain.window:
            return False
        seq, _, data, sig, signer = chain.window[-1]
        named = False
        if not self.verifier.valid(signer, data, sig):
            for seq, first, data, sig, signer in chain.window:
                if not self.verifier.valid(signer, data, sig):
                    span = f"seq {seq}" if first == seq else f"seqs {first}..{seq}"
                    self._find(first, "bad_signature", f"the signature of {span} does not match the facts or "
                               f"key {signer[:12]}...: not written by its claimed writer", signer)
                    named = True
        chain.window.clear()
        return named

    def finish(self) -> None:
        """Check what is left to check at the end of the log; findings in sequence order."""
        for (signer, chain_id), chain in self.chains.items():
            self._settle(chain)
            if chain.unvouched is not None:
                self._find(chain.unvouched, "unsigned", f"facts from here on of writer chain {chain_id} are "
                           "vouched for by no signed fact", signer)
                chain.unvouched = None
        self.findings.sort(key=lambda f: f.seq)

    def _check_principal(self, msg: Message, event: ev.Event | None, p: Principal, key: str) -> None:
        who = f"{p.name} ({p.role})"
        if p.revoked_at is not None and msg.time >= p.revoked_at:
            self._find(msg.seq, "revoked_signer", f"{_kind(event, msg)} signed by {who} after its key "
                       f"was revoked", key)
        if event is None:
            return
        if not roles.may_write(p.role, event.kind):
            self._find(msg.seq, "forbidden_kind", f"{event.kind} signed by {who}: only "
                       f"{', '.join(sorted(roles.EVENT_WRITERS.get(event.kind, ()))) or 'nobody'} may decide it", key)
        elif p.role == roles.NODE_ROLE:
            own = [n for n in [p.node, *getattr(p, "nodes", [])] if n]  # `nodes`: a host of simulated nodes
            problem = self._foreign(event, own)
            if problem:
                self._find(msg.seq, "foreign_node", f"{event.kind} signed by {who}: {problem}", key)

    def _check_unsigned(self, msg: Message, event: ev.Event) -> None:
        """The role and node checks of an unsigned fact: whoever may publish its subject wrote
        it. A node's subject (`...node.<node>`, its own by permissions) makes it that node's
        fact; a kind only nodes write on any other subject names no node and is no one's."""
        parts = msg.subject.split(".")
        if len(parts) == 6 and parts[4] == "node":
            who = f"unsigned, on node {parts[5]}'s subject"
            if not roles.may_write(roles.NODE_ROLE, event.kind):
                self._find(msg.seq, "forbidden_kind", f"{event.kind} {who}: only "
                           f"{', '.join(sorted(roles.EVENT_WRITERS.get(event.kind, ())))} may decide it")
                return
            problem = self._foreign(event, [getattr(event, "node", None) or parts[5]])
        elif roles.EVENT_WRITERS.get(event.kind) == frozenset({roles.NODE_ROLE}):
            who, problem = "unsigned", f"a fact only node daemons report, on {msg.subject}, which is no node's"
        else:
            return
        if problem:
            self._find(msg.seq, "foreign_node", f"{event.kind} {who}: {problem}")

    def _foreign(self, event: ev.Event, own: list[str]) -> str:
        """Why a node's fact is about something not its own ('' when it is its own): another
        node, a report that names no node, or a job that does not run on it in the reported
        attempt now (the fold's `node_report_problem`, on the fold before this fact). `own`: the
        node names (or globs) the key speaks for."""
        mine = " or ".join(own) or "no node"
        node = getattr(event, "node", None)
        if node is not None and not any(fnmatch.fnmatchcase(node, pattern) for pattern in own):
            return f"about node {node}, not its own ({mine})"
        if type(event) not in NODE_REPORTS:
            return ""
        if node is None:
            return f"about job {event.job_id} (a node's report), naming no node"  # type: ignore[attr-defined]
        return node_report_problem(self.state, event) or ""

    # --- checkpoints ----------------------------------------------------------------------

    def checkpoint(self) -> bytes:
        """Everything needed to go on after `last_seq`; take it before `finish` (which settles
        what the next messages would otherwise settle)."""
        chains = [(signer, chain_id, c.n, c.digest, c.seq, list(c.window), c.unvouched)
                  for (signer, chain_id), c in self.chains.items()]
        return msgspec.msgpack.encode(Checkpoint(
            CHECKPOINT_VERSION, self.last_seq, self.last_digest, self.alloc_seq, self.allow_unsigned,
            dict(self.counts), chains, list(self.findings),
            self.state.snapshot()))

    def resume(self, data: bytes) -> None:
        """Go on from a checkpoint of an audit (raises ValueError when it is not one)."""
        try:
            cp = msgspec.msgpack.decode(data, type=Checkpoint)
            state = ClusterState.restore(cp.state)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            raise ValueError(f"not an audit checkpoint ({err})") from None
        if cp.version != CHECKPOINT_VERSION:
            raise ValueError(f"an audit checkpoint of version {cp.version}, this gpusched reads {CHECKPOINT_VERSION}")
        if cp.allow_unsigned != self.allow_unsigned:
            raise ValueError("the checkpoint was taken with another --allow-unsigned: audit from the start")
        state.last_seq = cp.last_seq
        self.state, self.last_seq, self.last_digest, self.alloc_seq = state, cp.last_seq, cp.last_digest, cp.alloc_seq
        self.counts = dict(cp.counts)
        self.chains = {(signer, chain_id): _Chain(n, digest, seq, [tuple(w) for w in window], unvouched)  # type: ignore[misc]
                       for signer, chain_id, n, digest, seq, window, unvouched in cp.chains}
        self.findings = list(cp.findings)

    # --- results ------------------------------------------------------------------------

    def summary(self) -> dict:
        """What `replay --json` adds under `trust`: counts and the findings, first one first."""
        self.finish()
        findings = self.findings
        return {
            **self.counts,
            "allow_unsigned": self.allow_unsigned,
            "keys": len(self.keyring.keys),
            "first": msgspec.to_builtins(findings[0]) if findings else None,
            "findings": [msgspec.to_builtins(f) for f in findings[:1000]],
            "total_findings": len(findings),
        }


def _kind(event: ev.Event | None, msg: Message) -> str:
    return event.kind if event is not None else f"the message on {msg.subject}"
