"""PNG plots of a simulation (matplotlib, Agg backend: no display needed).

matplotlib is an optional extra (`pip install 'gpusched-cluster[sim-plots]'`): importing this
module without it raises ImportError with that advice; nothing else in the library needs it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

MISSING = ("PNG plots need matplotlib, an optional extra: "
           "pip install 'gpusched-cluster[sim-plots]' (or run without --out)")

try:
    import matplotlib
except ImportError as err:  # pragma: no cover - depends on what is installed
    raise ImportError(MISSING) from err

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..core.model import LEVELS  # noqa: E402
from .metrics import SIZE_BUCKETS, size_bucket  # noqa: E402

if TYPE_CHECKING:
    from .engine import Simulation


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def team_timeline(sim: Simulation, path: Path, title: str = "") -> Path:
    """GPUs held per team over time (stacked), with the cluster's capacity."""
    rec = sim.rec
    xs = [t / 3600 for t, _ in rec.timeline]
    order = sorted(range(len(rec.teams)), key=lambda i: -sum(h[i] for _, h in rec.timeline))
    ys = [[h[i] for _, h in rec.timeline] for i in order]
    fig, ax = plt.subplots(figsize=(10, 4))
    if xs:
        colors = [plt.get_cmap("tab20")(k % 20) for k in range(len(order))]
        ax.stackplot(xs, *ys, labels=[rec.teams[i] for i in order], colors=colors, step="post")
    ax.axhline(sim.cluster.total_gpus, color="k", lw=0.8, ls="--", label="capacity")
    ax.set_xlabel("hours since the first submission")
    ax.set_ylabel("GPUs held")
    ax.set_title(title or f"GPUs held per team ({sim.policy_name})")
    ax.legend(loc="upper right", fontsize=7, ncol=2)
    ax.set_ylim(0, sim.cluster.total_gpus * 1.08)
    return _save(fig, path)


def queue_cdf(sim: Simulation, path: Path, title: str = "") -> Path:
    """CDF of queue time, one curve per job-size bucket."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for bucket in SIZE_BUCKETS:
        qs = sorted(r.queue_s / 3600 for r in sim.runs.values()
                    if r.first_start is not None and size_bucket(r.trace.gpus) == bucket)
        if qs:
            ax.step(qs, [(i + 1) / len(qs) for i in range(len(qs))], where="post", label=f"{bucket} GPU ({len(qs)})")
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set_xlabel("queue time (hours, symlog)")
    ax.set_ylabel("share of jobs")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or f"Queue time by job size ({sim.policy_name})")
    return _save(fig, path)


def locality(levels: dict[str, dict[str, int]], path: Path, title: str = "") -> Path:
    """How multi-GPU grants spanned the topology (summary["locality_levels"]), bars per policy."""
    shown = [lvl for lvl in LEVELS if lvl != "block" or any(lvl in c for c in levels.values())]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(levels))
    for k, (name, counts) in enumerate(levels.items()):
        total = sum(counts.values()) or 1
        ax.bar([i + k * width for i in range(len(shown))], [counts.get(lvl, 0) / total for lvl in shown], width,
               label=name)
    ax.set_xticks([i + width * (len(levels) - 1) / 2 for i in range(len(shown))], shown)
    ax.set_ylabel("share of multi-GPU grants")
    ax.set_xlabel("widest level the GPU set spans")
    ax.legend(fontsize=8)
    ax.set_title(title or "Placement locality")
    return _save(fig, path)


def compare_bars(results: dict[str, dict], path: Path, title: str = "") -> Path:
    """Average JCT and average queue time per policy (hours)."""
    names = list(results)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [results[n]["avg_jct_s"] / 3600 for n in names], 0.4, label="avg JCT")
    ax.bar([x + 0.2 for x in xs], [results[n]["avg_queue_s"] / 3600 for n in names], 0.4, label="avg queue")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("hours")
    ax.legend()
    ax.set_title(title or "Average JCT and queue time per policy")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def write_all(sim: Simulation, out: Path, summary: dict) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    return [team_timeline(sim, out / "gpus_per_team.png"), queue_cdf(sim, out / "queue_cdf.png"),
            locality({sim.policy_name: summary["locality_levels"]}, out / "locality.png")]
