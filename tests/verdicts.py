"""The server's own verdict on a write a credential may not make: its `Permissions Violation`
for the subject, not a guess from silence (a refused publish gets no ack, no reply, no error
raised: waiting out a client's timeout is slow and proves nothing)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from nats.aio.client import Client

from gpusched.bus.log import connect


class Attacker:
    """A fresh connection per attempt (the client closes one the server refused)."""

    def __init__(self, url: str, creds: str):
        self.url, self.creds = url, creds

    async def refused(self, subject: str, act: Callable[[Client], Awaitable[object]], prefix: bool = False) -> bool:
        """Whether the server refused `act`'s publish to `subject` (`prefix`: to a subject that
        starts with it, e.g. an object store's chunk subject, named by a fresh id) within 5 s."""
        needle = f'permissions violation for publish to "{subject.lower()}' + ("" if prefix else '"')
        seen = asyncio.Event()

        async def on_error(err: Exception) -> None:
            if needle in str(err).lower():
                seen.set()

        nc = await connect(self.url, name="attacker", creds=self.creds, error_cb=on_error)
        try:
            attempt, verdict = asyncio.ensure_future(act(nc)), asyncio.ensure_future(seen.wait())
            await asyncio.wait({attempt, verdict}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
            attempt.cancel()
            verdict.cancel()
            return seen.is_set()
        finally:
            await nc.close()
