"""`gpusched chaos`: fault drills with a verdict, against a stack that `gpusched up` runs.

By default it starts its own stack (`up --nats-cluster 3` in a temporary data dir, restarts
after 0.5 s), keeps a load of short jobs flowing through admission, and runs each drill:

- `service:NAME`  kill -9 of one service at a random moment (`service` = every service, in turn)
- `leader`        kill -9 of the NATS server leading the log's stream
- `follower`      kill -9 of a NATS server replicating it
- `nats-all`      kill -9 of every NATS server at once (`up` starts them again: a whole-cluster restart)
- `redis`         kill -9 of Redis; it comes back empty (no persistence): lost and wiped
- `redis-flush`   FLUSHALL on the running Redis (wiped, not lost)
- `nodeagent`     kill -9 of the node agent process (every simulated node's daemon)
- `partition`     SIGSTOP of one NATS server (its routes go silent), SIGCONT after `--partition-s`

After each drill a probe job is submitted (retried with the same request id until admission
answers) and timed until it is granted: the recovery time. The verdict, over the whole log
after every drill: every acknowledged submit is a job in the log (0 lost), no GPU granted
twice, no two live copies of a job, no broken invariant and no trust finding on the same
checks as `replay --verify`. `--attach DATA` drills a running `up` instead (its stack.json).
Exit code 0: every verdict clean.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpusched.bus.client import Client, ControlPlaneUnavailable
from gpusched.bus.log import EventLog
from gpusched.core.commands import SubmitJob
from gpusched.core.model import JobSpec
from gpusched.core.state import ClusterState

DRILLS = ("service", "leader", "follower", "nats-all", "redis", "redis-flush", "nodeagent", "partition")
SIZES = (1, 1, 1, 2, 2, 4)


@dataclass
class Target:
    """A running stack, as its stack.json says (read again for each drill: pids change)."""

    data_dir: Path

    def state(self) -> dict:
        return json.loads((self.data_dir / "stack.json").read_text())

    @property
    def nats(self) -> str:
        return self.state()["nats"]

    @property
    def creds(self) -> str | None:
        return self.state().get("admin_creds")

    def pid(self, name: str) -> int:
        s = self.state()
        return s["services"].get(name) or s["servers"][name]

    def nats_pids(self) -> dict[str, int]:
        """Stream peer name (`gpusched-<i>`, or `gpusched` alone) -> pid."""
        servers = self.state()["servers"]
        return {("gpusched-" + n.split("-")[1]) if "-" in n else "gpusched": pid
                for n, pid in servers.items() if n.startswith("nats")}


@dataclass
class Load:
    """Short jobs submitted at `rate`/s through admission; a submit counts as acknowledged only
    when admission answered ok (a timed-out one is sent again with the same request id)."""

    client: Client
    jobs: int
    rate: float
    duration_s: float
    rng: random.Random
    acked: dict[str, str] = field(default_factory=dict)  # request id -> job id
    unanswered: int = 0
    refused: dict[str, str] = field(default_factory=dict)  # request id -> admission's reason

    def spec(self, i: int) -> JobSpec:
        return JobSpec(team=f"t{i % 4}", gpus=self.rng.choice(SIZES),
                       env={"GPUSCHED_SIM_DURATION_S": f"{self.duration_s:g}"}, name=f"chaos-{i}")

    async def send(self, request_id: str, spec: JobSpec, deadline: float) -> str | None:
        while time.monotonic() < deadline:
            try:
                reply = await self.client.send(SubmitJob(request_id=request_id, spec=spec))
            except (ControlPlaneUnavailable, TimeoutError, OSError):
                await asyncio.sleep(0.2)
                continue
            if reply.ok:
                self.acked[request_id] = reply.job_id
                return reply.job_id
            if str(reply.error).startswith(("internal error", "event log unavailable")):  # between leaders: retry
                await asyncio.sleep(0.2)
                continue
            self.refused[request_id] = str(reply.error)
            return None
        self.unanswered += 1
        return None

    async def run(self) -> None:
        pending: set[asyncio.Task] = set()
        t0 = time.monotonic()
        for i in range(self.jobs):
            await asyncio.sleep(max(0.0, t0 + i / self.rate - time.monotonic()))
            task = asyncio.create_task(self.send(f"chaos-{i}", self.spec(i), time.monotonic() + 60))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending)


class Fold:
    """The log folded as it grows (this process is admin: it reconnects through any outage)."""

    def __init__(self, log: EventLog):
        self.log, self.state = log, ClusterState()

    async def sync(self) -> ClusterState:
        last = await self.log.last_seq()
        if last > self.state.last_seq:
            async for seq, event in self.log.replay(self.state.last_seq + 1, last):
                self.state.apply(event, seq)
        return self.state


@dataclass
class Result:
    drill: str
    recovery_s: float | None
    lost: int
    double_booked: int
    duplicate_processes: int
    violations: int
    findings: int
    acked: int

    @property
    def clean(self) -> bool:
        bad = (self.lost, self.double_booked, self.duplicate_processes, self.violations, self.findings)
        return self.recovery_s is not None and not any(bad)


# --- the faults ---------------------------------------------------------------------------------


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


async def stream_peers(log: EventLog) -> tuple[str | None, list[str]]:
    """(leader, followers) of the log's stream: server names."""
    from gpusched.bus import subjects

    info = await asyncio.wait_for(log.js.stream_info(subjects.STREAM), 10)
    if info.cluster is None:
        return None, []
    return info.cluster.leader, [p.name for p in info.cluster.replicas or []]


