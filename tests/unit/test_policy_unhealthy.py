"""Which jobs on quarantined GPUs the policy moves (policy/unhealthy.py), as a table."""

from __future__ import annotations

import pytest

from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.core.state import fold
from gpusched.policy.config import PRESETS
from gpusched.policy.cycle import cycle
from gpusched.policy.unhealthy import moves


def state_with(preemptible: bool = True, told: bool = True, asked: bool = False):
    events = [ev.NodeRegistered(at=0, node="n", rack="r", gpus=[GpuInfo(index=i, uuid=f"u{i}") for i in range(2)]),
              ev.JobSubmitted(at=1, job_id="j", spec=JobSpec(team="t", gpus=2, preemptible=preemptible)),
              ev.GpusGranted(at=2, job_id="j", attempt=1, gpus=["n/0", "n/1"]),
              ev.GpuQuarantined(at=3, gpu="n/1", reason="health: XID 79")]
    if told:
        events.append(ev.JobOnUnhealthyGpu(at=3, job_id="j", attempt=1, gpus=["n/1"], reason="health: XID 79"))
    if asked:
        events.append(ev.PreemptionRequested(at=4, job_id="j", for_job="j", reason="moving", deadline=100))
    return fold(events)


CASES = {
    "a preemptible job on an unhealthy GPU moves": (dict(), ["j"]),
    "not told yet: nothing": (dict(told=False), []),
    "a non-preemptible job keeps running": (dict(preemptible=False), []),
    "already asked: not asked twice": (dict(asked=True), []),
}


@pytest.mark.parametrize("setup, want", CASES.values(), ids=CASES.keys())
def test_moves(setup, want):
    got = moves(state_with(**setup), 10.0, 60.0)
    assert [e.job_id for e in got] == want
    assert all(e.for_job == e.job_id and e.deadline == 70.0 for e in got)


def test_the_cycle_moves_it_and_releases_it_after_its_checkpoint():
    state = state_with()
    out = cycle(state, 10.0, PRESETS["full"])
    assert [e.kind for e in out if e.kind == "PreemptionRequested"] == ["PreemptionRequested"]
    off = cycle(state, 10.0, PRESETS["full"].replace(move_off_unhealthy=False))
    assert not [e for e in off if e.kind == "PreemptionRequested"]
    for e in out:
        state.apply(e)
    state.apply(ev.CheckpointSaved(at=11, job_id="j", attempt=1, path="/c", step=5))
    released = [e for e in cycle(state, 12.0, PRESETS["full"]) if e.kind == "GpusReleased"]
    assert [(e.job_id, e.reason, e.forced) for e in released] == [("j", "preempted", False)]
    assert state.violations() == []
