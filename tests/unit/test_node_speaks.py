"""A node speaks only for itself, and time comes from the log (issue 24): the fold refuses a
node's report about a job that does not run on that node in its current attempt, bounds a fact
dated ahead of its store time, and the audit checks the same facts, signed or not, and that each
payload is the fact its subject is for."""

from __future__ import annotations

import msgspec

from gpusched.bus import subjects
from gpusched.bus.log import RawMessage
from gpusched.core import events as ev
from gpusched.core.fold.checks import AT_LEAD_S
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.core.state import ClusterState
from gpusched.policy.config import PolicyConfig
from gpusched.policy.cycle import cycle
from gpusched.security import signing
from gpusched.security.audit import Audit
from gpusched.security.keyring import KeyRing, Principal

T0 = 1_800_000_000.0  # store times: a real epoch, as JetStream's
DAY = 86_400.0


def node(name: str) -> ev.NodeRegistered:
    return ev.NodeRegistered(at=T0, node=name, rack="r0", gpus=[GpuInfo(index=i, uuid=f"{name}-{i}") for i in range(2)])


def running(job: str, on: str, attempt: int = 1, team: str = "a", **spec) -> list[ev.Event]:
    """A job submitted, granted both GPUs of `on` and started there."""
    return [ev.JobSubmitted(at=T0 + 1, job_id=job, spec=JobSpec(team=team, gpus=2, **spec)),
            ev.GpusGranted(at=T0 + 2, job_id=job, attempt=attempt, gpus=[f"{on}/0", f"{on}/1"]),
            ev.JobStarted(at=T0 + 3, job_id=job, attempt=attempt, node=on)]


def moved(job: str, src: str, dst: str) -> list[ev.Event]:
    """`job` ran on `src` (attempt 1), was preempted, its processes there ended, and it runs on `dst` (attempt 2)."""
    return [*running(job, src, preemptible=True),
            ev.GpusReleased(at=T0 + 4, job_id=job, reason="preempted"),
            ev.ProcessesEnded(at=T0 + 5, job_id=job, attempt=1, node=src),
            ev.GpusGranted(at=T0 + 6, job_id=job, attempt=2, gpus=[f"{dst}/0", f"{dst}/1"]),
            ev.JobStarted(at=T0 + 7, job_id=job, attempt=2, node=dst)]


def folded(events: list[ev.Event]) -> ClusterState:
    state = ClusterState()
    for i, e in enumerate(events):
        state.apply(e, i + 1, T0 + 10 + i)
    return state


def rules_of(state: ClusterState) -> list[str]:
    return [v.rule for v in state.broken]


CLUSTER = [node("node00"), node("node01"), node("node03")]


# --- the fold -------------------------------------------------------------------------------

def test_a_job_completed_from_another_node_ends_nothing():
    state = folded([*CLUSTER, *running("j", "node00"), ev.JobCompleted(at=T0 + 9, job_id="j", attempt=1, node="node03")])
    job = state.jobs["j"]
    assert (job.state, job.gpus) == ("running", ["node00/0", "node00/1"])
    assert rules_of(state) == ["foreign_node"] and state.broken[0].seq == len(CLUSTER) + 4
    assert "node03" in state.broken[0].detail and "node00" in state.broken[0].detail


def test_a_process_failed_release_from_another_node_requeues_nothing():
    state = folded([*CLUSTER, *running("j", "node00", team="b"),
                    ev.GpusReleased(at=T0 + 9, job_id="j", reason="process_failed", lost_gpu_s=5000, node="node03")])
    job = state.jobs["j"]
    assert (job.state, job.restarts, job.lost_gpu_s, state.teams["b"].held) == ("running", 0, 0.0, 2)
    assert rules_of(state) == ["foreign_node"]