async def inject(drill: str, target: Target, log: EventLog, rng: random.Random, partition_s: float) -> str:
    """Do the fault; return what was hit."""
    kind, _, name = drill.partition(":")
    if kind == "service" or kind == "nodeagent":
        name = name or "nodeagent"
        _kill(target.pid(name))
        return name
    if kind in ("leader", "follower"):
        leader, followers = await stream_peers(log)
        victim = leader if kind == "leader" else (rng.choice(followers) if followers else None)
        if victim is None:
            raise RuntimeError(f"drill {drill}: the log's stream has no {kind} (one NATS server?)")
        _kill(target.nats_pids()[victim])
        return victim
    if kind == "nats-all":
        for pid in target.nats_pids().values():
            _kill(pid)
        return "every NATS server"
    if kind == "redis":
        _kill(target.pid("redis"))
        return "redis"
    if kind == "redis-flush":
        import redis

        client = redis.Redis.from_url(target.state()["redis"])
        client.flushall()
        client.close()
        return "redis"
    if kind == "partition":
        victim, pid = rng.choice(sorted(target.nats_pids().items()))
        _kill(pid, signal.SIGSTOP)
        asyncio.get_running_loop().call_later(partition_s, _kill, pid, signal.SIGCONT)
        return victim
    raise ValueError(f"unknown drill {drill!r}; known: {', '.join(DRILLS)}")


# --- the verdict --------------------------------------------------------------------------------


