"""A node daemon serves its jobs' stdout/stderr over NATS (`gpusched logs JOB`).

Each rank's output of each attempt is kept in one file on the node; the fold knows where
(`JobStarted.log`). A request names the job, attempt, rank (and optionally generation) and
a byte range; the daemon serves only files under its own log directory that the fold lists
for this node, in chunks well under NATS's max payload.

The asker's fold can be ahead of the daemon's: the daemon appends `JobStarted` and folds it back
a moment later, and `logs -f` asks as soon as its own fold shows the start. So a miss first
catches the daemon's fold up to the stream's head (bounded), then looks again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from gpusched.core.heartbeat import LogReply, LogRequest
from gpusched.core.state import ClusterState

if TYPE_CHECKING:
    from gpusched.services.runtime import FoldedLog

_decoder = msgspec.json.Decoder(LogRequest)
#: How long a miss waits for the daemon's fold to reach the stream's head: under the CLI's
#: default request timeout (5 s), so the asker hears "no log" rather than a timeout.
CATCH_UP_S = 2.0


def find_log(state: ClusterState, node: str, req: LogRequest) -> str | None:
    """The path the fold lists for this rank of this attempt on `node` (the latest generation
    unless one is asked for)."""
    job = state.jobs.get(req.job_id)
    if job is None:
        return None
    refs = [r for r in job.logs if r.node == node and r.attempt == req.attempt and r.rank == req.rank
            and (req.generation is None or r.generation == req.generation)]
    return max(refs, key=lambda r: r.generation).path if refs else None


async def serve_log(node: str, log_dir: Path, data: bytes, folded: FoldedLog) -> LogReply:
    try:
        req = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        return LogReply(ok=False, node=node, error=str(err))
    path = find_log(folded.state, node, req)
    if path is None:
        try:
            await folded.catch_up(CATCH_UP_S)
        except Exception:  # noqa: BLE001 - the log out of reach or slow: answer from what is folded
            pass
        path = find_log(folded.state, node, req)
    if path is None:
        return LogReply(ok=False, node=node, error=f"no log of {req.job_id} attempt {req.attempt} rank {req.rank} "
                                                   f"on node {node}")
    real = os.path.realpath(path)
    if not real.startswith(os.path.realpath(log_dir) + os.sep):
        return LogReply(ok=False, node=node, error="log outside this daemon's log directory")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        return LogReply(ok=False, node=node, path=path, error=f"cannot read the log: {err.strerror}")
    try:
        size = os.fstat(fd).st_size
        start = max(0, size + req.offset) if req.offset < 0 else min(req.offset, size)
        os.lseek(fd, start, os.SEEK_SET)
        chunk = os.read(fd, req.max_bytes)
    finally:
        os.close(fd)
    return LogReply(ok=True, node=node, path=path, data=chunk.decode(errors="replace"),
                    offset=start + len(chunk), size=size)


__all__ = ["find_log", "serve_log"]
