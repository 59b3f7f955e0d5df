"""Fifty random faults over the whole deployed stack in the lab (`gpusched.lab.faults`), one after
another with random kinds, victims and hold times: no acknowledged submit lost, no job running on
two hosts at once (the OS's census), `replay --verify` clean, every fault recovered from. The
JSON verdict is written to tests/artifacts/lab-random-faults.json. Slow: about 15-25 minutes."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from gpusched.lab import faults, netns
from gpusched.lab.stack import LabStack

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "lab available")]
RUNS = int(os.environ.get("GPUSCHED_LAB_FAULT_RUNS", "50"))
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


@pytest.mark.timeout(3600)
def test_random_faults_over_the_whole_stack():
    work = Path(tempfile.mkdtemp(prefix="gs-labfaults-"))
    work.chmod(0o711)  # jobs under dynamic uids reach their control directories
    stack = LabStack(work, nodes=3, node_timeout_s=8.0, heartbeat_s=0.5)
    try:
        stack.up()
        verdict = faults.run(stack, RUNS, seed=int(os.environ.get("GPUSCHED_LAB_FAULT_SEED", "1")))
    finally:
        stack.down()
        shutil.rmtree(work, ignore_errors=True)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "lab-random-faults.json").write_text(json.dumps(verdict, indent=1))
    assert set(faults.KINDS) <= {r["kind"] for r in verdict["results"]} or RUNS < 30  # every kind drawn
    assert verdict["lost_submits"] == []
    assert verdict["double_running"] == {}
    assert verdict["not_recovered"] == []
    assert verdict["replay_verify"], verdict["replay_verify_tail"]
