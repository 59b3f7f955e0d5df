"""Reclaim to a guarantee (issue 26): every team below its guarantee with a waiting job that fits
within it gets GPUs back, not only the teams whose jobs lead the walk, and a job taken for other
teams over and over is shielded for at most `preempt_backoff_max_s`. Each row but the contract's
failed on the code before: the walk handed reclaim only its first few blocked jobs, and the
back-off grew to a week."""

from __future__ import annotations

import pytest

from gpusched.core.model import DEFAULT_HALF_LIFE_S
from gpusched.policy.config import PRESETS

from .policy_helpers import Scenario, gpus
from .test_policy_preemption import summary

N0, N1 = gpus("r0n0", *range(8)), gpus("r0n1", *range(8))
FULL = PRESETS["full"]


def _pinned_nodes(s, a=8, b=4, c=4, d=0):
    # c holds 2 GPUs on each node at its guarantee (not preemptible); b borrows the other 12
    # (preemptible 1-GPU jobs, running since 0): no node can be freed whole for a
    for name, g in (("a", a), ("b", b), ("c", c), ("d", d)):
        s.team(name, guaranteed=g)
    s.run("c0", gpus("r0n0", 0, 1), team="c", at=0)
    s.run("c1", gpus("r0n1", 0, 1), team="c", at=0)
    for i, g in enumerate(gpus("r0n0", *range(2, 8)) + gpus("r0n1", *range(2, 8))):
        s.run(f"b{i:02d}", [g], team="b", at=0, preemptible=True)


def _gangs_first(s, **quotas):
    # a, with none of its 8, first asks for four whole nodes (the walk's blocked jobs), then 1 GPU
    _pinned_nodes(s, **quotas)
    for i in range(4):
        s.submit(f"g{i}", 8, team="a", at=1000, required="node", preemptible=True)
    s.submit("small", 1, team="a", at=1001, preemptible=True)


def _later_team(s):
    # a (0 of 6) leads the order with the same four gangs; d (0 of 2) waits behind with 1 GPU
    _pinned_nodes(s, a=6, d=2)
    for i in range(4):
        s.submit(f"g{i}", 8, team="a", at=1000, required="node", preemptible=True)
    s.submit("d1", 1, team="d", at=1001, preemptible=True)


def _beyond_guarantee(s):
    # a holds 7 of its 8: its later 2-GPU job would take it past its guarantee
    _pinned_nodes(s, a=8, b=4, c=4)
    s.finish("b00", 500)
    for i in range(1, 7):
        s.finish(f"b{i:02d}", 500)
    s.run("a0", gpus("r0n0", *range(2, 8)) + gpus("r0n1", 2), team="a", at=500)
    for i in range(4):
        s.submit(f"g{i}", 8, team="a", at=1000, required="node", preemptible=True)
    s.submit("two", 2, team="a", at=1001, preemptible=True)


def _taken_often(s, times=10, restarted=10000.0):
    # b borrows the whole cluster with two 8-GPU jobs, each taken `times` times for a's job x (a
    # holds none of its 8) and last restarted at `restarted`; x still waits
    s.team("a", guaranteed=8)
    s.team("b", guaranteed=8)
    s.submit("x", 1, team="a", at=0, preemptible=True)
    for k in range(times):
        at = 500.0 * k
        s.run("bb1", N0, team="b", at=at, preemptible=True)
        s.run("bb2", N1, team="b", at=at, preemptible=True)
        s.preempt("bb1", "x", at + 400)
        s.preempt("bb2", "x", at + 400)
    s.run("bb1", N0, team="b", at=restarted, preemptible=True)
    s.run("bb2", N1, team="b", at=restarted, preemptible=True)


def _zero_share(s, last_of_n1: str):
    # a and b at their guarantees of 7 (non-preemptible jobs), a 1-GPU job of each waiting; z,
    # guaranteed none, holds N0's last GPU, and `last_of_n1` (z or b) holds N1's. Fair shares:
    # a 7.67, b 7.67, z 0.67 (counted as one)
    for name, g in (("a", 7), ("b", 7), ("z", 0)):
        s.team(name, guaranteed=g)
    s.run("a0", N0[:7], team="a", at=0)
    s.run("b0", N1[:7], team="b", at=0)
    s.run("z0", N0[7:], team="z", at=0, preemptible=True)
    s.run({"z": "z1", "b": "b2"}[last_of_n1], N1[7:], team=last_of_n1, at=0, preemptible=True)
    s.submit("a1", 1, team="a", at=1000, preemptible=True)
    s.submit("b1", 1, team="b", at=1000, preemptible=True)


