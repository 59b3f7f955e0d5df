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

The load's jobs are real processes (`sleep`) on the simulated nodes, so that a job running
twice shows in the OS: every 0.2 s the tool lists the stack's job processes in /proc (those
whose control directory lies in the stack's data dir) and counts a duplicate when one job has
two launchers for the same node rank, or launchers of two attempts, alive at once. The load
keeps flowing (at least `--jobs` submits) until the last drill is judged.

After each drill a probe job is submitted (retried with the same request id until admission
answers) and timed until its node agent reports it running: the recovery time. The verdict, over the whole log
after every drill: every acknowledged submit is a job in the log (0 lost), no GPU granted
twice, no duplicate job process in the OS since the previous verdict, no broken invariant
and no trust finding on the same checks as `replay --verify`. `--attach DATA` drills a
running `up` instead (its stack.json). Exit code 0: every verdict clean.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpusched.bus.control_client import Client, ControlPlaneUnavailable
from gpusched.bus.log import EventLog
from gpusched.core.commands import SubmitJob
from gpusched.core.model import JobSpec
from gpusched.core.state import ClusterState
from gpusched.job import env as E

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
    processes: bool = True  # jobs run `sleep` (an OS process); False: placeholders without one
    acked: dict[str, str] = field(default_factory=dict)  # request id -> job id
    unanswered: int = 0
    refused: dict[str, str] = field(default_factory=dict)  # request id -> admission's reason
    submitted: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)  # the drills are over: stop after `jobs`

    def spec(self, i: int, gpus: int | None = None, duration_s: float | None = None, team: str | None = None,
             name: str | None = None) -> JobSpec:
        seconds = f"{self.duration_s if duration_s is None else duration_s:g}"
        return JobSpec(team=team or f"t{i % 4}", gpus=gpus or self.rng.choice(SIZES),
                       command=["sleep", seconds] if self.processes else [],
                       env={"GPUSCHED_SIM_DURATION_S": seconds}, name=name or f"chaos-{i}")

    async def send(self, request_id: str, spec: JobSpec, deadline: float) -> str | None:
        while time.monotonic() < deadline:
            try:
                reply = await self.client.send(SubmitJob(request_id=request_id, spec=spec))
            except (ControlPlaneUnavailable, TimeoutError, OSError):
                await asyncio.sleep(0.2)
                continue
            if reply.ok and reply.job_id is not None:  # an accepted submit names its job
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
        """At least `jobs` submits at `rate`/s, and on until the drills are done."""
        pending: set[asyncio.Task] = set()
        t0 = time.monotonic()
        i = 0
        while i < self.jobs or not self.done.is_set():
            await asyncio.sleep(max(0.0, t0 + i / self.rate - time.monotonic()))
            task = asyncio.create_task(self.send(f"chaos-{i}", self.spec(i), time.monotonic() + 60))
            pending.add(task)
            task.add_done_callback(pending.discard)
            i += 1
            self.submitted = i
        if pending:
            await asyncio.wait(pending)


def _environ(pid: int, patience_s: float = 0.02) -> bytes:
    """A process's environment. It reads empty for a moment while an exec sets up the new image
    (a launcher that has just started), so an empty read is tried again, briefly."""
    deadline = time.monotonic() + patience_s
    while True:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
        if raw or time.monotonic() > deadline:
            return raw
        time.sleep(0.001)


