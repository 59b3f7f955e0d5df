"""Random faults over the whole lab stack (`gpusched lab drill --stack`), with a verdict from the
log and from the OS: each run submits a short job, injects one fault of a random kind on random
hosts for a random time, heals it, and waits until the cluster is whole again (every NATS server
ready with one meta leader, every node registered and not lost), then cancels the job (so
it ran through the fault, and the cluster does not fill up). Meanwhile a census thread
samples every node host's processes every 0.2 s. The verdict: every acknowledged submit is a job
in the log, no job ran on two hosts at once, `replay --verify` is clean, every run recovered.

Faults: a node host cut off from everything, or from the control plane only; the NATS meta
leader cut off from its peers (a minority its clients still reach); a service host cut off; a
one-way cut between two random hosts; flapping (a random host cut and healed three times); a
NATS server, a service or a node agent killed -9 and started again."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from .stack import GROUPS, LabStack

KINDS = ("node-cut", "node-control-cut", "leader-minority", "service-host-cut", "one-way", "flapping",
         "kill-nats", "kill-service", "kill-node")


#: Every drill job's command line starts so (then its own run number): what the census looks for.
MARK = "sleep 600."


class Census:
    """Which node hosts run a process of each job, every 0.2 s, in a thread."""

    def __init__(self, stack: LabStack):
        self.stack = stack
        self.markers: dict[str, str] = {}  # job id -> the unique text of its command line
        self.doubles: dict[str, int] = {}  # job id -> samples with its process on two hosts or more
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            markers = dict(self.markers)
            seen: dict[str, set[str]] = {}
            for host in self.stack.nodes:
                for cmd in self.stack.job_commands(host, MARK).values():
                    for job, marker in markers.items():
                        if marker in cmd:
                            seen.setdefault(job, set()).add(host)
            for job, hosts in seen.items():
                if len(hosts) > 1:
                    self.doubles[job] = self.doubles.get(job, 0) + 1
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _inject(stack: LabStack, kind: str, rng: random.Random, hold_s: float) -> str:
    """Inject one fault, hold it, heal it; the victims, in words."""
    lab, nats = stack.lab, stack.nats
    control = [*nats.names, *GROUPS, "client"]
    if kind in ("node-cut", "node-control-cut"):
        victim = rng.choice(stack.nodes)
        lab.isolate(victim, None if kind == "node-cut" else control)
    elif kind == "leader-minority":
        victim = nats.meta_leader(nats.names[0]) or rng.choice(nats.names)
        lab.isolate(victim, [n for n in nats.names if n != victim])
    elif kind == "service-host-cut":
        victim = rng.choice(list(GROUPS))
        lab.isolate(victim)
    elif kind == "one-way":
        a, b = rng.sample(sorted(lab.hosts), 2)
        victim = f"{a}->{b}"
        lab.cut(a, b, one_way=True)
    elif kind == "flapping":
        victim = rng.choice(sorted(lab.hosts))
        for _ in range(3):
            lab.isolate(victim)
            time.sleep(hold_s / 6)
            lab.heal()
            time.sleep(hold_s / 6)
        return victim
    else:
        victim = rng.choice({"kill-nats": nats.names, "kill-service": [s for g in GROUPS.values() for s in g],
                             "kill-node": stack.nodes}[kind])
        procs = nats.procs if kind == "kill-nats" else stack.procs
        procs[victim].kill()
        procs[victim].wait(10)
        time.sleep(hold_s)
        if kind == "kill-nats":
            nats.start(victim)
        else:
            stack.restart(victim)
        return victim
    time.sleep(hold_s)
    lab.heal()
    return victim


def _whole(stack: LabStack) -> bool:
    nats = stack.nats
    if not all(nats.ready(n) for n in nats.names) or len({nats.meta_leader(n) for n in nats.names}) != 1:
        return False
    docs = stack.node_docs()
    return len(docs) >= len(stack.nodes) and not any(d.get("lost") for d in docs)


def _submit(stack: LabStack, census: Census, i: int, rng: random.Random) -> str | None:
    """A job that runs through the fault (it is cancelled after), once it runs (15 s at most)."""
    marker = f"{MARK}{i:04d}"
    done = stack.gpusched("submit", "--team", "t", "--gpus", str(rng.choice((1, 2))), "--chdir", "/",
                          "--", *marker.split(), timeout=20)
    if done.returncode != 0:
        return None  # not acknowledged (a fault on its path): nothing was promised
    job = done.stdout.strip().split()[-1]
    census.markers[job] = marker
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not any(j["job_id"] == job and j["state"] == "running"
                                                  for j in stack.jobs()):
        time.sleep(0.3)
    return job


def run(stack: LabStack, runs: int, seed: int = 1, hold_s: tuple[float, float] = (1.0, 12.0),
        recover_s: float = 90.0, say: Callable[[str], None] = lambda line: None) -> dict:
    """`runs` random faults; the verdict (JSON-able)."""
    rng = random.Random(seed)
    census = Census(stack)
    acked: list[str] = []
    results: list[dict[str, Any]] = []
    try:
        for i in range(runs):
            job = _submit(stack, census, i, rng)
            if job:
                acked.append(job)
            kind, hold = rng.choice(KINDS), round(rng.uniform(*hold_s), 2)
            t0 = time.monotonic()
            victim = _inject(stack, kind, rng, hold)
            t_heal = time.monotonic()
            try:
                recovered = stack.nats.wait(lambda: _whole(stack), recover_s, step=0.5)
            except TimeoutError:
                recovered = None
            results.append({"run": i, "kind": kind, "victim": victim, "hold_s": hold, "job": job,
                            "recovery_s": None if recovered is None else round(recovered, 2),
                            "fault_to_whole_s": round(time.monotonic() - t0, 2), "healed_at_s": round(t_heal - t0, 2)})
            say(json.dumps(results[-1]))
            if job:
                stack.gpusched("cancel", job, timeout=20)
    finally:
        stack.lab.heal()
        census.stop()
    in_log = {j["job_id"] for j in stack.jobs()}
    verify = stack.gpusched("replay", "--verify", "--keys", str(stack.secrets / "trust" / "keys.json"), timeout=120)
    lost = [j for j in acked if j not in in_log]
    by_kind: dict[str, list[float]] = {}
    for r in results:
        if r["recovery_s"] is not None:
            by_kind.setdefault(r["kind"], []).append(r["recovery_s"])
    return {
        "ok": not lost and not census.doubles and verify.returncode == 0 and all(r["recovery_s"] is not None
                                                                                 for r in results),
        "runs": runs, "seed": seed, "acknowledged_submits": len(acked), "lost_submits": lost,
        "double_running": census.doubles, "replay_verify": verify.returncode == 0,
        "replay_verify_tail": (verify.stdout + verify.stderr)[-600:] if verify.returncode else "",
        "not_recovered": [r for r in results if r["recovery_s"] is None],
        "recovery_p50_s": {k: sorted(v)[len(v) // 2] for k, v in by_kind.items()},
        "recovery_max_s": {k: max(v) for k, v in by_kind.items()},
        "results": results,
    }
