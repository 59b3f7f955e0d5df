"""`SharedRead`: concurrent read barriers share one request, and none is answered by a request
that began before it asked."""

from __future__ import annotations

import asyncio

from gpusched.services.runtime import SharedRead


class Head:
    """A stream head that moves; each read takes a round trip and records when it began."""

    def __init__(self) -> None:
        self.value = 0
        self.began: list[int] = []
        self.fail = False

    async def read(self) -> int:
        self.began.append(self.value)
        seen = self.value
        await asyncio.sleep(0.01)
        if self.fail:
            raise ConnectionError("no answer")
        return seen


async def test_a_burst_of_callers_costs_two_requests_and_each_sees_a_head_read_after_it_asked():
    head = Head()
    shared = SharedRead(head.read)
    first = asyncio.ensure_future(shared.read())
    while not head.began:  # the first request is in flight, with head 0
        await asyncio.sleep(0)
    head.value = 7  # appended after the first request began: later callers must see it
    burst = [asyncio.ensure_future(shared.read()) for _ in range(50)]
    assert await first == 0
    assert await asyncio.gather(*burst) == [7] * 50
    assert head.began == [0, 7]


async def test_a_failed_read_reaches_every_caller_that_shared_it_and_the_next_one_retries():
    head = Head()
    shared = SharedRead(head.read)
    head.fail = True
    results = await asyncio.gather(*(shared.read() for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)
    head.fail, head.value = False, 3
    assert await shared.read() == 3


async def test_one_callers_timeout_does_not_cancel_the_others():
    head = Head()
    shared = SharedRead(head.read)
    head.value = 5
    impatient = asyncio.wait_for(shared.read(), 0.001)
    patient = shared.read()
    impatient_result, patient_result = await asyncio.gather(impatient, patient, return_exceptions=True)
    assert isinstance(impatient_result, TimeoutError) and patient_result == 5


