"""Whom to preempt, and the checkpoint handshake that follows."""

from __future__ import annotations

import pytest

from gpusched.core import events as ev
from gpusched.policy.config import PRESETS

from .policy_helpers import FULL_INSTANT, Scenario, gpus

N0, N1 = gpus("r0n0", *range(8)), gpus("r0n1", *range(8))


def summary(events) -> list[tuple]:
    out = []
    for e in events:
        if isinstance(e, ev.PreemptionRequested):
            out.append(("preempt", e.job_id, e.for_job))
        elif isinstance(e, ev.GpusReleased):
            out.append(("release", e.job_id, e.forced))
        elif isinstance(e, ev.GpusGranted):
            out.append(("grant", e.job_id))
        elif isinstance(e, ev.JobResized):
            out.append(("resize", e.job_id, len(e.added) - len(e.removed)))
    return out


def _priority(s):
    s.run("lo", N0, at=0, priority="low", preemptible=True)
    s.run("keep", N1, at=0)
    s.submit("hi", 8, at=1000, priority="high")


def _non_preemptible(s):
    s.run("lo", N0, at=0, priority="low")
    s.run("keep", N1, at=0)
    s.submit("hi", 8, at=1000, priority="high")


def _equal(s):
    s.run("lo", N0, at=0, preemptible=True)
    s.run("keep", N1, at=0)
    s.submit("hi", 8, at=1000)


def _young(s):
    s.run("lo", N0, at=900, priority="low", preemptible=True)
    s.run("keep", N1, at=0)
    s.submit("hi", 8, at=1000, priority="high")


def _least_lost(s):
    s.run("a", N0, at=0, priority="low", preemptible=True)
    s.run("b", N1, at=0, priority="low", preemptible=True)
    s.checkpoint("b", at=990)
    s.submit("hi", 8, at=1000, priority="high")


def _smallest_set(s):
    s.run("a", gpus("r0n0", 0, 1, 2, 3), at=0, priority="low", preemptible=True)
    s.run("b", gpus("r0n0", 4, 5, 6, 7), at=0, priority="low", preemptible=True)
    s.run("c", N1, at=0, priority="low", preemptible=True)
    s.checkpoint("c", at=999)
    s.submit("hi", 8, at=1000, priority="high")


def _reclaim(s):
    s.team("poor", guaranteed=8)
    s.team("rich", guaranteed=0)
    s.run("r1", N0, at=0, team="rich", preemptible=True)
    s.run("r2", N1, at=10, team="rich", preemptible=True)
    s.submit("p", 8, team="poor", at=1000)


def _protected(s):
    s.team("owner", guaranteed=16)
    s.team("greedy", guaranteed=0)
    s.run("o1", N0, at=0, team="owner", priority="low", preemptible=True)
    s.run("o2", N1, at=0, team="owner", priority="low", preemptible=True)
    s.submit("g", 8, team="greedy", at=1000, priority="high")


def _furthest_over(s):
    s.team("a", guaranteed=4)
    s.team("b", guaranteed=0)
    s.team("c", guaranteed=16)
    s.run("ja", N0, at=0, team="a", priority="low", preemptible=True)
    s.run("jb", N1, at=0, team="b", priority="low", preemptible=True)
    s.checkpoint("jb", at=999)  # cheaper, but team a is further over... no: a is 4 over, b 8 over
    s.submit("hi", 8, team="c", at=1000, priority="high")


def _required_node(s):
    s.run("a", gpus("r0n0", 0, 1, 2, 3), at=0, priority="low", preemptible=True)
    s.run("k0", gpus("r0n0", 6, 7), at=0)
    s.run("b", gpus("r0n1", 0, 1), at=0, priority="low", preemptible=True)
    s.run("k1", gpus("r0n1", 2, 3, 4, 5, 6, 7), at=0)
    s.checkpoint("b", at=999)  # the cheapest victim, but its node cannot hold the gang
    s.submit("hi", 6, at=1000, priority="high", required="node")


def _reclaim_lower_priority(s):
    s.team("poor", guaranteed=8)
    s.team("rich", guaranteed=0)
    s.run("r1", N0, at=0, team="rich", priority="high", preemptible=True)
    s.run("r2", N1, at=10, team="rich", priority="high", preemptible=True)
    s.submit("p", 8, team="poor", at=1000, priority="low")


def _reclaim_not_preemptible(s):
    s.team("poor", guaranteed=8)
    s.team("rich", guaranteed=0)
    s.run("r1", N0, at=0, team="rich", priority="high")
    s.run("r2", N1, at=10, team="rich", priority="high")
    s.submit("p", 8, team="poor", at=1000, priority="low")