async def probe(load: Load, fold: Fold, tag: str, timeout: float) -> float | None:
    """Seconds from now until a fresh 1-GPU job is granted (None: not within `timeout`)."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    spec = JobSpec(team="probe", gpus=1, env={"GPUSCHED_SIM_DURATION_S": "1"}, name=tag)
    job = await load.send(tag, spec, deadline)
    while job is not None and time.monotonic() < deadline:
        try:
            state = await asyncio.wait_for(fold.sync(), max(0.1, deadline - time.monotonic()))
        except (TimeoutError, OSError):
            continue
        j = state.jobs.get(job)
        if j is not None and j.state not in ("pending",):
            return time.monotonic() - t0
        await asyncio.sleep(0.1)
    return None


async def verdict(target: Target, load: Load, drill: str, recovery_s: float | None, tries: int = 6) -> Result:
    """The whole log, as `replay --verify` checks it, against the submits admission acknowledged.
    A read that times out (the cluster still electing after the fault) is read again."""
    from nats.errors import Error as NatsError

    from gpusched.cli.replay import audit_stream
    from gpusched.security import keyring
    from gpusched.security.audit import Audit

    for attempt in range(tries):
        audit = Audit(keyring.load(target.data_dir / "trust" / "keys.json"))
        try:
            await asyncio.wait_for(audit_stream(target.nats, audit), 60)
            break
        except (TimeoutError, NatsError):
            if attempt == tries - 1:
                raise
            await asyncio.sleep(2.0)
    state = audit.state
    rules = [v.rule for v in state.violations()]
    lost = [j for j in load.acked.values() if j not in state.jobs]
    return Result(drill, recovery_s, len(lost), rules.count("double_booking"), rules.count("two_live_attempts"),
                  len(rules), len(audit.findings), len(load.acked))


# --- the stack ----------------------------------------------------------------------------------


def start_stack(data: Path, nodes: int, cluster: int, gpus: int) -> subprocess.Popen:
    """`gpusched up` for the drills: its own data dir, any free ports, quick restarts."""
    argv = [sys.executable, "-m", "gpusched.cli.main", "up", "--data-dir", str(data), "--fresh",
            "--nats-cluster", str(cluster), "--nodes", str(nodes), "--gpus-per-node", str(gpus),
            "--nats-port", "0", "--redis-port", "0", "--dashboard-port", "0", "--restart-delay", "0.5",
            "--no-client-config", "--ready-timeout", "180"]
    env = {k: v for k, v in os.environ.items() if k not in ("GPUSCHED_NATS_URL", "GPUSCHED_REDIS_URL")}
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                          start_new_session=True)
    line = up.stdout.readline() if up.stdout is not None else ""
    if not line.startswith("gpusched up: ready"):
        up.kill()
        up.wait()
        logs = data / "logs"
        raise RuntimeError(f"gpusched up did not start (logs in {logs}): {line.strip()}")
    return up


def stop_stack(up: subprocess.Popen) -> None:
    up.send_signal(signal.SIGTERM)
    try:
        up.wait(timeout=60)
    except subprocess.TimeoutExpired:
        up.kill()
        up.wait()


def expand(drills: str, services: list[str]) -> list[str]:
    out = []
    for d in (x.strip() for x in drills.split(",") if x.strip()):
        if d == "service":
            out += [f"service:{s}" for s in services if s not in ("nodeagent", "dashboard")]
        else:
            out.append(d)
    return out


async def drill_all(target: Target, args: argparse.Namespace) -> tuple[list[Result], Load]:
    """Run the load and, meanwhile, each drill `--runs` times at random moments."""
    rng = random.Random(args.seed)
    creds = target.creds
    if creds:
        os.environ["GPUSCHED_CREDS"] = creds  # the stack's admin: the verdict's replay reads as it
    client = await Client.connect(target.nats, timeout=5.0, name="gpusched-chaos", creds=creds)
    log = await EventLog.open(target.nats, name="gpusched-chaos", creds=creds)
    load = Load(client, args.jobs, args.rate, args.job_s, rng)
    fold = Fold(log)
    results: list[Result] = []
    loading = asyncio.create_task(load.run())
    try:
        plan = expand(args.drills, list(target.state()["services"])) * args.runs
        for n, drill in enumerate(plan):
            await asyncio.sleep(rng.uniform(0.2, args.gap_s))  # a random moment of the load
            hit = await inject(drill, target, log, rng, args.partition_s)
            recovery = await probe(load, fold, f"probe-{n}-{drill.replace(':', '-')}", args.recovery_timeout_s)
            await asyncio.sleep(args.settle_s)
            result = await verdict(target, load, drill, recovery)
            results.append(result)
            report_line(result, hit, args.json)
        await loading
        results.append(await verdict(target, load, "final", 0.0))
    finally:
        loading.cancel()
        await client.close()
        await log.close()
    return results, load


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def report_line(r: Result, hit: str, as_json: bool) -> None:
    if as_json:
        return
    rec = "NOT RECOVERED" if r.recovery_s is None else f"recovered in {r.recovery_s:.2f} s"
    print(f"{'ok  ' if r.clean else 'FAIL'} {r.drill:22s} ({hit}): {rec}; acked {r.acked}, lost {r.lost}, "
          f"double-booked {r.double_booked}, duplicate processes {r.duplicate_processes}, "
          f"violations {r.violations}, trust findings {r.findings}", flush=True)


def summary(results: list[Result]) -> dict:
    by: dict[str, list[Result]] = {}
    for r in results:
        by.setdefault(r.drill.split(":")[0] if r.drill.startswith("service") else r.drill, []).append(r)
    out = {}
    for drill, rs in by.items():
        times = [r.recovery_s for r in rs if r.recovery_s is not None]
        out[drill] = {"runs": len(rs), "clean": sum(r.clean for r in rs), "unrecovered": len(rs) - len(times),
                      "recovery_p50_s": round(pct(times, 50), 2) if times else None,
                      "recovery_p99_s": round(pct(times, 99), 2) if times else None,
                      "lost": max(r.lost for r in rs), "double_booked": max(r.double_booked for r in rs),
                      "duplicate_processes": max(r.duplicate_processes for r in rs),
                      "violations": max(r.violations for r in rs), "findings": max(r.findings for r in rs)}
    return out


def cmd_chaos(args: argparse.Namespace) -> int:
    own = args.attach is None
    data = Path(args.attach) if args.attach else Path(tempfile.mkdtemp(prefix="gpusched-chaos-"))
    up = start_stack(data, args.nodes, args.nats_cluster, args.gpus_per_node) if own else None
    try:
        results, load = asyncio.run(drill_all(Target(data), args))
    finally:
        if up is not None:
            stop_stack(up)
    table = summary(results)
    if args.json:
        print(json.dumps({"drills": table, "acked": results[-1].acked, "refused": load.refused,
                          "unanswered": load.unanswered}, indent=2))
    else:
        for drill, row in table.items():
            print(f"{drill:14s} runs {row['runs']:3d} clean {row['clean']:3d}  recovery p50 {row['recovery_p50_s']} s "
                  f"p99 {row['recovery_p99_s']} s  lost {row['lost']}  double-booked {row['double_booked']}  "
                  f"duplicates {row['duplicate_processes']}  violations {row['violations']}")
    if load.refused and not args.json:
        print(f"refused by admission: {len(load.refused)} (first: {next(iter(load.refused.values()))})")
    return 0 if all(r.clean for r in results) and not load.refused else 1


def register(sub) -> None:
    p = sub.add_parser("chaos", help="fault drills with a verdict (kills services, NATS, Redis under load)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--attach", default=None, metavar="DATA",
                   help="drill the running `gpusched up` of this data dir (default: start one of its own)")
    p.add_argument("--nodes", type=int, default=128, help="simulated nodes of its own stack (default 128)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per simulated node of its own stack")
    p.add_argument("--nats-cluster", type=int, default=3, help="NATS servers of its own stack (default 3)")
    p.add_argument("--jobs", type=int, default=1000, help="jobs of the load (default 1000)")
    p.add_argument("--rate", type=float, default=20.0, help="submits per second (default 20)")
    p.add_argument("--job-s", type=float, default=3.0, help="how long each simulated job runs (default 3)")
    p.add_argument("--drills", default=",".join(DRILLS),
                   help=f"comma-separated, in order: {', '.join(DRILLS)}, service:NAME (default: all)")
    p.add_argument("--runs", type=int, default=1, help="repeat the whole list this many times (default 1)")
    p.add_argument("--gap-s", type=float, default=3.0, help="a drill strikes within this many seconds (default 3)")
    p.add_argument("--settle-s", type=float, default=1.0, help="wait after recovery before the verdict")
    p.add_argument("--partition-s", type=float, default=5.0, help="how long a NATS server stays stopped")
    p.add_argument("--recovery-timeout-s", type=float, default=60.0,
                   help="a drill not recovered by then is a failed verdict (default 60)")
    p.add_argument("--seed", type=int, default=1, help="seed of the random moments and victims")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_chaos)
