"""The fold's settings are a fact of the log (`FoldSettingsSet`): every fold reads them from
their seq on, usage before the fact decays with the settings before it, a replay computes the
same, and only admin decides them (through admission)."""

from __future__ import annotations

import math

import pytest

from gpusched.core import events as ev
from gpusched.core.commands import SetFoldSettings
from gpusched.core.model import DEFAULT_HALF_LIFE_S, FORGET_AFTER_S, FoldSettings, JobSpec
from gpusched.core.state import ClusterState
from gpusched.services.admission import ADMIN, AdmissionConfig, Caller, Capacity, admit

from .policy_helpers import Scenario

HOUR = 3600.0


def _decayed(usage: float, held: float, dt: float, half_life: float) -> float:
    decay = math.exp(-math.log(2) * dt / half_life)
    return usage * decay + held * half_life / math.log(2) * (1 - decay)


def test_usage_decays_with_each_half_life_in_its_own_span_and_a_replay_agrees():
    s = Scenario(racks=0, nodes=0, half_life_s=DEFAULT_HALF_LIFE_S)  # a cluster's fold before any fact
    log: list[ev.Event] = []
    apply = s.apply
    s.apply = lambda *events: (log.extend(events), apply(*events))  # type: ignore[method-assign]
    s.node("r0n0", "r0", gpus=2)
    s.submit("j", gpus=2, team="a", at=0.0)
    s.run("j", ["r0n0/0", "r0n0/1"], at=0.0)
    s.apply(ev.FoldSettingsSet(at=10 * HOUR, settings=FoldSettings(half_life_s=HOUR, forget_after_s=None)))
    s.apply(ev.JobCancelled(at=12 * HOUR, job_id="j"))
    before = _decayed(0.0, 2, 10 * HOUR, DEFAULT_HALF_LIFE_S)  # the default, up to the fact
    want = _decayed(before, 2, 2 * HOUR, HOUR)  # the new half-life after it
    assert s.state.team_usage("a", at=12 * HOUR) == pytest.approx(want)
    assert s.state.half_life_s == HOUR and s.state.forget_after_s is None
    replay = ClusterState()
    for seq, event in enumerate(log, 1):
        replay.apply(event, seq)
    assert replay.team_usage("a", at=12 * HOUR) == pytest.approx(want)  # the same from the log alone


def test_only_admin_decides_them_and_the_fact_is_what_admission_appends():
    st = ClusterState()
    cmd = SetFoldSettings(request_id="f1", settings=FoldSettings(half_life_s=3 * 86400.0), reason="shorter memory")
    d = admit(st, cmd, 5.0, AdmissionConfig(), Capacity(), {}, ADMIN)
    assert d.reply.ok and d.event == ev.FoldSettingsSet(at=5.0, settings=FoldSettings(half_life_s=3 * 86400.0,
                                                                                        forget_after_s=FORGET_AFTER_S),
                                                        reason="shorter memory")
    d = admit(st, cmd, 5.0, AdmissionConfig(), Capacity(), {}, Caller("alice", "a"))
    assert d.event is None and d.reply.error == "SetFoldSettings needs the admin role"


def test_settings_are_bounded():
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"half_life_s": 5.0}, FoldSettings)  # under an hour: a typo, not a policy
    assert msgspec.convert({"half_life_s": None, "forget_after_s": None}, FoldSettings).half_life_s is None
    assert JobSpec(team="t", gpus=1)  # the spec is untouched by them
