"""A crash of `gpusched up` itself (issue 10): `up` killed with SIGKILL, and every process it
started with it (NATS, Redis, the services, the node agents), but not the jobs; `up` again on the
same data dir adopts them. Afterwards the OS runs exactly one process per job rank, every job is
in its first attempt, no GPU-second is counted lost and `replay --verify` is clean. An orderly
stop of `up` (SIGTERM) then stops the jobs: nothing is left running."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusched.bus.control_client import Client
from gpusched.core import events as ev
from gpusched.core.model import JobSpec
from gpusched.core.state import ClusterState
from gpusched.job import env as E

from ..marked import kill_marked, marked_pythons
from .test_up import _alive, _cli, _fold
from .test_up_supervision import _all_gone, _kill_all, _pids, _ready, _up

MARK = "gpusched-up-restart-test"
#: 2 nodes of 10 GPUs: one job of 11 GPUs spans both (2 ranks), 9 jobs of one GPU fill the rest.
SHAPE = ("--nodes", "2", "--gpus-per-node", "10")
#: A short no-process grace, so that a job the restart failed to adopt would be requeued within
#: the few seconds the test watches after the restart. The node timeout stays the default 30 s,
#: given explicitly because `up` hands it to the node agents too: their fence keepers stop the
#: jobs once the agents are gone for most of it, so a restart must take less (one that took more
#: would rightly be a node loss, its jobs fenced before the reconciler could run them elsewhere).
TIMINGS = ("--node-timeout-s", "30", "--no-process-grace-s", "3")


def _job_processes(tag: str) -> dict[int, tuple[str, str]]:
    """pid -> (job id, node rank) of this test's job processes (the commands, not their shell
    wrappers), found by the marker and tag on their command line."""
    found = {}
    for pid, _, proc in marked_pythons(MARK, tag):
        try:
            environ = dict(v.split(b"=", 1) for v in (proc / "environ").read_bytes().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if E.JOB_ID.encode() in environ:  # started by a node agent
            found[pid] = (environ[E.JOB_ID.encode()].decode(), environ[E.NODE_RANK.encode()].decode())
    return found


def _per_rank(procs: dict[int, tuple[str, str]]) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for key in procs.values():
        counts[key] = counts.get(key, 0) + 1
    return counts


async def _events(nats_url: str) -> list[tuple[int, ev.Event]]:
    from gpusched.bus.log import EventLog

    log = await EventLog.open(nats_url, name="e2e-up-restart")
    try:
        return [(seq, e) async for seq, e in log.replay()]
    finally:
        await log.close()


async def _submit_all(nats_url: str, tag: str) -> list[str]:
    command = [sys.executable, "-c", "import time; time.sleep(600)", MARK, tag]
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "time.sleep(600)", MARK, tag]  # an orderly stop must still end it (SIGKILL after the grace)
    async with await Client.connect(nats_url, timeout=10) as client:
        specs = [JobSpec(team="wide", gpus=11, command=command)]  # first: it needs GPUs of both nodes
        specs += [JobSpec(team=f"t{i % 3}", gpus=1, command=stubborn if i == 0 else command) for i in range(9)]
        jobs = []
        for spec in specs:
            reply = await client.submit(spec)
            assert reply.ok, reply.error
            jobs.append(reply.job_id)
    return jobs


def _last_ready(data: Path, service: str) -> str:
    """When the service last said it was ready (the ISO time of its log line)."""
    lines = [json.loads(line) for line in (data / "logs" / f"{service}.log").read_text().splitlines()
             if f'"{service}_ready"' in line]
    return lines[-1]["timestamp"]


async def _until(what: str, check, timeout: float):
    deadline = time.monotonic() + timeout
    while not (result := await check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        await asyncio.sleep(0.3)
    return result


async def _run_jobs(up: subprocess.Popen, data: Path, tag: str) -> tuple[dict, list[str], dict]:
    """Once `up` is ready: the 10 jobs submitted and running, one process per rank in the OS.
    Returns stack.json, the job ids (the wide one first) and the job processes."""
    stack = await _ready(up, data)
    jobs = await _submit_all(stack["nats"], tag)
    ranks = {**{(j, "0"): 1 for j in jobs}, (jobs[0], "1"): 1}  # the wide job: a rank on each node

    async def all_running():
        state = await _fold(stack["nats"])
        return all(state.jobs[j].state == "running" for j in jobs) and _per_rank(_job_processes(tag)) == ranks
    await _until("every job running, one process per rank", all_running, 40)
    state = await _fold(stack["nats"])
    assert {g.split("/")[0] for g in state.jobs[jobs[0]].gpus} == {"node00", "node01"}
    return stack, jobs, _job_processes(tag)


async def _assert_adopted(stack: dict, data: Path, tag: str, jobs: list[str], before: dict) -> ClusterState:
    """After a restart of `up`: exactly the first processes run, every job in its first attempt,
    nothing requeued, lost or ended, no violation, `replay --verify` clean."""
    await asyncio.sleep(4.0)  # past the no-process grace, two heartbeats: a job not adopted is requeued
    assert _job_processes(tag) == before, "after the restart the OS does not run exactly the first processes"
    state = await _fold(stack["nats"])
    assert all(state.jobs[j].state == "running" and state.jobs[j].attempt == 1 for j in jobs), \
        {j: (state.jobs[j].state, state.jobs[j].attempt) for j in jobs}
    assert sum(j.lost_gpu_s for j in state.jobs.values()) == 0
    facts = [e for _, e in await _events(stack["nats"])]
    assert not [e for e in facts if isinstance(e, (ev.NodeLost, ev.GpusReleased, ev.ProcessesEnded))]
    assert state.violations() == []
    # the restarted reconciler started only once the node agents had adopted their jobs
    assert _last_ready(data, "reconciler") > _last_ready(data, "nodeagent")
    env = {**os.environ, "GPUSCHED_NATS_URL": stack["nats"]}
    audit = _cli("replay", "--verify", "--keys", str(data / "trust" / "keys.json"), "--json", env=env)
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr
    return state


async def _stop_ends_the_jobs(up: subprocess.Popen, data: Path, before: dict) -> None:
    """An orderly stop of `up` without --keep-jobs stops the jobs: nothing leaks."""
    now = json.loads((data / "stack.json").read_text())
    up.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(up.wait, 40) == 0
    assert await _all_gone([*_pids(now), *before], 10) == []


async def test_a_crashed_up_restarted_on_its_data_dir_adopts_every_job(tmp_path):
    data, tag = tmp_path / "stack", f"t{os.getpid()}-{time.time_ns()}"
    up = _up(data, *SHAPE, *TIMINGS)
    try:
        stack, jobs, before = await _run_jobs(up, data, tag)

        # The crash: `up` first (its children get their parent-death signal), then whatever of
        # its children still runs. The jobs are left alone.
        crashed_at = time.monotonic()
        up.kill()
        up.wait()
        assert await _all_gone([stack["services"]["nodeagent"]], 5) == [], "the node agent outlived `up`"
        for pid in _pids(stack):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        assert await _all_gone(_pids(stack), 10) == []
        assert _job_processes(tag) == before, "a job process died with `up`"

        restarted_at = time.monotonic()
        up = _up(data, *SHAPE, *TIMINGS)
        stack = await _ready(up, data)
        ready_at = time.monotonic()
        state = await _assert_adopted(stack, data, tag, jobs, before)
        print(f"\nup restart: {len(jobs)} jobs, {len(before)} job processes before the crash and "
              f"{len(_job_processes(tag))} after (the same pids); attempts {sorted({state.jobs[j].attempt for j in jobs})}; "
              f"lost GPU-s {sum(j.lost_gpu_s for j in state.jobs.values())}; ready {ready_at - restarted_at:.1f}s "
              f"after the restart, {ready_at - crashed_at:.1f}s after the crash")
        await _stop_ends_the_jobs(up, data, before)
    finally:
        _kill_all(up, data)
        kill_marked(MARK, tag)


@pytest.mark.slow
async def test_an_orderly_stop_with_keep_jobs_leaves_the_jobs_to_the_next_up(tmp_path):
    data, tag = tmp_path / "stack", f"t{os.getpid()}-{time.time_ns()}"
    up = _up(data, *SHAPE, *TIMINGS, "--keep-jobs")
    try:
        stack, jobs, before = await _run_jobs(up, data, tag)
        up.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(up.wait, 40) == 0
        assert await _all_gone(_pids(stack), 10) == []
        assert _job_processes(tag) == before, "--keep-jobs: an orderly stop ended a job"

        up = _up(data, *SHAPE, *TIMINGS)
        stack = await _ready(up, data)
        await _assert_adopted(stack, data, tag, jobs, before)
        await _stop_ends_the_jobs(up, data, before)
    finally:
        _kill_all(up, data)
        kill_marked(MARK, tag)


def test_fresh_stops_the_jobs_a_crashed_up_left_running(tmp_path):
    """`up --fresh` deletes the work dir with the state files no later daemon could adopt from:
    the job processes those files prove still run are stopped first (and nothing else is)."""
    from gpusched.cli.startup import claim_data_dir
    from gpusched.services.nodeagent import launcher

    data, tag = tmp_path / "d", f"t{os.getpid()}-{time.time_ns()}"
    runs = data / "work" / "runs" / "node00"
    runs.mkdir(parents=True)
    launch = launcher.Launch(job_id="j-1", attempt=1, node="node00", node_rank=0, num_nodes=1, gpus=(0,),
                             gpu_ids=("node00/0",), gpu_uuids=("GPU-0",), master_addr="127.0.0.1",
                             command=(sys.executable, "-c", "import time; time.sleep(600)", MARK, tag), env={},
                             checkpoint_dir=tmp_path / "c", control_dir=tmp_path / "k", log_path=tmp_path / "j.log")
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", MARK, tag],
                                 start_new_session=True)
    try:
        job = launcher.start(launch)
        (runs / "j-1.1.0.json").write_text(json.dumps(launcher.record(job)))
        deadline = time.monotonic() + 10
        while len(_job_processes(tag)) < 1:  # the job's python is up (its wrapper started it)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        lock = claim_data_dir(data, fresh=True)
        lock.close()
        job.poll()
        assert _job_processes(tag) == {} and not (data / "work").exists()
        assert bystander.poll() is None, "a process no state file proves was stopped"
    finally:
        bystander.kill()
        bystander.wait()
        kill_marked(MARK, tag)


def test_up_passes_keep_jobs_and_the_reconciler_timings_and_starts_the_reconciler_after_the_nodes(tmp_path):
    """What `up` hands its children (the crash-and-restart test above runs them for real)."""
    from gpusched.cli.main import build_parser
    from gpusched.cli.stack import Stack

    def planned(*flags: str) -> Stack:
        args = build_parser().parse_args(["up", "--data-dir", str(tmp_path), "--dashboard-port", "0", *flags])
        stack = Stack(args, tmp_path)
        stack.plan()
        stack.notify.close()
        return stack

    plain = planned()
    assert "--keep-jobs" not in plain.children["nodeagent"].argv_extra
    assert "--node-timeout-s" not in plain.children["reconciler"].argv_extra  # the reconciler's defaults
    assert plain.children["reconciler"].after is None  # nothing to adopt: everything starts at once
    (tmp_path / "work" / "runs" / "node01").mkdir(parents=True)
    (tmp_path / "work" / "runs" / "node01" / "j-1.1.0.json").write_text("{}")
    assert planned().children["reconciler"].after == "nodeagent"
    kept = planned("--keep-jobs", "--node-timeout-s", "45", "--no-process-grace-s", "90")
    assert "--keep-jobs" in kept.children["nodeagent"].argv_extra
    # the agents' fences are computed against the same node timeout as the reconciler's
    assert kept.children["nodeagent"].env["GPUSCHED_NODE_TIMEOUT_S"] == "45"
    assert "GPUSCHED_NODE_TIMEOUT_S" not in plain.children["nodeagent"].env
    argv = kept.children["reconciler"].argv_extra
    assert argv[argv.index("--node-timeout-s") + 1] == "45" and argv[argv.index("--no-process-grace-s") + 1] == "90"
    alone = planned("--services", "admission,placement,reconciler")  # no node agents: nothing to wait for
    assert alone.children["reconciler"].after is None


def test_up_passes_the_running_policy_to_the_dashboard_as_to_the_reader(tmp_path):
    """The dashboard explains a pending job as `show` does: under the policy `up` runs."""
    from gpusched.cli.main import build_parser
    from gpusched.cli.stack import Stack

    args = build_parser().parse_args(["up", "--data-dir", str(tmp_path), "--dashboard-port", "0",
                                      "--policy", "tiresias", "--policy-set", "min_runtime_s=60"])
    stack = Stack(args, tmp_path)
    stack.plan()
    stack.notify.close()
    policy = ["--policy", "tiresias", "--policy-set=min_runtime_s=60"]
    argv = stack.children["dashboard"].argv_extra
    assert argv[-len(policy):] == policy == stack.children["reader"].argv_extra
