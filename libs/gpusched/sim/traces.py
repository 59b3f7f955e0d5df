"""Trace loaders: every supported format becomes a list of `TraceJob`, sorted by submit time.

Formats (`load_trace(path, fmt)`):

- `csv`: the documented generic format, header `job_id,submit_time_s,duration_s,num_gpus,team`
  and optional `priority,preemptible,min_gpus,max_gpus,time_limit_s,util_pct`. `util_pct` is the
  job's mean GPU utilization while it runs (0..100; empty: busy): a job under the policy's
  `idle_util_pct` is reported idle by the simulated reconciler `idle_after_s` after each start.
  A bad row raises `TraceError` naming the file and line.
- `philly`: `philly.csv` of the Pollux artifact (`timestamp,duration,num_gpus,gpu_time,cluster`);
  the Philly virtual cluster (`cluster`) is the team. Rows are sorted by timestamp (stable).
- `tiresias`: the Tiresias simulator format (`job_id,num_gpu,submit_time,...,duration,...`). If a
  `<name>_jobs_vc.csv` (`job_id,timestamp,vc`) lies beside a `<name>_tiresias.csv`, the VC is the
  team (the derived Philly week); otherwise every job belongs to team `default`.
- `alibaba`: `openb_pod_list_*.csv` of Alibaba's cluster-trace-gpu-v2023. See `load_alibaba`.

Traces without priority or preemptibility get `default_class(job_id)`: a deterministic mapping
by a hash of the job id, documented there. Durations are run times *alone, at full size, on
the tightest placement*: the simulator's runtime model slows them down, never speeds them up.
"""

from __future__ import annotations

import csv
import zlib
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from msgspec import Struct, structs

from ..core.model import PRIORITY_RANK, Priority, TeamQuota

FORMATS = ("philly", "tiresias", "csv", "alibaba")
CSV_REQUIRED = ("job_id", "submit_time_s", "duration_s", "num_gpus", "team")
CSV_OPTIONAL = ("priority", "preemptible", "min_gpus", "max_gpus", "time_limit_s", "util_pct")

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
#: The trace `gpusched sim` runs without `--trace`: one week of Philly (bundled, CC BY 4.0).
DEFAULT_TRACE = DATA_DIR / "philly_2017-10-23_7d_tiresias.csv"


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


class TraceJob(Struct, frozen=True):
    """One job of a trace. `gpus` is the size the duration was measured at; an elastic job may
    run between `min_gpus` and `max_gpus` (its speed scales with the GPUs it holds)."""

    job_id: str
    submit_s: float
    duration_s: float
    gpus: int
    team: str
    priority: Priority = "normal"
    preemptible: bool = True
    min_gpus: int | None = None
    max_gpus: int | None = None
    time_limit_s: float | None = None
    util_pct: float | None = None  # mean GPU utilization while running (None: busy)
    #: CPUs and memory (MiB) per node, where the trace has them (Alibaba's cpu_milli, memory_mib)
    cpus: float | None = None
    memory_mb: int | None = None
    #: Thousandths of ONE GPU a sharing job asks (Alibaba's `gpu_milli`; 1000: whole GPUs).
    gpu_milli: int = 1000

    @property
    def fraction(self) -> float | None:
        """The share of one GPU it asks for (None: whole GPUs)."""
        return self.gpu_milli / 1000 if self.gpus == 1 and 0 < self.gpu_milli < 1000 else None

    @property
    def gpu_s(self) -> float:
        return self.duration_s * (self.fraction or self.gpus)


def default_class(job_id: str) -> tuple[Priority, bool]:
    """(priority, preemptible) for traces that carry neither, deterministic in the job id:
    crc32(job_id) % 100 < 10 -> high, not preemptible (10%: production runs that must not stop);
    < 15 -> low, preemptible (5%: best-effort sweeps); else normal, preemptible (85%)."""
    h = zlib.crc32(job_id.encode()) % 100
    if h < 10:
        return "high", False
    if h < 15:
        return "low", True
    return "normal", True


def _job(job_id: str, submit: float, duration: float, gpus: int, team: str) -> TraceJob:
    priority, preemptible = default_class(job_id)
    return TraceJob(job_id, submit, max(1.0, duration), gpus, team, priority, preemptible)


