"""`gpusched lab`: the deployed NATS cluster on separate network hosts of this machine, and
fault drills between them with a verdict.

`gpusched lab up [--hosts N]` starts three NATS hosts (deploy/k8s/nats-cluster.conf with
make-secrets.sh's certificates and users, TLS and auth on) and N more empty hosts, prints each
host's namespace and address, and runs until Ctrl-C; then (or when killed) it removes every
namespace, link and rule it made. `gpusched lab drill [--runs N] [--json]` repeats the drills
(leader cut off from its peers, a one-way cut, flapping, a NATS host killed -9) and prints each
kind's recovery time p50/p99: from the fault (or the heal) until every server's readiness probe
(deploy/k8s/nats.yaml's) passes again with one meta leader; `--stack` drills the whole deployed
stack with random faults instead (`lab/faults.py`). Root only (network namespaces)."""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from . import netns
from .cluster import NatsCluster, make_secrets


def _start(work: Path, hosts: int) -> NatsCluster:
    why = netns.available()
    if why:
        raise SystemExit(f"gpusched lab: {why}")
    lab = netns.Lab().up()
    cluster = NatsCluster(lab, work, make_secrets(work / "secrets", [f"node{i}" for i in range(max(1, hosts))]))
    cluster.add_hosts()
    for i in range(hosts):
        lab.add_host(f"host{i}")
    lab.write_hosts()
    cluster.start_all()
    cluster.wait(lambda: all(cluster.ready(n) for n in cluster.names), 60)
    return cluster


def _one_leader(c: NatsCluster) -> bool:
    leaders = {c.meta_leader(n) for n in c.names}
    return len(leaders) == 1 and all(c.ready(n) for n in c.names)


def drill(c: NatsCluster, kind: str, rng: random.Random, hold_s: float) -> dict:
    """One fault, healed; the seconds from the heal until the cluster is ready again."""
    leader = c.meta_leader(c.names[0]) or c.names[0]
    others = [n for n in c.names if n != leader]
    t_fault = time.monotonic()
    if kind == "leader-minority":
        c.lab.isolate(leader, others)
        detected = c.wait(lambda: c.meta_leader(others[0]) in others and all(c.ready(n) for n in others), 60)
    elif kind == "one-way":
        a, b = rng.sample(c.names, 2)
        c.lab.cut(a, b, one_way=True)
        time.sleep(hold_s)
        detected = None
    elif kind == "flapping":
        for _ in range(3):
            c.lab.isolate(rng.choice(c.names))
            time.sleep(hold_s / 3)
            c.lab.heal()
            time.sleep(hold_s / 3)
        detected = None
    elif kind == "kill-9":
        c.procs[leader].send_signal(signal.SIGKILL)
        c.procs[leader].wait()
        detected = c.wait(lambda: c.meta_leader(others[0]) in others and all(c.ready(n) for n in others), 60)
        c.start(leader)
    else:
        raise ValueError(kind)
    c.lab.heal()
    t_heal = time.monotonic()
    recovered = c.wait(lambda: _one_leader(c), 60)
    return {"kind": kind, "majority_ready_s": detected, "recovery_s": round(recovered, 3),
            "fault_to_ready_s": round(time.monotonic() - t_fault, 3), "healed_at_s": round(t_heal - t_fault, 3)}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def summary(results: list[dict]) -> dict:
    out: dict = {}
    for kind in dict.fromkeys(r["kind"] for r in results):
        rec = [r["recovery_s"] for r in results if r["kind"] == kind]
        maj = [r["majority_ready_s"] for r in results if r["kind"] == kind and r["majority_ready_s"] is not None]
        out[kind] = {"runs": len(rec), "recovery_p50_s": _pct(rec, 0.5), "recovery_p99_s": _pct(rec, 0.99),
                     "recovery_mean_s": round(statistics.fmean(rec), 3)}
        if maj:
            out[kind] |= {"majority_ready_p50_s": _pct(maj, 0.5), "majority_ready_p99_s": _pct(maj, 0.99)}
    return out


