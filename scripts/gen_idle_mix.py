"""Write the synthetic idle-notebook mix (docs/sim.md): batch training jobs of two teams plus
interactive notebook sessions, most of which sit idle (a notebook left open), on one day.

    python scripts/gen_idle_mix.py > libs/gpusched/data/idle_notebooks.csv

Deterministic (seeded): the checked-in csv is exactly what this prints. Columns are the generic
csv format with `util_pct` (mean GPU utilization while running; empty: busy).
"""

from __future__ import annotations

import csv
import random
import sys

SEED = 15
DAY_S = 24 * 3600


def rows(seed: int = SEED) -> list[list[object]]:
    rng = random.Random(seed)
    out: list[list[object]] = []
    for i in range(60):  # batch: 1-8 GPUs, 1-4 h, busy, not preemptible
        gpus = rng.choice([1, 2, 4, 4, 8])
        out.append([f"batch-{i:03d}", round(rng.uniform(0, DAY_S), 1), round(rng.uniform(3600, 4 * 3600), 1),
                    gpus, rng.choice(["vision", "speech"]), "normal", "false", ""])
    for i in range(40):  # notebooks: 1-2 GPUs, sessions of 2-6 h; 70% idle (left open), 30% in use;
        idle = rng.random() < 0.7  # not preemptible (someone may be at the keyboard)
        util = round(rng.uniform(0, 2), 1) if idle else round(rng.uniform(30, 90), 1)
        out.append([f"nb-{i:03d}", round(rng.uniform(0, DAY_S), 1), round(rng.uniform(2 * 3600, 6 * 3600), 1),
                    rng.choice([1, 1, 2]), "notebooks", "interactive", "false", util])
    return sorted(out, key=lambda r: (r[1], r[0]))


def main() -> int:
    w = csv.writer(sys.stdout, lineterminator="\n")
    w.writerow(["job_id", "submit_time_s", "duration_s", "num_gpus", "team", "priority", "preemptible", "util_pct"])
    w.writerows(rows())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
