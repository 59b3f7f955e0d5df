"""Why `full` preempts: every preemption of one simulation, by cause, and how often one job is
taken. Measurement only: it wraps the policy's victim search in this process (no decision
changes) and prints one JSON object.

    python bench/bench_preempt_causes.py [--cluster 2x32x8] [--topology pack|any]
                                         [--runtime-model realistic|ideal] [--set KEY=VALUE ...]
                                         [--csv FILE]

Causes, judged when the preemption is requested, in the order tested:

- `due`: a backfilled borrower yields to the reserved head (`steps/victims.due`);
- `priority_own`: a victim of the preemptor's team and a lower priority class;
- `las_own`: a victim of the preemptor's team in a later LAS queue (`las_preempt`);
- `reclaim`: the preemptor's team is below its guarantee and takes from a team over its own;
- `priority_cross`: another team's lower-class victim, by the fold's fairness rule;
- `idle` (idle timeout) and `move` (off a quarantined GPU) are not preemptions for another job.

Only requests that end in a release count (`GpusReleased` "preempted", as the fold counts
`preemptions`); a victim that completes within its grace is not preempted. `--csv` writes one
row per counted preemption with the victim's true remaining run time (from the trace: what a
rule that reads predictions could at best know) and the preemptor's.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import Counter

from gpusched.core import events as ev
from gpusched.core.model import PRIORITY_RANK
from gpusched.policy import fairshare
from gpusched.policy.steps import reclaim
from gpusched.policy.steps import victims as victims_mod
from gpusched.sim import engine
from gpusched.sim.engine import Cluster
from gpusched.sim.report import load_jobs, parse_overrides, runtime_model, simulate


def _cause(plan, job, v, due: bool) -> str:
    if due:
        return "due"
    config = plan.ctx.config
    lower = config.priority and PRIORITY_RANK[v.spec.priority] < PRIORITY_RANK[job.spec.priority]
    if v.team == job.team:
        return "priority_own" if lower else "las_own"
    for_held = plan.held(job.team) + plan.incoming.get(job.team, 0)
    under = config.fairshare and fairshare.over_share(plan.ctx.state, job.team, for_held) < 0
    return "reclaim" if under else "priority_cross"


def scenario_parser() -> argparse.ArgumentParser:
    """The options of one `full` run of the bundled week (shared by the benches that wrap it)."""
    p = argparse.ArgumentParser()
    p.add_argument("--cluster", default="2x32x8")
    p.add_argument("--topology", default="pack")
    p.add_argument("--runtime-model", default="realistic")
    p.add_argument("--set", action="append", default=[])
    return p


def run_full(jobs, args):
    """Simulate `jobs` under `full` with the scenario options of `args` (`scenario_parser`)."""
    return simulate(jobs, Cluster.parse(args.cluster), "full", runtime_model(args.runtime_model),
                    parse_overrides(args.set), topology=args.topology)


def main() -> None:
    p = scenario_parser()
    p.add_argument("--csv", default=None)
    args = p.parse_args()
    jobs, _ = load_jobs(None, None, None, None)
    duration = {j.job_id: j.duration_s for j in jobs}
    requested: dict[str, dict] = {}  # victim -> what was recorded at its pending request
    rows: list[dict] = []
    shrinks = Counter[str]()
    granted: dict[str, list[float]] = {}  # job -> the times it was granted GPUs

    real_due, real_victims = victims_mod.due, reclaim.victims
    last_due: list = []

    def due(plan, ctx, job, need, fits):
        got = real_due(plan, ctx, job, need, fits)
        last_due[:] = got or []
        return got

    def victims(plan, ctx, job, need, fits, *rest):
        last_due.clear()
        chosen = real_victims(plan, ctx, job, need, fits, *rest)
        predictor = ctx.indexes.predictor(ctx.state)
        mine = predictor.estimate(job, ctx.now)
        for v in chosen or []:
            now = ctx.now
            est = predictor.estimate(v, now)
            ran = v.attained_gpu_s(now) / max(1, v.spec.gpus)
            requested[v.job_id] = {
                "t": now, "cause": _cause(plan, job, v, any(d is v for d in last_due)),
                "victim": v.job_id, "victim_team": v.team, "victim_gpus": len(v.gpus),
                "victim_attained_gpu_s": round(v.attained_gpu_s(now)),
                "victim_left_s": round(max(0.0, duration[v.job_id] - ran)),
                "victim_run_s": round(now - (v.started_at or now)), "victim_preemptions": v.preemptions,
                "victim_pred_s": round(est.remaining_s), "victim_pred_low_s": round(est.low_s),
                "victim_pred_high_s": round(est.high_s), "for_pred_s": round(mine.remaining_s),
                "for": job.job_id, "for_team": job.team, "for_gpus": job.spec.gpus,
                "for_attained_gpu_s": round(job.service_gpu_s),
                "for_left_s": round(max(0.0, duration[job.job_id] - job.service_gpu_s / max(1, job.spec.gpus))),
            }
        return chosen

    victims_mod.due, reclaim.victims = due, victims
    real_apply = engine.Simulation._apply

    def apply(self, event) -> None:
        if isinstance(event, ev.GpusReleased) and event.reason == "preempted":
            job = self.state.jobs.get(event.job_id)
            if job is not None and job.holding and job.preemption is not None:
                if job.preemption.cause == "idle":
                    rows.append({"cause": "idle", "victim": event.job_id})
                elif job.preemption.for_job == event.job_id:
                    rows.append({"cause": "move", "victim": event.job_id})
                else:
                    row = requested.pop(event.job_id, {"cause": "unknown", "victim": event.job_id})
                    row["released_at"] = event.at
                    rows.append(row)
        elif isinstance(event, ev.GpusGranted):
            granted.setdefault(event.job_id, []).append(event.at)
        elif isinstance(event, ev.JobResized) and event.removed:
            shrinks["shrinks"] += 1
        real_apply(self, event)

    engine.Simulation._apply = apply  # type: ignore[method-assign]
    sim = run_full(jobs, args)
    s = sim.summary()
    for r in rows:  # did the job it was preempted for start when its GPUs came back?
        if "for" in r:
            r["for_started_by_release"] = any(r["t"] <= t <= r["released_at"] for t in granted.get(r["for"], []))
            later = [t for t in granted.get(r["for"], []) if t >= r["t"]]
            r["for_next_start_after_s"] = round(later[0] - r["released_at"]) if later else None
    per_job = Counter(j.preemptions for j in sim.state.jobs.values())
    by_cause = Counter(r["cause"] for r in rows)
    taken = Counter(r["victim"] for r in rows if r["cause"] not in ("idle", "move"))
    print(json.dumps({
        "summary": {k: s[k] for k in ("avg_jct_s", "avg_queue_s_by_size", "preemptions", "max_preemptions_of_a_job",
                                      "lost_gpu_hours", "jain_fairness") if k in s},
        "by_cause": dict(by_cause.most_common()), "shrinks": shrinks["shrinks"],
        "beneficiary_not_started_by_release": dict(Counter(r["cause"] for r in rows
                                                           if r.get("for_started_by_release") is False)),
        "jobs_preempted_k_times": {k: per_job[k] for k in sorted(per_job) if k},
        "preemptions_of_jobs_taken_over_3_times": sum(n for n in taken.values() if n > 3),
        "by_cause_of_jobs_taken_over_3_times": dict(Counter(r["cause"] for r in rows if taken[r["victim"]] > 3)),
    }, indent=1))
    if args.csv:
        keys = sorted({k for r in rows for k in r})
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
