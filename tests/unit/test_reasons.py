"""What `gpusched show` and `queue` say about a pending job is what the running policy decided.

For random contended states and presets, every reason the cycle recorded (`decide(...).reasons`)
is, once its events are applied, exactly what `explain_pending` reports (text, blockers, typed
reason, ETA), and the queue lists jobs in the order of the policy that ran, not the default's.
"""

from __future__ import annotations

import math

import msgspec
from hypothesis import HealthCheck, given, settings

from gpusched import readmodel
from gpusched.core import reasons as rs
from gpusched.policy.config import PRESETS
from gpusched.policy.cycle import decide
from gpusched.policy.explain import explain_pending
from gpusched.policy.ordering import ordered

from .policy_helpers import Scenario, gpus
from .test_policy_properties import contended, contended_state


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(contended())
def test_show_gives_exactly_the_reasons_the_cycle_recorded(w):
    state = contended_state(w)
    config = PRESETS[w["preset"]].replace(**w["overrides"])
    now = 1000.0
    for _ in range(w["steps"]):
        plan = decide(state, now, config)
        for e in plan.events:
            state.apply(e)
        assert state.violations() == []
        for jid, (why, eta) in plan.reasons.items():
            if state.jobs[jid].state != "pending":
                continue
            shown = explain_pending(state, jid, now, config)
            assert shown["policy"]["reason"] == why.text == shown["summary"]
            assert shown["policy"]["blockers"] == why.blockers
            assert shown["policy"]["why"] == msgspec.to_builtins(why)
            if eta is not None and math.isfinite(eta) and state.jobs[jid].pending_why == why:
                assert shown["eta_s"] == round(eta, 3)
        now += 20.0


def _two_priorities(s: Scenario) -> None:
    s.run("big", gpus("r0n0", *range(8)), at=0)
    s.submit("old-low", 4, at=1, priority="low")
    s.submit("new-high", 4, at=2, priority="high")


# name: (preset, the queue order `queue` must list)
QUEUE_CASES = {
    "fifo lists by submission, whatever the priority": ("fifo", ["old-low", "new-high"]),
    "full lists by priority class first": ("full", ["new-high", "old-low"]),
}


def test_queue_lists_jobs_in_the_running_policys_order():
    for name, (preset, want) in QUEUE_CASES.items():
        s = Scenario(racks=1, nodes=1)
        _two_priorities(s)
        got = [q["job_id"] for q in readmodel.queue_docs(s.state, PRESETS[preset])]
        assert got == want, name
        assert got == [j.job_id for j in ordered(s.state, s.state.now, PRESETS[preset])], name


def test_every_reason_kind_round_trips_through_job_pending():
    from gpusched.core import events as ev

    kinds = [rs.QueuedBehind(), rs.NoRoom(4, "node"), rs.TeamLimit("t", 8, 2), rs.BehindReservation(),
             rs.Topology(16, "rack", 7, [("r0", 6), ("r1", 1)], ["j1"], reserved=True),
             rs.WaitingForCheckpoint(["v1", "v2"]), rs.ComingFree(["v3"])]
    for why in kinds:
        e = ev.JobPending(at=1.0, job_id="j", reason=why.text, blockers=why.blockers, why=why)
        back = msgspec.json.decode(msgspec.json.encode(e), type=ev.AnyEvent)
        assert back == e and back.why == why
