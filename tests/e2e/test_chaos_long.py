"""The long form of `gpusched chaos` (slow: about 25 minutes on two busy cores): its own
`up --nats-cluster 3` stack with 128 simulated nodes, a stream of at least 1,000 jobs (each a
real `sleep` process), and at least 50 faults at random moments of it: every service killed
in turn, the stream leader and a follower, the whole NATS cluster, Redis killed and flushed,
the node agent, and one NATS server stopped (SIGSTOP) and resumed. Every verdict must be clean."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LONG_FORM = ["--nodes", "128", "--jobs", "1000", "--rate", "3", "--job-s", "20",
             "--drills", "service,leader,follower,nats-all,redis,redis-flush,nodeagent,partition,"
                         "service:any,service:any,service:any,service:any,service:any",
             "--runs", "3", "--gap-s", "6", "--seed", "13", "--json"]


@pytest.mark.slow
def test_the_long_form_of_the_fault_drills_has_a_clean_verdict():
    done = subprocess.run([sys.executable, "-m", "gpusched.cli.main", "chaos", *LONG_FORM],
                          capture_output=True, text=True, timeout=2400)
    assert done.stdout.strip(), done.stderr[-3000:]
    verdict = json.loads(done.stdout)
    table = verdict["drills"]
    runs = sum(row["runs"] for name, row in table.items() if name not in ("service", "final"))
    assert runs >= 50, table
    assert verdict["submitted"] >= 1000 and verdict["census_samples"] > 0 and verdict["peak_job_processes"] > 0
    for kind in ("service", "leader", "follower", "nats-all", "redis", "redis-flush", "nodeagent", "partition"):
        assert table[kind]["runs"] >= 3, (kind, table)
    for name, row in table.items():
        assert row["clean"] == row["runs"], (name, row)
        assert row["lost"] == row["double_booked"] == row["duplicate_processes"] == row["violations"] == 0, row
    assert verdict["duplicates"] == {} and verdict["refused"] == {} and verdict["unanswered"] == 0
    assert done.returncode == 0, done.stderr[-3000:]