def _reclaim_only_to_the_guarantee(s):
    s.team("poor", guaranteed=8)
    s.team("rich", guaranteed=0)
    s.run("p0", N0, at=0, team="poor", priority="low")
    s.run("r1", N1, at=0, team="rich", priority="high", preemptible=True)
    s.submit("p", 8, team="poor", at=1000, priority="low")


def _no_ping_pong(s):
    # a is 1 over its guarantee in 4-GPU jobs, b 3 under: taking a 4-GPU job would leave a 3
    # under (no better than b now), and a would reclaim it back: no reclaim.
    s.team("a", guaranteed=7)
    s.team("b", guaranteed=7)
    s.team("c", guaranteed=2)
    s.run("a1", gpus("r0n0", 0, 1, 2, 3), at=0, team="a", preemptible=True)
    s.run("a2", gpus("r0n0", 4, 5, 6, 7), at=0, team="a", preemptible=True)
    s.run("b1", gpus("r0n1", 0, 1, 2, 3), at=0, team="b", preemptible=True)
    s.run("c1", gpus("r0n1", 4, 5, 6, 7), at=0, team="c")
    s.submit("b2", 4, team="b", at=1000)


def _priority_hands_back(s):
    """Team f (guarantee 4) holds 12 GPUs and wants one more for a normal job; team v
    (guarantee 0) holds only its low-priority 4-GPU job. The fold allows taking it (v is over its
    guarantee), but without it v would rank before f (less usage): v's jobs, this one requeued
    first, would take the GPUs straight back, and f's next job ask again after `min_runtime_s`.
    (Philly week under full: job 2222 preempted 144 times this way, after the livelock fix.)"""
    s.team("f", guaranteed=4)
    s.team("v", guaranteed=0)
    s.run("f0", N0, at=0, team="f")
    s.run("f1", gpus("r0n1", 0, 1, 2, 3), at=0, team="f")
    s.run("low", gpus("r0n1", 4, 5, 6, 7), at=0, team="v", priority="low", preemptible=True)
    s.submit("hi", 1, team="f", at=1000)


def _reclaim_named(name: str):
    """Issue 12's report: a team guaranteed 8 and holding nothing wants 8 GPUs; the only
    preemptible job is the 8-GPU job of `nlp` (guaranteed 4, so 4 over). Taking it leaves nlp 4
    short, the reclaimer 8 short: both at 0 of their guarantee. The tie breaks toward the team
    further below its guarantee in GPUs, whatever the teams are called (it used to break by
    name: `avision` reclaimed at once, `vision` never)."""
    def setup(s):
        s.team(name, guaranteed=8)
        s.team("nlp", guaranteed=4)
        s.team("keep", guaranteed=4)
        s.run("n1", N0, at=0, team="nlp", preemptible=True)
        s.run("k1", N1, at=0, team="keep")
        s.submit("v", 8, team=name, at=1000)
    return setup


def _taken_before(times: int, restart_at: float):
    """`_reclaim`, but both of rich's jobs were already taken `times` times for poor and last
    restarted at `restart_at` (r2 ten seconds later)."""
    def setup(s):
        s.team("poor", guaranteed=8)
        s.team("rich", guaranteed=0)
        s.submit("p", 8, team="poor", at=0)
        for jid, node, delay in (("r1", N0, 0), ("r2", N1, 10)):
            t = 0.0
            for _ in range(times):
                s.run(jid, node, at=t, team="rich", preemptible=True)
                s.preempt(jid, "p", at=t + 20)
                t += 30
            s.run(jid, node, at=restart_at + delay, team="rich", preemptible=True)
    return setup


def _chaos_flood(s):
    """The chaos demo on 32 GPUs: vision (guaranteed 12, limit 24) holds 20 in preemptible 4-GPU
    batch jobs, nlp (guaranteed 12) its 12, chat (guaranteed 8, limit 12) holds nothing and
    floods 12 interactive 1-GPU jobs."""
    s.node("r0n2", "r0")
    s.node("r0n3", "r0")
    s.team("vision", guaranteed=12, limit=24)
    s.team("nlp", guaranteed=12, limit=24)
    s.team("chat", guaranteed=8, limit=12)
    quads = [gpus(f"r0n{n}", *range(h, h + 4)) for n in range(4) for h in (0, 4)]
    for i in range(5):
        s.run(f"v{i}", quads[i], at=0, team="vision", preemptible=True)
    for i in range(3):
        s.run(f"n{i}", quads[5 + i], at=0, team="nlp", preemptible=True)
    for i in range(12):
        s.submit(f"c{i:02d}", 1, at=1000, team="chat", priority="interactive")


