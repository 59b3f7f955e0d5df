"""Snapshots a service may trust: their digest is recorded in the log.

Redis is not the source of truth and anyone who can write it could hand a restarting service a
state in which held GPUs look free (its compare-and-set would still pass: the snapshot also
claims the alloc sequence). So the projector, after writing a snapshot, appends `SnapshotTaken`
(seq, SHA-256 of the snapshot's bytes) to the log, where only the projector may write that kind
(NATS permissions, and its signature checked by `replay --verify`). A service adopts a snapshot
only if it re-encodes to exactly that digest at exactly that sequence, checked against the
latest seal in the log; otherwise it says why and replays the log from the start.

The check re-encodes the restored state rather than hashing the bytes read from Redis, so it
vouches for the very object the service is about to use.
"""

from __future__ import annotations

import hashlib

import msgspec
from nats.js.errors import NotFoundError

from gpusched.bus import subjects
from gpusched.core import events as ev
from gpusched.core.state import ClusterState

#: The subject of every seal (event_key of a SnapshotTaken is "cluster").
SEAL_SUBJECT = subjects.event_subject(ev.SnapshotTaken(at=0.0, seq=0, digest=""))


def digest(state: ClusterState) -> str:
    return hashlib.sha256(state.snapshot()).hexdigest()


def seal(state: ClusterState) -> ev.SnapshotTaken:
    """The fact that records a snapshot of `state` (append it after writing the snapshot)."""
    return ev.SnapshotTaken(at=state.now, seq=state.last_seq, digest=digest(state))


async def append_seal(event_log, state: ClusterState) -> int:
    """Record the snapshot just written (a retry of the same snapshot is stored once)."""
    sealed = seal(state)
    return await event_log.append(sealed, msg_id=f"snapshot-{sealed.seq}-{sealed.digest[:32]}")


async def latest_seal(event_log) -> ev.SnapshotTaken | None:
    try:
        msg = await event_log.js.get_last_msg(subjects.STREAM, SEAL_SUBJECT)
    except NotFoundError:
        return None
    try:
        event = ev.decode_event(msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return event if isinstance(event, ev.SnapshotTaken) else None


async def untrusted(event_log, state: ClusterState) -> str | None:
    """Why the snapshot `state` must not be used (None: it is the one the log's latest seal
    records). Any failure to check is a reason not to trust it."""
    try:
        sealed = await latest_seal(event_log)
    except Exception as err:  # noqa: BLE001 - cannot check: do not trust
        return f"the log's seal could not be read ({type(err).__name__}: {err})"
    if sealed is None:
        return "the log records no snapshot seal"
    if sealed.seq != state.last_seq:
        return f"it claims seq {state.last_seq}, the log's latest seal is for seq {sealed.seq}"
    if sealed.digest != digest(state):
        return f"its digest does not match the log's seal for seq {sealed.seq} (altered)"
    return None
