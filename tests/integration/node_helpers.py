"""Shared by the node-side integration tests: the test plays the control plane (it submits,
grants, preempts and releases by appending to the real log) and watches the fold."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gpusched.bus.cas import append_cas
from gpusched.bus.log import EventLog
from gpusched.core import events as ev
from gpusched.core.model import JobSpec
from gpusched.core.state import ClusterState, fold
from gpusched.services.nodeagent.agent_config import AgentConfig
from gpusched.services.nodeagent.backends import SimBackend
from gpusched.services.nodeagent.host import NodeHost
from gpusched.services.runtime import FoldedLog

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_numpy.py"
PY = sys.executable
#: The tests' job cgroups (as root): <controller>/.../gpusched-test/<run>, removed afterwards.
CGROUP_PARENT = "gpusched-test"


class Cluster:
    """A real log, a fold that watches it, and simulated node daemons in this process."""

    def __init__(self, nats_url: str, tmp: Path):
        self.nats_url = nats_url
        self.tmp = tmp
        self.log: EventLog | None = None
        self.watch: FoldedLog | None = None
        self.hosts: list[NodeHost] = []
        self.history: list[ev.Event] = []  # the whole log, as of the last `refold`

    async def __aenter__(self) -> Cluster:
        self.log = await EventLog.open(self.nats_url, name="test-control-plane")
        self.watch = FoldedLog(self.log)
        await self.watch.start()
        return self

    async def __aexit__(self, *exc) -> None:
        for host in self.hosts:
            await host.stop()
        await self.watch.stop()
        await self.log.close()

    @property
    def state(self) -> ClusterState:
        return self.watch.state

    async def start_nodes(self, names: list[str], gpus: int = 4, nvlink: str = "pairs", heartbeat_s: float = 0.2,
                          kill_grace_s: float = 1.0, racks: list[str] | None = None, mig: bool = False,
                          **config) -> NodeHost:
        host = await NodeHost.open(self.nats_url, heartbeat_s=heartbeat_s, poll_s=0.05)
        # the test's directory plays the site's shared checkpoint file system
        config = {"retry_backoff_s": 0.05, "resize_grace_s": 3.0, "checkpoint_roots": (str(self.tmp),),
                  "cgroup_parent": CGROUP_PARENT, **config}
        for i, name in enumerate(names):
            host.add(AgentConfig(node=name, rack=(racks[i] if racks else "r0"), address="127.0.0.1", nvlink=nvlink,
                                 work_dir=self.tmp / "work", kill_grace_s=kill_grace_s, **config),
                     SimBackend(name, gpus, nvlink, mig=mig))
        await host.start()
        self.hosts.append(host)
        await self.wait(lambda s: all(n in s.nodes and not s.nodes[n].lost for n in names), "nodes registered")
        return host

    async def wait(self, pred: Callable[[ClusterState], object], what: str, timeout: float = 15.0):
        deadline = time.monotonic() + timeout
        while True:
            got = pred(self.watch.state)
            if got:
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}; job states: "
                                   f"{ {j: (x.state, x.attempt) for j, x in self.watch.state.jobs.items()} }")
            await self.watch.wait_changed(0.1)

    async def append(self, *events: ev.Event) -> None:
        await self.watch.catch_up()
        _, conflicted = await append_cas(self.watch, list(events))
        assert not conflicted
        await self.watch.catch_up()

    async def submit(self, job_id: str, spec: JobSpec) -> None:
        await self.append(ev.JobSubmitted(at=time.time(), job_id=job_id, spec=spec))

    async def grant(self, job_id: str, gpus: list[str], slices: list[int] | None = None) -> int:
        attempt = self.state.jobs[job_id].attempt + 1
        await self.append(ev.GpusGranted(at=time.time(), job_id=job_id, attempt=attempt, gpus=gpus, placer="sim",
                                         slices=slices or []))
        return attempt

    def events(self, kind: type | None = None, job_id: str | None = None) -> list[ev.Event]:
        return [e for e in self.history if (kind is None or isinstance(e, kind))
                and (job_id is None or getattr(e, "job_id", None) == job_id)]

    async def refold(self) -> ClusterState:
        """Fold the whole log from scratch (the audit every scenario ends with)."""
        pairs = [(seq, e) async for seq, e in self.log.replay()]
        self.history = [e for _, e in pairs]
        return fold(pairs)


def train_spec(ckpt_dir: Path, steps: int = 60, every: int = 10, step_time: float = 0.03, gpus: int = 2,
               **kw) -> JobSpec:
    return JobSpec(team="t", gpus=gpus, preemptible=True, checkpoint_dir=str(ckpt_dir),
                   command=[PY, str(EXAMPLE), "--steps", str(steps), "--checkpoint-every", str(every),
                            "--step-time", str(step_time)], **kw)


def reference_weights(tmp: Path, steps: int) -> bytes:
    import subprocess

    from gpusched.services.nodeagent.launcher import allowed

    out = tmp / "reference.npy"
    # the environment a job gets from the daemon (the numeric libraries' settings change the bits)
    env = {k: v for k, v in os.environ.items() if allowed(k) and not k.startswith("GPUSCHED_")}
    subprocess.run([PY, str(EXAMPLE), "--steps", str(steps), "--out", str(out)], check=True, env=env,
                   capture_output=True, timeout=60)
    return out.read_bytes()


def alive(pid: int) -> bool:
    from gpusched.services.nodeagent.backends import process_alive

    return process_alive(pid)


async def wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still alive"
        await asyncio.sleep(0.05)
