"""The admin step that creates the streams (services only check they exist): `gpusched up`
and the test fixtures run it once per server (or cluster)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

#: How long a freshly started cluster may take to elect its JetStream meta leader.
READY_S = 45.0
#: How long a too-small cluster is given to show its other members (routes still forming).
MEMBERS_S = 8.0


async def create_streams(url: str, creds: str | os.PathLike | None, replicas: int | None = None) -> None:
    """Create (or update) the streams. A cluster that has not elected its JetStream meta leader
    yet answers "temporarily unavailable" or not at all: wait for it, up to READY_S; a replica
    count the cluster cannot hold is an error at once (`ReplicasUnavailable`)."""
    from nats.errors import Error as NatsError

    from gpusched.bus.log import EventLog, ReplicasUnavailable, connect

    log = EventLog(await connect(url, name="gpusched-bootstrap", creds=creds), replicas)
    start = time.monotonic()
    deadline = start + READY_S
    try:
        while True:
            try:
                await log.create_streams()
                return
            except ReplicasUnavailable:
                if time.monotonic() > start + MEMBERS_S:
                    raise
                await asyncio.sleep(0.5)
            except (NatsError, TimeoutError) as err:  # APIError is a NatsError too
                if time.monotonic() > deadline:
                    raise RuntimeError(f"JetStream at {url} not ready within {READY_S:.0f}s: {err}") from err
                await asyncio.sleep(0.25)
    finally:
        await log.close()


def create_streams_sync(url: str, creds: str | os.PathLike | None, replicas: int | None = None) -> None:
    """From synchronous code, even inside a running event loop's thread (fixtures): in a thread."""
    error: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(create_streams(url, creds, replicas))
        except BaseException as err:  # re-raised in the caller
            error.append(err)

    t = threading.Thread(target=run, name="create-streams")
    t.start()
    t.join()
    if error:
        raise error[0]
