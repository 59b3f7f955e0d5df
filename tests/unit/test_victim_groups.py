"""The victim search's memo of GPU groups (`memo.GpuGroups`): it must count what a scan of the
state counts, follow a job's GPUs when they change, and be rebuilt when the topology is."""

from __future__ import annotations

from gpusched.core import events as ev
from gpusched.policy.memo import Indexes

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
