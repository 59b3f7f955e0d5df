"""`gpusched sim`: replay a job trace through the real fold and policies on a virtual clock."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from pathlib import Path

from ..core.limits import size_mb

EPILOG = """\
examples:
  gpusched sim --policy full                         # the bundled Philly week on 2x32x8
  gpusched sim --compare fifo,gang,topo,preempt,fairshare,full --runtime-model ideal
  gpusched sim --trace ../shared/traces/tiresias-sample/60_job.csv --cluster 1x16x4 --compare all
  gpusched sim --format alibaba --trace openb_pod_list_default.csv --cluster 1x8x8 --json
  gpusched sim --format alibaba --trace openb_pod_list_default.csv --cluster 1x6x8 --compare full --fractions honour,round
  gpusched sim --services --policy full              # placement, preemptor, fallback on an in-memory log
  gpusched sim --interactive-burst team=6c71a0,at=86400,count=200,gpus=1,duration=600 --out out/burst
  gpusched sim --gpu-types 16:H100,48:A100 --gpu-type-mix 'H100=0.2,H100|A100=0.5' --quotas pools.csv

--format csv: header job_id,submit_time_s,duration_s,num_gpus,team and optional
priority,preemptible,min_gpus,max_gpus,time_limit_s. See docs/results.md for every mapping.
"""


def register(sub) -> None:
    from ..sim.traces import FORMATS

    p = sub.add_parser("sim", help="simulate a job trace under a policy (virtual clock)", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Replay a job trace through the same fold and policies as production, "
                                   "on a virtual clock, and report JCT, queueing, utilization, locality, "
                                   "fairness and lost work.")
    p.add_argument("--trace", help="trace file (default: the bundled Philly week, 7,748 jobs)")
    p.add_argument("--format", choices=FORMATS, help="trace format (default: guessed from the file)")
    p.add_argument("--cluster", default="2x32x8", help="RxNxG: racks x nodes per rack x GPUs per node (default 2x32x8)")
    p.add_argument("--node-cpus", type=float, default=0.0, metavar="N",
                   help="CPUs each node offers jobs (default: not declared, CPUs are not scheduled); jobs ask "
                        "theirs where the trace has them (alibaba: cpu_milli)")
    p.add_argument("--node-mem", default=None, metavar="SIZE",
                   help="memory each node offers jobs, like 256G (default: not declared); alibaba: memory_mib")
    p.add_argument("--nvlink", default="all", choices=("all", "pairs", "quads", "none"), help="NVLink layout in a node")
    p.add_argument("--gpu-types", metavar="COUNT:MODEL,...",
                   help="a mixed cluster: each node's GPU model in order, e.g. 16:H100,48:A100 (docs/gpu-pools.md)")
    p.add_argument("--gpu-type-mix", metavar="TYPES=SHARE,...",
                   help="the GPU types the trace's jobs accept, by share of jobs (crc32 of the job id): "
                        "H100=0.2,H100|A100=0.5 (the rest: any model)")
    p.add_argument("--policy", default="full", help="policy preset (default full)")
    p.add_argument("--compare", help="comma-separated presets to run side by side, or 'all'")
    p.add_argument("--fractions", default="honour", metavar="MODE[,MODE]",
                   help="jobs asking a share of one GPU (Alibaba's gpu_milli): honour (fractional GPUs, the "
                        "default) or round (a whole GPU each); both, comma-separated, run side by side")
    p.add_argument("--runtime-model", default="realistic", choices=("realistic", "ideal"),
                   help="realistic: cross-level slowdown and checkpoint costs; ideal: neither")
    p.add_argument("--topology", default="pack", choices=("pack", "any"),
                   help="pack: a job that fits on one node must run on one node; any: placement preference only")
    p.add_argument("--checkpoint-interval", type=float, help="seconds between periodic checkpoints (realistic: 1800)")
    p.add_argument("--checkpoint-s", type=float, help="seconds to save a checkpoint when asked to yield (realistic: 30)")
    p.add_argument("--restore-s", type=float, help="seconds to restore a checkpoint on restart (realistic: 60)")
    p.add_argument("--interactive-burst", metavar="SPEC",
                   help="overlay a burst: team=X,at=SECONDS,count=N,gpus=G,duration=SECONDS[,every=S][,priority=P]")
    p.add_argument("--quotas", type=Path, metavar="FILE",
                   help="team quotas, CSV team,guaranteed,weight,limit (default: shares of the trace's GPU-hours)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a PolicyConfig knob (repeatable)")
    p.add_argument("--services", action="store_true",
                   help="run the live services' composition (placement, preemptor and fallback deciding and "
                        "appending separately, with compare-and-set) on an in-memory log, not one whole cycle")
    p.add_argument("--placement-down", metavar="START:END",
                   help="with --services: placement decides nothing from START to END seconds (the fallback places)")
    p.add_argument("--tick", type=float, help="also run the policy every TICK seconds while jobs wait")
    p.add_argument("--limit", type=int, help="only the first N jobs of the trace")
    p.add_argument("--jitter", type=int, metavar="SEED",
                   help="move each submission later by under a second (seeded): replays of a few seeds show "
                        "what one run's figures are worth (bench/seeds.py)")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.add_argument("--out", type=Path, help="write summary.json and jobs.csv here, and PNG plots when matplotlib is installed")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..sim.engine import Cluster, SimStalled, SimViolation
    from ..sim.report import load_jobs, parse_overrides, rich_table, runtime_model, simulate, write_out
    from ..sim.traces import TraceError, jittered, load_quotas

    plots = bool(args.out)
    if args.out:  # say it before a long run, not after it
        try:
            importlib.import_module("gpusched.sim.plots")  # matplotlib: an optional extra
        except ImportError as err:
            plots = False
            print(f"gpusched sim --out: writing summary.json and jobs.csv only: {err}", file=sys.stderr)
    try:
        cluster = Cluster.parse(args.cluster, args.nvlink)
        if args.node_cpus or args.node_mem:
            cluster = dataclasses.replace(cluster, cpus=max(0.0, args.node_cpus),
                                          memory_mb=size_mb(args.node_mem) if args.node_mem else 0)
        if args.gpu_types:
            from ..sim.pools import node_models

            cluster = dataclasses.replace(cluster, models=node_models(args.gpu_types, cluster.racks * cluster.nodes_per_rack))
        model = runtime_model(args.runtime_model, checkpoint_interval_s=args.checkpoint_interval,
                              checkpoint_s=args.checkpoint_s, restore_s=args.restore_s)
        overrides = parse_overrides(args.set)
        jobs, burst = load_jobs(args.trace, args.format, args.limit, args.interactive_burst)
        if args.jitter is not None:
            jobs = jittered(jobs, args.jitter)
        quotas = load_quotas(args.quotas) if args.quotas else None
        job_types = None
        if args.gpu_type_mix:
            from ..sim.pools import parse_mix, types_of

            mix = parse_mix(args.gpu_type_mix)
            job_types = {j.job_id: t for j in jobs if (t := types_of(j.job_id, mix))}
        down = _window(args.placement_down) if args.placement_down else None
        if args.services or down:
            from ..telemetry import configure_logging

            configure_logging(level="WARNING")  # the writers log every round at debug
        presets = _presets(args.compare) if args.compare else [args.policy]
        modes = _fractions(args.fractions)
        names = [f"{p}@{m}" if len(modes) > 1 else p for p in presets for m in modes]
        results, sims = {}, {}
        for name in names:
            preset, _, mode = name.partition("@")
            sim = simulate(jobs, cluster, preset, model, overrides, burst, args.tick, args.topology, quotas,
                           services=args.services, placement_down=down, fractions=mode or modes[0],
                           job_types=job_types)
            results[name], sims[name] = sim.summary(), sim
    except (TraceError, ValueError) as err:
        print(f"gpusched sim: {err}", file=sys.stderr)
        return 2
    except (SimViolation, SimStalled) as err:
        print(f"gpusched sim: {err}", file=sys.stderr)
        return 1
    if args.out:
        for name, sim in sims.items():
            write_out(sim, args.out / name if len(sims) > 1 else args.out, results[name], plots=plots)
        if len(sims) > 1 and plots:
            from ..sim.plots import compare_bars, locality

            locality({n: r["locality_levels"] for n, r in results.items()}, args.out / "locality.png")
            compare_bars(results, args.out / "compare.png")
    if args.json:
        print(json.dumps(results[names[0]] if len(names) == 1 else {"runs": results}, indent=2))
        return 0
    from rich.console import Console

    title = f"{len(jobs)} jobs on {cluster} ({cluster.total_gpus} GPUs), runtime model {model.name}"
    Console(width=None if sys.stdout.isatty() else 200).print(rich_table(results, title))
    return 0


def _presets(text: str) -> list[str]:
    from ..policy.config import PRESETS

    if text.strip() == "all":
        return list(PRESETS)
    return [n.strip() for n in text.split(",") if n.strip()]


def _fractions(text: str) -> list[str]:
    from ..sim.engine import FRACTIONS

    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in FRACTIONS]
    if bad or not modes or len(set(modes)) != len(modes):
        raise ValueError(f"--fractions {text!r}: expected one or both of {', '.join(FRACTIONS)}")
    return modes


def _window(text: str) -> tuple[float, float]:
    start, sep, end = text.partition(":")
    try:
        window = (float(start), float(end))
    except ValueError:
        raise ValueError(f"--placement-down {text!r}: expected START:END in seconds") from None
    if not sep or window[1] <= window[0]:
        raise ValueError(f"--placement-down {text!r}: expected START:END with START < END")
    return window