def test_a_job_moved_away_is_not_ended_by_its_old_node():
    base = [*CLUSTER, *moved("j", "node03", "node01")]
    for attempt in (1, 2):  # the old attempt (late, not its to end now) and the current one
        state = folded([*base, ev.JobCompleted(at=T0 + 9, job_id="j", attempt=attempt, node="node03")])
        assert state.jobs["j"].state == "running" and state.jobs["j"].attempt == 2
        assert rules_of(state) == ["foreign_node"]
    honest = folded([*base, ev.JobCompleted(at=T0 + 9, job_id="j", attempt=2, node="node01")])
    assert honest.jobs["j"].state == "completed" and honest.broken == []


def test_other_reports_from_another_node_are_refused_and_own_ones_kept():
    base = [*CLUSTER, *running("j", "node00", checkpoint="rank0")]
    forged = [ev.JobStarted(at=T0 + 9, job_id="j", attempt=1, node="node03"),
              ev.CheckpointSaved(at=T0 + 9, job_id="j", attempt=1, path="/x", step=9, node="node03"),
              ev.JobFailed(at=T0 + 9, job_id="j", attempt=1, reason="forged", node="node03"),
              ev.ProcessesEnded(at=T0 + 9, job_id="j", attempt=1, node="node03")]
    state = folded([*base, *forged])
    job = state.jobs["j"]
    assert (job.state, job.checkpoint, [x.node for x in job.live]) == ("running", None, ["node00"])
    assert rules_of(state) == ["foreign_node"] * len(forged)
    own = folded([*base, ev.CheckpointSaved(at=T0 + 9, job_id="j", attempt=1, path="/ok", step=9, node="node00"),
                  ev.JobCompleted(at=T0 + 10, job_id="j", attempt=1, node="node00"),
                  ev.ProcessesEnded(at=T0 + 11, job_id="j", attempt=1, node="node00")])
    assert own.broken == [] and own.jobs["j"].checkpoint.path == "/ok" and own.jobs["j"].live == []


def test_a_node_cannot_end_a_waiting_job():
    """A requeued job waits on no node: a node's completion of it (current attempt or not) is
    refused, or, from the node that ran the released attempt, late and without effect."""
    base = [*CLUSTER, *running("j", "node00", preemptible=True), ev.GpusReleased(at=T0 + 4, job_id="j", reason="preempted")]
    stranger = folded([*base, ev.JobCompleted(at=T0 + 9, job_id="j", attempt=1, node="node03")])
    assert stranger.jobs["j"].state == "pending" and rules_of(stranger) == ["foreign_node"]
    late = folded([*base, ev.JobCompleted(at=T0 + 9, job_id="j", attempt=1, node="node00")])
    assert late.jobs["j"].state == "pending" and late.broken == []


# --- the clock ------------------------------------------------------------------------------

def test_a_fact_dated_400_days_ahead_moves_nothing():
    ahead = T0 + 400 * DAY
    events = [*CLUSTER, *running("j", "node00", time_limit_s=3600.0)]
    state = folded([*events, msgspec.structs.replace(node("node03"), at=ahead)])
    stored = T0 + 10 + len(events)
    assert state.now == stored
    assert rules_of(state) == ["clock_ahead"] and state.nodes["node03"].registered_at == stored + AT_LEAD_S
    decided = cycle(state, max(stored, state.now), PolicyConfig())
    assert not [e for e in decided if isinstance(e, ev.JobTimedOut)]
    assert state.jobs["j"].state == "running"
    # a completion dated ahead ends the job at its bounded time: accounting stays on the server's clock
    done = folded([*events, ev.JobCompleted(at=ahead, job_id="j", attempt=1, node="node00")])
    assert done.jobs["j"].finished_at == T0 + 10 + len(events) + AT_LEAD_S
    assert done.team_gpu_seconds("a")[0] < 2 * 3600


def test_the_store_time_is_the_clock_and_a_late_at_is_kept():
    state = folded([*CLUSTER, *running("j", "node00")])
    assert state.now == T0 + 10 + len(CLUSTER) + 2 and state.jobs["j"].started_at == T0 + 2
    assert state.broken == []


