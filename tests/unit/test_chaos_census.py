"""The duplicate-process census of `gpusched chaos`: real processes in /proc, found by their
job environment, counted once per job, and only those of the drilled stack."""

from __future__ import annotations

import os
import random
import signal
import subprocess

from gpusched.cli.chaos import ProcessCensus, expand


def _launcher(control_root, job: str, attempt: int, rank: int) -> subprocess.Popen:
    """A launcher as the node agent starts one: its own session, the job's environment, a child."""
    env = {"PATH": "/usr/bin:/bin", "GPUSCHED_JOB_ID": job, "GPUSCHED_ATTEMPT": str(attempt),
           "GPUSCHED_NODE_RANK": str(rank), "GPUSCHED_CONTROL_DIR": str(control_root / job / f"{attempt}-{rank}")}
    return subprocess.Popen(["sh", "-c", "sleep 30; true"], env=env, start_new_session=True)


def test_the_census_counts_a_job_running_twice_once_and_ignores_other_stacks(tmp_path):
    work, other = tmp_path / "stack" / "work", tmp_path / "other" / "work"
    procs = [_launcher(work / "control", "j-single", 1, 0),
             _launcher(work / "control", "j-gang", 1, 0), _launcher(work / "control", "j-gang", 1, 1),
             _launcher(work / "control", "j-twice", 1, 0), _launcher(work / "control", "j-twice", 1, 0),
             _launcher(work / "control", "j-attempts", 1, 0), _launcher(work / "control", "j-attempts", 2, 1),
             _launcher(other / "control", "j-single", 2, 0)]  # another stack's: not this census's business
    census = ProcessCensus(work)
    try:
        live = census.launchers()
        assert sorted(live) == ["j-attempts", "j-gang", "j-single", "j-twice"]
        assert len(live["j-single"]) == 1  # the wrapper leads its group; its `sleep` child is not counted
        census.sample()
        census.sample()
        assert sorted(census.seen) == ["j-attempts", "j-twice"]
        assert census.take() == 2 and census.take() == 0  # each duplicate is reported once
        assert census.peak == 7
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)  # the wrapper and its `sleep`
            p.wait()
    assert census.launchers() == {}


def test_the_census_reaps_what_the_stack_left_behind(tmp_path):
    work = tmp_path / "work"
    left = _launcher(work / "control", "j-left", 1, 0)
    census = ProcessCensus(work)
    assert census.reap() == 1
    assert left.wait(timeout=10) == -9
    assert census.launchers() == {}


def test_service_drills_expand_to_each_service_or_a_random_one():
    services = ["admission", "placement", "nodeagent", "dashboard", "reconciler"]
    assert expand("leader,service", services) == ["leader", "service:admission", "service:placement",
                                                  "service:reconciler"]
    picks = {expand("service:any", services, random.Random(seed))[0] for seed in range(40)}
    assert picks == {"service:admission", "service:placement", "service:reconciler"}
