"""The log's streams as an admin makes and bounds them: the fact stream (delete and purge
denied, atomic batches on), the dead letters (bounded per subject, aged out), the snapshot object
store and the lease bucket. Every other role only checks that they exist (`ensure`): what a
stream is belongs to admin alone. Split from `bus/log.py`, which reads and appends."""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from gpusched.core import limits

from . import subjects

DEAD_MAX_MSGS = 100_000
DEAD_MAX_BYTES = 256 * 1024 * 1024
DEAD_MAX_AGE_S = 30 * 86_400.0
DEAD_MAX_MSG_BYTES = 64 * 1024  # a dead letter keeps at most this much of the bad message
EXISTS = 10058  # "stream name already in use with a different configuration"

#: JetStream's answers to a replica count the cluster cannot hold (too few servers; not clustered).
REPLICA_ERRORS = (10023, 10074)


class ReplicasUnavailable(RuntimeError):
    """The log was asked for more replicas than the NATS cluster has servers."""

    def __init__(self, replicas: int, size: int, detail: str = ""):
        super().__init__(f"the log at R{replicas} needs at least {replicas} NATS servers, but the cluster has "
                         f"{size}{f' ({detail})' if detail else ''}; start more servers (`gpusched up "
                         f"--nats-cluster {replicas}`) or lower --replicas")
        self.replicas, self.size = replicas, size


def cluster_size(nc) -> int:
    """How many servers the connected cluster has, as its INFO says (1: a single server)."""
    info = getattr(nc, "_server_info", None) or {}
    return max(1, len(info.get("connect_urls") or ()))


def configs(replicas: int) -> list[StreamConfig]:
    """The streams: the log denies deleting and purging (nobody rewrites history through
    the API, admin included); its limits and subjects change only by admin."""
    return [
        StreamConfig(
            name=subjects.STREAM, subjects=[subjects.EVENTS], storage=StorageType.FILE,
            retention=RetentionPolicy.LIMITS, discard=DiscardPolicy.OLD, num_replicas=replicas,
            duplicate_window=120.0, allow_atomic=True, description="gpusched: every fact, the source of truth",
            deny_delete=True, deny_purge=True,
            max_msg_size=limits.MAX_EVENT_BYTES,
        ),
        # Dead letters: one per stream sequence (subject `gpusched.dead.<seq>.<subject>`, one
        # message per subject, a second publish refused by the server), bounded and aged out.
        StreamConfig(
            name=subjects.DEAD_STREAM, subjects=[subjects.DEAD], storage=StorageType.FILE,
            num_replicas=replicas, description="gpusched: messages that did not decode, with why",
            deny_delete=True, deny_purge=True,
            discard=DiscardPolicy.NEW, discard_new_per_subject=True, max_msgs_per_subject=1,
            max_msgs=DEAD_MAX_MSGS, max_bytes=DEAD_MAX_BYTES, max_age=DEAD_MAX_AGE_S,
            max_msg_size=DEAD_MAX_MSG_BYTES,
        ),
    ]


async def ensure(log) -> None:
    """Admin: create or update the streams (idempotent; `gpusched up` and the test fixtures do
    it). Every other role only checks that they exist."""
    ident = log.identity
    if ident is not None and ident.role != "admin":
        for config in configs(log.replicas):
            try:
                await log.js.stream_info(config.name)
            except NotFoundError:
                raise RuntimeError(f"stream {config.name} does not exist: an admin creates it "
                                   "(`gpusched up`, or `gpusched stream create` with admin credentials)") from None
        return
    await create(log)


async def create(log) -> None:
    """Create or update the streams (`log`: an admin's `EventLog`), the snapshot store and the
    lease bucket. An operator's retention limits on the fact stream stay as set."""
    size = cluster_size(log.nc)
    if log.replicas_given and log.replicas > size:
        raise ReplicasUnavailable(log.replicas, size)
    for config in configs(log.replicas):
        try:
            await log.js.add_stream(config)
        except APIError as err:
            if err.err_code in REPLICA_ERRORS:
                raise ReplicasUnavailable(log.replicas, size, err.description or "") from err
            if err.err_code != EXISTS:
                raise
            if config.name == subjects.STREAM:
                await _keep_limits(log.js, config)
            if not log.replicas_given:
                config.num_replicas = (await log.js.stream_info(config.name)).config.num_replicas
            try:
                await log.js.update_stream(config)
            except APIError as err2:
                if err2.err_code in REPLICA_ERRORS:
                    raise ReplicasUnavailable(log.replicas, size, err2.description or "") from err2
                raise
    await create_snapshot_store(log.js, log.replicas)
    await create_lease_bucket(log.js, log.replicas)


async def _keep_limits(js: JetStreamContext, config: StreamConfig) -> None:
    assert config.name is not None, "configs() names every stream"
    current = (await js.stream_info(config.name)).config
    config.max_age, config.max_msgs, config.max_bytes = current.max_age, current.max_msgs, current.max_bytes


async def create_snapshot_store(js: JetStreamContext, replicas: int) -> None:
    """The object store of sealed fold snapshots (`gpusched.store.SnapshotStore`); bounded by
    its rotating names, so no limits of its own."""
    from nats.js.api import ObjectStoreConfig

    try:
        await js.create_object_store(subjects.SNAPSHOT_BUCKET, config=ObjectStoreConfig(
            description="gpusched: sealed snapshots of the fold", storage=StorageType.FILE, replicas=replicas))
    except APIError as err:
        if err.err_code != EXISTS:  # exists (with other settings): keep it
            raise


async def set_retention(js: JetStreamContext, max_age_s: float | None = None, max_msgs: int | None = None,
                        max_bytes: int | None = None) -> StreamConfig:
    """Admin: bound the log by age, count or size (None: leave as is; 0: unbounded). The server
    drops the oldest facts past a limit; purge and delete stay denied. A process starts from a
    snapshot, so the limits must leave every fact after the newest verified snapshot in the
    stream (see docs/operating.md, "Retention")."""
    config = (await js.stream_info(subjects.STREAM)).config
    if max_age_s is not None:
        config.max_age = max_age_s or None
    if max_msgs is not None:
        config.max_msgs = max_msgs or -1
    if max_bytes is not None:
        config.max_bytes = max_bytes or -1
    return (await js.update_stream(config)).config


async def create_lease_bucket(js: JetStreamContext, replicas: int) -> None:
    """The key-value bucket of the placement and fallback leases (`services/lease.py`), created
    with the streams: one revision per key, small values, direct gets (a lease is read often)."""
    from nats.js.api import KeyValueConfig

    try:
        await js.create_key_value(KeyValueConfig(
            bucket=subjects.LEASE_BUCKET, description="gpusched: liveness leases of placement and the fallback",
            history=1, max_value_size=1024, max_bytes=1 << 20, storage=StorageType.FILE, replicas=replicas,
            direct=True))
    except APIError as err:
        if err.err_code != EXISTS:  # exists (with other settings): keep it
            raise
