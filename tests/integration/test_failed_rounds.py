"""A decider that fails every round ends itself, non-zero, so that its supervisor restarts it
from the log. Before, placement and the preemptor logged `*_round_failed` forever (47 and 91
failed rounds after a fuzzed fold, no scheduling) and stayed up, holding their leases. A real
preemptor loop over a real NATS log, with its decision made to raise."""

from __future__ import annotations

import asyncio

import pytest

from gpusched.bus.log import EventLog
from gpusched.policy.config import DEFAULT
from gpusched.services import runtime
from gpusched.services.preemptor import Preemptor
from gpusched.services.runtime import FoldedLog


@pytest.fixture
def fatal_reasons(monkeypatch):
    reasons: list[str] = []
    monkeypatch.setattr(runtime, "on_fatal", reasons.append)
    monkeypatch.setenv("GPUSCHED_MAX_FAILED_ROUNDS", "4")
    return reasons


async def test_a_decider_failing_n_rounds_in_a_row_ends_and_one_that_recovers_stays(nats_url, fatal_reasons):
    folded = FoldedLog(await EventLog.open(nats_url, name="failed-rounds"))
    await folded.start()
    try:
        preemptor = Preemptor(folded, DEFAULT, tick_s=0.01)
        rounds = 0

        def flaky(state, now):
            nonlocal rounds
            rounds += 1
            if rounds % 2 == 0:  # every other round succeeds: never 4 failures in a row
                return []
            raise KeyError("j-gone")

        preemptor.decide = flaky
        stop = asyncio.Event()
        task = asyncio.create_task(preemptor.run(stop))
        while rounds < 6:
            await asyncio.sleep(0.05)
        assert not task.done() and fatal_reasons == []
        preemptor.decide = lambda state, now: (_ for _ in ()).throw(KeyError("j-gone"))
        await asyncio.wait_for(task, timeout=10)  # the loop ends itself at the 4th failure in a row
        assert fatal_reasons == ["preemptor: 4 rounds failed in a row; restart from the log"]
        stop.set()
    finally:
        await folded.close()