def _rows(path: Path, required: Iterable[str]) -> Iterable[tuple[int, dict[str, str]]]:
    """(line number, row) of a CSV file, after checking the header has the required columns."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in required if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}:1: missing column(s) {', '.join(missing)}; header is {reader.fieldnames}")
        for row in reader:
            yield reader.line_num, row


def _num(path: Path, line: int, row: dict[str, str], col: str, kind=float, minimum: float | None = None):
    raw = (row.get(col) or "").strip()
    try:
        value = kind(raw)
    except ValueError:
        raise TraceError(f"{path}:{line}: column {col}: {raw!r} is not a valid {kind.__name__}") from None
    if minimum is not None and value < minimum:
        raise TraceError(f"{path}:{line}: column {col}: {value} is below the minimum {minimum}")
    return value


def _sorted(jobs: list[TraceJob]) -> list[TraceJob]:
    return sorted(jobs, key=lambda j: j.submit_s)  # stable: ties keep file order


# --- generic csv ----------------------------------------------------------------------------


def load_csv(path: Path) -> list[TraceJob]:
    jobs: list[TraceJob] = []
    seen: set[str] = set()
    for line, row in _rows(path, CSV_REQUIRED):
        job_id = (row["job_id"] or "").strip()
        if not job_id:
            raise TraceError(f"{path}:{line}: empty job_id")
        if job_id in seen:
            raise TraceError(f"{path}:{line}: duplicate job_id {job_id!r}")
        seen.add(job_id)
        submit = _num(path, line, row, "submit_time_s", float, 0.0)
        duration = _num(path, line, row, "duration_s", float, 0.0)
        if duration <= 0:
            raise TraceError(f"{path}:{line}: column duration_s: must be > 0")
        gpus = _num(path, line, row, "num_gpus", int, 1)
        team = (row["team"] or "").strip()
        if not team:
            raise TraceError(f"{path}:{line}: empty team")
        priority, preemptible = default_class(job_id)
        if (given := (row.get("priority") or "").strip()):
            if given not in PRIORITY_RANK:
                raise TraceError(f"{path}:{line}: column priority: {given!r} is not one of {', '.join(PRIORITY_RANK)}")
            priority = cast(Priority, given)
        if (row.get("preemptible") or "").strip():
            flag = row["preemptible"].strip().lower()
            if flag not in ("true", "false", "1", "0", "yes", "no"):
                raise TraceError(f"{path}:{line}: column preemptible: {flag!r} is not a boolean")
            preemptible = flag in ("true", "1", "yes")
        min_gpus = _num(path, line, row, "min_gpus", int, 1) if (row.get("min_gpus") or "").strip() else None
        max_gpus = _num(path, line, row, "max_gpus", int, 1) if (row.get("max_gpus") or "").strip() else None
        if min_gpus is not None and min_gpus > gpus:
            raise TraceError(f"{path}:{line}: min_gpus {min_gpus} > num_gpus {gpus}")
        if max_gpus is not None and max_gpus < gpus:
            raise TraceError(f"{path}:{line}: max_gpus {max_gpus} < num_gpus {gpus}")
        limit = _num(path, line, row, "time_limit_s", float, 0.0) if (row.get("time_limit_s") or "").strip() else None
        util = _num(path, line, row, "util_pct", float, 0.0) if (row.get("util_pct") or "").strip() else None
        if util is not None and util > 100:
            raise TraceError(f"{path}:{line}: column util_pct: {util} is above 100")
        jobs.append(TraceJob(job_id, submit, duration, gpus, team, priority, preemptible, min_gpus, max_gpus, limit,
                             util))
    return _sorted(jobs)


# --- Philly (Pollux artifact) ---------------------------------------------------------------


def load_philly(path: Path) -> list[TraceJob]:
    raw: list[tuple[datetime, float, int, str, int]] = []
    for line, row in _rows(path, ("timestamp", "duration", "num_gpus", "cluster")):
        try:
            stamp = datetime.strptime(row["timestamp"].strip(), "%Y-%m-%d %H:%M:%S")
        except ValueError:
            raise TraceError(f"{path}:{line}: column timestamp: {row['timestamp']!r} is not YYYY-MM-DD HH:MM:SS") from None
        duration = _num(path, line, row, "duration", float, 0.0)
        gpus = _num(path, line, row, "num_gpus", int, 1)
        raw.append((stamp, duration, gpus, row["cluster"].strip() or "default", line))
    raw.sort(key=lambda r: r[0])
    if not raw:
        return []
    t0 = raw[0][0]
    # The job id is the data line number (1-based): stable whatever the sort does.
    return [_job(str(line - 1), (s - t0).total_seconds(), d, g, team) for s, d, g, team, line in raw]


# --- Tiresias format (and the derived Philly week) ------------------------------------------


def _teams_beside(path: Path) -> dict[str, str]:
    name = path.name
    if not name.endswith("_tiresias.csv"):
        return {}
    side = path.with_name(name[: -len("_tiresias.csv")] + "_jobs_vc.csv")
    if not side.exists():
        return {}
    return {row["job_id"].strip(): row["vc"].strip() for _, row in _rows(side, ("job_id", "vc"))}


def load_tiresias(path: Path) -> list[TraceJob]:
    teams = _teams_beside(path)
    jobs: list[TraceJob] = []
    for line, row in _rows(path, ("job_id", "num_gpu", "submit_time", "duration")):
        job_id = row["job_id"].strip()
        team = teams.get(job_id, "default")
        if teams and job_id not in teams:
            raise TraceError(f"{path}:{line}: job {job_id} has no VC in the _jobs_vc.csv beside it")
        jobs.append(_job(job_id, _num(path, line, row, "submit_time", float, 0.0),
                         _num(path, line, row, "duration", float, 0.0),
                         _num(path, line, row, "num_gpu", int, 1), team))
    return _sorted(jobs)


# --- Alibaba cluster-trace-gpu-v2023 --------------------------------------------------------

#: qos -> (priority, preemptible). LS (latency-sensitive) and Guaranteed pods must not be
#: preempted; Burstable is normal and preemptible; BE (best effort) is low and preemptible.
ALIBABA_QOS: dict[str, tuple[Priority, bool]] = {"LS": ("high", False), "Guaranteed": ("high", False), "Burstable": ("normal", True), "BE": ("low", True)}


def load_alibaba(path: Path) -> list[TraceJob]:
    """Mapping (documented in docs/results.md): pods with `num_gpu == 0` (CPU only) and pods that
    were never scheduled (empty `scheduled_time`) are skipped; submit = `creation_time`;
    duration = `deletion_time - scheduled_time` (at least 1 s); a GPU-sharing pod
    (`gpu_milli < 1000`, one GPU) keeps its share in `gpu_milli`: the simulator runs it as a
    fractional job (`sim --fractions honour`, the default) or rounds it up to a whole GPU
    (`--fractions round`, what gpusched did before it shared GPUs); priority and preemptibility come from `qos`
    (`ALIBABA_QOS`). The trace has no teams: the team is the qos class, so fairness is measured
    between workload classes. A pod's `cpu_milli` and `memory_mib` are its CPUs and memory
    (`--node-cpus`/`--node-mem` give the simulated nodes theirs; without them they do not count)."""
    jobs: list[TraceJob] = []
    for line, row in _rows(path, ("name", "num_gpu", "gpu_milli", "qos", "creation_time", "deletion_time", "scheduled_time")):
        gpus = _num(path, line, row, "num_gpu", int, 0)
        if gpus == 0 or not row["scheduled_time"].strip():
            continue
        submit = _num(path, line, row, "creation_time", float, 0.0)
        duration = _num(path, line, row, "deletion_time", float) - _num(path, line, row, "scheduled_time", float)
        qos = row["qos"].strip()
        if qos not in ALIBABA_QOS:
            raise TraceError(f"{path}:{line}: column qos: unknown class {qos!r}")
        priority, preemptible = ALIBABA_QOS[qos]
        milli = _num(path, line, row, "gpu_milli", int, 0)
        cpus = _num(path, line, row, "cpu_milli", float, 0.0) / 1000 if (row.get("cpu_milli") or "").strip() else 0.0
        mem = _num(path, line, row, "memory_mib", int, 0) if (row.get("memory_mib") or "").strip() else 0
        jobs.append(TraceJob(row["name"].strip(), submit, max(1.0, duration), gpus, qos, priority, preemptible,
                             cpus=cpus or None, memory_mb=mem or None,
                             gpu_milli=milli if gpus == 1 and 0 < milli < 1000 else 1000))
    return _sorted(jobs)


LOADERS = {"csv": load_csv, "philly": load_philly, "tiresias": load_tiresias, "alibaba": load_alibaba}


def guess_format(path: Path) -> str:
    name = path.name
    if name.startswith("openb_pod_list"):
        return "alibaba"
    if name.startswith("philly") and not name.endswith("_tiresias.csv"):
        return "philly"
    with open(path, newline="") as f:
        header = f.readline()
    if "num_gpu," in header and "submit_time" in header:
        return "tiresias"
    return "csv"


def load_trace(path: str | Path | None = None, fmt: str | None = None, limit: int | None = None) -> list[TraceJob]:
    """Load a trace (default: the bundled Philly week); `limit` keeps the first N jobs by submit."""
    p = Path(path) if path else DEFAULT_TRACE
    if not p.exists():
        raise TraceError(f"{p}: no such trace file")
    fmt = fmt or guess_format(p)
    if fmt not in LOADERS:
        raise TraceError(f"unknown trace format {fmt!r}; expected one of {', '.join(FORMATS)}")
    jobs = LOADERS[fmt](p)
    if limit is not None:
        jobs = jobs[:limit]
    if jobs:  # time 0 is the first submission
        t0 = jobs[0].submit_s
        if t0:
            jobs = [TraceJob(j.job_id, j.submit_s - t0, *_rest(j)) for j in jobs]
    return jobs


def jittered(jobs: list[TraceJob], seed: int, spread_s: float = 1.0) -> list[TraceJob]:
    """The trace with each submission moved later by under `spread_s` (crc32 of the seed and the
    job id), in submit order. A schedule of a saturated cluster is chaotic: a change this small
    takes a replay down another path, so the spread of a figure over seeds is what one run's
    figure is worth, and a knob compared on the same seeds is compared on the same traces."""
    moved = [structs.replace(j, submit_s=j.submit_s + spread_s * zlib.crc32(f"{seed}/{j.job_id}".encode()) / 2**32)
             for j in jobs]
    return sorted(moved, key=lambda j: j.submit_s)


def _rest(j: TraceJob) -> tuple:
    return (j.duration_s, j.gpus, j.team, j.priority, j.preemptible, j.min_gpus, j.max_gpus, j.time_limit_s, j.util_pct,
            j.cpus, j.memory_mb, j.gpu_milli)


def parse_burst(text: str) -> dict[str, Any]:
    """`team=X,at=86400,count=200,gpus=1,duration=600[,every=0][,priority=interactive]`."""
    spec: dict[str, Any] = {"team": "interactive", "at": 0.0, "count": 100, "gpus": 1, "duration": 600.0, "every": 0.0,
            "priority": "interactive"}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in spec:
            raise TraceError(f"--interactive-burst: bad item {part!r}; keys are {', '.join(spec)}")
        try:
            spec[key] = type(spec[key])(value)
        except ValueError:
            raise TraceError(f"--interactive-burst: {key}={value!r} is not a valid {type(spec[key]).__name__}") from None
    if spec["priority"] not in PRIORITY_RANK:
        raise TraceError(f"--interactive-burst: priority {spec['priority']!r} is not one of {', '.join(PRIORITY_RANK)}")
    if spec["count"] < 0 or spec["gpus"] < 1 or spec["duration"] <= 0:
        raise TraceError("--interactive-burst: count >= 0, gpus >= 1 and duration > 0 are required")
    return spec


def burst_jobs(spec: dict) -> list[TraceJob]:
    """The chaos scene: `count` interactive jobs of one team, all at `at` (or `every` s apart).
    Interactive jobs are not preemptible (someone is waiting at a terminal)."""
    return [TraceJob(f"burst-{i}", spec["at"] + i * spec["every"], spec["duration"], spec["gpus"], spec["team"],
                     spec["priority"], False) for i in range(spec["count"])]


def merge(*traces: list[TraceJob]) -> list[TraceJob]:
    return _sorted([j for t in traces for j in t])


def load_quotas(path: str | Path) -> dict[str, TeamQuota]:
    """Team quotas from a CSV with the header `team,guaranteed,weight,limit` (`gpusched sim
    --quotas`): the same terms `gpusched quota` sets live. Empty weight: 1; empty limit: none.
    An optional `model` column: a row with one sets the team's terms on that GPU pool
    (guaranteed and limit; `gpusched quota --model`), and the team's guarantee becomes the sum of
    its per-model ones (docs/gpu-pools.md). A bad row raises TraceError naming the file, line and column."""
    import csv

    import msgspec

    out: dict[str, TeamQuota] = {}
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        missing = {"team", "guaranteed", "weight", "limit"} - set(rows.fieldnames or [])
        if missing:
            raise TraceError(f"{path}:1: missing column(s) {', '.join(sorted(missing))}; "
                             "expected team,guaranteed,weight,limit")
        for line, row in enumerate(rows, 2):
            team = (row["team"] or "").strip()
            if not team:
                raise TraceError(f"{path}:{line}: column team: empty")
            raw = {"guaranteed": (row["guaranteed"] or "0").strip(), "weight": (row["weight"] or "1").strip(),
                   "limit": (row["limit"] or "").strip() or None}
            model = (row.get("model") or "").strip()
            try:
                if model:
                    out[team] = _with_model(out.get(team), model, msgspec.convert(raw, TeamQuota, strict=False))
                else:
                    out[team] = msgspec.convert(raw, TeamQuota, strict=False)
            except msgspec.ValidationError as err:
                raise TraceError(f"{path}:{line}: {err}") from None
    return out


def _with_model(current: TeamQuota | None, model: str, row: TeamQuota) -> TeamQuota:
    """`current` (or a fresh quota) with the row's guaranteed and limit as its terms on `model`."""
    import msgspec

    from ..core.model import ModelQuota
    from ..core.pools import canonical_model

    q = current if current is not None else TeamQuota()
    models = {**q.models, canonical_model(model): ModelQuota(guaranteed=row.guaranteed, limit=row.limit)}
    return msgspec.structs.replace(q, models=models, guaranteed=sum(m.guaranteed for m in models.values()))