class ProcessCensus:
    """The stack's job processes, counted in the OS: every `every` s, each process in /proc
    whose control directory lies under `work_dir` and that leads its process group (the
    launcher's wrapper, not the job's children) is listed by job, attempt and node rank. A job
    with two such processes for one node rank, or of two attempts, alive at once is a duplicate."""

    def __init__(self, work_dir: Path, every: float = 0.2):
        self.prefix = str(work_dir).rstrip("/") + "/"
        self.every = every
        self.seen: dict[str, list[tuple[str, str, int]]] = {}  # job -> (attempt, rank, pid) when caught
        self.reported: set[str] = set()
        self.samples = 0
        self.peak = 0  # the most job processes alive in one sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-census", daemon=True)

    def launchers(self) -> dict[str, list[tuple[str, str, int]]]:
        """job id -> [(attempt, node rank, pid)] of its live launchers, now."""
        out: dict[str, list[tuple[str, str, int]]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            try:
                raw = _environ(pid) if os.getpgid(pid) == pid else b""  # launchers lead their group
            except OSError:  # gone, or not ours to read
                continue
            if b"GPUSCHED_JOB_ID=" not in raw:
                continue
            env = dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)
            if not env.get(E.CONTROL_DIR.encode(), b"").decode(errors="replace").startswith(self.prefix):
                continue  # another stack's job
            job = env[E.JOB_ID.encode()].decode(errors="replace")
            out.setdefault(job, []).append((env.get(E.ATTEMPT.encode(), b"?").decode(),
                                            env.get(E.NODE_RANK.encode(), b"?").decode(), pid))
        return out

    def sample(self) -> None:
        live = self.launchers()
        self.samples += 1
        self.peak = max(self.peak, sum(len(v) for v in live.values()))
        for job, procs in live.items():
            keys = [(attempt, rank) for attempt, rank, _ in procs]
            if len(set(keys)) < len(keys) or len({a for a, _ in keys}) > 1:
                self.seen.setdefault(job, procs)

    def take(self) -> int:
        """Jobs caught running twice since the last call."""
        new = set(self.seen) - self.reported
        self.reported |= new
        return len(new)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a census round that failed is retried next round
                continue

    def start(self) -> ProcessCensus:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def reap(self) -> int:
        """SIGKILL every job process of the stack still alive (after the stack stopped)."""
        pids = [pid for procs in self.launchers().values() for _, _, pid in procs]
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        return len(pids)


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
    rules: dict[str, int] = field(default_factory=dict)  # violated invariant -> count
    lost_requests: list[str] = field(default_factory=list)  # request ids acknowledged, not in the log

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
    """(leader, followers) of the log's stream: server names (asked again while the cluster
    answers 503 or not at all, as it does for a while after the previous fault)."""
    from nats.errors import Error as NatsError

    from gpusched.bus import subjects

    for attempt in range(10):
        try:
            info = await asyncio.wait_for(log.js.stream_info(subjects.STREAM), 10)
            break
        except (TimeoutError, NatsError):
            if attempt == 9:
                raise
            await asyncio.sleep(1.0)
    if info.cluster is None:
        return None, []
    return info.cluster.leader, [p.name for p in info.cluster.replicas or [] if p.name is not None]


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
    """Seconds from now until a fresh 1-GPU job runs (None: not within `timeout`): the whole path
    of a job, admission, placement and the node agent, works again."""
    from nats.errors import Error as NatsError

    t0 = time.monotonic()
    deadline = t0 + timeout
    spec = load.spec(0, gpus=1, duration_s=1.0, team="probe", name=tag)
    job = await load.send(tag, spec, deadline)
    while job is not None and time.monotonic() < deadline:
        try:
            state = await asyncio.wait_for(fold.sync(), max(0.1, deadline - time.monotonic()))
        except (TimeoutError, OSError, NatsError):  # e.g. 503 "JetStream temporarily unavailable" mid-election
            await asyncio.sleep(0.2)
            continue
        j = state.jobs.get(job)
        if j is not None and j.state not in ("pending", "starting"):  # its node agent runs it
            return time.monotonic() - t0
        await asyncio.sleep(0.1)
    return None


async def verdict(target: Target, load: Load, census: ProcessCensus, drill: str, recovery_s: float | None,
                  tries: int = 6) -> Result:
    """The whole log, as `replay --verify` checks it, against the submits admission acknowledged,
    and the OS's job processes since the last verdict. A read that times out (the cluster still
    electing after the fault) is read again."""
    from nats.errors import Error as NatsError

    from gpusched.cli.replay import audit_stream
    from gpusched.security import keyring
    from gpusched.security.audit import Audit

    for attempt in range(tries):
        audit = Audit(keyring.load(target.data_dir / "trust" / "keys.json"))
        # Acknowledged before the read starts, so in the log it reads up to its end: a submit
        # acknowledged meanwhile may lie past that end, and is judged by the next verdict.
        acked = dict(load.acked)
        try:
            await asyncio.wait_for(audit_stream(target.nats, audit, creds=target.creds), 60)
            break
        except (TimeoutError, NatsError):
            if attempt == tries - 1:
                raise
            await asyncio.sleep(2.0)
    state = audit.state
    rules = [v.rule for v in state.violations()]
    lost = sorted(rid for rid, j in acked.items() if j not in state.jobs)
    return Result(drill, recovery_s, len(lost), rules.count("double_booking"), census.take(),
                  len(rules), len(audit.findings), len(acked), {r: rules.count(r) for r in sorted(set(rules))},
                  lost[:20])


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


