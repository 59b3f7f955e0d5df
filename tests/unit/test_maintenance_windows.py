"""Maintenance windows (`gpusched drain NODE --at START --until END`): the fold keeps a window
list per node, and placement keeps a job off a node whose window its time limit would run into
(any window not over yet, for a job without a limit). After END the node returns by itself."""

from __future__ import annotations

import pytest

from gpusched.core import events as ev
from gpusched.core.commands import DrainNode
from gpusched.core.reasons import MaintenanceWindow
from gpusched.policy.config import PRESETS
from gpusched.services.admission import AdmissionConfig, Capacity, admit

from .policy_helpers import Scenario, grants

PRESET_NAMES = list(PRESETS)


def _window(s: Scenario, node: str, start: float, until: float, at: float = 5.0) -> None:
    s.apply(ev.NodeDrained(at=at, node=node, start=start, until=until, reason="firmware"))


def test_the_fold_keeps_windows_apart_from_the_drained_flag():
    s = Scenario(nodes=2)
    _window(s, "r0n0", 100.0, 200.0)
    _window(s, "r0n0", 20.0, 30.0, at=6.0)
    assert s.state.windows == {"r0n0": [(20.0, 30.0), (100.0, 200.0)]}
    assert not s.state.nodes["r0n0"].drained and s.state.free_count == 16
    _window(s, "r0n0", 300.0, 400.0, at=50.0)  # the window that ended at 30 is dropped
    assert s.state.windows["r0n0"] == [(100.0, 200.0), (300.0, 400.0)]
    s.apply(ev.NodeDrained(at=60.0, node="r0n0", drain=False))  # undrain cancels its windows
    assert "r0n0" not in s.state.windows
    _window(s, "nope", 1.0, 2.0)
    assert "nope" not in s.state.windows


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_a_job_that_ends_before_the_window_runs_one_that_would_cross_it_waits(preset):
    s = Scenario(nodes=1)
    s.team("a")
    _window(s, "r0n0", 100.0, 200.0)
    s.submit("long", gpus=4, at=6.0, time_limit_s=500.0)
    s.submit("short", gpus=4, at=7.0, time_limit_s=50.0)
    s.submit("open", gpus=2, at=8.0)  # no time limit: any window ahead bars the node
    assert set(grants(s.cycle(preset, now=10.0))) == {"short"}
    why = s.state.jobs["long"].pending_why
    assert isinstance(why, MaintenanceWindow) and why.need == 4
    assert why.windows == ["r0n0 1970-01-01T00:01Z..1970-01-01T00:03Z"]
    assert "maintenance window" in s.state.jobs["long"].pending_reason
    assert isinstance(s.state.jobs["open"].pending_why, MaintenanceWindow)
    s.finish("short", at=60.0)
    s.submit("tiny", gpus=1, at=150.0, time_limit_s=1.0)
    assert grants(s.cycle(preset, now=150.0)) == {}  # inside the window: nobody
    assert set(grants(s.cycle(preset, now=200.0))) == {"long", "open", "tiny"}  # over: no event needed


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_a_job_that_would_cross_a_window_goes_to_another_node(preset):
    s = Scenario(nodes=2)
    s.team("a")
    _window(s, "r0n0", 100.0, 200.0)
    s.submit("long", gpus=8, at=6.0, time_limit_s=500.0)
    s.submit("short", gpus=8, at=7.0, time_limit_s=50.0)
    g = grants(s.cycle(preset, now=10.0))
    assert {x.split("/")[0] for x in g["long"]} == {"r0n1"}
    assert {x.split("/")[0] for x in g["short"]} == {"r0n0"}


def test_backfill_keeps_off_a_window_it_would_run_into():
    s = Scenario(nodes=2)
    s.team("a")
    s.run("busy", [f"r0n1/{i}" for i in range(8)], at=1.0, time_limit_s=1000.0)
    _window(s, "r0n0", 100.0, 200.0)
    s.submit("head", gpus=16, at=6.0, time_limit_s=100.0)  # waits for busy: a reservation
    s.submit("fill", gpus=4, at=7.0, time_limit_s=500.0)  # would fit the hole, but crosses the window
    s.submit("brief", gpus=4, at=8.0, time_limit_s=50.0)
    g = grants(s.cycle("full", now=10.0))
    assert "fill" not in g and "head" not in g
    assert {x.split("/")[0] for x in g["brief"]} == {"r0n0"}


def test_show_explains_a_job_barred_by_a_window():
    from gpusched.policy.explain import explain_pending

    s = Scenario(nodes=1)
    s.team("a")
    _window(s, "r0n0", 100.0, 200.0)
    s.submit("long", gpus=4, at=6.0, time_limit_s=500.0)
    s.cycle("full", now=10.0)
    x = explain_pending(s.state, "long", 10.0)
    assert x["summary"].startswith("needs 4 GPUs outside maintenance windows it would run into: r0n0 ")
    assert "time-limit" in x["unblock"][0]
    assert x["policy"]["why"]["kind"] == "maintenance_window"


def test_admission_appends_a_window_and_refuses_a_malformed_one():
    s = Scenario(nodes=1)

    def drain(**kw):
        return admit(s.state, DrainNode(request_id="d", node="r0n0", **kw), 1000.0, AdmissionConfig(), Capacity())

    d = drain(at=2000.0, until=3000.0, reason="bios")
    assert d.reply.ok and d.event == ev.NodeDrained(at=1000.0, node="r0n0", reason="bios", start=2000.0, until=3000.0)
    assert drain(until=1500.0).event.start == 1000.0  # no --at: from now
    assert "before it starts" in drain(at=3000.0, until=2000.0).reply.error
    assert "already over" in drain(at=100.0, until=900.0).reply.error
    assert "needs an end" in drain(at=2000.0).reply.error
    assert "undrain" in drain(drain=False, until=3000.0).reply.error
    assert drain().event == ev.NodeDrained(at=1000.0, node="r0n0")  # a plain drain is unchanged


def test_cli_times_ahead():
    from gpusched.cli.output import UsageError, parse_future

    assert parse_future("+2h", now=1000.0) == 1000.0 + 7200
    assert parse_future("1970-01-01T01:00:00Z") == 3600.0
    assert parse_future("5000") == 5000.0
    with pytest.raises(UsageError, match=r"\+2h"):
        parse_future("2h", now=0.0)
    with pytest.raises(UsageError):
        parse_future("+soon")
