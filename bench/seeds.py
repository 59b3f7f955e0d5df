"""What one run's figures are worth: the same `gpusched sim --compare` on a few seeds (`--jitter
SEED`: each submission moved later by under a second), then per variant the mean and range of
each figure, and against the first variant, paired seed by seed (the same jittered trace), the
change and on how many seeds it goes down.

    python bench/seeds.py --compare full,full+max_victim_searches_per_cycle=64 --seeds 4 --jobs 2 \\
        -- --cluster 1x32x8 [--trace T --format philly] [--topology any --runtime-model ideal]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from price_of_fairness import run_all  # bench/ is the script's own folder: on sys.path

#: (label, how to read it from one run's summary, format)
FIGURES = [
    ("avg JCT s", lambda r: r["avg_jct_s"], "{:,.0f}"),
    ("Jain", lambda r: r["jain_fairness"], "{:.3f}"),
    ("Jain of shortfalls", lambda r: r["jain_shortfall"], "{:.3f}"),
    ("guarantee wait p99 s", lambda r: r["guarantee_wait"]["p99_s"], "{:,.0f}"),
    ("team shortfall max s", lambda r: r["guarantee_wait"]["team_shortfall"]["max_s"], "{:,.0f}"),
    (">8-GPU queue s", lambda r: r["avg_queue_s_by_size"][">8"], "{:,.0f}"),
    ("preemptions", lambda r: r["preemptions"], "{:,.0f}"),
    ("sim wall s", lambda r: r["sim_wall_s"], "{:.0f}"),
]


def run_seeds(compare: str, seeds: list[int], sim_args: list[str], jobs: int) -> dict[int, dict[str, dict]]:
    """seed -> variant -> summary, through price_of_fairness's runner (a seed whose run failed is
    left out; the runner says so)."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = {Path(tmp) / f"seed{seed}.json": [*sim_args, "--jitter", str(seed)] for seed in seeds}
        run_all(outs, compare, jobs)
        return {seed: json.loads(out.read_text())["runs"] for seed, out in zip(seeds, outs) if out.exists()}


def report(by_seed: dict[int, dict[str, dict]]) -> str:
    """Markdown: per variant each figure's mean [min–max]; then each variant's paired change."""
    seeds = sorted(by_seed)
    variants = list(by_seed[seeds[0]])
    lines = [f"{len(seeds)} seeds ({', '.join(map(str, seeds))})", "",
             "| variant | " + " | ".join(f"{label} mean [min–max]" for label, *_ in FIGURES) + " |",
             "|---" * (len(FIGURES) + 1) + "|"]
    for v in variants:
        cells = []
        for _, get, fmt in FIGURES:
            xs = [get(by_seed[s][v]) for s in seeds]
            cells.append(f"{fmt.format(statistics.fmean(xs))} [{fmt.format(min(xs))}–{fmt.format(max(xs))}]")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    base = variants[0]
    lines += ["", f"Paired against `{base}` (each seed's change; mean [min–max], seeds lower / all):", "",
              "| variant | " + " | ".join(label for label, *_ in FIGURES) + " |", "|---" * (len(FIGURES) + 1) + "|"]
    for v in variants[1:]:
        cells = []
        for label, get, _ in FIGURES:
            pairs = [(get(by_seed[s][v]), get(by_seed[s][base])) for s in seeds]
            if label.startswith("Jain"):  # a share: the difference, not a ratio
                d = [a - b for a, b in pairs]
                text = f"{statistics.fmean(d):+.3f} [{min(d):+.3f}–{max(d):+.3f}]"
            else:
                d = [a / b - 1 if b else 0.0 for a, b in pairs]
                text = f"{statistics.fmean(d):+.1%} [{min(d):+.1%}–{max(d):+.1%}]"
            cells.append(f"{text}, {sum(x < 0 for x in d)}/{len(d)}")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", required=True, help="the variants, as `gpusched sim --compare` takes them")
    ap.add_argument("--seeds", type=int, default=4, help="how many seeds (1..N)")
    ap.add_argument("--jobs", type=int, default=1, help="seeds run at once (each one process)")
    ap.add_argument("sim_args", nargs=argparse.REMAINDER, help="after --: the trace, cluster and mode options")
    args = ap.parse_args()
    sim_args = args.sim_args[1:] if args.sim_args[:1] == ["--"] else args.sim_args
    by_seed = run_seeds(args.compare, list(range(1, args.seeds + 1)), sim_args, args.jobs)
    if not by_seed:
        sys.exit("every seed's run failed")
    print(report(by_seed))


if __name__ == "__main__":
    main()
