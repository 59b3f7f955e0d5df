"""A job runs where and how its user expects: in the directory it was submitted from, with the
variables it exported, its launch errors reported at once, its output readable with
`gpusched logs` (and followed with -f), its time limit its own end state."""

from __future__ import annotations

import argparse
import asyncio
import io
import time

import msgspec

from gpusched.cli.commands import register as register_client
from gpusched.cli.commands import spec_from_args
from gpusched.cli.logs import run_logs
from gpusched.core import events as ev
from gpusched.core.heartbeat import LogRequest
from gpusched.core.model import JobSpec
from gpusched.services.nodeagent.logs import serve_log
from gpusched.services.runtime import FoldedLog

from .node_helpers import PY, Cluster


def submit_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register_client(parser.add_subparsers(dest="command"))
    return parser.parse_args(["submit", "--team", "t", "--gpus", "1", *argv])


def logs_args(nats_url: str, job_id: str, follow: bool = False, **kw) -> argparse.Namespace:
    return argparse.Namespace(job_id=job_id, rank=kw.get("rank", 0), attempt=kw.get("attempt"), follow=follow,
                              interval=0.1, timeout=3.0, nats=nats_url)


async def test_relative_path_job_runs_in_its_submit_dir_and_logs_are_served(nats_url, tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    (project / "hello.py").write_text("import os; print('MARKER-hello', os.environ.get('MY_SETTING'))\n")
    monkeypatch.chdir(project)
    monkeypatch.setenv("MY_SETTING", "exported-42")
    monkeypatch.setenv("NOT_EXPORTED", "secret")
    spec = spec_from_args(submit_args(["--export", "MY_SETTING", "--", PY, "hello.py"]))
    assert spec.workdir == str(project) and spec.env == {"MY_SETTING": "exported-42"}
    assert spec_from_args(submit_args(["--chdir", "/tmp", "--", "x"])).workdir == "/tmp"
    assert spec_from_args(submit_args(["--", "x"])).env == {}  # default: export nothing
    monkeypatch.chdir(tmp_path)  # the agent runs elsewhere: the job must not care
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["w0"], gpus=2)
        await c.submit("hello", spec)
        await c.grant("hello", ["w0/0"])
        job = await c.wait(lambda s: s.jobs["hello"].state in ("completed", "failed") and s.jobs["hello"], "done")
        assert job.state == "completed", job.end_reason
        out = io.StringIO()
        assert await run_logs(logs_args(nats_url, "hello"), out) == 0
        assert "MARKER-hello exported-42" in out.getvalue()
        # a missing command fails at once, with the reason, and is not retried
        await c.submit("missing", JobSpec(team="t", gpus=1, command=["no-such-command-xyz"], workdir=str(project)))
        await c.grant("missing", ["w0/1"])
        job = await c.wait(lambda s: s.jobs["missing"].state == "failed" and s.jobs["missing"], "failed")
        assert "launch error" in job.end_reason and "'no-such-command-xyz' not found in PATH" in job.end_reason
        assert job.attempt == 1 and job.restarts == 0
        # a working directory that does not exist is a launch error too
        await c.submit("nodir", JobSpec(team="t", gpus=1, command=[PY, "-c", "pass"], workdir="/no/such/dir"))
        await c.grant("nodir", ["w0/1"])
        job = await c.wait(lambda s: s.jobs["nodir"].state == "failed" and s.jobs["nodir"], "failed")
        assert "working directory '/no/such/dir' does not exist" in job.end_reason
        state = await c.refold()
        assert not c.events(ev.GpusReleased) and state.violations() == []


async def test_logs_follow_a_running_job(nats_url, tmp_path):
    script = ("import time\nfor i in range(8):\n    print('tick', i, flush=True); time.sleep(0.25)\n"
              "print('MARKER-end', flush=True)\n")
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["x0"], gpus=1)
        await c.submit("ticker", JobSpec(team="t", gpus=1, command=[PY, "-c", script]))
        await c.grant("ticker", ["x0/0"])
        await c.wait(lambda s: s.jobs["ticker"].logs, "running with a log")
        out = io.StringIO()
        t0 = time.monotonic()
        assert await asyncio.wait_for(run_logs(logs_args(nats_url, "ticker", follow=True), out), 30) == 0
        text = out.getvalue()
        assert time.monotonic() - t0 >= 1.0  # it followed the job rather than printing once
        assert "tick 0" in text and "tick 7" in text and text.rstrip().endswith("MARKER-end")
        assert c.state.jobs["ticker"].state == "completed"


