"""The victim search's memo of GPU groups (`memo.GpuGroups`): it must count what a scan of the
state counts, follow a job's GPUs when they change, and be rebuilt when the topology is."""

from __future__ import annotations

import pytest

from gpusched.core import events as ev
from gpusched.policy import memo
from gpusched.policy.config import PRESETS
from gpusched.policy.memo import Indexes
from gpusched.policy.ordering import las_queue

from .policy_helpers import Scenario, gpus


def test_counts_per_level_and_follows_a_jobs_new_gpus():
    s = Scenario(racks=2, nodes=2, blocks=1)
    s.run("j", gpus("r0n0", 0, 1) + gpus("r1n1", 0), at=0)
    idx = Indexes()
    assert idx.gpu_groups(s.state, "node").spread(s.state.jobs["j"]) == {"r0n0": 2, "r1n1": 1}
    assert idx.gpu_groups(s.state, "rack").spread(s.state.jobs["j"]) == {"r0": 2, "r1": 1}
    assert idx.gpu_groups(s.state, "block").spread(s.state.jobs["j"]) == {"b0": 3}
    # A new attempt on other GPUs: the fold gives the job a new list, and the memo recounts.
    s.apply(ev.GpusReleased(at=10, job_id="j", reason="preempted"))
    s.run("j", gpus("r0n1", 0, 1, 2, 3), at=20)
    assert idx.gpu_groups(s.state, "node").spread(s.state.jobs["j"]) == {"r0n1": 4}
    assert idx.gpu_groups(s.state, "rack").spread(s.state.jobs["j"]) == {"r0": 4}


def test_a_rack_without_a_block_is_its_own_group():
    s = Scenario(racks=1, nodes=1)
    s.node("x0", "rx", block="bx")
    s.run("j", gpus("r0n0", 0) + gpus("x0", 0), at=0)
    assert Indexes().gpu_groups(s.state, "block").spread(s.state.jobs["j"]) == {"r0": 1, "bx": 1}


def test_rebuilt_when_a_node_registers():
    s = Scenario(racks=1, nodes=1)
    idx = Indexes()
    first = idx.gpu_groups(s.state, "rack")
    assert idx.gpu_groups(s.state, "rack") is first  # nothing changed: the same memo
    s.node("r9n0", "r9")
    s.run("j", gpus("r9n0", 0, 1), at=0)
    again = idx.gpu_groups(s.state, "rack")
    assert again is not first
    assert again.spread(s.state.jobs["j"]) == {"r9": 2}


@pytest.mark.parametrize("required", ["rack", "block"])
def test_a_rack_or_block_counts_its_free_gpus_across_its_nodes(required):
    """16 GPUs within one rack (or block): rack r0 has a free node and a low-priority job,
    rack r1 a low-priority job and a job that may not be preempted. Only r0 can make room
    (8 free on one node + the victim's 8 on the other). In one block of both racks, the
    cheaper low job (less work lost since it started) makes room with the free node."""
    s = Scenario(racks=2, nodes=2, blocks=1)
    s.run("victim", gpus("r0n1", *range(8)), at=0.0, priority="low", preemptible=True)
    s.run("other", gpus("r1n0", *range(8)), at=100.0, priority="low", preemptible=True)
    s.run("keep", gpus("r1n1", *range(8)), at=0.0)
    s.submit("big", 16, at=1000.0, priority="high", required=required)
    out = s.cycle("full", now=1000.0)
    asked = {e.job_id for e in out if isinstance(e, ev.PreemptionRequested)}
    assert asked == ({"victim"} if required == "rack" else {"other"})


def _scan_above(state, now, config, level):
    """What LasLevels answers, by walking every running job."""
    return sum(len(j.gpus) for j in (state.jobs[x] for x in state.running)
               if las_queue(j.attained_gpu_s(now), config) > level)


def test_las_levels_count_what_a_scan_counts_and_follow_the_state_and_the_clock():
    config = PRESETS["tiresias"]  # queues at 3,250, 7,200 and 18,000 GPU-seconds
    s = Scenario(racks=1, nodes=2)
    s.run("old", gpus("r0n0", *range(4)), at=0.0)  # 4 GPUs since 0
    s.run("mid", gpus("r0n0", 4, 5), at=500.0)
    s.run("new", gpus("r0n1", 0), at=900.0)
    idx = Indexes()
    for now in (1000.0, 2000.0, 5000.0):
        levels = idx.las_levels(s.state, now, config)
        for level in (-1.0, 0.0, 1.0, 2.0, 3.0):
            assert levels.gpus_above(level) == _scan_above(s.state, now, config, level), (now, level)
    assert idx.las_levels(s.state, 1000.0, config).gpus_above(0.0) == 4  # old: 4,000 GPU-s, queue 1
    first = idx.las_levels(s.state, 1000.0, config)
    assert idx.las_levels(s.state, 1000.0, config) is first  # same state, same instant: kept
    s.run("more", gpus("r0n1", *range(1, 8)), at=1000.0)  # an event: counted afresh
    assert idx.las_levels(s.state, 1000.0, config) is not first
    assert idx.las_levels(s.state, 1000.0, config).gpus_above(-1.0) == 14


def test_the_counts_of_jobs_that_ended_are_forgotten(monkeypatch):
    monkeypatch.setattr(memo, "_SPREAD_KEEP", 2)
    s = Scenario(racks=1, nodes=1)
    groups = Indexes().gpu_groups(s.state, "node")
    for i in range(6):
        s.run(f"j{i}", gpus("r0n0", i), at=0.0)
        assert groups.spread(s.state.jobs[f"j{i}"]) == {"r0n0": 1}
    for i in range(5):
        s.finish(f"j{i}", at=10.0)
    s.run("k", gpus("r0n0", 6), at=20.0)  # 6 kept > twice the 2 running: the ended ones go
    assert groups.spread(s.state.jobs["k"]) == {"r0n0": 1}
    assert set(groups._spread) == {"j5", "k"}
