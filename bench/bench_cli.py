"""How quick the command line answers, as a ratio to `python -c pass` measured in the same run
(the interpreter's own start-up, which no CLI can beat): `gpusched --version`, `--help` and
`jobs --help` (one command's parser and imports, without a server).

    python bench/bench_cli.py [--runs 7]

Targets (issue 29): --version and --help <= 150 ms. Prints the median of `--runs` runs.
`jobs` against a 1,000-node stack is not measured here yet.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

GPUSCHED = [sys.executable, "-m", "gpusched.cli.main"]


def median_s(argv: list[str], runs: int, env: dict | None = None) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, env=env)
        times.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.decode()[-400:]}")
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    base = median_s([sys.executable, "-c", "pass"], args.runs)
    print(f"python -c pass: {base * 1000:.0f} ms (baseline)")
    for name, argv, target in (("--version", ["--version"], 0.150), ("--help", ["--help"], 0.150),
                               ("jobs --help", ["jobs", "--help"], 0.300)):
        t = median_s(GPUSCHED + argv, args.runs)
        print(f"gpusched {name}: {t * 1000:.0f} ms = {t / base:.1f}x python -c pass "
              f"(target {target * 1000:.0f} ms: {'met' if t <= target else 'MISSED'})")


if __name__ == "__main__":
    main()
