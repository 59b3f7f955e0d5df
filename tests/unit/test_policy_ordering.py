"""Which pending job goes first: priority, submission time, least attained service, fair share."""

from __future__ import annotations

import pytest

from gpusched.core import events as ev
from gpusched.policy.config import PRESETS
from gpusched.policy.memo import Indexes
from gpusched.policy.ordering import REVERIFY_EVERY, ordered

from .policy_helpers import Scenario, gpus


def _order(s: Scenario, config, now=None) -> list[str]:
    return [j.job_id for j in ordered(s.state, s.now if now is None else now, config)]


def _fifo_queue(s: Scenario) -> None:
    s.submit("a", 1, at=1, priority="low")
    s.submit("b", 1, at=2, priority="high")
    s.submit("c", 1, at=3, priority="interactive")
    s.submit("d", 1, at=3, priority="high")


def _teams(s: Scenario) -> None:
    s.team("rich", guaranteed=2)
    s.team("poor", guaranteed=4)
    s.run("r1", gpus("r0n0", 0, 1, 2, 3), team="rich", at=0)
    s.submit("rich-hi", 1, team="rich", at=1, priority="interactive")
    s.submit("poor-lo", 1, team="poor", at=2, priority="low")
    s.submit("poor-2", 1, team="poor", at=3)


def _usage(s: Scenario) -> None:
    s.team("used", guaranteed=0)
    s.team("fresh", guaranteed=0)
    s.run("u", gpus("r0n0", 0), team="used", at=0)
    s.finish("u", at=1000)
    s.submit("used-1", 1, team="used", at=1001)
    s.submit("fresh-1", 1, team="fresh", at=1002)
    s.submit("used-2", 1, team="used", at=1003)


def _weights(s: Scenario) -> None:
    s.team("heavy", weight=4.0)
    s.team("light", weight=1.0)
    s.run("h", gpus("r0n0", 0, 1), team="heavy", at=0)
    s.run("l", gpus("r0n0", 2), team="light", at=0)
    s.submit("light-1", 1, team="light", at=1)
    s.submit("heavy-1", 1, team="heavy", at=2)


def _borrowing(s: Scenario) -> None:
    # big has held its 4 guaranteed GPUs for five half-lives; tiny, guaranteed none, ran 1 GPU
    # for 1,000 s. Both at or over their guarantee now, each asks for one more GPU.
    s.team("big", guaranteed=4)
    s.team("tiny", guaranteed=0)
    s.run("b", gpus("r0n0", 0, 1, 2, 3), team="big", at=0)
    s.run("t", gpus("r0n0", 4), team="tiny", at=16000)
    s.finish("t", at=17000)
    s.submit("tiny-1", 1, team="tiny", at=18001)
    s.submit("big-1", 1, team="big", at=18002)


def _credit(s: Scenario) -> None:
    # low (guaranteed 4, held none for hours, now its 4) borrowed 1 GPU for 400 s; tiny,
    # guaranteed none, held 1 GPU for 200 s. low's hours below its guarantee are its credit:
    # what it left unused it may borrow first (a team guaranteed nothing has none to leave).
    s.team("low", guaranteed=4)
    s.team("tiny", guaranteed=0)
    s.run("base", gpus("r0n0", 0, 1, 2, 3), team="low", at=20000)
    s.run("l", gpus("r0n0", 4), team="low", at=20000)
    s.run("t", gpus("r0n0", 5), team="tiny", at=20000)
    s.finish("t", at=20200)
    s.finish("l", at=20400)
    s.submit("low-1", 1, team="low", at=20401)
    s.submit("tiny-1", 1, team="tiny", at=20402)


def _requeued(s: Scenario) -> None:
    s.submit("old", 1, at=1)
    s.submit("new", 1, at=5)
    s.run("old", gpus("r0n0", 0), at=6)
    s.apply(_release("old", 100))


def _las(s: Scenario) -> None:
    s.run("served", gpus("r0n0", 0, 1), at=0)
    s.apply(_release("served", 500))  # attained 1000 GPU-s, submitted first
    s.submit("new", 1, at=600)


def _release(job, at):
    from gpusched.core.events import GpusReleased

    return GpusReleased(at=at, job_id=job, reason="preempted")


