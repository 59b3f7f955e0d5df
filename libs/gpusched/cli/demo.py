"""`gpusched demo`: the chaos scene (the sharp edges of the README), on a live stack, with a verdict.

1. Start the stack (`gpusched up` machinery: NATS, Redis, every service as its own process, the
   dashboard) and set team quotas.
2. Fill the cluster with preemptible batch jobs of two teams (one over its guarantee).
3. Kill the placement service (SIGKILL). The fallback sees its lease lapse and places naively.
4. Flood a burst of 1-GPU interactive jobs from a third team.
5. Restart placement; it takes its lease back and appends `PlacementRecovered`.

Then fold the whole log and print the verdicts: placement degraded to naive (locality before and
during), interactive wait p50/p99, each team's share vs guarantee during the flood (a team at or
under its guarantee kept it), GPUs double-booked (0), jobs lost (0), recovery time. Exit code 0
when every verdict holds. The dashboard of the stack shows the scene live (`--keep` leaves it up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusched.core import events as ev
from gpusched.core.model import JobSpec, TeamQuota

TIGHT = ("nvlink", "node")  # a gang kept within one node


@dataclass
class Scene:
    """What the scene saw while it ran (wall-clock marks and the flood's samples)."""

    marks: dict[str, float] = field(default_factory=dict)
    fill_jobs: list[str] = field(default_factory=list)
    flood_jobs: list[str] = field(default_factory=list)
    acked: list[str] = field(default_factory=list)
    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    flood_window: bool = False
    grace_s: float = 3.0
    flood_end_seq: int = 0  # the log as it stood when the flood had settled (before placement returns)


def _teams(args) -> dict[str, TeamQuota]:
    total = args.nodes * args.gpus_per_node
    q = total // 8
    return {
        "vision": TeamQuota(guaranteed=3 * q, weight=1.0, limit=6 * q),
        "nlp": TeamQuota(guaranteed=3 * q, weight=1.0, limit=6 * q),
        args.flood_team: TeamQuota(guaranteed=2 * q, weight=1.0, limit=3 * q),
    }


def _fill_plan(args) -> list[tuple[str, int]]:
    """vision gets 5/8 of the cluster (over its 3/8 guarantee), nlp its 3/8: full."""
    total = args.nodes * args.gpus_per_node
    size = max(1, args.gpus_per_node // 2)
    plan = [("vision", size)] * (5 * total // 8 // size) + [("nlp", size)] * (3 * total // 8 // size)
    used = sum(g for _, g in plan)
    if used < total:
        plan.append(("vision", total - used))
    return plan


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))
    return v[k]


def _stack_args(args, data_dir: Path) -> argparse.Namespace:
    """The options of `gpusched up` for the scene, parsed by `up`'s own parser (so every option
    `up` grows gets its default here too)."""
    from gpusched.cli import stack

    services = ["admission", "placement", "fallback", "preemptor", "quota_ledger", "projector", "dashboard"]
    if args.node_daemons:
        services += ["nodeagent", "reconciler"]
    parser = argparse.ArgumentParser(add_help=False)
    stack.register(parser.add_subparsers(dest="command"))
    argv = ["up", "--nodes", str(args.nodes), "--gpus-per-node", str(args.gpus_per_node),
            "--nodes-per-rack", str(args.nodes_per_rack), "--nvlink", "quads", "--nats-port", "0",
            "--redis-port", "0", "--dashboard-port", str(args.dashboard_port), "--data-dir", str(data_dir),
            "--policy", args.policy, "--services", ",".join(services), "--lease-ttl-ms", str(args.lease_ttl_ms),
            "--no-restart", "--ready-timeout", str(args.ready_timeout), "--placeholders", "any",
            # the scene is short: preempted jobs get a short grace, and no minimum runtime
            "--policy-set", f"checkpoint_grace_s={args.checkpoint_grace_s}", "--policy-set", "min_runtime_s=0"]
    return parser.parse_args(argv)


async def _wait(pred, timeout: float, folded, what: str) -> float:
    """Wait until `pred(state)` holds; returns the wall time it took. Raises on timeout."""
    t0 = time.time()
    while not pred(folded.state):
        if time.time() - t0 > timeout:
            raise TimeoutError(f"demo: {what} did not happen within {timeout:.0f}s")
        await folded.wait_changed(0.2)
    return time.time() - t0


def _say(args, text: str) -> None:
    if not args.json:
        print(text, flush=True)


def scene_identity(stack) -> tuple[str, str | None]:
    """Where the scene connects and as whom: its own temporary stack, as that stack's admin
    (never $GPUSCHED_CREDS or the client config, which name another stack's identity)."""
    return stack.nats_url, stack.admin_creds


async def run_scene(args) -> dict[str, Any]:
    from gpusched.bus.control_client import Client
    from gpusched.bus.log import EventLog
    from gpusched.cli.stack import Stack
    from gpusched.services.runtime import FoldedLog

    data_dir = Path(args.data_dir) if args.data_dir else Path(tempfile.mkdtemp(prefix="gpusched-demo-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(_stack_args(args, data_dir), data_dir.resolve())
    scene = Scene(grace_s=args.checkpoint_grace_s)
    client = log = folded = None
    try:
        stack.start_servers()
        stack.plan()
        for child in stack.children.values():
            stack.spawn(child)
        _say(args, f"demo: starting the stack in {data_dir} ...")
        await stack.wait_ready(args.ready_timeout)
        _say(args, f"demo: stack ready: nats {stack.nats_url}, dashboard {stack.dashboard_url}")
        url, creds = scene_identity(stack)
        client = await Client.connect(url, timeout=10.0, creds=creds)
        log = await EventLog.open(url, name="gpusched-demo", creds=creds)
        folded = FoldedLog(log)

        def watch(rec, state) -> None:
            if scene.flood_window and (rec.event.ALLOC or isinstance(rec.event, ev.PreemptionRequested)):
                scene.samples.append((rec.event.at, {t: u.held for t, u in state.teams.items()}))

        folded.listeners.append(watch)
        await folded.start()

        # 1. quotas
        for team, quota in _teams(args).items():
            reply = await client.set_quota(team, quota)
            if not reply.ok:
                raise RuntimeError(f"demo: quota of {team} refused: {reply.error}")

        await _play(args, stack, client, folded, scene)
        await asyncio.sleep(min(2.0, args.settle_s))
        await folded.stop()
        result = await verdict(log, scene, args)
        result["dashboard"] = stack.dashboard_url
        result["data_dir"] = str(data_dir)
        if args.keep:
            _say(args, f"demo: --keep: the stack stays up (dashboard {stack.dashboard_url}); Ctrl-C stops it")
            _print(result, args)
            try:
                while True:
                    await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass
        return result
    finally:
        if folded is not None:
            await folded.stop()
        if client is not None:
            await client.close()
        if log is not None:
            await log.close()
        stack.stop()


async def _play(args, stack, client, folded, scene: Scene) -> None:
    """The scene after the quotas: fill the cluster, kill placement, flood, restart placement."""
    # 2. fill
    plan = _fill_plan(args)
    _say(args, f"demo: filling {args.nodes * args.gpus_per_node} GPUs with {len(plan)} batch jobs of vision and nlp")
    scene.marks["fill"] = time.time()
    replies = await asyncio.gather(*[client.submit(JobSpec(team=t, gpus=g, preemptible=True, name=f"batch-{t}-{i}"))
                                     for i, (t, g) in enumerate(plan)])
    scene.fill_jobs = [r.job_id for r in replies if r.ok and r.job_id]
    scene.acked += scene.fill_jobs
    await _wait(lambda s: all(s.jobs.get(j) is not None and s.jobs[j].holding for j in scene.fill_jobs),
                args.step_timeout, folded, "filling the cluster")
    scene.marks["filled"] = time.time()

    # 3. kill placement
    _say(args, "demo: killing the placement service (SIGKILL)")
    proc = stack.children["placement"].proc
    scene.marks["kill"] = time.time()
    proc.kill()
    proc.wait()
    scene.marks["degraded_after_s"] = await _wait(lambda s: s.placement_degraded, args.step_timeout, folded,
                                                  "the fallback taking over")
    scene.marks["degraded"] = time.time()
    _say(args, f"demo: placement degraded after {scene.marks['degraded_after_s']:.1f}s: naive fallback places")

    # 4. flood
    _say(args, f"demo: flooding {args.flood} interactive jobs from team {args.flood_team}")
    scene.flood_window = True
    state = folded.state
    scene.samples.append((state.now, {t: u.held for t, u in state.teams.items()}))
    scene.marks["flood"] = time.time()
    replies = await asyncio.gather(*[client.submit(JobSpec(team=args.flood_team, gpus=1, priority="interactive",
                                                           name=f"flood-{i}")) for i in range(args.flood)])
    scene.flood_jobs = [r.job_id for r in replies if r.ok and r.job_id]
    scene.acked += scene.flood_jobs
    entitled = _teams(args)[args.flood_team].guaranteed
    want = min(len(scene.flood_jobs), entitled)
    try:
        await _wait(lambda s: sum(1 for j in scene.flood_jobs if s.jobs.get(j) is not None
                                  and s.jobs[j].first_started_at is not None) >= want,
                    args.step_timeout, folded, f"{want} flood jobs getting GPUs")
    except TimeoutError as err:
        _say(args, str(err))
    await asyncio.sleep(args.settle_s)  # let the flood settle: who else gets what
    scene.flood_window = False
    scene.marks["flood_end"] = time.time()
    scene.flood_end_seq = folded.seen_seq

    # 5. restart placement
    _say(args, "demo: restarting placement")
    scene.marks["restart"] = time.time()
    stack.spawn(stack.children["placement"])
    try:
        await _wait(lambda s: not s.placement_degraded, args.step_timeout, folded, "placement recovering")
        scene.marks["recovered"] = time.time()
    except TimeoutError as err:
        _say(args, str(err))


async def _replay(log, scene: Scene, args):
    """Fold the whole log from scratch: the state, every grant, when placement degraded and
    recovered, and who waited under their guarantee when the flood had settled."""
    from gpusched.core.state import ClusterState

    state = ClusterState()
    grants: list[ev.GpusGranted] = []
    degraded_at = recovered_at = None
    at_flood_end: dict[str, dict[str, int]] | None = None
    async for seq, e in log.replay():
        if at_flood_end is None and scene.flood_end_seq and seq > scene.flood_end_seq:
            at_flood_end = waiting_under_guarantee(state, _teams(args))
        state.apply(e, seq)
        if isinstance(e, ev.GpusGranted):
            grants.append(e)
        elif isinstance(e, ev.PlacementDegraded) and degraded_at is None:
            degraded_at = e.at
        elif isinstance(e, ev.PlacementRecovered) and degraded_at is not None and recovered_at is None:
            recovered_at = e.at

    return state, grants, degraded_at, recovered_at, at_flood_end


def _locality(gs: list[ev.GpusGranted]) -> dict[str, Any]:
    multi = [g for g in gs if len(g.gpus) > 1]
    tight = sum(1 for g in multi if g.level in TIGHT)
    return {"grants": len(gs), "placers": sorted({g.placer for g in gs}),
            "multi_gpu_grants": len(multi), "within_one_node": tight,
            "tight_fraction": None if not multi else round(tight / len(multi), 3)}


def _shares(scene: Scene, state, quotas: dict[str, TeamQuota]) -> dict[str, dict[str, Any]]:
    """Each team's lowest and highest holding during the flood against its guarantee and limit."""
    start = scene.samples[0][1] if scene.samples else {}
    shares = {}
    for team, q in quotas.items():
        held = [s.get(team, 0) for _, s in scene.samples] or [state.teams[team].held if team in state.teams else 0]
        at_start = start.get(team, 0)
        floor = min(q.guaranteed, at_start)
        shares[team] = {"guaranteed": q.guaranteed, "limit": q.limit, "held_at_flood": at_start,
                        "min_during_flood": min(held), "max_during_flood": max(held),
                        "kept_guarantee": min(held) >= floor, "within_limit": max(held) <= (q.limit or 10**9)}
    return shares


async def verdict(log, scene: Scene, args) -> dict[str, Any]:
    """Fold the whole log from scratch and judge the scene."""
    state, grants, degraded_at, recovered_at, at_flood_end = await _replay(log, scene, args)

    fill = set(scene.fill_jobs)
    before = [g for g in grants if g.job_id in fill and g.attempt == 1]
    during = [g for g in grants if g.placer == "naive"]
    after = [g for g in grants if recovered_at is not None and g.at >= recovered_at]

    # interactive waits: submission -> first grant, from the log's own times
    submitted = {j: state.jobs[j].submitted_at for j in scene.flood_jobs if j in state.jobs}
    first_grant: dict[str, float] = {}
    for g in grants:
        if g.job_id in submitted and g.job_id not in first_grant:
            first_grant[g.job_id] = g.at
    granted_waits = [first_grant[j] - submitted[j] for j in first_grant]
    still_waiting = [j for j in submitted if j not in first_grant]
    # every flood job counts: a job still queued counts with its wait so far
    now = max(state.now, time.time())
    waits = granted_waits + [now - submitted[j] for j in still_waiting]
    # judged when the flood had settled, before placement returned (else at the end of the log)
    left_waiting = at_flood_end if at_flood_end is not None else waiting_under_guarantee(state, _teams(args))
    restart = scene.marks.get("restart", math.inf)
    during_outage = [j for j, at in first_grant.items() if at < restart]

    shares = _shares(scene, state, _teams(args))

    violations = state.violations()
    double_booked = sorted({g for v in violations if v.rule == "double_booking" for g in v.gpus})
    missing = [j for j in scene.acked if j not in state.jobs]
    inconsistent = [j.job_id for j in state.jobs.values()
                    if (j.holding and len(j.gpus) < j.spec.gang_min) or (j.state == "pending" and j.gpus)]
    recovery_s = None
    if recovered_at is not None and "restart" in scene.marks:
        recovery_s = round(max(0.0, recovered_at - scene.marks["restart"]), 3)

    checks = {
        "placement degraded to naive": bool(degraded_at is not None and during),
        "interactive jobs got GPUs during the outage": bool(during_outage),
        "every team at or under its guarantee kept it": all(s["kept_guarantee"] for s in shares.values()),
        "no team within its guarantee left waiting": not left_waiting,
        "flood bounded by its team's limit": all(s["within_limit"] for s in shares.values()),
        "no GPU double-booked": not double_booked,
        "no job lost": not missing and not inconsistent,
        "no invariant broken": not violations,
        "placement recovered": recovery_s is not None,
    }
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "locality": {"before": _locality(before), "during_outage": _locality(during), "after_recovery": _locality(after)},
        "degraded_after_kill_s": round(degraded_at - scene.marks["kill"], 3) if degraded_at and "kill" in scene.marks else None,
        "interactive_wait_s": {"jobs": len(scene.flood_jobs), "granted": len(granted_waits),
                               "over": "all flood jobs (queued ones with their wait so far)",
                               "granted_during_outage": len(during_outage), "still_queued": len(still_waiting),
                               "p50": None if (p50 := _pct(waits, 0.5)) is None else round(p50, 3),
                               "p99": None if (p99 := _pct(waits, 0.99)) is None else round(p99, 3)},
        "shares_during_flood": shares,
        "left_waiting_under_guarantee": left_waiting,
        "double_booked_gpus": double_booked,
        "jobs_lost": missing + inconsistent,
        "violations": [f"{v.rule}: {v.detail}" for v in violations],
        "recovery_s": recovery_s,
        "log_seq": state.last_seq,
        "jobs": state.job_counts(),
    }


def waiting_under_guarantee(state, quotas: dict[str, TeamQuota]) -> dict[str, dict[str, int]]:
    """Teams that hold less than their guarantee while a job of theirs that fits in the rest of
    it waits: fair share promised them those GPUs."""
    out: dict[str, dict[str, int]] = {}
    for team, quota in quotas.items():
        held = state.teams[team].held if team in state.teams else 0
        room = quota.guaranteed - held
        waiting = [j for j in state.pending if state.jobs[j].spec.team == team and state.jobs[j].spec.gang_min <= room]
        if room > 0 and waiting:
            out[team] = {"held": held, "guaranteed": quota.guaranteed, "waiting_jobs": len(waiting)}
    return out


def _print(result: dict[str, Any], args) -> None:
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    from rich.console import Console
    from rich.table import Table

    def pct(x):
        return "-" if x is None else f"{x:.0%}"

    def sec(x):
        return "-" if x is None else f"{x:.2f}s"

    loc = result["locality"]
    w = result["interactive_wait_s"]
    table = Table(title="gpusched demo: the chaos scene", header_style="bold", show_lines=False)
    table.add_column("verdict")
    table.add_column("measured")
    table.add_column("", justify="center")
    mark = lambda ok: "[green]PASS[/]" if ok else "[red]FAIL[/]"  # noqa: E731
    c = result["checks"]
    table.add_row("placement degraded to naive",
                  f"degraded {sec(result['degraded_after_kill_s'])} after the kill; multi-GPU gangs within one node: "
                  f"{pct(loc['before']['tight_fraction'])} before (topo), "
                  f"{pct(loc['during_outage']['tight_fraction'])} during the outage (naive, "
                  f"{loc['during_outage']['grants']} grants)", mark(c["placement degraded to naive"]))
    table.add_row("interactive wait (all flood jobs; queued: wait so far)",
                  f"p50 {sec(w['p50'])}, p99 {sec(w['p99'])}; {w['granted']}/{w['jobs']} granted "
                  f"({w['granted_during_outage']} during the outage), {w['still_queued']} still queued",
                  mark(c["interactive jobs got GPUs during the outage"]))
    left = result["left_waiting_under_guarantee"]
    table.add_row("teams within their guarantee left waiting",
                  "none" if not left else "; ".join(f"{t}: holds {x['held']} of {x['guaranteed']} guaranteed, "
                                                    f"{x['waiting_jobs']} job(s) waiting" for t, x in left.items()),
                  mark(c["no team within its guarantee left waiting"]))
    for team, s in result["shares_during_flood"].items():
        table.add_row(f"share of {team} during the flood",
                      f"held {s['held_at_flood']} -> min {s['min_during_flood']} / max {s['max_during_flood']}; "
                      f"guaranteed {s['guaranteed']}, limit {s['limit']}", mark(s["kept_guarantee"] and s["within_limit"]))
    table.add_row("GPUs double-booked", str(len(result["double_booked_gpus"])), mark(c["no GPU double-booked"]))
    table.add_row("jobs lost", str(len(result["jobs_lost"])), mark(c["no job lost"]))
    table.add_row("invariants broken (fold of the whole log)", str(len(result["violations"])), mark(c["no invariant broken"]))
    table.add_row("recovery after placement returns", sec(result["recovery_s"])
                  + (f"; gangs within one node after: {pct(loc['after_recovery']['tight_fraction'])}"
                     if loc["after_recovery"]["grants"] else ""), mark(c["placement recovered"]))
    console = Console(highlight=False)
    console.print(table)
    console.print(("[green]all verdicts hold[/]" if result["ok"] else "[red]some verdicts fail[/]")
                  + f"  (log seq {result['log_seq']}, jobs {result['jobs']})")


def cmd_demo(args: argparse.Namespace) -> int:
    if args.quick:
        args.nodes, args.gpus_per_node, args.nodes_per_rack = 4, 8, 2
        args.flood = min(args.flood, 12)
        args.settle_s = min(args.settle_s, 3.0)
    try:
        result = asyncio.run(run_scene(args))
    except (RuntimeError, TimeoutError) as err:
        print(f"gpusched demo: {err}", file=sys.stderr)
        return 2
    if not args.keep:
        _print(result, args)
    return 0 if result["ok"] else 1


def register(sub) -> None:
    p = sub.add_parser("demo", help="the chaos scene: fill, kill placement, flood interactive jobs, restart; verdicts",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small, fast scene (4 nodes x 8 GPUs, 12 interactive jobs)")
    p.add_argument("--nodes", type=int, default=8, help="simulated nodes (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--nodes-per-rack", type=int, default=4, help="nodes per rack (default 4)")
    p.add_argument("--flood", type=int, default=24, help="interactive jobs in the burst")
    p.add_argument("--flood-team", default="chat", help="the team that floods interactive jobs")
    p.add_argument("--policy", default="full", help="scheduling policy preset (default: full)")
    p.add_argument("--checkpoint-grace-s", type=float, default=3.0, help="how long a preempted job may take to checkpoint")
    p.add_argument("--lease-ttl-ms", type=int, default=1500, help="placement lease TTL (how fast the fallback notices)")
    p.add_argument("--node-daemons", action=argparse.BooleanOptionalAction, default=True,
                   help="run simulated node daemons and the reconciler (default); without, jobs never start "
                        "and preemptions end at the checkpoint deadline")
    p.add_argument("--settle-s", type=float, default=5.0, help="how long the flood runs before placement returns")
    p.add_argument("--step-timeout", type=float, default=60.0, help="seconds each step of the scene may take")
    p.add_argument("--ready-timeout", type=float, default=90.0, help="seconds the stack may take to start")
    p.add_argument("--dashboard-port", type=int, default=8080, help="port of the dashboard (0: any free one)")
    p.add_argument("--data-dir", default=None, help="where the stack keeps its store and logs (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="leave the stack running after the verdict")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    p.set_defaults(func=cmd_demo)
