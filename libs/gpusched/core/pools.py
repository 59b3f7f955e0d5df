"""GPU models as pools (issue 30): which pool a GPU is in, which pools a job accepts, in order.

A pool is a canonical GPU model name: `canonical_model("NVIDIA H100 80GB HBM3") == "H100"`.
Per-model quotas (`TeamQuota.models`) are keyed by it and matched by equality, so "H100"
never also matches an "H100-NVL" pool by accident of a substring; a job's `gpu_type` keeps its
older, looser rule (case-insensitive substring of the registered model), so
`--gpu-type A100-SXM4-80GB` still picks one variant out of the A100 pool.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import JobSpec, TeamQuota

#: Vendor and product-line words that name no model ("NVIDIA GeForce RTX 4090" is RTX4090).
_NOISE = frozenset({"nvidia", "tesla", "geforce", "quadro", "sim"})
_TOKEN = re.compile(r"[A-Za-z0-9]+")
#: Memory of the simulated models `up --gpu-types` and `sim --gpu-types` know (else 80 GiB).
SIM_MEMORY_MB = {"H100": 81920, "H200": 143360, "A100": 81920, "A10G": 24576, "L4": 23034, "L40S": 46068,
                 "V100": 32768, "T4": 15360}
#: How many models one `--gpu-types` or job may name.
MAX_MODELS = 8


@functools.lru_cache(maxsize=1024)
@functools.lru_cache(maxsize=1024)  # a pure function of a few distinct names, asked once per GPU
def canonical_model(model: str) -> str:
    """The pool a registered model belongs to: its first model token, upper case ("Tesla
    V100-SXM2-16GB" -> "V100", "SIM-H100-80GB" -> "H100"); a token without a digit joins the
    next ("RTX 4090" -> "RTX4090"). "unknown" when nothing is left."""
    tokens = [t for t in _TOKEN.findall(model) if t.lower() not in _NOISE]
    if not tokens:
        return "UNKNOWN"
    head = tokens[0].upper()
    if not any(c.isdigit() for c in head) and len(tokens) > 1:
        head += tokens[1].upper()
    return head


def type_matches(want: str, model: str) -> bool:
    """A job's `gpu_type` entry matches a registered model: case-insensitive substring."""
    return want.lower() in model.lower()


def accepted(spec: JobSpec) -> tuple[str, ...]:
    """The GPU types a job accepts, in its order of preference (empty: any)."""
    if spec.gpu_type is None:
        return ()
    return (spec.gpu_type, *spec.gpu_type_fallback)


def has_models(quota: TeamQuota | None) -> bool:
    return quota is not None and bool(quota.models)


def model_guaranteed(quota: TeamQuota | None, pool: str) -> int:
    m = quota.models.get(pool) if quota is not None else None
    return 0 if m is None else m.guaranteed


def parse_gpu_types(text: str) -> list[str]:
    """`2:H100,2:A100` -> the model of each node in order (`up --gpu-types`, `sim --gpu-types`).
    A bare model counts one node. Raises ValueError with the precise problem."""
    out: list[str] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            raise ValueError(f"empty entry in {text!r}: expected COUNT:MODEL[,COUNT:MODEL...]")
        count, sep, model = item.rpartition(":")
        model = model.strip()
        n = int(count) if sep and count.strip().isdigit() else (1 if not sep else -1)
        if n < 1 or not _TOKEN.fullmatch(model.replace("-", "")):
            raise ValueError(f"bad entry {item!r} in {text!r}: expected COUNT:MODEL, e.g. 2:H100")
        out += [model] * n
    if len(set(out)) > MAX_MODELS:
        raise ValueError(f"{text!r} names {len(set(out))} models; at most {MAX_MODELS}")
    return out


def pool_text(rows: dict[str, dict]) -> str:
    """`H100 2/8<=16 A100 0/0`: held / guaranteed (<= per-model limit) per pool."""
    return " ".join(f"{p} {r['held']:g}/{r['guaranteed']}" + ("" if r["limit"] is None else f"<={r['limit']}")
                    for p, r in rows.items())


def sim_memory_mb(model: str) -> int:
    return SIM_MEMORY_MB.get(canonical_model(model), 81920)


__all__ = ["MAX_MODELS", "accepted", "canonical_model", "has_models", "model_guaranteed",
           "parse_gpu_types", "pool_text", "sim_memory_mb", "type_matches"]
