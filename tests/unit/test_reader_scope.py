"""Who asks and what they get back, without servers: the reader takes the caller's team from the
subject the server allowed (never the payload), shows another team's job as no job at all and
masks other teams' job ids; admission takes a platform's on-behalf user from the subject too."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.bus import subjects
from gpusched.core import events as ev
from gpusched.core.commands import SubmitJob
from gpusched.core.model import JobSpec
from gpusched.core.state import ClusterState
from gpusched.services.admission import AdmissionConfig, Caller, Capacity, admit, request_scope, split_subject
from gpusched.services.reader import Asker, ReadError, asker_of, mask_foreign, visible


def _state() -> ClusterState:
    state = ClusterState()
    for job_id, team in (("j-0000aaaa", "nlp"), ("j-0000bbbb", "vision")):
        state.apply(ev.JobSubmitted(at=1.0, job_id=job_id, spec=JobSpec(team=team, gpus=1), user="u"), 1)
    return state


def test_the_team_comes_from_the_subject():
    assert asker_of(subjects.read_subject("show", "nlp", "alice")) == Asker("show", "nlp", "alice")
    assert asker_of(subjects.read_subject("jobs")) == Asker("jobs")  # admin's and auditors' form
    for bad in ("gpusched.read.show.nlp", "gpusched.read.steal.nlp.alice", "gpusched.cmd.show.nlp.alice"):
        with pytest.raises(ReadError):
            asker_of(bad)


def test_another_teams_job_is_not_visible_and_its_id_is_masked():
    state = _state()
    assert visible(state, "j-0000aaaa", "nlp") and not visible(state, "j-0000bbbb", "nlp")
    assert not visible(state, "j-00000000", "nlp") and visible(state, "j-0000bbbb", None)
    reply = b'{"held_by":["j-0000aaaa","j-0000bbbb","j-0000bbbb_3"],"text":"blocked by j-0000bbbb"}'
    masked = mask_foreign(reply, state, "nlp")
    assert masked == (b'{"held_by":["j-0000aaaa","j-(another team)","j-(another team)"],'
                      b'"text":"blocked by j-(another team)"}')
    assert mask_foreign(reply, state, None) == reply  # unscoped: admin, auditors
    assert b"j-0000bbbb\"" in mask_foreign(reply, state, "nlp", asked="j-0000bbbb")  # the id it named itself


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([b"j-0000aaaa", b"j-0000bbbb", b"j-0000bbbb_3", b"j-00", b"xj-0000bbbb", b"_",
                                 b"j-", b"0", b"a", b" ", b'"', b"\xc3\xa9", b"-", b"j-0000bbbb0"]), max_size=30))
def test_masking_finds_the_ids_the_word_bounded_pattern_finds(parts):
    """`JOB_ID` has no leading word boundary (for speed): the masking checks it instead, with the
    same result as the pattern that had one."""
    import re

    state, payload = _state(), b"".join(parts)
    bounded = re.compile(rb"\bj-[0-9a-f]{8}(?:_[0-9]+)?\b")
    expected = bounded.sub(lambda m: m.group(0) if m.group(0) == b"j-0000aaaa" else b"j-(another team)", payload)
    assert mask_foreign(payload, state, "nlp") == expected


def test_a_platforms_submit_on_behalf_is_the_users_job_via_the_platform():
    base, caller = split_subject(subjects.on_behalf_subject("nlp", "ci", "dana"))  # type: ignore[misc]
    assert (base, caller) == (subjects.CMD_SUBMIT, Caller(user="dana", team="nlp", via="ci"))
    assert "only a submit" in split_subject("gpusched.cmd.cancel.nlp.ci.dana")  # type: ignore[operator]
    cmd = SubmitJob(request_id="r1", spec=JobSpec(team="nlp", gpus=1))
    d = admit(ClusterState(), cmd, 1.0, AdmissionConfig(auto_create_teams=True, placeholders="any"), Capacity(),
              caller=caller)
    assert isinstance(d.event, ev.JobSubmitted) and (d.event.user, d.event.via) == ("dana", "ci")
    # the same request id from dana herself, or from another platform, is another request
    assert request_scope(cmd, caller) != request_scope(cmd, Caller(user="dana", team="nlp"))
    assert request_scope(cmd, caller) != request_scope(cmd, Caller(user="dana", team="nlp", via="other"))


def test_kept_job_documents_are_the_fresh_ones_after_every_record():
    """The reader keeps job documents between answers; after every record they are what a fresh
    build gives (GPU-seconds extrapolated to the same moment, as `accounting` does)."""
    from gpusched.bus.log import Record
    from gpusched.cli.reads import docs_from_state
    from gpusched.cli.stack import simulated_nodes
    from gpusched.core.model import ArraySpec
    from gpusched.readmodel import accounting
    from gpusched.services.reader import JobDocs

    state, kept, seq = ClusterState(), JobDocs(), 0
    events = [*simulated_nodes(1, 4, 1, "pairs", at=1.0),
              ev.JobSubmitted(at=2.0, job_id="j-0000000a", spec=JobSpec(team="nlp", gpus=2)),
              ev.JobSubmitted(at=2.0, job_id="j-0000000b", spec=JobSpec(team="vision", gpus=1)),
              ev.GpusGranted(at=3.0, job_id="j-0000000a", attempt=1, gpus=["node00/0", "node00/1"]),
              ev.JobPending(at=4.0, job_id="j-0000000b", reason="waiting for 1 free GPUs"),
              ev.JobSubmitted(at=5.0, job_id="j-0000000c", spec=JobSpec(team="nlp", gpus=1,
                                                                        array=ArraySpec(first=0, last=2))),
              ev.JobCancelled(at=6.0, job_id="j-0000000b"),
              ev.GpusReleased(at=9.0, job_id="j-0000000a", reason="preempted")]
    for e in events:
        seq += 1
        state.apply(e, seq)
        kept.listener(Record(seq, e, "", None), state)
        for team in (None, "nlp"):
            got, fresh = kept.of(state, team), docs_from_state(state, "jobs", team=team)
            assert [d["job_id"] for d in got] == [d["job_id"] for d in fresh]
            for g, f in zip(got, fresh):
                assert {**g, "gpu_s": None} == {**f, "gpu_s": None}
                assert accounting(g, state.now) == accounting(f, state.now)
    assert {d["job_id"] for d in kept.of(state, "nlp")} == {"j-0000000a", "j-0000000c_0", "j-0000000c_1",
                                                              "j-0000000c_2"}


def test_shows_predictor_kept_between_answers_learns_what_ended_meanwhile():
    """The reader keeps `show`'s run-time predictor between answers (`Reader.indexes`): a job
    granted and completed between two answers is learned as a fresh predictor learns it."""
    from types import SimpleNamespace

    from gpusched.bus.log import Record
    from gpusched.cli.stack import simulated_nodes
    from gpusched.policy.predict import RuntimePredictor
    from gpusched.services.reader import Reader

    state = ClusterState()
    folded = SimpleNamespace(listeners=[], state=state, log=None)
    reader = Reader(folded, config=None)  # type: ignore[arg-type]
    seq = 0

    def apply(*events):
        nonlocal seq
        for e in events:
            seq += 1
            state.apply(e, seq)
            for listener in folded.listeners:
                listener(Record(seq, e, "", None), state)

    def run(job_id: str, at: float):
        apply(ev.JobSubmitted(at=at, job_id=job_id, spec=JobSpec(team="nlp", gpus=1)),
              ev.GpusGranted(at=at, job_id=job_id, attempt=1, gpus=["node00/0"]),
              ev.JobStarted(at=at, job_id=job_id, attempt=1, node="node00"),
              ev.JobCompleted(at=at + 100.0, job_id=job_id, attempt=1))

    apply(*simulated_nodes(1, 1, 1, "pairs", at=1.0))
    run("j-0000000a", 2.0)
    assert reader.indexes().predictor(state).history.learned == 1  # the first answer: learned from the fold
    run("j-0000000b", 200.0)  # started and ended between two answers
    assert reader.indexes().predictor(state).history.learned == RuntimePredictor(state).history.learned == 2