# --- the audit ------------------------------------------------------------------------------

class Stream:
    """Messages as the stream stores them, each signed by its writer's chain (or not)."""

    def __init__(self) -> None:
        self.ring, self.chains, self.msgs = KeyRing(), {}, []
        for name, role, on in [("admission", "admission", None), ("placement", "placement", None),
                               ("preemptor", "preemptor", None), *[(n, "node", n) for n in ("node00", "node01", "node03")]]:
            signer = signing.Signer.generate()
            self.ring.add(signer.public_key, Principal(name=name, role=role, node=on))
            self.chains[name] = signing.Chain(signer)

    def add(self, writer: str | None, event: ev.Event, subject: str | None = None) -> int:
        subject = subject or subjects.event_subject(event)
        payload = ev.encode_event(event)
        headers = {}
        if writer is not None:
            (header,), end = self.chains[writer].sign([(subject, payload)])
            self.chains[writer].advance(1, end)
            headers[signing.SIG_HEADER] = header
        self.msgs.append(RawMessage(len(self.msgs) + 1, subject, headers, payload, T0 + 10 + len(self.msgs)))
        return len(self.msgs)

    def honest(self, events: list[ev.Event]) -> None:
        for e in events:
            self.add(_WRITER.get(type(e)) or getattr(e, "node", None), e)

    def audit(self, allow_unsigned: bool = False) -> Audit:
        audit = Audit(self.ring, allow_unsigned=allow_unsigned)
        for m in self.msgs:
            audit.feed(m)
        audit.finish()
        return audit


_WRITER = {ev.JobSubmitted: "admission", ev.GpusGranted: "placement", ev.GpusReleased: "preemptor"}


def findings(audit: Audit) -> list[tuple[int, str]]:
    return [(f.seq, f.rule) for f in audit.findings]


def test_the_audit_names_a_signed_completion_from_the_node_a_job_moved_away_from():
    log = Stream()
    log.honest([*CLUSTER, *moved("j", "node03", "node01")])
    assert findings(log.audit()) == []
    forged = log.add("node03", ev.JobCompleted(at=T0 + 9, job_id="j", attempt=2, node="node03"))
    audit = log.audit()
    assert findings(audit) == [(forged, "foreign_node")]
    assert audit.state.jobs["j"].state == "running" and [v.rule for v in audit.state.broken] == ["foreign_node"]


def test_allow_unsigned_still_checks_who_may_say_it():
    log = Stream()
    log.honest([*CLUSTER, *running("j", "node00")])
    forged = [log.add(None, ev.JobCompleted(at=T0 + 9, job_id="j", attempt=1, node="node03")),
              log.add(None, ev.GpusReleased(at=T0 + 9, job_id="j", reason="process_failed", lost_gpu_s=5000,
                                            node="node03")),
              log.add(None, ev.JobCompleted(at=T0 + 9, job_id="j", attempt=1))]  # on the alloc shard: no node's
    audit = log.audit(allow_unsigned=True)
    assert findings(audit) == [(seq, "foreign_node") for seq in forged]
    assert audit.counts["unsigned"] == 3 and audit.state.jobs["j"].state == "completed"  # folded, and named
    assert [f.rule for f in log.audit().findings] == ["unsigned", "foreign_node"] * 3


def test_the_audit_checks_each_subject_against_its_payload():
    log = Stream()
    log.honest([*CLUSTER, *running("j", "node00")])
    failed = ev.JobFailed(at=T0 + 9, job_id="j", attempt=1, reason="x", node="node00")
    on_completed = subjects.event_subject(failed).replace("JobFailed", "JobCompleted")
    seq = log.add("node00", failed, subject=on_completed)
    audit = log.audit()
    assert findings(audit) == [(seq, "wrong_subject")]
    assert audit.state.jobs["j"].state == "running"  # dead-lettered live, so not folded here either
