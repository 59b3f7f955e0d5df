"""Every bound on what a client may send, in one place.

The msgspec types (`model.py`, `commands.py`, `heartbeat.py`) carry these as `Meta` constraints,
so decoding rejects an out-of-range field with a message that names it and the JSON Schemas in
`schemas/` document the same numbers. What one field cannot say alone (total sizes, reserved
names, paths) is checked by `spec_problem`, which admission runs before anything is appended.
`schemas/LIMITS.md` is generated from this module (`gpusched schemas`).

The sizes are chosen so that the largest event gpusched writes (a `JobSubmitted` with a spec at
every maximum, plus headers) stays far below NATS's default 1 MiB `max_payload`; services refuse
to start against a server that advertises less than `MIN_SERVER_MAX_PAYLOAD`.
"""

from __future__ import annotations

import math
import posixpath
import re
from typing import Annotated

from msgspec import Meta


def _any_case(word: str) -> str:
    """A regex matching `word` in any letter case, written without inline flags (JSON Schema
    patterns are ECMA 262, which has none)."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in word)


#: Names that read as "no value" in JSON, YAML, shells or SQL: refused as team or node names.
RESERVED_NAMES = ("null", "none", "nil", "true", "false", "undefined", "nan")
_NOT_RESERVED = "(?!(?:" + "|".join(_any_case(w) for w in RESERVED_NAMES) + ")$)"

NAME_MAX = 63
#: Team (and user) names: a letter or digit, then letters, digits, `_` or `-`. No dots (they
#: split NATS subjects), so `.`, `..` and `a.b` are refused, and none of RESERVED_NAMES.
NAME_PATTERN = rf"^{_NOT_RESERVED}[A-Za-z0-9][A-Za-z0-9_-]{{0,{NAME_MAX - 1}}}$"
#: Node names may be host names: dot-separated labels of the team grammar (`gpu01.dc1`).
NODE_PATTERN = rf"^{_NOT_RESERVED}(?=.{{1,{NAME_MAX}}}$)[A-Za-z0-9][A-Za-z0-9_-]*(?:\.[A-Za-z0-9][A-Za-z0-9_-]*)*$"

MAX_GPUS = 65_536  # per job, and per team quota
MAX_TIME_LIMIT_S = 366 * 86_400.0
MIN_TIME_LIMIT_S = 1.0
MAX_RESTARTS = 1_000
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e6
MAX_ARGS = 1_024  # command: the program and its arguments
MAX_ARG_CHARS = 8_192
MAX_COMMAND_BYTES = 64 * 1024  # all arguments, UTF-8
MAX_ENV = 128
MAX_ARRAY_TASKS = 1_000  # tasks of one job array (`submit --array`)
MAX_ENV_KEY_CHARS = 128
MAX_ENV_VALUE_CHARS = 8_192
MAX_ENV_BYTES = 64 * 1024  # all keys and values, UTF-8
MAX_SECRET_ENV = 32
MAX_SECRET_BYTES = 64 * 1024  # one secret file, read by the node agent at launch
MAX_PATH_CHARS = 1_024
MAX_JOB_NAME_CHARS = 128
MAX_REASON_CHARS = 1_024
MAX_REQUEST_ID_CHARS = 128
MAX_SPEC_BYTES = 160 * 1024  # the whole spec as JSON
#: The largest event payload plus headers gpusched appends; `EventLog.append` refuses more.
MAX_EVENT_BYTES = 256 * 1024
#: A server must accept at least this (its `max_payload`), or services refuse to start.
MIN_SERVER_MAX_PAYLOAD = MAX_EVENT_BYTES
MIN_NATS_SERVER = (2, 12, 0)  # atomic batches (2.11 half-stores a stale batch)

#: Environment keys: POSIX portable names (no `=`, no NUL, not empty).
ENV_KEY_PATTERN = rf"^[A-Za-z_][A-Za-z0-9_]{{0,{MAX_ENV_KEY_CHARS - 1}}}$"
#: Any text without NUL (a C string ends there: argv and environ cannot hold one).
NO_NUL_PATTERN = "^[^\\x00]*$"
#: Absolute, no NUL.
ABS_PATH_PATTERN = "^/[^\\x00]*$"
#: Checkpoint directories must not live in kernel or device file systems.
FORBIDDEN_PATH_ROOTS = ("/proc", "/sys", "/dev")
#: The simulated placeholder job reads these from `spec.env`; any other GPUSCHED_ key is the
#: scheduler's to set and refused in a spec.
SIM_ENV = {"GPUSCHED_SIM_DURATION_S": "seconds", "GPUSCHED_SIM_EXIT_CODE": "exit code",
           "GPUSCHED_SIM_CHECKPOINT_S": "seconds or never", "GPUSCHED_SIM_UTIL": "a GPU utilization percentage"}
RESERVED_ENV_PREFIX = "GPUSCHED_"

# --- the annotated types the Structs use -------------------------------------------------------

Name = Annotated[str, Meta(pattern=NAME_PATTERN, description="team or user name")]
NodeName = Annotated[str, Meta(pattern=NODE_PATTERN, description="node name (host-name-like labels)")]
GpuCount = Annotated[int, Meta(ge=1, le=MAX_GPUS)]
QuotaGpus = Annotated[int, Meta(ge=0, le=MAX_GPUS)]
Weight = Annotated[float, Meta(ge=MIN_WEIGHT, le=MAX_WEIGHT)]
TimeLimit = Annotated[float, Meta(ge=MIN_TIME_LIMIT_S, le=MAX_TIME_LIMIT_S)]
#: CPUs of a job on each of its nodes (fractions allowed: a CFS quota) and its memory there (MiB).
MAX_CPUS = 4096
MAX_MEMORY_MB = 2**24  # 16 TiB
Cpus = Annotated[float, Meta(gt=0, le=MAX_CPUS)]
MemoryMb = Annotated[int, Meta(ge=4, le=MAX_MEMORY_MB)]
#: A share of one GPU (`--gpu-fraction`: strictly between none and all of it; at least 1/1000,
#: Alibaba's `gpu_milli` grain) and a GPU memory ask (MiB, `--gpu-memory`).
GpuFraction = Annotated[float, Meta(ge=0.001, lt=1.0)]
GpuMemoryMb = Annotated[int, Meta(ge=1, le=MAX_MEMORY_MB)]
#: A MIG GPU-instance profile (`--mig 1g.10gb`, `core/mig.py`), and how many slices of it a job takes.
MIG_PROFILE_PATTERN = r"^[1-7]g\.[1-9][0-9]{0,3}gb$"
MAX_MIG_SLICES = 7
MigProfileName = Annotated[str, Meta(pattern=MIG_PROFILE_PATTERN)]
MigCount = Annotated[int, Meta(ge=1, le=MAX_MIG_SLICES)]
#: A GPU's MIG geometry: one profile per slice (`gpusched mig set`).
MigGeometry = Annotated[list[MigProfileName], Meta(max_length=MAX_MIG_SLICES)]
Restarts = Annotated[int, Meta(ge=0, le=MAX_RESTARTS)]
Arg = Annotated[str, Meta(max_length=MAX_ARG_CHARS, pattern=NO_NUL_PATTERN)]
Command = Annotated[list[Arg], Meta(max_length=MAX_ARGS)]
EnvKey = Annotated[str, Meta(pattern=ENV_KEY_PATTERN)]
EnvValue = Annotated[str, Meta(max_length=MAX_ENV_VALUE_CHARS, pattern=NO_NUL_PATTERN)]
Env = Annotated[dict[EnvKey, EnvValue], Meta(max_length=MAX_ENV)]
AbsPath = Annotated[str, Meta(min_length=1, max_length=MAX_PATH_CHARS, pattern=ABS_PATH_PATTERN)]
SecretEnv = Annotated[dict[EnvKey, AbsPath], Meta(max_length=MAX_SECRET_ENV)]
JobName = Annotated[str, Meta(max_length=MAX_JOB_NAME_CHARS, pattern=NO_NUL_PATTERN)]
Reason = Annotated[str, Meta(max_length=MAX_REASON_CHARS, pattern=NO_NUL_PATTERN)]
#: A fold setting's span of log time (usage half-life, forgetting horizon): an hour to ten years.
FoldSpan = Annotated[float, Meta(ge=3600.0, le=10 * 365 * 86_400.0)]
#: Node labels and job constraints: `key=value` pairs, small and printable.
LabelKey = Annotated[str, Meta(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-/]*$")]
LabelValue = Annotated[str, Meta(max_length=63, pattern=r"^[A-Za-z0-9_.\-/]*$")]
Labels = Annotated[dict[LabelKey, LabelValue], Meta(max_length=32)]
GpuType = Annotated[str, Meta(min_length=1, max_length=63, pattern=NO_NUL_PATTERN)]
#: An OCI image reference (`[registry[:port]/]name[:tag][@digest]`): it starts with a letter or
#: digit, so no reference can be read as an option of the container runtime (`--privileged`).
MAX_IMAGE_CHARS = 512
IMAGE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$"
ImageRef = Annotated[str, Meta(min_length=1, max_length=MAX_IMAGE_CHARS, pattern=IMAGE_PATTERN)]


# --- what one field cannot say alone ------------------------------------------------------------


def _utf8(texts) -> int:
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


def path_problem(field: str, path: str) -> str | None:
    parts = path.split("/")
    if ".." in parts:
        return f"{field} must not contain '..' ({path!r})"
    for root in FORBIDDEN_PATH_ROOTS:
        if path == root or path.startswith(root + "/"):
            return f"{field} must not be under {root} ({path!r})"
    return None


def _sim_env_problem(key: str, value: str) -> str | None:
    if key == "GPUSCHED_SIM_EXIT_CODE":
        ok = value.strip().lstrip("-").isdigit() and -255 <= int(value) <= 255
        return None if ok else f"spec.env[{key}] must be an integer exit code, got {value[:40]!r}"
    if key == "GPUSCHED_SIM_CHECKPOINT_S" and value == "never":
        return None
    if key == "GPUSCHED_SIM_UTIL":
        ok = value.strip().replace(".", "", 1).isdigit() and 0 <= float(value) <= 100
        return None if ok else f"spec.env[{key}] must be a percentage between 0 and 100, got {value[:40]!r}"
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_TIME_LIMIT_S):
        return f"spec.env[{key}] must be {SIM_ENV[key]} between 0 and {MAX_TIME_LIMIT_S:g}, got {value[:40]!r}"
    return None


def env_problem(env: dict[str, str]) -> str | None:
    size = _utf8(env) + _utf8(env.values())
    if size > MAX_ENV_BYTES:
        return f"spec.env holds {size} bytes; at most {MAX_ENV_BYTES}"
    for key, value in env.items():
        if key in SIM_ENV:
            problem = _sim_env_problem(key, value)
            if problem:
                return problem
        elif key.startswith(RESERVED_ENV_PREFIX):
            return f"spec.env[{key}]: the {RESERVED_ENV_PREFIX} prefix is reserved for the scheduler"
    return None


def spec_problem(spec) -> str | None:
    """Why a decoded `JobSpec` is out of bounds in a way its field types cannot say, or None."""
    size = _utf8(spec.command)
    if size > MAX_COMMAND_BYTES:
        return f"spec.command holds {size} bytes; at most {MAX_COMMAND_BYTES}"
    if spec.command and not spec.command[0].strip():
        return "spec.command[0] (the program) is empty"
    problem = env_problem(spec.env)
    if problem:
        return problem
    for key in spec.secret_env:
        if key in spec.env:
            return f"{key} is in both spec.env and spec.secret_env"
        if key.startswith(RESERVED_ENV_PREFIX):
            return f"spec.secret_env[{key}]: the {RESERVED_ENV_PREFIX} prefix is reserved for the scheduler"
        problem = path_problem(f"spec.secret_env[{key}]", spec.secret_env[key])
        if problem:
            return problem
    if spec.checkpoint_dir is not None:
        problem = path_problem("spec.checkpoint_dir", spec.checkpoint_dir)
        if problem:
            return problem
    if spec.gpu_type_fallback and spec.gpu_type is None:
        return "spec.gpu_type_fallback needs spec.gpu_type (the first GPU type the job accepts)"
    return share_problem(spec) or mig_problem(spec)


def mig_problem(spec) -> str | None:
    """A MIG job asks for slices of ONE GPU (`mig_count` of profile `mig`), whole or shared never."""
    if spec.mig is None:
        return None if spec.mig_count == 1 else "spec.mig_count needs spec.mig (the profile of the slices)"
    if spec.gpu_fraction is not None or spec.gpu_memory_mb is not None:
        return "spec.mig is exclusive with spec.gpu_fraction and spec.gpu_memory_mb: a slice is a hard partition"
    if spec.gpus != 1 or spec.min_gpus not in (None, 1):
        return f"a MIG job takes slices of one GPU: spec.gpus must be 1, not {spec.gpus} (ask for more slices instead)"
    return None


def share_problem(spec) -> str | None:
    """A fractional job asks for a share of ONE GPU, by fraction or by memory, not both."""
    if spec.gpu_fraction is None and spec.gpu_memory_mb is None:
        return None
    if spec.gpu_fraction is not None and spec.gpu_memory_mb is not None:
        return "spec.gpu_fraction and spec.gpu_memory_mb are exclusive: ask for a share by one of them"
    if spec.gpus != 1 or spec.min_gpus not in (None, 1):
        return f"a fractional job takes a share of one GPU: spec.gpus must be 1, not {spec.gpus}"
    return None


def checkpoint_dir_problem(path: str | None, roots: tuple[str, ...]) -> str | None:
    """A checkpoint_dir outside the configured checkpoint roots (the nodes create and hand over
    directories only under them); None when allowed or when no roots are configured."""
    if path is None or not roots:
        return None
    norm = posixpath.normpath(path)
    if any(norm == r.rstrip("/") or norm.startswith(r.rstrip("/") + "/") for r in roots):
        return None
    return (f"spec.checkpoint_dir {path!r} is outside the cluster's checkpoint roots ({', '.join(roots)}): nodes "
            "create checkpoint directories only there; omit it for the default <root>/<job>")


def server_problem(info: dict) -> str | None:
    """Why a NATS server (its INFO: `version`, `max_payload`) cannot serve gpusched, or None."""
    version = str(info.get("version", "0.0.0"))
    found = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
    need = ".".join(map(str, MIN_NATS_SERVER))
    if found < MIN_NATS_SERVER:
        return (f"nats-server {version} is too old: gpusched needs >= {need} (atomic batches); "
                f"upgrade the server")
    max_payload = int(info.get("max_payload", 0))
    if max_payload < MIN_SERVER_MAX_PAYLOAD:
        return (f"nats-server max_payload is {max_payload} bytes; gpusched needs >= {MIN_SERVER_MAX_PAYLOAD} "
                f"(raise max_payload in the server config)")
    return None


def document() -> str:
    """docs/limits.md: the bounds as a table, from the constants above."""
    rows = [
        ("team / user name", f"1-{NAME_MAX} letters, digits, `_` or `-`, starting with a letter or digit (so no "
                             f"`.`, `..`, `a.b`); not {', '.join(RESERVED_NAMES)} in any case"),
        ("node name", f"host-name-like labels, 1-{NAME_MAX} chars, same reserved words refused"),
        ("spec.gpus, spec.min_gpus", f"1 - {MAX_GPUS}"),
        ("spec.time_limit_s", f"{MIN_TIME_LIMIT_S:g} - {MAX_TIME_LIMIT_S:g} s (or absent)"),
        ("spec.max_restarts", f"0 - {MAX_RESTARTS}"),
        ("spec.command", f"at most {MAX_ARGS} arguments of {MAX_ARG_CHARS} chars, {MAX_COMMAND_BYTES} bytes in all; "
                         "no NUL; empty only for simulated placeholders (admission `--placeholders`)"),
        ("spec.env", f"at most {MAX_ENV} entries; keys `{ENV_KEY_PATTERN}`; values {MAX_ENV_VALUE_CHARS} chars, "
                     f"no NUL; {MAX_ENV_BYTES} bytes in all; `{RESERVED_ENV_PREFIX}*` reserved except "
                     f"{', '.join(SIM_ENV)} (numbers)"),
        ("spec.secret_env", f"at most {MAX_SECRET_ENV} entries NAME -> absolute file path; each file at most "
                            f"{MAX_SECRET_BYTES} bytes"),
        ("spec.checkpoint_dir", f"absolute, at most {MAX_PATH_CHARS} chars, no `..`, not under "
                                f"{', '.join(FORBIDDEN_PATH_ROOTS)}"),
        ("spec.mig, spec.mig_count", f"a MIG profile `<1-7>g.<GB>gb`; 1 - {MAX_MIG_SLICES} slices of it, on one GPU"),
        ("spec.name", f"at most {MAX_JOB_NAME_CHARS} chars, no NUL"),
        ("spec.image", f"an OCI image reference, 1-{MAX_IMAGE_CHARS} chars of letters, digits and `._/:@+-`, "
                       "starting with a letter or digit (never `-`)"),
        ("whole spec (JSON)", f"at most {MAX_SPEC_BYTES} bytes"),
        ("reasons (cancel, drain)", f"at most {MAX_REASON_CHARS} chars, no NUL"),
        ("request_id", f"1 - {MAX_REQUEST_ID_CHARS} chars"),
        ("quota.guaranteed, quota.limit", f"0 - {MAX_GPUS}"),
        ("quota.weight", f"{MIN_WEIGHT:g} - {MAX_WEIGHT:g}"),
        ("one appended event (payload + headers)", f"at most {MAX_EVENT_BYTES} bytes"),
        ("NATS server", f">= {'.'.join(map(str, MIN_NATS_SERVER))}, max_payload >= {MIN_SERVER_MAX_PAYLOAD}"),
    ]
    lines = ["# Limits", "", "Generated from `libs/gpusched/core/limits.py` by `gpusched schemas`; do not edit.",
             "Admission rejects a command that breaks one of these with a reply naming the field, before anything "
             "is appended. The JSON Schemas in `schemas/` carry the per-field bounds.", "",
             "| what | bound |", "|---|---|"]
    lines += [f"| {what} | {bound.replace('|', '&#124;')} |" for what, bound in rows]
    return "\n".join(lines) + "\n"


#: What a pattern means, for error messages (msgspec names the field and quotes the regex).
PATTERN_MEANING = {
    NAME_PATTERN: f"a name of letters, digits, '_' or '-' starting with a letter or digit, at most {NAME_MAX} "
                  f"chars, not {'/'.join(RESERVED_NAMES)}",
    NODE_PATTERN: f"a node name (dot-separated labels of letters, digits, '_' or '-'), at most {NAME_MAX} chars",
    ENV_KEY_PATTERN: "an environment variable name ([A-Za-z_][A-Za-z0-9_]*, no '=')",
    NO_NUL_PATTERN: "text without NUL bytes",
    ABS_PATH_PATTERN: "an absolute path without NUL bytes",
    MIG_PROFILE_PATTERN: "a MIG profile such as 1g.10gb (<compute slices 1-7>g.<memory>gb)",
    IMAGE_PATTERN: "an image reference ([registry/]name[:tag][@digest]: letters, digits and ._/:@+- , starting "
                   "with a letter or digit)",
}
MAX_COMMAND_MESSAGE_BYTES = MAX_SPEC_BYTES + 8 * 1024


def explain(error: str) -> str:
    """msgspec's validation message with each regex replaced by what it means."""
    for pattern, meaning in PATTERN_MEANING.items():
        error = error.replace(f"`str` matching regex {pattern!r}", meaning)
    return error


def size_mb(text: str) -> int:
    """A size in MiB from `512M`, `16G`, `1.5T` (K, M, G, T: powers of 1024; a bare number is
    MiB), as Slurm's `--mem`; ValueError when it is not one."""
    units = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    factor = units.get(t[-1:], None)
    value = float(t[:-1] if factor is not None else t) * (factor or 1)
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"not a size: {text!r}")
    return max(1, int(value))
