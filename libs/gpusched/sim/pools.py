"""GPU pools in the simulator (issue 30): a mixed cluster (`--gpu-types 16:H100,48:A100`), the
GPU types each job of a trace accepts (`--gpu-type-mix`), and what each pool did.

Public traces name no GPU model (Philly, Alibaba's `openb`), so a mix assigns them: each job
draws, by crc32 of its id (the same job always gets the same answer), one entry of the mix
(`H100=0.2,H100|A100=0.5`: 20% accept only H100, 50% H100 else A100, the rest any model).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

from ..core.pools import MAX_MODELS, canonical_model, parse_gpu_types
from ..core.state import ClusterState


def node_models(text: str, nodes: int) -> tuple[str, ...]:
    """Each node's model for `--gpu-types` on a cluster of `nodes` nodes (in registration order)."""
    models = parse_gpu_types(text)
    if len(models) != nodes:
        raise ValueError(f"--gpu-types {text!r} names {len(models)} nodes; the cluster has {nodes}")
    return tuple(models)


def parse_mix(text: str) -> list[tuple[tuple[str, ...], float]]:
    """`H100=0.2,H100|A100=0.5` -> [(("H100",), 0.2), (("H100", "A100"), 0.5)]; shares sum <= 1."""
    out: list[tuple[tuple[str, ...], float]] = []
    for item in (p.strip() for p in text.split(",") if p.strip()):
        types, sep, share = item.partition("=")
        names = tuple(t.strip() for t in types.split("|"))
        try:
            value = float(share)
        except ValueError:
            value = -1.0
        if not sep or not all(names) or len(names) > MAX_MODELS or not 0 <= value <= 1:
            raise ValueError(f"--gpu-type-mix entry {item!r}: expected TYPE[|TYPE...]=SHARE, e.g. H100|A100=0.5")
        out.append((names, value))
    if sum(s for _, s in out) > 1 + 1e-9:
        raise ValueError(f"--gpu-type-mix {text!r}: shares add up to more than 1")
    return out


def types_of(job_id: str, mix: list[tuple[tuple[str, ...], float]]) -> tuple[str, ...]:
    """The GPU types a job accepts under the mix (empty: any)."""
    x = (zlib.crc32(f"{job_id}/gpu-type".encode()) % 10_000) / 10_000
    for names, share in mix:
        if x < share:
            return names
        x -= share
    return ()


def pool_summary(state: ClusterState, held_gpu_s: Mapping[str, Mapping[str, float]], queue_s: Mapping[str, list[float]],
                 span_s: float) -> dict[str, dict]:
    """Per pool: its GPUs, GPU-hours held by each team, utilization over the run, jobs started
    there and their mean wait. `held_gpu_s`: pool -> team -> GPU-seconds; `queue_s`: pool ->
    the waits of the jobs that started there."""
    size: dict[str, int] = {}
    for rec in state.gpus.values():
        size[canonical_model(rec.model)] = size.get(canonical_model(rec.model), 0) + 1
    out = {}
    for pool, n in sorted(size.items()):
        teams = held_gpu_s.get(pool, {})
        waits = queue_s.get(pool, [])
        held = sum(teams.values())
        out[pool] = {"gpus": n, "utilization": round(held / (n * span_s), 4) if span_s > 0 else 0.0,
                     "gpu_hours_by_team": {t: round(s / 3600, 3) for t, s in sorted(teams.items())},
                     "jobs_started": len(waits), "mean_queue_h": round(sum(waits) / len(waits) / 3600, 3) if waits else 0.0}
    return out


__all__ = ["node_models", "parse_mix", "pool_summary", "types_of"]
