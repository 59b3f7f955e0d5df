"""The preemptor decides its own question once: it skips the steps whose decisions it throws
away (the queue's reasons and ETAs), and keeps exactly what the whole cycle would have given it."""

from __future__ import annotations

from gpusched.core import events as ev
from gpusched.decider import PREEMPTOR_KINDS, PREEMPTOR_SKIPS
from gpusched.policy.config import PRESETS
from gpusched.policy.cycle import cycle

from .policy_helpers import Scenario, gpus


def _contended() -> Scenario:
    """Team b borrows the whole cluster with preemptible jobs; team a's guaranteed jobs queue."""
    s = Scenario(racks=1, nodes=2)
    s.team("a", guaranteed=8)
    s.team("b")
    s.run("b1", gpus("r0n0", *range(8)), at=0, team="b", preemptible=True)
    s.run("b2", gpus("r0n1", *range(8)), at=0, team="b", preemptible=True)
    for i in range(5):
        s.submit(f"a{i}", gpus=4, team="a", at=1)
    return s


def test_skipping_what_it_throws_away_keeps_the_same_decisions():
    s = _contended()
    config = PRESETS["full"].replace(min_runtime_s=0.0)
    whole = cycle(s.state, 4000.0, config)
    own = cycle(s.state, 4000.0, config, skip=PREEMPTOR_SKIPS)
    mine = [e for e in whole if isinstance(e, PREEMPTOR_KINDS)]
    assert any(isinstance(e, ev.PreemptionRequested) for e in mine)  # there was a question to decide
    assert [e for e in own if isinstance(e, PREEMPTOR_KINDS)] == mine
    assert any(isinstance(e, ev.JobPending) for e in whole) and not any(isinstance(e, ev.JobPending) for e in own)


def test_the_hand_off_is_in_the_log_from_victims_to_the_grant():
    """Asked for a blocked job, released for it, granted to it: each fact names the job."""
    s = _contended()
    config = PRESETS["full"].replace(min_runtime_s=0.0)
    asked = [e for e in s.cycle(config, now=4000.0) if isinstance(e, ev.PreemptionRequested)]
    assert asked and all(e.for_job.startswith("a") for e in asked)
    for e in asked:
        s.checkpoint(e.job_id, at=4001.0)
    out = s.cycle(config, now=4002.0)
    released = {e.job_id: e.for_job for e in out if isinstance(e, ev.GpusReleased)}
    assert released == {e.job_id: e.for_job for e in asked}
    granted = {e.job_id for e in out if isinstance(e, ev.GpusGranted)}
    assert set(released.values()) <= granted