def cmd_stack_drill(args: argparse.Namespace) -> int:
    """`lab drill --stack`: random faults over the whole deployed stack (`lab/faults.py`)."""
    from . import faults
    from .stack import LabStack

    why = netns.available()
    if why:
        raise SystemExit(f"gpusched lab: {why}")
    work = Path(tempfile.mkdtemp(prefix="gs-lab-"))
    work.chmod(0o711)  # the jobs' dynamic uids reach their control directories under it
    stack = LabStack(work, nodes=3, node_timeout_s=8.0, heartbeat_s=0.5)
    try:
        stack.up()
        verdict = faults.run(stack, args.runs, seed=args.seed, hold_s=(1.0, max(1.0, 4 * args.hold_s)),
                             say=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        stack.down()
    if args.json:
        print(json.dumps(verdict, indent=1))
    else:
        print(f"{'ok' if verdict['ok'] else 'FAILED'}: {verdict['runs']} random faults, "
              f"{verdict['acknowledged_submits']} submits acknowledged, {len(verdict['lost_submits'])} lost, "
              f"{len(verdict['double_running'])} jobs ever on two hosts, replay --verify "
              f"{'clean' if verdict['replay_verify'] else 'FAILED'}, {len(verdict['not_recovered'])} not recovered")
        for kind, p50 in sorted(verdict["recovery_p50_s"].items()):
            print(f"  {kind:18} recovery p50 {p50:.2f}s  max {verdict['recovery_max_s'][kind]:.2f}s")
    return 0 if verdict["ok"] else 1


def cmd_lab(args: argparse.Namespace) -> int:
    if args.action == "drill" and args.stack:
        return cmd_stack_drill(args)
    work = Path(tempfile.mkdtemp(prefix="gs-lab-"))
    c = _start(work, args.hosts)
    try:
        if args.action == "up":
            for host, addr in c.lab.hosts.items():
                print(f"{host:10} {addr:15} ip netns exec {c.lab.ns(host)} ...")
            print(f"gpusched lab: ready ({len(c.lab.hosts)} hosts; work dir {work}); Ctrl-C removes it", flush=True)
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
            return 0
        rng = random.Random(args.seed)
        kinds = args.drills.split(",")
        results = []
        for i in range(args.runs * len(kinds)):
            results.append(drill(c, kinds[i % len(kinds)], rng, args.hold_s))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        drills = summary(results)
        verdict = {"ok": all(r["recovery_s"] is not None for r in results), "hosts": len(c.lab.hosts),
                   "drills": drills}
        if args.json:
            print(json.dumps({**verdict, "results": results}, indent=1))
        else:
            for kind, s in drills.items():
                print(f"{kind:16} runs {s['runs']:3}  recovery p50 {s['recovery_p50_s']:.2f}s  p99 {s['recovery_p99_s']:.2f}s")
        return 0
    finally:
        c.stop()
        c.lab.down()


DRILLS = "leader-minority,one-way,flapping,kill-9"


def register(sub) -> None:
    p = sub.add_parser("lab", help="the deployed NATS cluster on separate network hosts (namespaces); fault drills",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("action", nargs="?", choices=["up", "drill"], default="up",
                   help="up: start it and wait for Ctrl-C; drill: run the drills and print the verdict")
    p.add_argument("--hosts", type=int, default=3, help="more hosts beside the three NATS hosts (default 3)")
    p.add_argument("--drills", default=DRILLS, help=f"comma-separated, in order (default {DRILLS})")
    p.add_argument("--runs", type=int, default=1, help="repeat the list this many times")
    p.add_argument("--hold-s", type=float, default=3.0, help="how long a cut is held (one-way, flapping); with --stack each hold is drawn from 1 s to 4x this")
    p.add_argument("--seed", type=int, default=1, help="seed of the random victims")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    p.add_argument("--stack", action="store_true",
                   help="drill: the whole deployed stack (services on 2 hosts, 3 node hosts), --runs random faults "
                        "of every kind; the verdict from the log (no submit lost, replay --verify) and the OS "
                        "(no job on two hosts at once); exit 1 if it fails")
    p.set_defaults(func=cmd_lab)