def expand(drills: str, services: list[str], rng: random.Random | None = None) -> list[str]:
    """The drill list: `service` is every service in turn (not the node agent, which has its own
    drill, nor the dashboard), `service:any` one picked at random (with `rng`) for each run."""
    killable = [s for s in services if s not in ("nodeagent", "dashboard")]
    out = []
    for d in (x.strip() for x in drills.split(",") if x.strip()):
        if d == "service":
            out += [f"service:{s}" for s in killable]
        elif d == "service:any":
            out.append(f"service:{(rng or random.Random()).choice(killable)}")
        else:
            out.append(d)
    return out


async def drill_all(target: Target, args: argparse.Namespace, census: ProcessCensus) -> tuple[list[Result], Load]:
    """Run the load and, meanwhile, each drill `--runs` times at random moments."""
    rng = random.Random(args.seed)
    creds = target.creds  # the stack's admin: the load, the drills and the verdict's replay act as it
    client = await Client.connect(target.nats, timeout=5.0, name="gpusched-chaos", creds=creds)
    log = await EventLog.open(target.nats, name="gpusched-chaos", creds=creds)
    load = Load(client, args.jobs, args.rate, args.job_s, rng, processes=not args.placeholders)
    fold = Fold(log)
    results: list[Result] = []
    loading = asyncio.create_task(load.run())
    try:
        services = list(target.state()["services"])
        plan = [d for _ in range(args.runs) for d in expand(args.drills, services, rng)]
        for n, drill in enumerate(plan):
            await asyncio.sleep(rng.uniform(0.2, args.gap_s))  # a random moment of the load
            hit = await inject(drill, target, log, rng, args.partition_s)
            recovery = await probe(load, fold, f"probe-{n}-{drill.replace(':', '-')}", args.recovery_timeout_s)
            await asyncio.sleep(args.settle_s)
            result = await verdict(target, load, census, drill, recovery)
            results.append(result)
            report_line(result, hit, load, args.json)
        load.done.set()
        await loading
        await asyncio.sleep(args.settle_s)
        results.append(await verdict(target, load, census, "final", 0.0))
    finally:
        loading.cancel()
        await client.close()
        await log.close()
    return results, load


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def report_line(r: Result, hit: str, load: Load, as_json: bool) -> None:
    if as_json:
        return
    rec = "NOT RECOVERED" if r.recovery_s is None else f"recovered in {r.recovery_s:.2f} s"
    print(f"{'ok  ' if r.clean else 'FAIL'} {r.drill:22s} ({hit}): {rec}; submitted {load.submitted}, "
          f"acked {r.acked}, lost {r.lost}" + (f" (requests {', '.join(r.lost_requests[:3])})" if r.lost else "") + ", "
          f"double-booked {r.double_booked}, duplicate processes {r.duplicate_processes}, "
          f"violations {r.violations}{_rules(r.rules)}, trust findings {r.findings}", flush=True)


def _rules(rules: dict[str, int]) -> str:
    return f" ({', '.join(f'{k} {v}' for k, v in rules.items())})" if rules else ""


def summary(results: list[Result]) -> dict:
    """Per drill (each service on its own, and every service kill together as `service`)."""
    by: dict[str, list[Result]] = {}
    for r in results:
        by.setdefault(r.drill, []).append(r)
        if r.drill.startswith("service:"):
            by.setdefault("service", []).append(r)
    out = {}
    for drill, rs in by.items():
        times = [r.recovery_s for r in rs if r.recovery_s is not None]
        out[drill] = {"runs": len(rs), "clean": sum(r.clean for r in rs), "unrecovered": len(rs) - len(times),
                      "recovery_p50_s": round(pct(times, 50), 2) if times else None,
                      "recovery_p99_s": round(pct(times, 99), 2) if times else None,
                      "recovery_max_s": round(max(times), 2) if times else None,
                      "lost": max(r.lost for r in rs), "double_booked": max(r.double_booked for r in rs),
                      "duplicate_processes": sum(r.duplicate_processes for r in rs),
                      "violations": max(r.violations for r in rs), "findings": max(r.findings for r in rs),
                      "rules": max((r.rules for r in rs), key=lambda x: sum(x.values())),
                      "lost_requests": sorted({rid for r in rs for rid in r.lost_requests})[:20]}
    return out


