"""Fencing: a node cut off from the control plane stops its own jobs before they can run twice.

The reconciler declares a node lost (and its jobs requeued elsewhere) after `node_timeout_s`
without a heartbeat. If the node is only cut off, its jobs still run: a second attempt would
train beside the first and both write checkpoints. So the agent watches its own reach of the
log: every `probe_s` it asks JetStream for the stream's head (`log.last_seq`, answered only by
a stream leader with a quorum: a NATS server in a minority cannot answer it either, though
its clients still reach it). When no probe has succeeded for `fence_after_s`, it asks every
job to checkpoint, gives them `checkpoint_grace_s`, then stops them (SIGTERM, SIGKILL after the
agent's kill grace). The bound, with everything it waits for:

    heartbeat_s + fence_after_s + probe_s + probe_timeout_s + checkpoint_grace_s + kill_grace_s
        < node_timeout_s

(the reconciler counts from the last heartbeat it received, up to `heartbeat_s` before the
cut). `fence_after_s` defaults to `node_timeout_s` minus the rest and a `slack_s`, so that the
last process of a cut-off node is gone before the reconciler may requeue. The node-side equivalent
of Nomad's `stop_after_client_disconnect` (we stop before the server gives the work away,
rather than Nomad's `max_client_disconnect`, which keeps the job running "unknown" and risks two
copies); Kubernetes' node leases are the same clock seen from the control plane.

A dead agent fences nothing, and its jobs outlive it on purpose (a restarted agent adopts
them). So a fence keeper (`keeper.py`), a small process of its own session per work dir that
outlives the agent, watches a lease the agent renews with its last good probe's time; when the
lease is `keeper_after_s` old it stops every job the work dir's run records prove alive (SIGTERM,
SIGKILL after the kill grace; no checkpoint: no agent could record it) and marks them fenced.
It waits as long as the agent's own fence may take before it stops a job, so a live, cut-off
agent fences first (with its checkpoint grace) and the bound is the one above plus the keeper's
tick (0.2 s, within `slack_s`):

    keeper_after_s = fence_after_s + probe_s + probe_timeout_s + checkpoint_grace_s

(13 s with the defaults). An agent back within it renews the lease and adopts
every job. What no process on the node can do: a host frozen or powered off (its processes
freeze with it: the reconciler's `NodeLost` is the fence there), and an operator's kill -9 of both
the agent and its keeper (then nothing stops the jobs: kill the jobs too, or start the agent).

Environment (the node daemon's): `GPUSCHED_NODE_TIMEOUT_S` (must equal the reconciler's
`--node-timeout-s`; default 30), `GPUSCHED_FENCE_AFTER_S` (explicit), `GPUSCHED_FENCE=0` (off).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger()


@dataclass
class FenceConfig:
    node_timeout_s: float = 30.0
    probe_s: float = 1.0
    probe_timeout_s: float = 2.0
    checkpoint_grace_s: float = 3.0
    slack_s: float = 2.0
    fence_after_s: float | None = None  # default: what is left of node_timeout_s

    def after_s(self, kill_grace_s: float, heartbeat_s: float) -> float:
        """The last heartbeat the reconciler saw may be `heartbeat_s` older than the last probe
        that succeeded, and a probe may hang `probe_s + probe_timeout_s`: all of it, the
        checkpoint grace and the kill grace must fit in the node timeout."""
        if self.fence_after_s is not None:
            return self.fence_after_s
        rest = (heartbeat_s + self.probe_s + self.probe_timeout_s + self.checkpoint_grace_s + kill_grace_s
                + self.slack_s)
        return max(self.probe_s, self.node_timeout_s - rest)

    def keeper_after_s(self, kill_grace_s: float, heartbeat_s: float) -> float:
        """How long the fence keeper (`keeper.py`) waits on a lease the agent stopped renewing:
        as long as the agent's own fence may take to stop a job (its last probe timing out, its
        checkpoint grace), so that a live, cut-off agent fences first and with checkpoints; the
        bound is then the agent's own plus the keeper's tick, which the slack covers."""
        return self.after_s(kill_grace_s, heartbeat_s) + self.probe_s + self.probe_timeout_s + self.checkpoint_grace_s

    @classmethod
    def from_env(cls) -> FenceConfig | None:
        if os.environ.get("GPUSCHED_FENCE", "1") == "0":
            return None
        timeout = float(os.environ.get("GPUSCHED_NODE_TIMEOUT_S", cls.node_timeout_s))
        after = os.environ.get("GPUSCHED_FENCE_AFTER_S")
        return cls(node_timeout_s=timeout, fence_after_s=float(after) if after else None,
                   probe_s=min(cls.probe_s, timeout / 10), probe_timeout_s=min(cls.probe_timeout_s, timeout / 5),
                   checkpoint_grace_s=min(cls.checkpoint_grace_s, timeout / 10), slack_s=min(cls.slack_s, timeout / 10))


class Fence:
    """The watch over one `NodeHost`: its agents' jobs stop when the log is out of reach."""

    def __init__(self, host: Any, cfg: FenceConfig):
        self.host, self.cfg = host, cfg
        kill = max((a.cfg.kill_grace_s for a in host.agents.values()), default=10.0)
        self.after_s = cfg.after_s(kill, host.heartbeat_s)
        self.last_ok = time.monotonic()
        self.fenced_at: float | None = None  # monotonic, while fenced
        self.fences = 0

    async def probe(self) -> bool:
        try:
            await asyncio.wait_for(self.host.log.last_seq(), self.cfg.probe_timeout_s)
            return True
        except asyncio.CancelledError:
            raise
        except Exception:
            return False

    async def run(self) -> None:
        while True:
            ok = await self.probe()
            now = time.monotonic()
            if ok:
                if self.fenced_at is not None:
                    log.warning("fence_lifted", fenced_s=round(now - self.fenced_at, 1))
                self.last_ok, self.fenced_at = now, None
            elif self.fenced_at is None and now - self.last_ok >= self.after_s:
                self.fenced_at = now
                self.fences += 1
                await self.fence(now - self.last_ok)
            await asyncio.sleep(self.cfg.probe_s)

    async def fence(self, unreachable_s: float) -> None:
        """Ask every job to checkpoint, then stop them all."""
        why = f"fenced: the log unreachable for {unreachable_s:.1f}s (node timeout {self.cfg.node_timeout_s:g}s)"
        runs = [(a, r) for a in self.host.agents.values() for r in list(a.jobs.values()) if r.state == "running"]
        log.warning("fencing", jobs=len(runs), why=why)
        deadline = time.time() + self.cfg.checkpoint_grace_s
        for agent, run in runs:
            agent._request_checkpoint(run, f"fence-{run.attempt}.{run.generation}", why, deadline, "")
        if runs:
            await asyncio.sleep(self.cfg.checkpoint_grace_s)
        for agent in self.host.agents.values():
            agent.stop_all(why)


def config(host: Any) -> FenceConfig | None:
    """A host's fencing settings: set on it (tests), else from the environment; None: off."""
    return getattr(host, "fence_config", None) or FenceConfig.from_env()


def tasks(host: Any) -> list[asyncio.Task]:
    """The fence's task for a started `NodeHost` (none when fencing is off)."""
    cfg = config(host)
    if cfg is None:
        return []
    host.fence = Fence(host, cfg)
    log.info("fence_armed", fence_after_s=round(host.fence.after_s, 1), node_timeout_s=cfg.node_timeout_s)
    return [asyncio.create_task(host.fence.run(), name="nodeagent-fence")]
