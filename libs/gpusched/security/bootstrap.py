"""The admin step that creates the streams (services only check they exist): `gpusched up`
and the test fixtures run it once per server."""

from __future__ import annotations

import asyncio
import os
import threading


async def create_streams(url: str, creds: str | os.PathLike | None) -> None:
    from gpusched.bus.log import EventLog, connect

    log = EventLog(await connect(url, name="gpusched-bootstrap", creds=creds))
    try:
        await log.create_streams()
    finally:
        await log.close()


def create_streams_sync(url: str, creds: str | os.PathLike | None) -> None:
    """From synchronous code, even inside a running event loop's thread (fixtures): in a thread."""
    error: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(create_streams(url, creds))
        except BaseException as err:  # re-raised in the caller
            error.append(err)

    t = threading.Thread(target=run, name="create-streams")
    t.start()
    t.join()
    if error:
        raise error[0]
