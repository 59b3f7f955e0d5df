"""The control-plane e2e harness: real nats-server and redis-server (tests/conftest.py), real
service processes (`gpusched service run NAME`, killable with SIGKILL), a client, and a local
fold of the log to wait on. The test plays the node daemon where it needs one (appending
`JobStarted`, `CheckpointSaved`, `JobCompleted`). Each service signs with a key of its own role
(`GPUSCHED_SIGNING_SEED`, the hook trust-auth's identities plug into). After every test the whole
log is folded again and must show no broken invariant, fold the same twice, and pass the trust
audit: every service's fact signed by a role that may write it, none missing, altered or moved
(the harness's own appends, as the node daemon, are unsigned and only counted).

Test modules import the fixture: `from .harness import harness  # noqa: F401`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpusched.bus import subjects
from gpusched.bus.control_client import Client
from gpusched.bus.log import EventLog
from gpusched.cli.stack import register_simulated_nodes, spawn_service, stop_processes
from gpusched.core import events as ev
from gpusched.core.state import ClusterState, stale_live
from gpusched.security import keyring

#: Short leases and grace periods keep the chaos scenarios fast.
LEASE_TTL_MS = 600
FAST_POLICY = ["--policy-set=min_runtime_s=0", "--policy-set=checkpoint_grace_s=1.5"]


class Harness:
    def __init__(self, nats_url: str, redis_url: str, tmp: Path):
        self.nats_url, self.redis_url, self.tmp = nats_url, redis_url, tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.kinds: dict[str, str] = {}  # alias -> service name
        self.log: EventLog | None = None
        self.client: Client | None = None
        self.state = ClusterState()
        self.records: list[tuple[int, ev.Event]] = []

    async def open(self) -> None:
        self.log = await EventLog.open(self.nats_url, name="e2e")
        self.client = await Client.connect(self.nats_url, timeout=10.0)

    async def close(self) -> None:
        stop_processes(list(self.procs.values()), timeout=5)
        if self.client is not None:
            await self.client.close()
        if self.log is not None:
            await self.log.close()

    # --- services -----------------------------------------------------------------------------

    def start(self, name: str, *extra: str, alias: str | None = None, strict_teams: bool = False) -> subprocess.Popen:
        if name in ("placement", "fallback") and not any(a.startswith("--lease-ttl-ms") for a in extra):
            extra = (*extra, "--lease-ttl-ms", str(LEASE_TTL_MS))
        if name in ("placement", "preemptor") and not any(a.startswith("--policy-set") for a in extra):
            extra = (*extra, *FAST_POLICY)
        if name == "admission" and not any(a.startswith("--placeholders") for a in extra):
            extra = (*extra, "--placeholders", "any")  # the tests play the node daemon
        if name == "admission" and not strict_teams and "--auto-create-teams" not in extra:
            extra = (*extra, "--auto-create-teams")  # the tests submit to teams they never created
        key = alias or name
        proc = spawn_service(name, self.nats_url, self.redis_url, list(extra), log_path=self.tmp / f"{key}.log")
        self.procs[key] = proc
        self.kinds[key] = name
        return proc

    def kill9(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def service_log(self, name: str) -> str:
        try:
            return (self.tmp / f"{name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    async def job_logs(self, jobs: list[str], marker: str, tries: int = 100) -> dict[str, str]:
        """Each job's output as the node daemon keeps it (its ranks' logs under the work dir),
        once every one shows `marker` (or after `tries` looks, 0.1 s apart)."""
        logs = {j: "" for j in jobs}
        for _ in range(tries):
            for j in logs:
                logs[j] = "".join(p.read_text() for p in (self.tmp / "work").rglob("*.log") if subjects.token(j) in str(p))
            if all(marker in text for text in logs.values()):
                break
            await asyncio.sleep(0.1)
        return logs

    async def ready(self, *names: str, timeout: float = 30.0) -> None:
        """Wait for each service's `<service>_ready` log line."""
        deadline = time.monotonic() + timeout
        for name in names:
            marker = f'"{self.kinds[name]}_ready"'
            while marker not in self.service_log(name):
                if self.procs[name].poll() is not None:
                    raise AssertionError(f"{name} exited:\n{self.service_log(name)[-3000:]}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{name} not ready:\n{self.service_log(name)[-3000:]}")
                await asyncio.sleep(0.05)

    async def scheduler(self, nodes: int, gpus: int = 8, *placement: str, **layout) -> None:
        """Admission and one placement service (with `placement` flags), both ready, over
        `nodes` simulated nodes: how most scheduling tests begin."""
        self.start("admission")
        self.start("placement", *placement)
        await self.ready("admission", "placement")
        await self.nodes(nodes, gpus, **layout)

    # --- the log ------------------------------------------------------------------------------

    async def nodes(self, n: int, gpus: int = 8, per_rack: int = 4, nvlink: str = "all") -> None:
        await register_simulated_nodes(self.log, n, gpus, per_rack, nvlink)

    async def append(self, event: ev.Event) -> int:
        return await self.log.append(event)

    async def sync(self) -> ClusterState:
        """Fold everything appended so far into the local state."""
        last = await self.log.last_seq()
        if last > self.state.last_seq:
            async for seq, event in self.log.replay(self.state.last_seq + 1, last):
                self.state.apply(event, seq)
                self.records.append((seq, event))
        return self.state

    async def wait_for(self, what: str, predicate: Callable[[ClusterState], object], timeout: float = 10.0):
        """Poll the fold until `predicate(state)` is truthy; return its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate(await self.sync())
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; last events: "
                                     f"{[(s, e.kind, getattr(e, 'job_id', '')) for s, e in self.records[-12:]]}")
            await asyncio.sleep(0.05)

    def events(self, kind: type[ev.Event]) -> list:
        return [e for _, e in self.records if isinstance(e, kind)]

    async def submit(self, **spec) -> str:
        import msgspec

        from gpusched.core.model import JobSpec

        reply = await self.client.submit(msgspec.convert(spec, JobSpec))
        assert reply.ok, reply.error
        return reply.job_id

    def holding(self, job_id: str) -> bool:
        job = self.state.jobs.get(job_id)
        return job is not None and job.holding

    async def run_job(self, job_id: str) -> None:
        """Play the node daemon: the job's processes started."""
        job = self.state.jobs[job_id]
        node = job.gpus[0].rsplit("/", 1)[0]
        for x in stale_live(job):  # the earlier attempt's processes are gone (the fence)
            await self.append(ev.ProcessesEnded(at=time.time(), job_id=job_id, attempt=x.attempt, node=x.node,
                                                generation=x.generation))
        await self.append(ev.JobStarted(at=time.time(), job_id=job_id, attempt=job.attempt, node=node,
                                        generation=job.generation))

    async def checkpoint(self, job_id: str, step: int = 100) -> None:
        job = self.state.jobs[job_id]
        await self.append(ev.CheckpointSaved(at=time.time(), job_id=job_id, attempt=job.attempt,
                                             path=f"/ckpt/{job_id}/{step}", step=step))

    async def complete(self, job_id: str, exit_code: int = 0) -> None:
        job = self.state.jobs[job_id]
        await self.append(ev.JobCompleted(at=time.time(), job_id=job_id, attempt=job.attempt, exit_code=exit_code))


@pytest.fixture
async def harness(nats_url, redis_url, tmp_path):
    h = Harness(nats_url, redis_url, tmp_path)
    await h.open()
    try:
        yield h
    finally:
        await h.close()
    # The audit: the whole log, folded from scratch, breaks no invariant and folds the same.
    from gpusched.cli.replay import rebuild

    state = await rebuild(nats_url)
    if state.violations():
        first = state.violations()[0].seq
        log = await EventLog.open(nats_url, name="e2e-audit")
        until = min(first + 3, await log.last_seq())  # records() waits for a sequence past the end
        around = [f"{rec.seq} {rec.subject} {rec.event}" async for rec in log.records(max(1, first - 8), until)]
        await log.close()
        raise AssertionError(f"{state.violations()}\naround the first:\n" + "\n".join(around))
    again = await rebuild(nats_url)
    assert again.summary() == state.summary()
    from gpusched.cli.replay import audit_stream
    from gpusched.security.audit import Audit

    audit = Audit(keyring.load(Path(os.environ["GPUSCHED_IDENTITY_DIR"]).parent / "keys.json"), allow_unsigned=True)
    await audit_stream(nats_url, audit)
    assert audit.findings == [], audit.findings[:5]
