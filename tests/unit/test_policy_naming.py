"""Team names never decide (issue 12): renaming the teams by a bijection changes no decision.

The same random world is built twice, once with the teams renamed (names drawn so that the
alphabetical order changes), and a few cycles are run on both, the world moving the same way
between them. After every cycle the jobs started, asked to yield, released and resized must be
the same on both sides.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.core import events as ev
from gpusched.core.state import ClusterState
from gpusched.policy.config import PRESETS
from gpusched.policy.cycle import cycle

from .test_policy_properties import contended, contended_state

#: Names whose alphabetical order differs from the generator's "a" < "b" < "c" in every way.
NAMES = ["vision", "avision", "nlp", "zeta", "b"]


def _renamed(w: dict, names: dict[str, str]) -> dict:
    out = dict(w)
    out["teams"] = {names[t]: q for t, q in w["teams"].items()}
    out["running"] = [{**r, "team": names[r["team"]]} for r in w["running"]]
    out["pending"] = [{**p, "team": names[p["team"]]} for p in w["pending"]]
    return out


def _decisions(out: list[ev.Event]) -> dict[str, set]:
    """What a cycle did, by job id (team names appear only in texts, which are left out)."""
    got: dict[str, set] = {"started": set(), "preempted": set(), "released": set(), "resized": set()}
    for e in out:
        if isinstance(e, ev.GpusGranted):
            got["started"].add((e.job_id, tuple(e.gpus)))
        elif isinstance(e, ev.PreemptionRequested):
            got["preempted"].add((e.job_id, e.for_job))
        elif isinstance(e, ev.GpusReleased):
            got["released"].add(e.job_id)
        elif isinstance(e, ev.JobResized):
            got["resized"].add((e.job_id, tuple(e.added), tuple(e.removed)))
    return got


def _step(state: ClusterState, now: float) -> None:
    """The world between cycles, by job id only: even victims checkpoint, one job in three ends."""
    for jid in list(state.running):
        job = state.jobs[jid]
        if job.preemption is not None and int(jid[1:]) % 2 == 0:
            state.apply(ev.CheckpointSaved(at=now + 5, job_id=jid, attempt=job.attempt, path="p", step=1))
        elif job.preemption is None and int(jid[1:]) % 3 == 0:
            state.apply(ev.JobCompleted(at=now + 5, job_id=jid, attempt=job.attempt))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(contended(), st.permutations(NAMES))
def test_renaming_teams_changes_no_decision(w, names):
    mapping = dict(zip(sorted(w["teams"]), names))
    a, b = contended_state(w), contended_state(_renamed(w, mapping))
    config = PRESETS[w["preset"]].replace(**w["overrides"])
    now = 1000.0
    for _ in range(w["steps"] + 1):
        out_a, out_b = cycle(a, now, config), cycle(b, now, config)
        assert _decisions(out_a) == _decisions(out_b), mapping
        for e in out_a:
            a.apply(e)
        for e in out_b:
            b.apply(e)
        _step(a, now)
        _step(b, now)
        now += 20.0
