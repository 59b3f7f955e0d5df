"""Read models: the projector's Redis views equal a fold of the log, are rebuilt from the log,
and the CLI prints the same documents from either source; `show` explains a pending job."""

from __future__ import annotations

import asyncio
import json
import time

from gpusched.bus.log import EventLog
from gpusched.cli.main import main
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec, TeamQuota, TopologyConstraint
from gpusched.services import projector
from gpusched.views import Views


def _scenario() -> list[ev.Event]:
    gpus = [GpuInfo(index=i, uuid=f"u{i}", nvlink_domain=i // 4) for i in range(8)]
    return [
        ev.NodeRegistered(at=1, node="n0", rack="r0", gpus=gpus),
        ev.NodeRegistered(at=1, node="n1", rack="r1", gpus=gpus),
        ev.TeamQuotaSet(at=1, team="vision", quota=TeamQuota(guaranteed=8, limit=12)),
        ev.TeamQuotaSet(at=1, team="nlp", quota=TeamQuota(guaranteed=8, limit=8)),
        ev.JobSubmitted(at=2, job_id="big", spec=JobSpec(team="vision", gpus=8, preemptible=True, time_limit_s=100)),
        ev.GpusGranted(at=3, job_id="big", attempt=1, gpus=[f"n0/{i}" for i in range(8)], level="node"),
        ev.JobStarted(at=4, job_id="big", attempt=1, node="n0"),
        ev.JobSubmitted(at=5, job_id="mid", spec=JobSpec(team="nlp", gpus=6, time_limit_s=50)),
        ev.GpusGranted(at=6, job_id="mid", attempt=1, gpus=[f"n1/{i}" for i in range(6)], level="node"),
        ev.JobSubmitted(at=7, job_id="wait", spec=JobSpec(team="nlp", gpus=4, topology=TopologyConstraint(required="node"))),
        ev.JobPending(at=7, job_id="wait", reason="team nlp at its limit 8 (needs 2 more GPUs)",
                      blockers=["team nlp limit 8"]),
        ev.CheckpointSaved(at=8, job_id="big", attempt=1, path="/ck/big", step=40),
        ev.PreemptionRequested(at=9, job_id="big", for_job="mid", reason="test", deadline=20),
        ev.GpusReleased(at=10, job_id="big", reason="preempted", lost_gpu_s=16.0),
    ]


async def _append_all(url, events):
    log = await EventLog.open(url)
    try:
        for e in events:
            await log.append(e)
    finally:
        await log.close()


def _cli_json(capsys, *argv):
    capsys.readouterr()
    assert main(list(argv)) in (0, None)
    return json.loads(capsys.readouterr().out)


def test_views_from_redis_equal_fold_and_rebuild(nats_url, redis_url, capsys, monkeypatch):
    # The fold's clock is the server's store time, so this log is live: its listings would age
    # against the wall clock, which moves between the two reads. Compare them at the log's time.
    monkeypatch.setattr("gpusched.cli.listings.display_now", lambda meta: meta.get("at") or 0.0)
    asyncio.run(_append_all(nats_url, _scenario()))
    summary = asyncio.run(projector.rebuild_views(nats_url, redis_url))
    assert summary["seq"] == 14 and summary["jobs"] == 3 and summary["nodes"] == 2

    for what in ("jobs", "nodes", "teams", "queue"):
        from_redis = _cli_json(capsys, what, "--json", "--nats", nats_url, "--redis", redis_url)
        from_log = _cli_json(capsys, what, "--json", "--nats", nats_url, "--fold")
        assert from_redis == from_log, what
        assert all(d["seq"] == 14 for d in from_redis)
        if what == "teams":  # the cluster's totals, the projector's (its meta) as the fold's
            assert from_redis and all((d["cluster"]["nodes"], d["cluster"]["teams"], d["cluster"]["pending_jobs"])
                                      == (summary["nodes"], summary["teams"], summary["queue"]) for d in from_redis)

    jobs = {d["job_id"]: d for d in _cli_json(capsys, "jobs", "--json", "--nats", nats_url, "--redis", redis_url)}
    assert jobs["mid"]["state"] == "starting"
    assert [(g["node"], g["index"]) for g in jobs["mid"]["gpus"]] == [("n1", i) for i in range(6)]
    assert jobs["big"]["state"] == "pending" and jobs["big"]["preemptions"] == 1
    teams = {d["team"]: d for d in _cli_json(capsys, "teams", "--json", "--nats", nats_url, "--redis", redis_url)}
    assert teams["nlp"]["held"] == 6 and teams["nlp"]["limit"] == 8 and teams["vision"]["held"] == 0
    queue = _cli_json(capsys, "queue", "--json", "--nats", nats_url, "--redis", redis_url)
    assert {q["job_id"] for q in queue} == {"big", "wait"}


def test_jobs_from_redis_reads_the_views_and_the_usage_on_one_connection(nats_url, redis_url, capsys):
    """`jobs` from the read models reads the meta, the order, the usage and the documents on one
    connection in two round trips (`Views.listing`); before, a second connection (and event
    loop) read the usage after the listing: 7 round trips on 2 connections."""
    import redis

    from gpusched.views import USAGE_KEY

    asyncio.run(_append_all(nats_url, _scenario()))
    asyncio.run(projector.rebuild_views(nats_url, redis_url))
    window = {"attempt": 1, "util_pct": 42.0, "memory_mb": 2048.0}
    r = redis.Redis.from_url(redis_url)
    r.hset(USAGE_KEY, "mid", json.dumps(window))
    before = r.info("stats")["total_connections_received"]
    jobs = {d["job_id"]: d for d in _cli_json(capsys, "jobs", "--json", "--nats", nats_url, "--redis", redis_url)}
    connections = r.info("stats")["total_connections_received"] - before
    r.close()
    assert jobs["mid"]["usage"] == window and jobs["big"]["usage"] is None
    assert connections == 1


#: What admin's `jobs` from the read models (no reader service: its request answered 503 "no
#: responders") never needs: JetStream's client, importlib.metadata, the fold and its events.
NOT_FOR_A_REDIS_LISTING = ("nats.js", "nats.js.api", "importlib.metadata", "gpusched.core.state",
                           "gpusched.core.events", "gpusched.bus.log")


def test_admins_jobs_without_a_reader_reads_redis_loading_no_jetstream_nor_metadata(nats_url, redis_url, capsys):
    """Admin asks the reader first (the live fold); with no reader running it reads the read models
    in Redis, the same jobs as a fold of the log, without loading JetStream's client (nats-py
    looked up the 503's status header in it) or importlib.metadata (redis-py reads its own
    version with it): a fifth of such a call's start."""
    import subprocess
    import sys

    asyncio.run(_append_all(nats_url, _scenario()))
    asyncio.run(projector.rebuild_views(nats_url, redis_url))
    code = ("import json, sys\nfrom gpusched.cli.main import main\nrc = main(%r)\n"
            "print(json.dumps([rc, sorted(m for m in %r if m in sys.modules)]), file=sys.stderr)"
            % (["jobs", "--json", "--nats", nats_url, "--redis", redis_url], NOT_FOR_A_REDIS_LISTING))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    rc, loaded = json.loads(proc.stderr.strip().splitlines()[-1])
    assert rc == 0, proc.stderr
    from_log = _cli_json(capsys, "jobs", "--json", "--nats", nats_url, "--fold")
    assert [(d["job_id"], d["state"], d["seq"]) for d in json.loads(proc.stdout)] == \
        [(d["job_id"], d["state"], d["seq"]) for d in from_log]
    assert loaded == []


def test_projector_follows_live(nats_url, redis_url):
    async def scenario():
        events = _scenario()
        await _append_all(nats_url, events[:6])
        stop = asyncio.Event()
        task = asyncio.create_task(projector.run(nats_url, redis_url, stop, flush_s=0.02))
        views = Views.connect(redis_url)
        try:
            async def seq_reaches(n):
                for _ in range(200):
                    meta = await views.meta()
                    if meta and meta["seq"] >= n:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"views never reached seq {n}")

            await seq_reaches(6)
            assert {j["job_id"]: j["state"] for j in await views.jobs()} == {"big": "starting"}
            await _append_all(nats_url, events[6:])
            await seq_reaches(14)
            jobs = {j["job_id"]: j for j in await views.jobs()}
            assert jobs["big"]["state"] == "pending" and jobs["mid"]["state"] == "starting"
            nodes = {n["node"]: n for n in await views.nodes()}
            assert nodes["n0"]["free"] == 8 and nodes["n1"]["held"] == 6
            assert nodes["n1"]["gpus"][0]["team"] == "nlp"
            tail = await views.tail()
            assert tail[-1]["seq"] == 14 and "released" in tail[-1]["text"]
            assert (await views.health())["placement_degraded"] is False
            # shares are sampled once per second of the log's clock, the server's store time: a
            # fact stored a second later samples the holdings the facts before it left
            await asyncio.sleep(1.1)
            await _append_all(nats_url, [ev.JobPending(at=time.time(), job_id="wait", reason="still waiting")])
            await seq_reaches(15)
            shares = await views.shares()
            assert shares[-1]["teams"] == {"nlp": 6, "vision": 0}
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
            await views.close()

    asyncio.run(scenario())


def test_show_explains_pending_and_preempted(nats_url, capsys):
    asyncio.run(_append_all(nats_url, _scenario()))
    data = _cli_json(capsys, "show", "wait", "--json", "--nats", nats_url)
    why = data["why_pending"]
    assert why["team_quota"]["limit_blocks"] is True
    assert why["topology"]["level"] == "node" and why["topology"]["fits_now_in"] == ["n0"]
    assert any("limit" in u for u in why["unblock"])
    assert [h["type"] for h in data["history"]] == ["JobSubmitted", "JobPending"]

    data = _cli_json(capsys, "show", "big", "--json", "--nats", nats_url)
    (p,) = data["preemptions"]
    assert p["for_job"] == "mid" and p["lost_gpu_s"] == 16.0 and p["checkpoint"]["step"] == 40
    data = _cli_json(capsys, "show", "mid", "--json", "--nats", nats_url)
    assert data["preempted_for_it"][0]["victim"] == "big"
    assert "PreemptionRequested" in [h["type"] for h in data["history"]]

    capsys.readouterr()
    assert main(["show", "wait", "--nats", nats_url]) == 0
    out = capsys.readouterr().out
    assert "why is it pending?" in out and "limit" in out
    assert main(["jobs", "--nats", nats_url, "--fold"]) == 0
    assert "n1[0-5]" in capsys.readouterr().out


async def test_dashboard_explains_a_pending_job_under_the_running_policy(nats_url, monkeypatch):
    """`gpusched dashboard --policy fifo` orders the queue as fifo does: `wait` behind the
    preempted `big` only, where the default (`full`) puts the later high-priority `urgent`
    ahead of it too."""
    import argparse

    import aiohttp

    from gpusched.bus.servers import free_port
    from gpusched.services import dashboard

    await _append_all(nats_url, [*_scenario(), ev.JobSubmitted(at=11, job_id="urgent",
                                                                spec=JobSpec(team="nlp", gpus=4, priority="high"))])
    monkeypatch.setenv("GPUSCHED_DASHBOARD_TOKEN", "views-token")
    parser = argparse.ArgumentParser()
    dashboard.add_arguments(parser)
    port = free_port()
    args = parser.parse_args(["--port", str(port), "--policy", "fifo"])
    args.nats = nats_url
    stop = asyncio.Event()
    task = asyncio.create_task(dashboard.serve(args, stop))
    try:
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer views-token"}) as http:
            for _ in range(150):  # until it serves
                try:
                    async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.1)
            answers = []
            for _ in range(2):  # the second from the indexes the first made
                async with http.get(f"http://127.0.0.1:{port}/api/job/wait") as resp:
                    assert resp.status == 200
                    answers.append((await resp.json())["why_pending"])
        assert answers[0]["queue"]["ahead"] == ["big"] and answers[0]["queue"]["of"] == 3
        assert answers[1]["queue"] == answers[0]["queue"]
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
