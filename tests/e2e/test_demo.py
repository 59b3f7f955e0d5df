"""`gpusched demo --quick`: the chaos scene on a live stack (every service its own process)
ends with every verdict holding: placement degraded to naive and recovered, interactive jobs got
GPUs during the outage, every team at or under its guarantee kept it, the flood stayed within its
team's limit, no GPU double-booked, no job lost, no invariant broken."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(420)
def test_quick_demo_verdicts(tmp_path, trust):
    # beside another stack: its client config names that stack's admin, and no $GPUSCHED_CREDS
    config = tmp_path / "config.toml"
    config.write_text(f'nats = "nats://127.0.0.1:1"\ncreds = "{trust.creds("admin")}"\n')
    env = {k: v for k, v in os.environ.items() if k != "GPUSCHED_CREDS"} | {"GPUSCHED_CONFIG": str(config)}
    proc = subprocess.run(
        [sys.executable, "-m", "gpusched.cli.main", "demo", "--quick", "--json", "--dashboard-port", "0",
         "--data-dir", str(tmp_path / "demo"), "--step-timeout", "45"],
        capture_output=True, text=True, timeout=400, env=env,
    )
    assert proc.stdout.strip(), f"demo printed nothing (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout)
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, f"verdicts failed: {failed}\n{json.dumps(result, indent=2)}"
    assert result["double_booked_gpus"] == [] and result["jobs_lost"] == []
    assert result["locality"]["during_outage"]["placers"] == ["naive"]
    wait = result["interactive_wait_s"]
    assert wait["p50"] is not None and wait["granted"] + wait["still_queued"] == wait["jobs"]  # over all of them
    assert "no team within its guarantee left waiting" in result["checks"]
    assert result["left_waiting_under_guarantee"] == {}
    assert result["recovery_s"] is not None
    assert proc.returncode == 0
