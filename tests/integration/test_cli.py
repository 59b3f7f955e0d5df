"""The command line against a real NATS: pipes get full-width plain columns, filters and formats
work, `--at` shows the cluster as it was (cut by the server's store time), `history` bills each
job, and an unreachable server is one line and exit 2 for every command."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from gpusched.bus.log import EventLog
from gpusched.bus.servers import free_port
from gpusched.cli.main import build_parser, main
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec

LONG_ID = "j-8c1f0e9d2b7a4c3e9f10aa55bb66cc77"


def cli(capsys, *argv: str) -> str:
    """Run one command in this process (no fail-fast switch: that is for the CLI's own process)."""
    args = build_parser().parse_args(list(argv))
    assert args.func(args) in (0, None)
    return capsys.readouterr().out


async def _append(url: str, events: list, pause_after: int | None = None) -> tuple[float, int]:
    """Append events; returns (a wall time between event `pause_after` and the next, its seq)."""
    log = await EventLog.open(url)
    mark = (0.0, 0)
    try:
        for i, e in enumerate(events, 1):
            seq = await log.append(e, msg_id=f"t-{i}")
            if i == pause_after:
                await asyncio.sleep(0.3)
                mark = (time.time(), seq)
                await asyncio.sleep(0.3)
    finally:
        await log.close()
    return mark


def _cluster(t0: float) -> list:
    return [
        ev.NodeRegistered(at=t0, node="n0", rack="rack2", gpus=[GpuInfo(index=i, uuid=f"u{i}") for i in range(4)]),
        ev.NodeRegistered(at=t0, node="n1", rack="rack10", gpus=[GpuInfo(index=i, uuid=f"v{i}") for i in range(4)]),
        ev.JobSubmitted(at=t0 + 1, job_id=LONG_ID, spec=JobSpec(team="vision", gpus=4, name="train-big")),
        ev.GpusGranted(at=t0 + 2, job_id=LONG_ID, attempt=1, gpus=[f"n0/{i}" for i in range(4)], level="node"),
        ev.JobSubmitted(at=t0 + 3, job_id="j-2", spec=JobSpec(team="nlp", gpus=2)),
        # decided earlier than the events before it (another writer's clock): `at` is not monotonic
        ev.GpusGranted(at=t0 - 50, job_id="j-2", attempt=1, gpus=["n1/0", "n1/1"], level="nvlink"),
        ev.JobCompleted(at=t0 + 3603, job_id=LONG_ID, attempt=1),
    ]


@pytest.fixture
def populated(nats_url):
    t0 = time.time() - 7200
    mark = asyncio.run(_append(nats_url, _cluster(t0), pause_after=5))
    return nats_url, mark


def test_pipes_get_plain_full_width_columns_and_formats(populated, capsys):
    url, _ = populated
    out = cli(capsys, "jobs", "--nats", url)
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["JOB", "TEAM", "USER", "STATE", "PRIO"]
    assert LONG_ID in out  # never cut, whatever the width
    row = next(x for x in lines if x.startswith(LONG_ID))
    assert "completed" in row and "4" in row.split()
    assert cli(capsys, "jobs", "--nats", url, "--no-header", "--format", "job,state").splitlines() == [
        f"{LONG_ID}  completed", f"{'j-2'.ljust(len(LONG_ID))}  starting"]
    wide = cli(capsys, "jobs", "--nats", url, "-o", "wide")
    assert "SUBMITTED" in wide.splitlines()[0] and "train-big" in wide
    assert [d["job_id"] for d in json.loads(cli(capsys, "jobs", "--nats", url, "--json", "--team", "nlp"))] == ["j-2"]
    assert cli(capsys, "jobs", "--nats", url, "--state", "starting,running", "--no-header", "--format", "job").split() == ["j-2"]
    assert cli(capsys, "jobs", "--nats", url, "--user", "nobody", "--no-header") == ""
    csv_out = cli(capsys, "jobs", "--nats", url, "-o", "csv", "--format", "job,team").splitlines()
    assert csv_out[0] == "job,team" and "j-2,nlp" in csv_out
    nodes = cli(capsys, "nodes", "--nats", url, "-o", "wide", "--format", "node,rack,holders")
    assert f"[0-3]={LONG_ID}" not in nodes  # it completed: nobody holds n0 now
    assert "[0-1]=j-2" in nodes
    teams = cli(capsys, "teams", "--nats", url, "--format", "team,held", "--no-header").split()
    assert teams == ["nlp", "2", "vision", "0"]


def test_at_shows_the_cluster_as_it_was(populated, capsys):
    url, (when, seq) = populated
    # by sequence: before the completion, the big job held n0
    past = cli(capsys, "nodes", "--nats", url, "--at", "6", "--format", "node,holders", "--no-header")
    assert f"[0-3]={LONG_ID}" in past
    # by the server's store time: the cut lands after event 5, although event 6's `at` is the oldest
    jobs = json.loads(cli(capsys, "jobs", "--nats", url, "--at", str(_iso(when)), "--json"))
    assert {d["job_id"]: d["state"] for d in jobs} == {LONG_ID: "starting", "j-2": "pending"}
    assert all(d["seq"] == seq for d in jobs)


def _iso(t: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, timezone.utc).isoformat()


def test_history_bills_each_job(populated, capsys):
    url, _ = populated
    rows = {r["job_id"]: r for r in json.loads(cli(capsys, "history", "--nats", url, "--json"))}
    big = rows[LONG_ID]
    assert big["state"] == "completed" and big["wait_s"] == pytest.approx(1.0, abs=1e-3)
    assert big["run_s"] == pytest.approx(3601.0, abs=1e-3) and big["gpu_hours"] == pytest.approx(4 * 3601 / 3600, abs=1e-3)
    assert rows["j-2"]["state"] == "starting" and rows["j-2"]["attempts"] == 1
    csv_out = cli(capsys, "history", "--nats", url, "-o", "csv", "--team", "vision").splitlines()
    assert csv_out[0].startswith("job,user,team,gpus,state") and len(csv_out) == 2
    report = json.loads(cli(capsys, "history", "--nats", url, "--by", "week", "--json"))
    assert {r["team"] for r in report} == {"vision", "nlp"}
    assert sum(r["gpu_hours"] for r in report if r["team"] == "vision") == pytest.approx(4 * 3601 / 3600, abs=1e-3)


COMMANDS = [["jobs"], ["nodes"], ["teams"], ["queue"], ["show", "j-1"], ["history"], ["replay"],
            ["replay", "--until", "2025-01-01T00:00:00"], ["jobs", "--at", "2h"], ["cancel", "j-1"],
            ["quota", "t", "--guaranteed", "1"], ["drain", "n0"], ["submit", "--team", "t", "--gpus", "1", "--", "true"]]


@pytest.fixture
def fail_fast_cli(monkeypatch, tmp_path):
    """`main()` switches this process's NATS connections to fail fast: undo it afterwards. No
    client config (an earlier `gpusched up` in the session may have written one naming its Redis)."""
    from gpusched.bus import log

    monkeypatch.setenv("GPUSCHED_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.delenv("GPUSCHED_REDIS_URL", raising=False)
    yield main
    log._client_options.clear()


def test_unreachable_nats_is_one_line_and_exit_2_for_every_command(fail_fast_cli, capsys):
    url = f"nats://127.0.0.1:{free_port()}"
    for argv in COMMANDS:
        code = fail_fast_cli([argv[0], "--nats", url, *argv[1:]])
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        assert err.count("\n") == 1 and "Traceback" not in err, (argv, err)
        assert url in err and "gpusched up" in err, (argv, err)
    # the real process: one line on stderr, exit 2; --debug shows the traceback
    real = subprocess.run([sys.executable, "-m", "gpusched.cli.main", "show", "j-1", "--nats", url],
                          capture_output=True, text=True, timeout=120)
    assert real.returncode == 2 and real.stderr.count("\n") == 1 and "Traceback" not in real.stderr
    debug = subprocess.run([sys.executable, "-m", "gpusched.cli.main", "--debug", "jobs", "--nats", url],
                           capture_output=True, text=True, timeout=120)
    assert "Traceback" in debug.stderr and debug.returncode != 0


def test_bad_time_is_a_usage_error_not_a_traceback(nats_url):
    proc = subprocess.run([sys.executable, "-m", "gpusched.cli.main", "jobs", "--nats", nats_url, "--at", "yesterday-ish"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--at" in proc.stderr


def test_show_in_a_pipe_cuts_no_line(populated, capsys):
    """rich assumes 80 columns in a pipe; `show` is as wide as its widest line instead."""
    url, _ = populated
    lines = cli(capsys, "show", LONG_ID, "--nats", url).splitlines()
    head = next(x for x in lines if "train-big" in x)
    assert LONG_ID in head and "team vision" in head and "wants 4 GPU(s)" in head
    assert any(f"{LONG_ID} granted 4 GPU(s) (node, " in x for x in lines)  # the history's text whole
    assert max(len(x) for x in lines) > 80
