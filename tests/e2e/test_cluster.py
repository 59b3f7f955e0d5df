"""`gpusched up --nats-cluster 3`: three JetStream servers clustered on this machine, the log
at R3, every service on the seed list; and the short form of `gpusched chaos` against it (the
stream leader killed under load, Redis lost and wiped), whose verdict must be clean."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

from gpusched.bus import subjects
from gpusched.bus.log import EventLog
from gpusched.bus.servers import find_binary, free_port
from gpusched.core.state import ClusterState
from gpusched.security import authz, keyring

from .test_up import UNCONFINED_USERS


def _gpusched(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpusched.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


async def _stream(url: str, creds: str):
    log = await EventLog.open(url, name="test-cluster", creds=creds)
    try:
        info = await log.js.stream_info(subjects.STREAM)
        state = ClusterState()
        async for seq, event in log.replay():
            state.apply(event, seq)
        return info, state
    finally:
        await log.close()


async def test_up_with_a_three_node_cluster_runs_jobs_at_r3_and_survives_the_short_drills(tmp_path):
    data = tmp_path / "stack"
    up = subprocess.Popen(
        [sys.executable, "-m", "gpusched.cli.main", "up", "--nats-cluster", "3", "--nodes", "8",
         "--data-dir", str(data), "--nats-port", "0", "--redis-port", "0", "--dashboard-port", "0",
         "--restart-delay", "0.5", "--no-client-config", "--ready-timeout", "120", *UNCONFINED_USERS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(up.stdout.readline), 150)
        assert line.startswith("gpusched up: ready - nats nats://"), line + up.stderr.read()
        stack = json.loads((data / "stack.json").read_text())
        seeds = stack["nats"].split(",")
        assert len(seeds) == 3 and len(stack["nats_servers"]) == 3
        assert len({s["data"] for s in stack["nats_servers"]}) == 3  # each its own store
        info, _ = await _stream(stack["nats"], stack["admin_creds"])
        assert info.config.num_replicas == 3
        assert info.cluster.leader and len(info.cluster.replicas) == 2

        # The short form: the stream leader killed under load, Redis killed (it returns empty).
        drills = await asyncio.to_thread(
            _gpusched, "chaos", "--attach", str(data), "--jobs", "60", "--rate", "10", "--job-s", "1",
            "--drills", "leader,redis", "--gap-s", "2", "--json")
        assert drills.returncode == 0, drills.stdout[-3000:] + drills.stderr[-3000:]
        verdict = json.loads(drills.stdout)
        for drill in ("leader", "redis", "final"):
            row = verdict["drills"][drill]
            assert row["clean"] == row["runs"] == 1, (drill, row)
            assert row["lost"] == row["double_booked"] == row["duplicate_processes"] == row["violations"] == 0
        assert verdict["acked"] >= 60 and verdict["unanswered"] == 0
        # Every job was a real process, and the census saw them: no job ran twice.
        assert verdict["census_samples"] > 0 and verdict["peak_job_processes"] > 0
        assert verdict["duplicates"] == {}

        # Jobs ran to completion on the cluster, and an admin's client did not scale the log down.
        deadline = time.monotonic() + 60
        while True:
            info, state = await _stream(stack["nats"], stack["admin_creds"])
            done = [j for j in state.jobs.values() if j.state == "completed"]
            if len(done) >= 60:
                break
            assert time.monotonic() < deadline, {j.job_id: j.state for j in state.jobs.values() if j.state != "completed"}
            await asyncio.sleep(1.0)
        assert info.config.num_replicas == 3 and state.violations() == []
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_more_replicas_than_servers_is_refused_at_start(tmp_path):
    done = _gpusched("up", "--replicas", "3", "--data-dir", str(tmp_path / "d"), "--nats-port", "0",
                     "--redis-port", "0", "--no-client-config", timeout=60)
    assert done.returncode == 1
    assert "--replicas 3 needs at least 3 NATS servers, but --nats-cluster is 1" in done.stderr


async def test_a_seed_list_connects_past_a_dead_server(nats_url):
    dead = f"nats://127.0.0.1:{free_port()}"
    log = await EventLog.open(f"{dead}, {nats_url}", name="test-seeds")
    try:
        assert (await log.js.stream_info(subjects.STREAM)).config.num_replicas == 1
    finally:
        await log.close()


def test_a_cluster_member_config_is_valid_and_its_routes_authenticate(tmp_path):
    member = {"name": "gpusched", "server_name": "gpusched-1", "port": 6333, "routes": [6332, 6334],
              "password": "s3cret"}
    conf = authz.write_server_config(keyring.KeyRing(), tmp_path / "n.conf", port=4333, store_dir=tmp_path,
                                     cluster=member)
    text = json.loads(conf.read_text())
    assert text["server_name"] == "gpusched-1"
    assert text["cluster"]["authorization"] == {"user": "route", "password": "s3cret", "timeout": 5}
    assert text["cluster"]["routes"] == ["nats-route://route:s3cret@127.0.0.1:6332",
                                         "nats-route://route:s3cret@127.0.0.1:6334"]
    assert oct(os.stat(conf).st_mode & 0o777) == "0o600"  # the route password
    checked = subprocess.run([find_binary("nats-server"), "-t", "-c", str(conf)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
