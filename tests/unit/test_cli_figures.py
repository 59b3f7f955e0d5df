"""The figures the CLI prints: durations truncated (never rounded up), attempts as integers,
the bill naming who submitted."""

from __future__ import annotations

import pytest

from gpusched.accounting import account, job_records
from gpusched.cli.render import dur
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.readmodel import attempt_text, describe


@pytest.mark.parametrize("seconds, shown", [
    (None, "-"), (-3, "0.0s"), (0.06, "0.0s"), (9.99, "9.9s"), (10.9, "10s"), (59.99, "59s"),
    (60, "1m00s"), (90, "1m30s"), (119.7, "1m59s"), (179, "2m59s"), (3599.9, "59m59s"),
    (3600, "1h00m"), (7199, "1h59m"), (86399, "23h59m"), (86400, "1d00h"), (90000, "1d01h"),
])
def test_durations_are_truncated_not_rounded_up(seconds, shown):
    assert dur(seconds) == shown


def test_attempts_read_as_integers():
    assert attempt_text(1) == "attempt 1"
    assert attempt_text(1, 4) == "attempt 1, restart 4"
    line = describe(ev.ProcessesEnded(at=1.0, job_id="j", node="n0", attempt=2, generation=0, reason=""))
    assert "attempt 2)" in line and "2.0" not in line


def test_the_bill_records_the_submitting_user():
    t0 = 1_700_000_000.0
    records = [(1, ev.NodeRegistered(at=t0, node="n0", rack="r0", gpus=[GpuInfo(index=0, uuid="u0")])),
               (2, ev.JobSubmitted(at=t0 + 1, job_id="a", spec=JobSpec(team="t1", gpus=1), user="bob")),
               (3, ev.JobSubmitted(at=t0 + 2, job_id="b", spec=JobSpec(team="t1", gpus=1)))]
    state, ledger = account(records)
    assert {r["job_id"]: r["user"] for r in job_records(state, ledger)} == {"a": "bob", "b": None}


def test_a_platforms_submit_on_behalf_of_a_user_reads_as_both(capsys):
    """A platform's submit for bob is bob's job sent via the platform: the job document (`show
    --json`, `jobs --json`, the client's and the HTTP API's show), `show`'s text and the bill
    say both, an array's tasks too; a job its user sent says no `via`."""
    from gpusched import readmodel
    from gpusched.cli import render
    from gpusched.core.model import ArraySpec

    t0 = 1_700_000_000.0
    records = [(1, ev.JobSubmitted(at=t0, job_id="a", spec=JobSpec(team="t1", gpus=1), user="bob", via="ci")),
               (2, ev.JobSubmitted(at=t0, job_id="arr", spec=JobSpec(team="t1", gpus=1, array=ArraySpec(0, 1)),
                                   user="bob", via="ci")),
               (3, ev.JobSubmitted(at=t0, job_id="b", spec=JobSpec(team="t1", gpus=1), user="bob"))]
    state, ledger = account(records)
    docs = {j: readmodel.job_doc(state, state.jobs[j]) for j in ("a", "arr_0", "b")}
    assert {j: (d["user"], d["via"]) for j, d in docs.items()} == {"a": ("bob", "ci"), "arr_0": ("bob", "ci"),
                                                                  "b": ("bob", None)}
    assert {r["job_id"]: r["via"] for r in job_records(state, ledger)} == {"a": "ci", "arr_0": "ci", "arr_1": "ci",
                                                                          "b": None}
    render.print_show({"job": docs["a"], "now": t0, "seq": 1, "preemptions": [], "preempted_for_it": [], "history": []})
    assert "user bob (via ci)" in " ".join(capsys.readouterr().out.split())
    render.print_show({"job": docs["b"], "now": t0, "seq": 3, "preemptions": [], "preempted_for_it": [], "history": []})
    assert "via" not in capsys.readouterr().out


@pytest.mark.parametrize("text, seconds", [
    ("300", 300), ("90m", 5400), ("2h", 7200), ("1d2h", 93600), ("1h30m15s", 5415), ("1.5h", 5400),
    ("1w", 604800), ("PT2H", 7200), ("P1DT2H", 93600), ("pt90s", 90), ("P1W", 604800),
    ("2h1d", None), ("1h1h", None), ("abc", None), ("P", None), ("PT", None), ("", None), ("-5m", None),
])
def test_one_duration_grammar(text, seconds):
    from gpusched.cli.output import duration_s

    assert duration_s(text) == seconds


def test_ages_and_times_ahead_use_the_same_grammar():
    from gpusched.cli.output import parse_future, parse_time

    assert parse_time("1d2h", now=100_000.0) == 100_000.0 - 93600
    assert parse_time("PT30M", now=10_000.0) == 10_000.0 - 1800
    assert parse_future("+1h30m", now=0.0) == 5400
    assert parse_time("1700000000", now=0.0) == 1_700_000_000  # a bare number stays epoch seconds


def test_user_list_has_a_header(tmp_path, capsys):
    from gpusched.cli.main import main
    from gpusched.security.trust import TrustStore

    store = TrustStore(tmp_path)
    store.add("ann", "tenant", teams=["nlp"])
    assert main(["user", "list", "--trust", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "ROLE", "TEAMS/NODE", "STATE", "PUBLIC_KEY"]
    assert lines[1].split()[:4] == ["ann", "tenant", "nlp", "active"]
    assert main(["user", "list", "--trust", str(tmp_path), "--no-header"]) == 0
    assert capsys.readouterr().out.split()[0] == "ann"