async def test_logs_follow_waits_for_a_job_not_yet_started(nats_url, tmp_path):
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["z0"], gpus=1)
        await c.submit("later", JobSpec(team="t", gpus=1, command=[PY, "-c", "print('MARKER-later')"]))
        out = io.StringIO()
        follow = asyncio.ensure_future(run_logs(logs_args(nats_url, "later", follow=True), out))
        await asyncio.sleep(0.5)
        assert not follow.done()  # pending: it waits instead of exiting 1
        await c.grant("later", ["z0/0"])
        assert await asyncio.wait_for(follow, 30) == 0
        assert "MARKER-later" in out.getvalue()
        assert "later attempt 1 on z0" in out.getvalue()  # the log's header: an integer, not `1.0`


async def test_a_daemon_whose_fold_lags_the_asker_still_serves_the_log(nats_url, tmp_path):
    """`logs -f` asks as soon as its fold shows the start; the daemon that appended it may not
    have folded it back yet (a CI failure): a miss catches the daemon's fold up, then looks again."""
    log_dir = tmp_path / "logs"
    (log_dir / "j").mkdir(parents=True)
    path = log_dir / "j" / "r0.log"
    path.write_text("MARKER-lagging\n")
    async with Cluster(nats_url, tmp_path) as c:
        daemon = FoldedLog(c.log)
        await daemon.start()
        await daemon.stop()  # it stops following: the daemon's fold is behind from here on
        await c.submit("j", JobSpec(team="t", gpus=1, command=["x"]))
        await c.grant("j", ["n0/0"])
        await c.append(ev.JobStarted(at=time.time(), job_id="j", attempt=1, node="n0", log=str(path)))
        assert c.state.jobs["j"].logs and "j" not in daemon.state.jobs

        async def resume_following() -> None:
            await asyncio.sleep(0.3)
            await daemon.start()

        ask = msgspec.json.encode(LogRequest(job_id="j", attempt=1))
        reply, _ = await asyncio.gather(serve_log("n0", log_dir, ask, daemon), resume_following())
        await daemon.stop()
        assert reply.ok, reply.error
        assert reply.data == "MARKER-lagging\n"


async def test_time_limit_asks_for_a_checkpoint_before_the_end(nats_url, tmp_path):
    """A time-limited job is asked to checkpoint `timeout_checkpoint_s` before its limit; the
    limit then ends it in its own state, `timeout` (the policy appends JobTimedOut)."""
    script = ("import time, gpusched.job as J\nctx = J.context()\nwhile True:\n"
              "    if ctx.checkpoint_requested:\n        ctx.checkpoint(b'state', 7)\n    time.sleep(0.05)\n")
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["y0"], gpus=1, timeout_checkpoint_s=1.5)
        await c.submit("limited", JobSpec(team="t", gpus=1, time_limit_s=2.5, checkpoint_dir=str(tmp_path / "ck"),
                                          command=[PY, "-c", script]))
        await c.grant("limited", ["y0/0"])
        job = await c.wait(lambda s: s.jobs["limited"].checkpoint is not None and s.jobs["limited"], "checkpoint")
        assert job.checkpoint.step == 7 and job.checkpoint.at < job.started_at + 2.5
        await c.append(ev.JobTimedOut(at=time.time(), job_id="limited", attempt=1, limit_s=2.5))
        await c.wait(lambda s: not s.jobs["limited"].live, "its processes ended")
        state = await c.refold()
        assert state.jobs["limited"].state == "timeout"
        assert state.jobs["limited"].end_reason == "time limit of 2.5 s exceeded"
        assert state.violations() == []