def _zero_share_holds_two(s):
    # z took both GPUs the guarantees leave
    _zero_share(s, "z")


def _zero_share_holds_one(s):
    # z holds its first GPU only (not over a share of 0.67); b borrows one beyond its 7, as far
    # over its fair share as a would be with its job started
    _zero_share(s, "b")


SHARE = FULL.replace(reclaim_to="share")

# name: (setup, now, want decisions)
CASES = {
    "a team under its guarantee whose first jobs cannot be placed reclaims for a later job that fits": (
        _gangs_first, 1001, [("preempt", "b00", "small")]),
    "a team under its guarantee behind the walk's blocked jobs reclaims too": (
        _later_team, 1001, [("preempt", "b00", "d1")]),
    "no reclaim for a job beyond the guarantee": (_beyond_guarantee, 1001, []),
    "contract: a team at its guarantee is never preempted for another team's later job": (
        lambda s: _gangs_first(s, a=8, b=12, c=4), 1001, []),
    "a job taken for other teams ten times is shielded one fair-share horizon, not a week": (
        _taken_often, 10000 + FULL.fairshare_horizon_s + 1, [("preempt", "bb1", "x")]),
    "... and within it, it is left alone": (_taken_often, 10000 + FULL.fairshare_horizon_s - 1, []),
}


def _gangs_then_small(s):
    # a (all 16 GPUs its own) waits with four whole-node gangs no victim set can free (a
    # non-preemptible job on each node), then a 1-GPU job that may take a's long-running job (LAS)
    s.team("a", guaranteed=16)
    s.run("pin0", N0[:1], team="a", at=0)
    s.run("pin1", N1[:1], team="a", at=0)
    s.run("long", N0[1:] + N1[1:], team="a", at=0, preemptible=True)
    for i in range(4):
        s.submit(f"g{i}", 8, team="a", at=1000, required="node", preemptible=True)
    s.submit("small", 1, team="a", at=1001, preemptible=True)


@pytest.mark.parametrize("searches, want", [(None, []), (16, [("preempt", "long", "small")])])
def test_failed_searches_leave_the_triggers_to_jobs_that_can_act(searches, want):
    """With `max_victim_searches_per_cycle`, a search that finds nothing does not use one of the
    cycle's `max_preemptors_per_cycle` triggers: the short job behind the gangs gets its turn."""
    s = Scenario(racks=1, nodes=2)
    _gangs_then_small(s)
    out = s.cycle(FULL.replace(max_victim_searches_per_cycle=searches), now=1001)
    assert [d for d in summary(out) if d[0] != "release"] == want
    assert s.state.violations() == []


#: `reclaim_to="share"`: name -> (setup, want under it, want under `full`'s reclaim to guarantees)
SHARE_CASES = {
    "a team at its guarantee, below its fair share, takes from a team far over its own, once": (
        _zero_share_holds_two, [("preempt", "z0", "a1")], []),
    "contract: a team owed less than one GPU is not over its share for holding its first": (
        _zero_share_holds_one, [], []),
}


@pytest.mark.parametrize("name", list(SHARE_CASES))
def test_reclaim_to_fair_shares(name):
    setup, want, want_full = SHARE_CASES[name]
    for config, expected in ((SHARE, want), (FULL, want_full)):
        s = Scenario(racks=1, nodes=2, half_life_s=DEFAULT_HALF_LIFE_S)  # the fold's default: ranks credit guarantees
        setup(s)
        out = s.cycle(config, now=1001)
        assert [d for d in summary(out) if d[0] != "release"] == expected
        assert s.state.violations() == []


@pytest.mark.parametrize("name", list(CASES))
def test_reclaim(name):
    setup, now, want = CASES[name]
    s = Scenario(racks=1, nodes=2)
    setup(s)
    out = s.cycle(FULL, now=now)
    assert [d for d in summary(out) if d[0] != "release"] == want
    assert s.state.violations() == []