def _BACKOFF():
    return PRESETS["fairshare"].replace(preempt_backoff_max_s=3600.0)


# name: (setup, preset (or a function returning a config), want decisions of the cycle at t=1000)
CASES = {
    "higher priority preempts a lower-priority preemptible job (killed, no checkpoint)": (
        _priority, "preempt", [("preempt", "lo", "hi"), ("release", "lo", True), ("grant", "hi")]),
    "non-preemptible jobs are never victims": (_non_preemptible, "preempt", []),
    "equal priority does not preempt": (_equal, "preempt", []),
    "a job just (re)started is protected by min_runtime_s": (_young, "preempt", []),
    "least work lost since the last checkpoint first": (
        _least_lost, "preempt", [("preempt", "b", "hi"), ("release", "b", True), ("grant", "hi")]),
    "fewest victims for the same need": (
        _smallest_set, "preempt", [("preempt", "c", "hi"), ("release", "c", True), ("grant", "hi")]),
    "a team below its guarantee reclaims from a team over its own": (
        _reclaim, "fairshare", [("preempt", "r2", "p"), ("release", "r2", True), ("grant", "p")]),
    "a team at its guarantee is never preempted for a team over its own": (_protected, "fairshare", []),
    "teams furthest over their share first": (
        _furthest_over, "fairshare", [("preempt", "jb", "hi"), ("release", "jb", True), ("grant", "hi")]),
    "required topology: victims free one node": (
        _required_node, "preempt", [("preempt", "a", "hi"), ("release", "a", True), ("grant", "hi")]),
    "checkpoint handshake: ask and wait": (_priority, "full", [("preempt", "lo", "hi")]),
    "a team below its guarantee reclaims from a team over its own, even at a lower priority": (
        _reclaim_lower_priority, "fairshare", [("preempt", "r2", "p"), ("release", "r2", True), ("grant", "p")]),
    "reclaim still respects non-preemptible jobs": (_reclaim_not_preemptible, "fairshare", []),
    "reclaim by a lower priority stops at the reclaiming team's guarantee": (
        _reclaim_only_to_the_guarantee, "fairshare", []),
    "reclaim never leaves the victim's team as short as the reclaimer (no ping-pong)": (
        _no_ping_pong, "fairshare", []),
    "no preemption across teams that would rank the victim's team first again": (
        _priority_hands_back, "fairshare", []),
    "back-off (opt-in): a job taken twice waits min_runtime_s * 4 before another team may take it again": (
        _taken_before(2, 200.0), _BACKOFF, []),
    "back-off (opt-in): once it has passed, the job may be taken again": (
        _taken_before(1, 200.0), _BACKOFF, [("preempt", "r2", "p"), ("release", "r2", True), ("grant", "p")]),
    "back-off is off by default: min_runtime_s alone protects a job taken before": (
        _taken_before(2, 200.0), "fairshare", [("preempt", "r2", "p"), ("release", "r2", True), ("grant", "p")]),
    "reclaim tie at 0 of their guarantees: team vision (8 short) reclaims from nlp (4 short once taken)": (
        _reclaim_named("vision"), "fairshare", [("preempt", "n1", "v"), ("release", "n1", True), ("grant", "v")]),
    "reclaim tie, the same team named avision: the same decision": (
        _reclaim_named("avision"), "fairshare", [("preempt", "n1", "v"), ("release", "n1", True), ("grant", "v")]),
    "reclaim tie under full (checkpoint handshake): vision asks nlp's job to yield": (
        _reclaim_named("vision"), FULL_INSTANT, [("preempt", "n1", "v")]),
    "reclaim tie under full, named zvision: the same": (
        _reclaim_named("zvision"), FULL_INSTANT, [("preempt", "n1", "v")]),
    # each 4-GPU victim of the team over its share serves four 1-GPU jobs; chat gets its whole
    # guarantee in one cycle (reclaim asks for every job within it, not only the walk's first four)
    "chaos flood: one 4-GPU victim of the team over its share serves four 1-GPU jobs": (
        _chaos_flood, "fairshare", [("preempt", "v0", "c00"), ("release", "v0", True), ("grant", "c00"),
                                    ("grant", "c01"), ("grant", "c02"), ("grant", "c03"),
                                    ("preempt", "v1", "c04"), ("release", "v1", True), ("grant", "c04"),
                                    ("grant", "c05"), ("grant", "c06"), ("grant", "c07")]),
    "chaos flood with checkpoints: GPUs being freed cover the other blocked jobs": (
        _chaos_flood, "full", [("preempt", "v0", "c00"), ("preempt", "v1", "c04")]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_preemption(name):
    setup, preset, want = CASES[name]
    s = Scenario(racks=1, nodes=2)
    setup(s)
    out = s.cycle(preset() if callable(preset) else preset, now=1000)
    assert summary(out) == want
    assert s.state.violations() == []
    if want and want[0][0] == "preempt":
        req = next(e for e in out if isinstance(e, ev.PreemptionRequested))
        assert req.reason.startswith(f"preempted for {want[0][2]}")


def _teams_held(s) -> dict[str, int]:
    return {t: u.held for t, u in sorted(s.state.teams.items())}


# name: (setup, preset, want holdings per team once steady, most GPUs preempted in all)
STEADY = {
    "chaos flood, kills: chat reclaims its guarantee from vision only": (
        _chaos_flood, "fairshare", {"chat": 8, "nlp": 12, "vision": 12}, 8),
    "chaos flood, checkpoints in flight over several cycles: vision only, no overkill": (
        _chaos_flood, "full", {"chat": 8, "nlp": 12, "vision": 12}, 8),
}


@pytest.mark.parametrize("name", list(STEADY))
def test_preemption_until_steady(name):
    """Run the preemptor cycle after cycle (every 10 s; a victim checkpoints 25 s after it is
    asked, one of them never does and is killed at its deadline), applying the events, until a
    cycle decides nothing and nothing is in flight."""
    setup, preset, want, most = STEADY[name]
    s = Scenario(racks=1, nodes=2)
    setup(s)
    now, asked, quiet = 1000.0, {}, 0
    preempted: list[str] = []
    for _ in range(40):
        for jid in list(s.state.running):
            job = s.state.jobs[jid]
            if job.preemption is not None and jid != "v1" and now - asked[jid] >= 25:
                s.checkpoint(jid, at=now)
        out = s.cycle(preset, now=now)
        for e in out:
            if isinstance(e, ev.PreemptionRequested):
                asked[e.job_id] = e.at
                preempted.append(e.job_id)
        assert s.state.violations() == []
        busy = [e for e in out if not isinstance(e, ev.JobPending)]
        inflight = any(s.state.jobs[j].preemption is not None for j in s.state.running)
        quiet = quiet + 1 if not busy and not inflight else 0
        if quiet >= 3:
            break
        now += 10.0
    assert quiet >= 3, "never settled"
    assert _teams_held(s) == want
    assert not [j for j in preempted if s.state.jobs[j].team != "vision"]
    assert sum(s.state.jobs[j].spec.gpus for j in preempted) <= most


def test_checkpointed_job_is_released_and_the_waiting_job_starts():
    s = Scenario(racks=1, nodes=2)
    _priority(s)
    req = next(e for e in s.cycle("full", now=1000) if isinstance(e, ev.PreemptionRequested))
    assert req.deadline == 1060.0
    assert summary(s.cycle("full", now=1010)) == []  # waiting, and no second request
    assert s.state.jobs["hi"].pending_blockers == ["lo"]
    s.checkpoint("lo", at=1020)
    out = s.cycle("full", now=1020)
    assert summary(out) == [("release", "lo", False), ("grant", "hi")]
    assert s.state.jobs["lo"].lost_gpu_s == 0.0 and s.state.jobs["lo"].state == "pending"
    assert s.state.violations() == []


def test_overdue_preemption_is_forced_and_counts_the_lost_work():
    s = Scenario(racks=1, nodes=2)
    _priority(s)
    s.checkpoint("lo", at=500)
    s.cycle("full", now=1000)
    out = s.cycle("full", now=1060)
    assert summary(out) == [("release", "lo", True), ("grant", "hi")]
    rel = next(e for e in out if isinstance(e, ev.GpusReleased))
    assert rel.lost_gpu_s == 8 * (1060 - 500)
    assert s.state.violations() == []


# --- tiresias: 2D-LAS, discretized queues on attained GPU-time, preemptive --------------------


def test_tiresias_preempts_a_job_of_a_later_las_queue():
    """`long` ran 8 GPUs for 1000 s (8000 GPU-s: queue 2 of [3250, 7200, 18000]); a new job
    (queue 0) of the same priority takes its GPUs. `young` (8 GPUs, 300 s: 2400 GPU-s, queue
    0 like the new job) is left alone."""
    s = Scenario(racks=1, nodes=2)
    s.run("long", N0, at=0, preemptible=True)
    s.run("young", N1, at=700, preemptible=True)
    s.submit("new", 8, at=1000)
    out = s.cycle("tiresias", now=1000)
    assert summary(out)[0] == ("preempt", "long", "new")
    assert "young" not in {e.job_id for e in out if isinstance(e, ev.PreemptionRequested)}
    assert s.state.violations() == []


def test_a_job_granted_at_this_instant_is_not_taken_at_it():
    """`back` attained 8000 GPU-s (queue 2), was preempted and granted again at t=1000; a new job
    (queue 0) comes at 1000. With min_runtime_s 0 (tiresias) it was taken at once, and on the
    Philly week of 2017-10-30 (fair share, free checkpoints) a 4-GPU gang freed 1-GPU jobs that
    the jobs behind it took at the same instant, 1,000 cycles without time moving on."""
    s = Scenario(racks=1, nodes=1)
    s.run("back", N0, at=0, preemptible=True)
    s.apply(ev.GpusReleased(at=1000, job_id="back", reason="preempted"))
    s.run("back", N0, at=1000)
    s.submit("new", 8, at=1000)
    assert summary(s.cycle("tiresias", now=1000)) == []
    assert summary(s.cycle("tiresias", now=1001))[0] == ("preempt", "back", "new")


def test_tiresias_does_not_preempt_within_a_queue():
    s = Scenario(racks=1, nodes=2)
    s.run("a", N0, at=800, preemptible=True)  # 1600 GPU-s by t=1000: queue 0, as the new job
    s.run("b", N1, at=800, preemptible=True)
    s.submit("new", 8, at=1000)
    assert summary(s.cycle("tiresias", now=1000)) == []


def test_tiresias_orders_by_queue_then_submission():
    """A requeued job that attained 4000 GPU-s (queue 1) waits behind a later job of queue 0,
    while two jobs of queue 0 keep their submission order (not least-attained first)."""
    from gpusched.policy.ordering import ordered

    s = Scenario(racks=1, nodes=1)
    s.run("old", N0, at=0)
    s.preempt("old", "x", at=500)  # 8 GPUs x 500 s = 4000 GPU-s: queue 1
    s.submit("q0a", 1, at=600)
    s.run("q0b", gpus("r0n0", 0), at=610)
    s.preempt("q0b", "x", at=700)  # 90 GPU-s: still queue 0, submitted after q0a
    order = [j.job_id for j in ordered(s.state, 800, PRESETS["tiresias"])]
    assert order == ["q0a", "q0b", "old"]


def test_las_preemption_stays_within_a_team_under_fair_share():
    """With fair share, LAS preempts only the blocked job's own team: `other` (a team over its
    guarantee of 0, queue 2) is left alone for team a's new job, `mine` (team a, queue 2) is not."""
    config = PRESETS["fairshare"].replace(las=True, las_preempt=True, las_queues_gpu_s=[3250.0, 7200.0, 18000.0])
    s = Scenario(racks=1, nodes=3)
    s.team("a", guaranteed=0)
    s.team("b", guaranteed=0)
    s.run("big", gpus("r0n2", *range(8)), at=0, team="b")  # b stays after a in the order without `other`
    s.run("other", N0, at=0, team="b", preemptible=True)
    s.run("mine", N1, at=10, team="a", preemptible=True)
    s.checkpoint("mine", at=980)  # killed (no handshake): losing 160 GPU-s is worth 7920 attained
    s.checkpoint("other", at=990)  # the cheaper victim, were teams not a boundary
    s.submit("new", 8, team="a", at=1000)
    assert summary(s.cycle(config, now=1000)) == [("preempt", "mine", "new"), ("release", "mine", True),
                                                  ("grant", "new")]


def test_tiresias_starvation_knob_promotes_a_job_that_waited_long_enough():
    """`old` ran 500 s on 8 GPUs (queue 1) and was requeued at 500; at t=800 it has waited
    300 s: with STARVE 0.5 (wait ≥ 250 s) it goes before the queue-0 job, with STARVE 1 not yet."""
    from gpusched.policy.ordering import QueueIndex

    s = Scenario(racks=1, nodes=1)
    s.run("old", N0, at=0)
    s.preempt("old", "x", at=500)
    s.submit("q0", 1, at=600)
    for factor, want in ((0.5, ["old", "q0"]), (1.0, ["q0", "old"]), (None, ["q0", "old"])):
        idx = QueueIndex(s.state, PRESETS["tiresias"].replace(las_starve_factor=factor), ())
        idx.update()
        assert [j.job_id for j in idx.ordered(800, lambda t: 0)] == want, factor


# --- full: least attained service inside fair share, checkpoint-cost aware (issue 12) ---------

N0_1 = gpus("r0n0", 0)


def _las_pair(long_attained: float, new_attained: float):
    """Team a holds the only GPU with `long` (it attained `long_attained` GPU-s by t=10000);
    `new` (1 GPU, same team, same class) waits having attained `new_attained` before."""
    def setup(s):
        s.team("a", guaranteed=1)
        s.submit("long", 1, at=0, preemptible=True)
        if new_attained:
            s.run("new", N0_1, at=0, preemptible=True)
            s.preempt("new", "long", at=new_attained)
        s.run("long", N0_1, at=10000 - long_attained)
        if not new_attained:
            s.submit("new", 1, at=9990, preemptible=True)
    return setup


def _las_taken_twice(ran_since_restart: float):
    """`long` (team a) ran 0..2000 and 2000..4000 s, preempted after each (4000 GPU-s: queue
    1), restarted at 10000 - `ran_since_restart`; `new` (queue 0) waits."""
    def setup(s):
        s.team("a", guaranteed=1)
        s.submit("long", 1, at=0, preemptible=True)
        s.submit("x", 1, at=0)
        for start in (0, 2000):
            s.run("long", N0_1, at=start)
            s.preempt("long", "x", at=start + 2000)
        s.run("x", N0_1, at=4000)
        s.finish("x", at=5000)
        s.run("long", N0_1, at=10000 - ran_since_restart)
        s.submit("new", 1, at=9990, preemptible=True)
    return setup


def _full(**changes):
    return lambda: FULL_INSTANT.replace(**changes)


# name: (setup, config, want decisions of the cycle at t=10000); one 1-GPU node.
LAS_CASES = {
    "full preempts its team's job of a later LAS queue for a new job (checkpoint handshake)": (
        _las_pair(4000, 0), _full(), [("preempt", "long", "new")]),
    "full leaves a job of the same LAS queue alone": (_las_pair(3000, 0), _full(), []),
    "a later queue but a saving below checkpoint + restore (30 s + 60 s): not preempted": (
        _las_pair(3300, 3240), _full(), []),
    "the same pair with free checkpoints (ideal runtime): preempted": (
        _las_pair(3300, 3240), _full(checkpoint_cost_s=0.0, restore_cost_s=0.0), [("preempt", "long", "new")]),
    "a saving above the costs: preempted": (
        _las_pair(3400, 3240), _full(), [("preempt", "long", "new")]),
    "without the handshake the work since the last checkpoint is a cost too": (
        _las_pair(3400, 3240), _full(checkpoint=False), []),
    "LAS preemption is a knob: off, nothing is preempted": (_las_pair(4000, 0), _full(las_preempt=False), []),
    "LAS back-off: a job taken twice runs min_runtime_s * 4 (1200 s) before LAS takes it again": (
        _las_taken_twice(1100), _full(), []),
    "LAS back-off: once it has passed, the job may be taken again": (
        _las_taken_twice(1300), _full(), [("preempt", "long", "new")]),
    "LAS back-off is capped (las_backoff_max_s)": (
        _las_taken_twice(700), _full(las_backoff_max_s=600.0), [("preempt", "long", "new")]),
}


@pytest.mark.parametrize("name", list(LAS_CASES))
def test_full_las_preemption(name):
    setup, config, want = LAS_CASES[name]
    s = Scenario(racks=1, nodes=1, gpus=1)
    setup(s)
    out = s.cycle(config(), now=10000)
    assert summary(out)[:1] == want
    assert s.state.violations() == []


def test_full_las_never_preempts_across_teams():
    """Team b's long job (queue 3, b over its guarantee of 0) is not taken for team a's new job
    (a at its guarantee of 1 with a queue-0 job): across teams only the fair-share rules
    preempt, and neither team is below its guarantee."""
    s = Scenario(racks=1, nodes=1, gpus=2)
    s.team("a", guaranteed=1)
    s.team("b", guaranteed=0)
    s.run("mine", gpus("r0n0", 0), at=9900, team="a", preemptible=True)
    s.run("other", gpus("r0n0", 1), at=0, team="b", preemptible=True)
    s.submit("new", 1, at=9990, team="a", preemptible=True)
    assert summary(s.cycle("full", now=10000)) == []


def test_full_starvation_bound_puts_a_starving_job_first_in_its_team_only():
    """The bound (docs/results.md): a requeued job that waited `las_starve_factor` times its
    run so far goes first in its team's queue. `old` (team a) ran 500 s: once it has waited
    that long it goes before a's queue-0 job `q0`, but not before team b, which is below its
    guarantee and so goes first whatever a's jobs are."""
    from gpusched.policy.ordering import QueueIndex

    s = Scenario(racks=1, nodes=1)
    s.team("a", guaranteed=0)
    s.team("b", guaranteed=4)
    s.run("old", N0, at=0, team="a")
    s.preempt("old", "x", at=500)  # 4000 GPU-s: queue 1
    s.submit("q0", 1, at=600, team="a")
    s.submit("bjob", 1, at=700, team="b")
    factor = 1.0
    config = PRESETS["full"].replace(las_starve_factor=factor)
    idx = QueueIndex(s.state, config, ())
    idx.update()
    bound = 500 + factor * 500  # requeued at 500, ran 500 s
    assert [j.job_id for j in idx.ordered(bound, lambda t: 0)] == ["bjob", "old", "q0"]
    # before it has waited that long it keeps its LAS place, behind the queue-0 job
    assert [j.job_id for j in idx.ordered(bound - 1, lambda t: 0)] == ["bjob", "q0", "old"]


# --- full's preemption restraint (issue 12): predicted run times and the back-off -------------
# `preempt_predicted`: a victim predicted (policy/predict.py, from completed jobs) to end before
# the blocked job would, by more than its checkpoint + restore, is left to finish: for LAS,
# reclaim and a borrower yielding to the head; never for priority classes.

NEAR_END = [4100.0] * 8  # every job like it ran 4100 s: one that ran 4000 s has 100 s left
HEAVY_TAIL = [100.0] * 8 + [20000.0] * 8  # one that ran 4000 s has 16,000 s left, a new one 10,050


def _history(s, runs: list[float], team: str = "a", gpu: list[str] = N0_1) -> float:
    """Completed 1-GPU jobs of `team`, one after another on `gpu`; returns when the last ended."""
    t = 0.0
    for i, d in enumerate(runs):
        s.run(f"h{i}", gpu, at=t, team=team)
        s.finish(f"h{i}", at=t + d)
        t += d
    return t


def _las_after(runs: list[float]):
    """One 1-GPU node. Team a's `long` has run 4000 s (queue 1) when its `new` job (queue 0)
    arrives; the cycle is 10 s later."""
    def setup(s) -> float:
        s.team("a", guaranteed=1)
        t = _history(s, runs) + 100
        s.run("long", N0_1, at=t, preemptible=True)
        s.submit("new", 1, at=t + 3990, preemptible=True)
        return t + 4000
    return setup


def _borrower(runs: list[float]):
    """One 8-GPU node. `x1`, `x2` (2 GPUs each) end at the cycle; `big` (8) waits as the head;
    borrower `b` (4 GPUs, backfilled, preemptible) has run 900 s on the rest. (Not one 4-GPU
    `x`: a job of b's size submitted just before it is its batch-mate, `predict._batch`, and would
    decide b's prediction instead of `runs`.)"""
    def setup(s) -> float:
        t = _history(s, runs) + 100
        s.run("x1", gpus("r0n0", 0, 1), at=t)
        s.run("x2", gpus("r0n0", 2, 3), at=t)
        s.submit("big", 8, at=t + 10)
        s.run("b", gpus("r0n0", 4, 5, 6, 7), at=t + 100, backfill=True, preemptible=True)
        s.finish("x1", at=t + 1000)
        s.finish("x2", at=t + 1000)
        return t + 1000
    return setup


def _reclaim_after(runs: list[float]):
    """Two nodes. Team poor (guaranteed 8) holds nothing and wants 8 GPUs; rich (guaranteed 0)
    holds both nodes in jobs that have run about 4000 s. The history is another team's."""
    def setup(s) -> float:
        s.team("poor", guaranteed=8)
        s.team("rich", guaranteed=0)
        t = _history(s, runs, team="h", gpu=gpus("r0n1", 0)) + 100
        s.run("r1", N0, at=t, team="rich", preemptible=True)
        s.run("r2", N1, at=t + 10, team="rich", preemptible=True)
        s.submit("p", 8, team="poor", at=t + 3990)
        return t + 4000
    return setup


def _priority_after(runs: list[float]):
    """`_priority` after a history that predicts `lo` ends in 100 s: priority still preempts."""
    def setup(s) -> float:
        t = _history(s, runs, gpu=gpus("r0n1", 0)) + 100
        s.run("lo", N0, at=t, priority="low", preemptible=True)
        s.run("keep", N1, at=t)
        s.submit("hi", 8, at=t + 3990, priority="high")
        return t + 4000
    return setup


_NO_PREDICTIONS = _full(preempt_predicted=False)

# name: (setup -> cycle time, (racks, nodes, gpus), config, want the cycle's first decision)
PREDICTED_CASES = {
    "LAS: a victim predicted to end before the new job would is left to finish": (
        _las_after(NEAR_END), (1, 1, 1), _full(), []),
    "LAS: the same with predictions off: taken": (
        _las_after(NEAR_END), (1, 1, 1), _NO_PREDICTIONS, [("preempt", "long", "new")]),
    "LAS: a heavy tail, the victim is predicted to outlast the new job: taken": (
        _las_after(HEAVY_TAIL), (1, 1, 1), _full(), [("preempt", "long", "new")]),
    "LAS: no completed job to predict from (the Lindy guess): taken as before": (
        _las_after([]), (1, 1, 1), _full(), [("preempt", "long", "new")]),
    "borrower predicted to end first (8 x 100 s < 4 x (1000 s + 90 s)): the head waits for it": (
        _borrower([1000.0] * 8), (1, 1, 8), _full(), []),
    "borrower, predictions off: it yields as soon as the head could start": (
        _borrower([1000.0] * 8), (1, 1, 8), _NO_PREDICTIONS, [("preempt", "b", "big")]),
    "borrower predicted to outlast the head (8 x 9100 s > 4 x (1000 s + 90 s)): it yields": (
        _borrower([100.0] * 8 + [10000.0] * 8), (1, 1, 8), _full(), [("preempt", "b", "big")]),
    "reclaim: victims predicted to end first are left to finish": (
        _reclaim_after(NEAR_END), (1, 2, 8), _full(), []),
    "reclaim, predictions off: the team below its guarantee reclaims": (
        _reclaim_after(NEAR_END), (1, 2, 8), _NO_PREDICTIONS, [("preempt", "r2", "p")]),
    "reclaim: victims predicted to outlast the reclaimer are taken": (
        _reclaim_after(HEAVY_TAIL), (1, 2, 8), _full(), [("preempt", "r2", "p")]),
    "priority classes ignore predictions: a low job about to end is still taken for a high one": (
        _priority_after(NEAR_END), (1, 2, 8), _full(), [("preempt", "lo", "hi")]),
}


@pytest.mark.parametrize("name", list(PREDICTED_CASES))
def test_full_preempt_predicted(name):
    setup, (racks, nodes, size), config, want = PREDICTED_CASES[name]
    s = Scenario(racks=racks, nodes=nodes, gpus=size)
    now = setup(s)
    out = s.cycle(config(), now=now)
    assert summary(out)[:1] == want
    assert s.state.violations() == []


def test_outlasts_is_the_exchange_argument_with_the_checkpoint_costs():
    """v > j + checkpoint + restore, weighted when asked; no evidence (the Lindy guess), taken."""
    from gpusched.policy.predict import Estimate
    from gpusched.policy.preemption import outlasts

    def est(left: float, samples: int = 8) -> Estimate:
        return Estimate(left, left, left, samples, "team")

    full = PRESETS["full"]  # 30 s + 60 s
    assert outlasts(est(1091.0), est(1000.0), full)
    assert not outlasts(est(1090.0), est(1000.0), full)
    assert outlasts(est(1.0), est(0.0), full.replace(checkpoint_cost_s=0.0, restore_cost_s=0.0))
    assert outlasts(est(10.0, samples=0), est(1000.0), full)
    assert outlasts(est(600.0), est(1000.0), full, weights=(1, 2))  # 2 x 600 > 1 x 1090
    assert not outlasts(est(1000.0), est(1000.0), full, weights=(2, 1))  # 1000 < 2 x 1090


# `_taken_before` under full: the back-off across teams is on (`preempt_backoff_max_s`, one
# week: doubling per preemption, with no cap below fair share's memory).
BACKOFF_CASES = {
    "full: a job taken 3 times for other teams waits min_runtime_s * 8 (2400 s)": (_taken_before(3, 200.0), []),
    "full: a job taken once waits min_runtime_s * 2 (600 s), then may be taken again": (
        _taken_before(1, 200.0), [("preempt", "r2", "p")]),
}


@pytest.mark.parametrize("name", list(BACKOFF_CASES))
def test_full_backs_off_across_teams(name):
    setup, want = BACKOFF_CASES[name]
    s = Scenario(racks=1, nodes=2)
    setup(s)
    assert summary(s.cycle(FULL_INSTANT, now=1000))[:1] == want
    assert s.state.violations() == []