# name: (setup, preset, knob changes, expected order)
CASES = {
    "fifo ignores priority": (_fifo_queue, "fifo", {}, ["a", "b", "c", "d"]),
    "priority classes, then submission time, then job id": (_fifo_queue, "preempt", {}, ["c", "b", "d", "a"]),
    "a team below its guaranteed share goes first, whatever the priority": (
        _teams, "fairshare", {}, ["poor-2", "poor-lo", "rich-hi"]),
    "then the team with the least decayed usage": (_usage, "fairshare", {}, ["fresh-1", "used-1", "used-2"]),
    "usage is divided by the team's weight": (_weights, "fairshare", {}, ["heavy-1", "light-1"]),
    "a team's guaranteed GPUs cost it nothing in the order: borrowing beyond it is what counts": (
        _borrowing, "fairshare", {}, ["big-1", "tiny-1"]),
    "... all of its usage with fairshare_by=usage": (_borrowing, "fairshare", {"fairshare_by": "usage"},
                                                       ["tiny-1", "big-1"]),
    "time below a guarantee is credit: a team borrows first what it left unused": (
        _credit, "fairshare", {}, ["low-1", "tiny-1"]),
    "a requeued job keeps its submission time": (_requeued, "topo", {}, ["old", "new"]),
    "least attained service first among equal jobs": (_las, "topo", {"las": True}, ["new", "served"]),
    "without LAS, submission order": (_las, "topo", {}, ["served", "new"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_order(name):
    setup, preset, changes, want = CASES[name]
    s = Scenario(racks=1, nodes=1, half_life_s=3600.0)
    setup(s)
    assert _order(s, PRESETS[preset].replace(**changes)) == want


def test_index_follows_the_fold_incrementally_and_matches_a_fresh_sort():
    s = Scenario(racks=1, nodes=1)
    config = PRESETS["fairshare"].replace(las=True)
    for i in range(20):
        s.submit(f"j{i}", 1, team=f"t{i % 3}", at=i, priority=("low", "normal", "high")[i % 3])
    indexes = Indexes()  # one index kept across the steps, as a service keeps it across cycles
    for step in range(12):
        idx = indexes.queue(s.state, config)
        got = [j.job_id for j in idx.ordered(s.now, lambda t: s.state.teams[t].held)]
        assert got == _order(s, config)
        jid = got[step % len(got)]
        s.run(jid, [s.state.nodes["r0n0"].free and next(iter(s.state.nodes["r0n0"].free))], at=s.now + 1)
        if step % 2:
            s.apply(_release(jid, s.now + 2))
            s.now += 2
        else:
            s.finish(jid, s.now + 2)
            s.now += 2


# --- predicted order (`las_predicted`): shortest predicted remaining GPU-seconds first, frozen ---

def _ran(s: Scenario, job_id: str, gpu_count: int, start: float, run_s: float, live: Indexes | None) -> None:
    s.submit(job_id, gpu_count, at=start)
    if live is not None:  # a long-lived index sees the job queued, then running, as cycles would
        live.queue(s.state, PREDICTED)
    s.run(job_id, gpus("r0n0", *range(gpu_count)), at=start)
    s.finish(job_id, at=start + run_s)


def _history(s: Scenario, t: float, runs: dict[int, float], n: int = 8, live: Indexes | None = None) -> float:
    """`n` completed jobs per gang size, each of the given run time, one after another."""
    for size, run_s in runs.items():
        for i in range(n):
            _ran(s, f"h{size}-{t:.0f}-{i}", size, t, run_s, live)
            t += run_s
    s.now = t
    return t


PREDICTED = PRESETS["full"].replace(las_predicted=True)


@pytest.mark.parametrize("config, expected", [
    (PRESETS["full"], ["long", "short"]),  # 2D-LAS: both in queue 0, FIFO
    (PREDICTED, ["short", "long"]),  # 1 GPU x ~100 s before 2 GPUs x ~10,000 s
])
def test_predicted_order_puts_the_shortest_predicted_remaining_gpu_time_first(config, expected):
    s = Scenario()
    t = _history(s, 0.0, {1: 100.0, 2: 10_000.0})
    s.submit("long", 2, at=t + 1)
    s.submit("short", 1, at=t + 2)
    assert _order(s, config) == expected


def test_predicted_keys_are_frozen_at_queue_time_a_fresh_index_gives_the_same():
    """A job's key uses only the jobs completed before it was queued: completions after that
    move neither a long-lived index's key nor a fresh one's (the same log, the same order)."""
    s = Scenario()
    t = _history(s, 0.0, {1: 100.0, 2: 10_000.0})
    s.submit("a", 1, at=t + 1)
    s.submit("b", 2, at=t + 2)
    live = Indexes()
    before = {j: e[0] for j, e in live.queue(s.state, PREDICTED).entries.items()}
    assert _order(s, PREDICTED) == ["a", "b"]
    # Later 1-GPU jobs run far longer: new arrivals are predicted long, the queued ones are not.
    t = _history(s, t + 10, {1: 100_000.0}, n=40, live=live)
    s.submit("c", 1, at=t + 1)
    kept = live.queue(s.state, PREDICTED).entries
    fresh = Indexes().queue(s.state, PREDICTED).entries
    assert {j: kept[j][0] for j in ("a", "b")} == before
    assert {j: e[0] for j, e in kept.items()} == {j: e[0] for j, e in fresh.items()}
    assert _order(s, PREDICTED) == ["a", "b", "c"]
    assert kept["c"][0][2] > kept["b"][0][2] > kept["a"][0][2]


def test_predicted_order_is_refrozen_when_a_job_is_requeued():
    """A requeued job is keyed again, as of its requeue and conditional on what it ran."""
    s = Scenario()
    t = _history(s, 0.0, {1: 100.0})
    s.submit("q", 1, at=t + 1)
    live = Indexes()
    first = live.queue(s.state, PREDICTED).entries["q"][0][2]
    s.run("q", gpus("r0n0", 0), at=t + 2)
    live.queue(s.state, PREDICTED)
    s.apply(_release("q", t + 52))  # ran 50 s of its ~100
    again = live.queue(s.state, PREDICTED).entries["q"][0][2]
    assert again < first
    assert again == Indexes().queue(s.state, PREDICTED).entries["q"][0][2]


def test_reading_the_queue_again_changes_nothing_it_re_verifies():
    """The index re-checks its settled reasons every `REVERIFY_EVERY` fold versions, not every
    `REVERIFY_EVERY` reads: a step that reads the queue once more in a cycle (the hand-over, the
    ETA plan) must not move when the cycle's reasons are re-emitted."""
    s = Scenario(racks=1, nodes=1)
    s.submit("a", 8)
    indexes, config = Indexes(), PRESETS["full"]
    q = indexes.queue(s.state, config)
    q.settled["a"] = None
    for _ in range(2 * REVERIFY_EVERY):
        assert indexes.queue(s.state, config) is q
    assert "a" in q.settled  # the same fold version, read many times
    for i in range(REVERIFY_EVERY):
        s.apply(ev.JobPending(at=float(i), job_id="a", reason="r"))
        indexes.queue(s.state, config)
    assert "a" not in q.settled  # REVERIFY_EVERY new versions: checked again
