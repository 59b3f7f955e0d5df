"""`submit --parsable` and the duration grammar, `cancel` of several ids and by filters (like
`scancel`), against a real admission service: what the CLI prints is what the log holds."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from ..e2e.harness import harness  # noqa: F401


async def gpusched(url: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPUSCHED_NATS_URL": url}
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "gpusched.cli.main", *argv],
                                   capture_output=True, text=True, timeout=60, env=env)


async def submit(url: str, team: str, *extra: str) -> str:
    proc = await gpusched(url, "submit", "--parsable", "--team", team, "--gpus", "1", *extra, "--", "true")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


async def test_parsable_submit_durations_and_cancel_by_ids_and_filters(harness):  # noqa: F811
    harness.start("admission")
    await harness.ready("admission")
    url = harness.nats_url
    a, b, c = [await submit(url, "ml", "--time-limit", t) for t in ("1h30m", "PT2H", "1d2h")]
    other = await submit(url, "cv", "--time-limit", "90")
    array = await submit(url, "cv", "--array", "0-2")
    assert all(j and not set(j) & set(" ()\n") for j in (a, b, c, other, array))  # the id alone, even an array's
    state = await harness.wait_for("submitted", lambda s: all(j in s.jobs for j in (a, b, c, other)) and s)
    assert [state.jobs[j].spec.time_limit_s for j in (a, b, c, other)] == [5400, 7200, 93600, 90]

    refused = await gpusched(url, "submit", "--team", "ml", "--gpus", "1", "--time-limit", "2x", "--", "true")
    assert refused.returncode == 2 and "'2x' is not a duration" in refused.stderr

    two = await gpusched(url, "cancel", a, b)
    assert two.returncode == 0, two.stderr
    assert two.stdout.split("\n")[:2] == [f"cancelled {a}", f"cancelled {b}"]
    await harness.wait_for("a, b cancelled", lambda s: all(s.jobs[j].state == "cancelled" for j in (a, b)))
    by_team = await gpusched(url, "cancel", "--team", "cv", "--state", "pending", "--fold")
    assert by_team.returncode == 0, by_team.stderr
    state = await harness.wait_for("cv cancelled", lambda s: all(
        j.state == "cancelled" for j in s.jobs.values() if j.spec.team == "cv") and s)
    assert state.jobs[c].state == "pending"  # another team's job, untouched
    assert f"cancelled {other}" in by_team.stdout