def cmd_chaos(args: argparse.Namespace) -> int:
    own = args.attach is None
    data = Path(args.attach) if args.attach else Path(tempfile.mkdtemp(prefix="gpusched-chaos-"))
    up = start_stack(data, args.nodes, args.nats_cluster, args.gpus_per_node) if own else None
    census = ProcessCensus(data / "work").start()
    t0 = time.monotonic()
    try:
        results, load = asyncio.run(drill_all(Target(data), args, census))
    finally:
        census.stop()
        if up is not None:
            stop_stack(up)
            census.reap()  # a job a drill left behind must not outlive the tool's own stack
    table = summary(results)
    facts = {"submitted": load.submitted, "acked": results[-1].acked, "refused": load.refused,
             "unanswered": load.unanswered, "census_samples": census.samples, "peak_job_processes": census.peak,
             "duplicates": census.seen, "wall_s": round(time.monotonic() - t0, 1)}
    if args.json:
        print(json.dumps({"drills": table, **facts}, indent=2))
    else:
        print_table(table, facts)
    clean = all(r.clean for r in results) and not load.refused
    if own and clean:
        shutil.rmtree(data, ignore_errors=True)
    elif own:
        print(f"the stack's data dir (logs, log store) is kept: {data}", file=sys.stderr)
    return 0 if clean else 1


def print_table(table: dict, facts: dict) -> None:
    for drill, row in table.items():
        print(f"{drill:24s} runs {row['runs']:3d} clean {row['clean']:3d}  recovery p50 {row['recovery_p50_s']} s "
              f"p99 {row['recovery_p99_s']} s  lost {row['lost']}  double-booked {row['double_booked']}  "
              f"duplicate processes {row['duplicate_processes']}  violations {row['violations']}{_rules(row['rules'])}  "
              f"trust findings {row['findings']}")
    print(f"submitted {facts['submitted']}, acknowledged {facts['acked']}, unanswered {facts['unanswered']}; "
          f"job processes counted in {facts['census_samples']} samples (peak {facts['peak_job_processes']}); "
          f"{facts['wall_s']} s")
    if facts["refused"]:
        print(f"refused by admission: {len(facts['refused'])} (first: {next(iter(facts['refused'].values()))})")
    for job, procs in facts["duplicates"].items():
        print(f"DUPLICATE {job}: launchers (attempt, rank, pid) {procs}")


def register(sub) -> None:
    p = sub.add_parser("chaos", help="fault drills with a verdict (kills services, NATS, Redis under load)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--attach", default=None, metavar="DATA",
                   help="drill the running `gpusched up` of this data dir (default: start one of its own)")
    p.add_argument("--nodes", type=int, default=128, help="simulated nodes of its own stack (default 128)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per simulated node of its own stack")
    p.add_argument("--nats-cluster", type=int, default=3, help="NATS servers of its own stack (default 3)")
    p.add_argument("--jobs", type=int, default=1000,
                   help="jobs of the load, at least (it keeps flowing until the last drill; default 1000)")
    p.add_argument("--rate", type=float, default=20.0, help="submits per second (default 20)")
    p.add_argument("--job-s", type=float, default=3.0, help="how long each job runs (default 3)")
    p.add_argument("--placeholders", action="store_true",
                   help="jobs without an OS process (the duplicate-process census then sees nothing; "
                        "default: each job runs `sleep`)")
    p.add_argument("--drills", default=",".join(DRILLS),
                   help=f"comma-separated, in order: {', '.join(DRILLS)}, service:NAME, service:any "
                        "(default: all)")
    p.add_argument("--runs", type=int, default=1, help="repeat the whole list this many times (default 1)")
    p.add_argument("--gap-s", type=float, default=3.0, help="a drill strikes within this many seconds (default 3)")
    p.add_argument("--settle-s", type=float, default=1.0, help="wait after recovery before the verdict")
    p.add_argument("--partition-s", type=float, default=5.0, help="how long a NATS server stays stopped")
    p.add_argument("--recovery-timeout-s", type=float, default=60.0,
                   help="a drill not recovered by then is a failed verdict (default 60)")
    p.add_argument("--seed", type=int, default=1, help="seed of the random moments and victims")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_chaos)
