"""Running a simulation from options, and writing its results (per-job CSV, JSON, tables)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import msgspec

from ..core.model import TeamQuota
from .engine import Cluster, Simulation
from .runtime_model import RUNTIME_MODELS, RuntimeModel
from .traces import TraceJob, burst_jobs, load_trace, merge, parse_burst


def policy_config(name: str, overrides: dict[str, str] | None = None):
    """A preset, with `key=value` overrides of its PolicyConfig fields (the one parser:
    `policy.config.parse_policy`)."""
    from ..policy.config import parse_policy

    try:
        return parse_policy(name, overrides)
    except ValueError as err:
        raise ValueError(f"--set: {err}") from None


def split_variant(name: str) -> tuple[str, dict[str, str]]:
    """A run's name in `--compare`: a preset, or a preset with its own knobs,
    `tiresias+fairshare=true+las_preempt=false` (they win over `--set`), so that variants of one
    preset run side by side in one comparison."""
    preset, *knobs = name.split("+")
    return preset.strip(), parse_overrides(knobs)


def parse_overrides(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def runtime_model(name: str, **changes) -> RuntimeModel:
    if name not in RUNTIME_MODELS:
        raise ValueError(f"unknown runtime model {name!r}; expected {', '.join(RUNTIME_MODELS)}")
    base = RUNTIME_MODELS[name]
    changes = {k: v for k, v in changes.items() if v is not None}
    return msgspec.structs.replace(base, **changes) if changes else base


def load_jobs(trace: str | None, fmt: str | None, limit: int | None, burst: str | None) -> tuple[list[TraceJob], list[TraceJob]]:
    """(trace jobs, burst jobs). Quotas come from the trace alone: a burst gets no extra share."""
    jobs = load_trace(trace, fmt, limit)
    extra = burst_jobs(parse_burst(burst)) if burst else []
    return jobs, extra


def simulate(jobs: list[TraceJob], cluster: Cluster, policy: str, runtime: RuntimeModel,
             overrides: dict[str, str] | None = None, burst: list[TraceJob] | None = None,
             tick_s: float | None = None, topology: str = "pack",
             quotas: dict[str, TeamQuota] | None = None, services: bool = False,
             placement_down: tuple[float, float] | None = None, fractions: str = "honour",
             job_types: dict[str, tuple[str, ...]] | None = None) -> Simulation:
    """Run one simulation. `quotas`: the teams' terms (default: shares of the trace's GPU-hours).
    `services`: run the live services' composition on an in-memory log (`sim.composed`) instead
    of applying each whole cycle; `placement_down` (with it): when placement is gone."""
    from .engine import as_asked, default_quotas

    jobs = as_asked(jobs, fractions)  # the quotas share out the demand as the run asks it

    # The policy weighs a preemption by the costs the runtime model charges (unless --set).
    costs = {"checkpoint_cost_s": str(runtime.checkpoint_s), "restore_cost_s": str(runtime.restore_s)}
    preset, own = split_variant(policy)
    config = policy_config(preset, {**costs, **(overrides or {}), **own})
    if quotas is None:
        quotas = default_quotas([j for j in jobs if j.gpus <= cluster.total_gpus], cluster.total_gpus)
    all_jobs = merge(jobs, burst) if burst else jobs
    kind: type[Simulation] = Simulation
    extra: dict = {}
    if services or placement_down:
        from .composed import ComposedSimulation

        kind, extra = ComposedSimulation, {"placement_down": placement_down}
    sim = kind(all_jobs, cluster, config, runtime, quotas=quotas, policy_name=policy, tick_s=tick_s,
               topology=topology, fractions=fractions, job_types=job_types, **extra)
    sim.run()
    return sim


JOB_COLUMNS = ("job_id", "team", "gpus", "priority", "preemptible", "submit_s", "first_start_s", "finish_s",
               "jct_s", "queue_s", "attempts", "levels", "preemptions", "lost_gpu_s")


def write_jobs_csv(sim: Simulation, path: Path) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(JOB_COLUMNS)
        for r in sim.runs.values():
            j = r.trace
            w.writerow([j.job_id, j.team, j.gpus, j.priority, j.preemptible, j.submit_s,
                        _opt(r.first_start), _opt(r.finish), _opt(None if r.finish is None else r.finish - j.submit_s),
                        round(r.queue_s, 3), len(r.grants), "|".join(level for _, level, _ in r.grants),
                        r.preemptions, round(r.lost_gpu_s, 3)])
    return path


def _opt(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def write_out(sim: Simulation, out: Path, summary: dict, plots: bool = True) -> list[Path]:
    """summary.json and jobs.csv (the standard library writes them), and with `plots` the PNGs
    (matplotlib, an optional extra)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    written = [out / "summary.json", write_jobs_csv(sim, out / "jobs.csv")]
    if plots:
        from .plots import write_all

        written += write_all(sim, out, summary)
    return written


#: (column title, summary key, formatter) of the comparison table
TABLE = (
    ("avg JCT h", "avg_jct_s", lambda v: f"{v / 3600:.2f}"),
    ("p50 JCT h", "p50_jct_s", lambda v: f"{v / 3600:.2f}"),
    ("p99 JCT h", "p99_jct_s", lambda v: f"{v / 3600:.1f}"),
    ("avg queue h", "avg_queue_s", lambda v: f"{v / 3600:.2f}"),
    ("queue >8 h", ("avg_queue_s_by_size", ">8"), lambda v: f"{v / 3600:.2f}"),
    ("max queue h", "max_queue_s", lambda v: f"{v / 3600:.1f}"),
    ("util", "utilization", lambda v: f"{v:.3f}"),
    ("locality", "locality", lambda v: f"{v:.3f}"),
    ("Jain", "jain_fairness", lambda v: f"{v:.3f}"),
    ("Jain of shortfalls", "jain_shortfall", lambda v: f"{v:.3f}"),
    ("preempt", "preemptions", str),
    ("lost GPU-h", "lost_gpu_hours", lambda v: f"{v:.1f}"),
    ("makespan d", "makespan_s", lambda v: f"{v / 86400:.1f}"),
    ("wall s", "sim_wall_s", lambda v: f"{v:.2f}"),
)


def cell(summary: dict, key) -> object:
    if isinstance(key, tuple):
        return summary[key[0]][key[1]]
    return summary[key]


def table_rows(results: dict[str, dict]) -> list[list[str]]:
    return [[name] + [fmt(cell(s, key)) for _, key, fmt in TABLE] for name, s in results.items()]


def markdown_table(results: dict[str, dict]) -> str:
    head = ["policy"] + [title for title, _, _ in TABLE]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    return "\n".join(lines)


def rich_table(results: dict[str, dict], title: str = ""):
    from rich.table import Table

    table = Table(title=title or None)
    table.add_column("policy", style="bold")
    for head, _, _ in TABLE:
        table.add_column(head, justify="right")
    for row in table_rows(results):
        table.add_row(*row)
    return table
