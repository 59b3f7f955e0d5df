"""Client commands: `gpusched submit`, `cancel`, `hold`, `release`, `update`, `quota`, `drain`. Each is one request/reply
to admission (`gpusched.bus.control_client`); the connection comes from `--nats` or `GPUSCHED_NATS_URL`.
Exit codes: 0 accepted, 1 refused (the reason on stderr), 2 no control plane answering."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any, cast

import msgspec
from opentelemetry.trace import SpanKind

from gpusched.core import limits
from gpusched.core.commands import CommandReply
from gpusched.core.model import LEVELS, JobSpec, Level, TeamQuota, TopologyConstraint

from .output import duration_arg

TOPOLOGY = {"nvlink": "nvlink", "node": "node", "rack": "rack", "block": "block", "any": "cluster", "cluster": "cluster"}


async def _send(args: argparse.Namespace, call) -> CommandReply:
    from gpusched import telemetry
    from gpusched.bus.control_client import Client

    client = await Client.connect(args.nats, timeout=args.timeout, creds=getattr(args, "creds", None),
                                  team=getattr(args, "as_team", None))
    try:
        # the CLI starts the trace of what it sends: admission, placement and the node daemon
        # continue it (the context travels in the request's headers, then in the log)
        with telemetry.span(f"gpusched {args.command}", kind=SpanKind.CLIENT, command=args.command):
            return await call(client)
    finally:
        await client.close()


def _run(args: argparse.Namespace, call, ok_text) -> int:
    from gpusched import telemetry
    from gpusched.bus.control_client import ControlPlaneUnavailable, NotPermitted

    telemetry.setup("cli", json_logs=True)
    try:
        reply = asyncio.run(_send(args, call))
    except NotPermitted as err:
        print(f"gpusched {args.command}: not permitted: {err}", file=sys.stderr)
        return 1
    except PermissionError as err:
        print(f"gpusched {args.command}: {err}", file=sys.stderr)
        return 2
    except ControlPlaneUnavailable as err:
        print(f"gpusched {args.command}: {err}", file=sys.stderr)
        return 2
    finally:
        telemetry.shutdown()
    if getattr(args, "json", False):
        print(json.dumps(msgspec.to_builtins(getattr(reply, "replies", reply))))  # several: a list
    elif reply.ok or isinstance(reply, _Replies):  # several: the ones done, then the refusals
        text = ok_text(reply)
        if text:  # none done: no empty line
            print(text)
    if not reply.ok:
        if not getattr(args, "json", False):
            print(f"gpusched {args.command}: refused: {reply.error}", file=sys.stderr)
        return 1
    return 0


def exported(names: str, environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """The submitter's variables `--export` names (as sbatch: ALL, NONE or NAME,NAME...).
    gpusched's own GPUSCHED_* variables are never exported."""
    if names.upper() == "NONE":
        return {}
    if names.upper() == "ALL":
        return {k: v for k, v in environ.items() if not k.startswith("GPUSCHED_")}
    out = {}
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name not in environ:
            raise SystemExit(f"gpusched submit: --export {name}: not set in your environment")
        out[name] = environ[name]
    return out


def memory_mb(text: str | None, flag: str = "--mem") -> int | None:
    """`--mem SIZE`: MiB, or with a unit K, M, G, T (powers of 1024), as Slurm's --mem."""
    if text is None:
        return None
    try:
        return limits.size_mb(text)
    except ValueError:
        raise SystemExit(f"gpusched submit: {flag} {text!r} is not a size like 512M or 16G") from None


def add_resource_arguments(p: argparse.ArgumentParser) -> None:
    """`submit --cpus N --mem SIZE`: the limits of the job's cgroup on each of its nodes."""
    p.add_argument("--cpus", type=float, default=None, metavar="N",
                   help="CPUs per node (a CFS quota; fractions allowed): the limit of the job's cgroup")
    p.add_argument("--mem", default=None, metavar="SIZE",
                   help="memory per node (512M, 16G; plain numbers are MiB): the job's cgroup limit, beyond which "
                        "the kernel kills the job's processes, not its neighbours'")
    p.add_argument("--image", default=None, metavar="REF",
                   help="run the command in this OCI image (podman, runc; pulled when the node lacks it): "
                        "only the granted GPUs enter it (CDI), with the checkpoint and control dirs; it starts in "
                        "the image's working directory unless --chdir names one inside the image")


def add_share_arguments(p: argparse.ArgumentParser) -> None:
    """`submit --gpu-fraction F | --gpu-memory SIZE`: a share of one GPU (docs/gpu-sharing.md)."""
    p.add_argument("--gpu-fraction", type=float, default=None, metavar="F",
                   help="a share of one GPU (0 < F < 1, with --gpus 1), co-located with other shares on it, "
                        "never beside whole-GPU jobs; GPU memory is limited by CUDA MPS (soft isolation)")
    p.add_argument("--gpu-memory", default=None, metavar="SIZE",
                   help="the GPU memory the job needs of one GPU (8G, 4096M; with --gpus 1): its share of the GPU "
                        "it lands on is that memory over the GPU's")
    p.add_argument("--mig", default=None, metavar="PROFILE[xN]",
                   help="N (default 1) MIG slices of this profile (1g.10gb, 3g.40gb) of one GPU an admin partitioned "
                        "(`gpusched mig set`): hard isolation, each slice its own device; charged its compute slices / 7")


def mig_from_arg(text: str | None) -> dict:
    """`--mig 1g.10gb` or `--mig 1g.10gbx2`: the spec's profile and slice count."""
    if text is None:
        return {}
    profile, sep, count = text.strip().lower().rpartition("x") if "gbx" in text.lower() else (text.strip().lower(), "", "")
    if sep and not count.isdigit():
        raise SystemExit(f"gpusched submit: --mig {text!r} is not PROFILE[xN] (1g.10gb, 1g.10gbx2)")
    return {"mig": profile, "mig_count": int(count) if sep else 1}


def spec_from_args(args: argparse.Namespace) -> JobSpec:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    env = exported(args.export, os.environ)  # --env wins over what is exported
    for item in args.env or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"gpusched submit: --env {item!r} is not KEY=VALUE")
        env[key] = value
    level, prefer = preferences_from_args(args.prefer)
    raw = {
        "team": args.team, "gpus": _gpus_of(args), "min_gpus": args.min_gpus, "priority": args.priority,
        "preemptible": args.preemptible, "time_limit_s": args.time_limit, "command": command, "env": env,
        "checkpoint_dir": args.checkpoint_dir, "name": args.name or "",
        "cpus": getattr(args, "cpus", None), "memory_mb": memory_mb(getattr(args, "mem", None)),
        "topology": msgspec.to_builtins(TopologyConstraint(required=TOPOLOGY[args.topology],  # type: ignore[arg-type]
                                                           preferred=level)),
        "on_failure": args.on_failure, "max_restarts": args.max_restarts,
        "checkpoint": args.checkpoint, "workdir": workdir_from_args(args),
        "image": getattr(args, "image", None),
        "secret_env": secret_env_from_args(getattr(args, "secret_env", None)),
        "dependency": dependencies_from_arg(getattr(args, "dependency", None)),
        **gpu_types_from_arg(getattr(args, "gpu_type", None)),
        "constraints": pairs_from_args(getattr(args, "constraint", None), "submit: --constraint"),
        "array": array_from_arg(getattr(args, "array", None)),
        "prefer": prefer,
        "gpu_fraction": getattr(args, "gpu_fraction", None),
        "gpu_memory_mb": memory_mb(getattr(args, "gpu_memory", None), "--gpu-memory"),
        **mig_from_arg(getattr(args, "mig", None)),
    }
    try:
        spec = msgspec.convert(raw, JobSpec)  # the same validation admission applies, earlier
    except msgspec.ValidationError as err:
        raise SystemExit(f"gpusched submit: invalid job: {limits.explain(str(err))}") from None
    problem = limits.spec_problem(spec)
    if problem:
        raise SystemExit(f"gpusched submit: invalid job: {problem}")
    return spec


def _gpus_of(args: argparse.Namespace) -> int:
    """`--gpus`, which a MIG job may leave out (its slices are of one GPU)."""
    if args.gpus is not None:
        return args.gpus
    if getattr(args, "mig", None):
        return 1
    raise SystemExit("gpusched submit: --gpus is required (the gang size), but with --mig")


def workdir_from_args(args: argparse.Namespace) -> str | None:
    """Where the job starts: --chdir, else the submit directory; in an image only --chdir (the
    submit directory is a path of the submitter's machine, not of the image)."""
    if getattr(args, "image", None):
        return os.path.abspath(args.chdir) if args.chdir else None
    return os.path.abspath(args.chdir or os.getcwd())


def dependencies_from_arg(text: str | None) -> list[dict[str, str]]:
    """`--dependency afterok:J1:J2,afterany:J3` (Slurm's form) as the spec's list."""
    out = []
    for part in (text or "").split(","):
        if not part:
            continue
        kind, _, jobs = part.partition(":")
        if kind not in ("afterok", "afterany") or not jobs:
            raise SystemExit(f"gpusched submit: --dependency {part!r} is not afterok:JOB or afterany:JOB")
        out += [{"kind": kind, "job": j} for j in jobs.split(":") if j]
    return out


def array_from_arg(text: str | None) -> dict[str, int] | None:
    """`--array 0-99%10` (Slurm's form: first-last, optional %max running; `7` is one task)."""
    if not text:
        return None
    span, _, limit = text.partition("%")
    first, sep, last = span.partition("-")
    try:
        out = {"first": int(first), "last": int(last) if sep else int(first)}
        if limit:
            out["max_running"] = int(limit)
    except ValueError:
        raise SystemExit(f"gpusched submit: --array {text!r} is not FIRST-LAST[%MAX_RUNNING]") from None
    return out


def preferences_from_args(items: list[str] | None) -> tuple[Level, dict | None]:
    """`--prefer` items: a topology level (the one placement aims for), `gpu-type=MODEL`,
    `label=K=V` or `spread` (soft preferences, `Preferences`)."""
    level: Level = "nvlink"
    prefer: dict[str, Any] = {}
    for item in items or []:
        what, _, value = item.partition("=")
        if item in LEVELS:
            level = cast(Level, item)
        elif what == "gpu-type" and value:
            prefer["gpu_type"] = value
        elif what == "label" and "=" in value:
            prefer.setdefault("labels", {}).update(pairs_from_args([value], "submit: --prefer label="))
        elif item == "spread":
            prefer["spread"] = True
        else:
            raise SystemExit(f"gpusched submit: --prefer {item!r} is not a level ({', '.join(LEVELS)}), "
                             "gpu-type=MODEL, label=KEY=VALUE or spread")
    return level, prefer or None


def pairs_from_args(items: list[str] | None, where: str) -> dict[str, str]:
    """KEY=VALUE items (repeatable options) as a mapping."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"gpusched {where} {item!r} is not KEY=VALUE")
        out[key] = value
    return out


def cmd_node_label(args: argparse.Namespace) -> int:
    labels = pairs_from_args(args.labels, "node label:")
    if not labels and not args.remove:
        raise SystemExit("gpusched node label: nothing to change (give KEY=VALUE and/or --remove KEY)")
    return _run(args, lambda c: c.label_node(args.node, labels, args.remove or []),
                lambda r: f"node {args.node}: " + ", ".join([f"{k}={v}" for k, v in labels.items()]
                                                            + [f"-{k}" for k in args.remove or []]))


def secret_env_from_args(items: list[str] | None) -> dict[str, str]:
    """`--secret-env NAME=@FILE`: the job gets FILE's content (read on the node at launch) in
    NAME; only the absolute path is sent and stored, never the value."""
    out = {}
    for item in items or []:
        name, sep, ref = item.partition("=")
        if not sep or not ref.startswith("@") or len(ref) < 2:
            raise SystemExit(f"gpusched submit: --secret-env {item!r} is not NAME=@FILE")
        out[name] = os.path.abspath(os.path.expanduser(ref[1:]))
    return out


def cmd_submit(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    arr = spec.array
    tasks = f" (tasks {{0}}_{arr.first}..{{0}}_{arr.last})" if arr is not None else ""
    def send(c):
        return c.submit(spec, request_id=args.request_id, on_behalf_of=args.on_behalf_of)

    if args.parsable:  # `JOB=$(gpusched submit --parsable ...)`: the id alone (an array's own id)
        return _run(args, send, lambda r: r.job_id)
    return _run(args, send,
                lambda r: r.job_id + tasks.format(r.job_id) + (" (already submitted)" if r.duplicate else ""))


ACTIVE = ("pending", "starting", "running")


def cancel_targets(args: argparse.Namespace, docs: list[dict] | None) -> list[str]:
    """The ids `cancel` acts on, like `scancel`: the ids given, and (with --user/--state, or
    --team without ids) the live jobs matching every filter given; ids and filters together:
    the ids that match."""
    users = None if not args.user else set(args.user.split(","))
    states = set(args.state.split(",")) if args.state else set(ACTIVE)
    teams = None if not args.as_team else set(args.as_team.split(","))

    def match(d: dict) -> bool:
        return (d["state"] in states and (users is None or d.get("user") in users)
                and (teams is None or d["team"] in teams))

    if docs is None:
        return list(dict.fromkeys(args.job))
    if args.job:
        by_id = {d["job_id"]: d for d in docs}
        return [j for j in dict.fromkeys(args.job) if j not in by_id or match(by_id[j])]
    return [d["job_id"] for d in docs if match(d)]


def _filtering(args: argparse.Namespace) -> bool:
    return bool(args.user or args.state or (args.as_team and not args.job))


def cmd_cancel(args: argparse.Namespace) -> int:
    if not args.job and not _filtering(args):
        raise SystemExit("gpusched cancel: give job id(s), or --user/--state/--team to select jobs")
    docs = None
    if _filtering(args):
        from gpusched.cli.reads import load

        docs, _ = asyncio.run(load(args, "jobs"))
    targets = cancel_targets(args, docs)
    if not targets:
        print("gpusched cancel: no job matches", file=sys.stderr)
        return 1

    async def each(client):
        teams = await _job_teams(args, client, docs)
        return _Replies(targets, [await client.cancel(j, reason=args.reason, team=teams.get(j)) for j in targets])

    return _run(args, each, lambda r: "\n".join(f"cancelled {j}" for j, x in zip(r.ids, r.replies) if x.ok))


async def _job_teams(args: argparse.Namespace, client, docs: list[dict] | None) -> dict[str, str]:
    """Each listed job's team (an array's id too), for a platform of several teams: admission
    takes its cancel only on the job's own team's subject. Nobody else needs them: {}."""
    from gpusched.bus.dial import identity_of

    ident = identity_of(client.nc)
    if ident is None or ident.role != "platform" or len(ident.teams) < 2:
        return {}
    if docs is None:
        from gpusched.cli import scoped

        docs, _ = await scoped.listing(args, ident, "jobs", client.nc)
    teams = {d["array_job"]: d["team"] for d in docs if d.get("array_job")}
    return {**teams, **{d["job_id"]: d["team"] for d in docs}}


class _Replies:
    """Several cancels as one reply for `_run`: ok when all were; the refusals named."""

    def __init__(self, ids: list[str], replies: list) -> None:
        self.ids, self.replies = ids, replies
        self.ok = all(r.ok for r in replies)
        self.error = "; ".join(f"{j}: {r.error}" for j, r in zip(ids, replies) if not r.ok)


def cmd_hold(args: argparse.Namespace) -> int:
    hold = args.command == "hold"
    return _run(args, lambda c: c.hold(args.job, hold=hold, reason=getattr(args, "reason", "")),
                lambda r: f"{'held' if hold else 'released'} {r.job_id}")


def cmd_update(args: argparse.Namespace) -> int:
    if args.priority is None and args.time_limit is None:
        raise SystemExit("gpusched update: nothing to change (give --priority and/or --time-limit)")
    changed = ", ".join(x for x in (args.priority and f"priority {args.priority}",
                                    args.time_limit is not None and f"time limit {args.time_limit:g} s") if x)
    return _run(args, lambda c: c.update(args.job, priority=args.priority, time_limit_s=args.time_limit),
                lambda r: f"updated {r.job_id}: {changed}")


def gpu_types_from_arg(text: str | None) -> dict:
    """`--gpu-type H100,A100`: the first type and the ones the job falls back to, in order."""
    if text is None:
        return {"gpu_type": None}
    types = [t.strip() for t in text.split(",")]
    if not all(types):
        raise SystemExit(f"gpusched submit: --gpu-type {text!r} has an empty entry (MODEL[,MODEL...])")
    return {"gpu_type": types[0], "gpu_type_fallback": types[1:]}


def cmd_quota(args: argparse.Namespace) -> int:
    """Change only the fields given (`--weight 2` keeps the guarantee and the limit)."""
    if args.model is not None:
        return _quota_model(args)
    given = {"guaranteed": args.guaranteed, "weight": args.weight, "limit": args.limit,
             "default_time_limit_s": args.default_time_limit, "max_time_limit_s": args.max_time_limit,
             "default_cpus": args.default_cpus, "default_memory_mb": memory_mb(args.default_mem)}
    only = [f for f, v in given.items() if v is not None]
    if args.no_limit:
        if args.limit is not None:
            raise SystemExit("gpusched quota: --limit and --no-limit exclude each other")
        only.append("limit")
    if not only:
        raise SystemExit("gpusched quota: nothing to change (give --guaranteed, --weight, --limit, --no-limit, "
                         "--default-time-limit, --max-time-limit, --default-cpus or --default-mem)")
    try:
        quota = msgspec.convert({k: v for k, v in given.items() if v is not None}, TeamQuota)
    except msgspec.ValidationError as err:
        raise SystemExit(f"gpusched quota: invalid quota: {err}") from None
    changed = ", ".join(f"{f} {'none' if getattr(quota, f) is None else getattr(quota, f)}" for f in only)

    def done(reply) -> str:
        return f"team {args.team}: {changed}" + (f"\nwarning: {reply.warning}" if reply.warning else "")

    return _run(args, lambda c: c.set_quota(args.team, quota, only=only), done)


def _quota_model(args: argparse.Namespace) -> int:
    """`--model H100 --guaranteed 8 --limit 16`: the team's terms on one GPU pool, replaced whole
    (guarantee 0 and no limit remove them); the others and the team's own terms stay."""
    if any(v is not None for v in (args.weight, args.default_time_limit, args.max_time_limit)):
        raise SystemExit("gpusched quota: --model takes only --guaranteed, --limit and --no-limit "
                         "(weight and time limits are the team's)")
    if args.no_limit and args.limit is not None:
        raise SystemExit("gpusched quota: --limit and --no-limit exclude each other")
    entry = {"guaranteed": args.guaranteed or 0, "limit": args.limit}
    try:
        quota = msgspec.convert({"models": {args.model: entry}}, TeamQuota)
    except msgspec.ValidationError as err:
        raise SystemExit(f"gpusched quota: invalid quota: {err}") from None
    lim = "none" if args.limit is None else args.limit

    def done(reply) -> str:
        return (f"team {args.team} on {args.model}: guaranteed {entry['guaranteed']}, limit {lim}"
                + (f"\nwarning: {reply.warning}" if reply.warning else ""))

    return _run(args, lambda c: c.set_quota(args.team, quota, only=["models"]), done)


def span_arg(text: str) -> float | None:
    """A fold setting: a duration (`7d`, `PT12H`), or `none`."""
    return None if text.strip().lower() in ("none", "never", "off") else duration_arg(text)


def cmd_fold_settings(args: argparse.Namespace) -> int:
    """Admin: both settings at once, so the fact says the whole of what every fold uses."""
    from gpusched.core.model import FoldSettings

    try:
        settings = msgspec.convert({"half_life_s": args.half_life, "forget_after_s": args.forget_after}, FoldSettings)
    except msgspec.ValidationError as err:
        raise SystemExit(f"gpusched fold-settings: {err} (each from 1h to 10 years, or none)") from None

    def shown(v: float | None) -> str:
        return "none" if v is None else f"{v:g} s"

    return _run(args, lambda c: c.set_fold_settings(settings, args.reason),
                lambda reply: f"fold settings from seq {reply.seq}: usage half-life {shown(settings.half_life_s)}, "
                              f"finished jobs kept whole {shown(settings.forget_after_s)}")


def _register_fold_settings(sub, common) -> None:
    p = sub.add_parser("fold-settings", parents=common,
                       help="admin: what every fold computes with from now on (a fact of the log): usage half-life, horizon")
    p.add_argument("--half-life", type=span_arg, required=True, metavar="DURATION|none",
                   help="fair share's usage half-life (default of a new cluster: 7d; none: usage never decays)")
    p.add_argument("--forget-after", type=span_arg, required=True, metavar="DURATION|none",
                   help="how long a finished job is kept whole, then only its tombstone (default 90d; none: for ever)")
    p.add_argument("--reason", default="", help="why (kept with the fact)")
    p.set_defaults(func=cmd_fold_settings)


def cmd_drain(args: argparse.Namespace) -> int:
    from gpusched.cli.output import parse_future

    at = None if args.at is None else parse_future(args.at, option="--at")
    until = None if args.until is None else parse_future(args.until, option="--until")
    if at is not None and until is None:
        raise SystemExit("gpusched drain: --at needs --until (a maintenance window has an end)")
    if until is None:
        return _run(args, lambda c: c.drain(args.node, drain=not args.undo, reason=args.reason),
                    lambda r: f"node {args.node} {'undrained' if args.undo else 'drained'}")
    return _run(args, lambda c: c.drain(args.node, reason=args.reason, at=at, until=until),
                lambda r: f"node {args.node}: maintenance window {_iso(at) if at else 'now'} .. {_iso(until)}")


def _iso(ts: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def cmd_restore(args: argparse.Namespace) -> int:
    return _run(args, lambda c: c.restore_gpu(args.gpu, reason=args.reason),
                lambda r: f"GPU {args.gpu} back in service")


def geometry_from_args(words: list[str]) -> list[str]:
    """`mig set`'s profiles, one per slice, by spaces or commas; `none` (or `whole`): no slices."""
    if [w.lower() for w in words] in (["none"], ["whole"]):
        return []
    return [p.strip().lower() for w in words for p in w.split(",") if p.strip()]


def cmd_mig(args: argparse.Namespace) -> int:
    """Admin: a GPU's MIG slices (`MigGeometrySet`), only while nobody holds the GPU."""
    profiles = geometry_from_args(args.profiles)
    shown = ", ".join(profiles) or "whole (no slices)"
    return _run(args, lambda c: c.set_mig_geometry(args.node, args.gpu, profiles, reason=args.reason),
                lambda r: f"GPU {args.node}/{args.gpu}: MIG geometry {shown} (seq {r.seq})")


def _register_mig(sub, common: list) -> None:
    p = sub.add_parser("mig", parents=common, help="admin: lay out a GPU's MIG slices (only while it is idle)")
    verbs = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    s = verbs.add_parser("set", parents=common, help="GPU INDEX of NODE in these slices, one profile each "
                                                     "(`none`: whole again); refused while any job holds it")
    s.add_argument("node", help="the node name")
    s.add_argument("gpu", type=int, help="the GPU's index on the node")
    s.add_argument("profiles", nargs="+", metavar="PROFILE",
                   help="one profile per slice, spaces or commas between (3g.40gb 2g.20gb 1g.10gb 1g.10gb), or none")
    s.add_argument("--reason", default="", help="why (kept with the fact)")
    s.set_defaults(func=cmd_mig)


def _client_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for admission's reply")
    p.add_argument("--json", action="store_true", help="print admission's reply as JSON")
    return p


def _job_feature_options(p: argparse.ArgumentParser) -> None:
    """`submit` options of the Slurm-like job features (docs/jobs.md)."""
    p.add_argument("--dependency", default=None, metavar="afterok:JOB,afterany:JOB",
                   help="start only after these jobs ended: afterok (completed successfully) or afterany "
                        "(ended any way); several jobs as afterok:J1:J2 (Slurm's form)")
    p.add_argument("--gpu-type", default=None, metavar="MODEL[,MODEL...]",
                   help="only on nodes whose GPU model contains MODEL (case-insensitive, e.g. H100); several: "
                        "tried in order, the whole job on one (H100,A100: H100, else A100; docs/gpu-pools.md)")
    p.add_argument("--constraint", action="append", metavar="KEY=VALUE",
                   help="only on nodes labelled KEY=VALUE (repeatable; see `gpusched node label`)")
    p.add_argument("--on-behalf-of", default=None, metavar="USER",
                   help="a platform's submit for USER of the job's team: the job is USER's, the log "
                        "records the platform too (platform credentials only)")
    p.add_argument("--parsable", action="store_true",
                   help="print only the job id (an array's id), for JOB=$(gpusched submit --parsable ...)")
    p.add_argument("--array", default=None, metavar="FIRST-LAST[%MAX]",
                   help="a job array: one task per index (job JOB_i, index in GPUSCHED_ARRAY_INDEX and "
                        "SLURM_ARRAY_TASK_ID), at most MAX running at once")


def _register_job_edits(sub, common: list) -> None:
    """`hold`, `release`, `update`: changes to a pending job."""
    for verb, text in (("hold", "hold a pending job: it is never placed until released (a tenant: its own team's)"),
                       ("release", "release a held job: it may be placed again")):
        p = sub.add_parser(verb, parents=common, help=text)
        p.add_argument("job", help="the job id")
        p.add_argument("--team", dest="as_team", default=None,
                       help="a platform's credentials: the team whose job it is (default: its first)")
        if verb == "hold":
            p.add_argument("--reason", default="", help="why (kept in the log, shown by `gpusched show`)")
        p.set_defaults(func=cmd_hold)

    p = sub.add_parser("update", parents=common, help="change a pending job's priority class or time limit")
    p.add_argument("job", help="the job id")
    p.add_argument("--priority", choices=["interactive", "high", "normal", "low"], default=None,
                   help="its new priority class")
    p.add_argument("--time-limit", type=duration_arg, default=None, metavar="DURATION",
                   help="its new time limit (at most the team's maximum)")
    p.add_argument("--team", dest="as_team", default=None,
                   help="a platform's credentials: the team whose job it is (default: its first)")
    p.set_defaults(func=cmd_update)

    node = sub.add_parser("node", help="change a node: gpusched node label NODE KEY=VALUE... (admin)")
    actions = node.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser("label", parents=common, help="set or remove a node's labels (jobs' --constraint)")
    p.add_argument("node", help="the node name")
    p.add_argument("labels", nargs="*", metavar="KEY=VALUE", help="labels to set")
    p.add_argument("--remove", action="append", metavar="KEY", help="a label to remove (repeatable)")
    p.set_defaults(func=cmd_node_label)


def _register_quota(sub, common) -> None:
    """`gpusched quota`: the team's terms, and with `--model` its terms on one GPU pool."""
    p = sub.add_parser("quota", parents=common, help="change a team's guaranteed share, weight or hard limit (only those given)")
    p.add_argument("team", help="the team")
    p.add_argument("--guaranteed", type=int, default=None, help="GPUs it can always reclaim")
    p.add_argument("--weight", type=float, default=None, help="its weight in sharing what is left")
    p.add_argument("--limit", type=int, default=None, help="a hard limit it never exceeds")
    p.add_argument("--no-limit", action="store_true", help="remove its hard limit")
    p.add_argument("--model", default=None, metavar="MODEL",
                   help="set --guaranteed and --limit on this GPU pool only (e.g. H100; docs/gpu-pools.md)")
    p.add_argument("--default-time-limit", type=duration_arg, default=None, metavar="DURATION",
                   help="the time limit its jobs get when submitted without one")
    p.add_argument("--max-time-limit", type=duration_arg, default=None, metavar="DURATION",
                   help="the longest time limit its jobs may ask for (longer submits are refused)")
    p.add_argument("--default-cpus", type=float, default=None, metavar="N",
                   help="the CPUs per node its jobs get when submitted without --cpus")
    p.add_argument("--default-mem", default=None, metavar="SIZE",
                   help="the memory per node its jobs get when submitted without --mem, like 16G")
    p.set_defaults(func=cmd_quota)


def _register_cancel(sub, common: list) -> None:
    p = sub.add_parser("cancel", parents=common, help="cancel a pending or running job, or every task of a job array by its id (a tenant: its own team's only)")
    p.add_argument("job", nargs="*", help="the job id(s)")
    p.add_argument("--team", dest="as_team", default=None,
                   help="only this team's jobs (comma-separated; without ids: every live one); a platform's "
                        "cancels go for each job's own team")
    p.add_argument("--user", default=None, help="only jobs of these submitting users (comma-separated)")
    p.add_argument("--state", default=None,
                   help="only jobs in these states (comma-separated; default: pending,starting,running)")
    p.add_argument("--fold", action="store_true", help="select by folding the log even when Redis answers")
    p.add_argument("--reason", default="cancelled by user", help="why (kept in the log)")
    p.set_defaults(func=cmd_cancel)


def _register_submit(sub, common) -> None:
    p = sub.add_parser("submit", parents=common, help="submit a job: gpusched submit --team T --gpus N -- COMMAND...")
    p.add_argument("--team", required=True, help="the team the job runs for (its quota and share)")
    p.add_argument("--gpus", type=int, default=None,
                   help="gang size (the most an elastic job uses); required but with --mig (its one GPU)")
    p.add_argument("--min-gpus", type=int, default=None, help="elastic: may run with this many")
    p.add_argument("--priority", choices=["interactive", "high", "normal", "low"], default="normal",
                   help="orders work within what the team is entitled to (default: normal)")
    p.add_argument("--preemptible", action="store_true",
                   help="may be preempted (asked to checkpoint, then released) for higher-priority work")
    p.add_argument("--time-limit", type=duration_arg, default=None, metavar="DURATION",
                   help="end the job (as Slurm's TIMEOUT) after this long running: seconds, 90m, 2h, 1d2h, PT2H")
    p.add_argument("--topology", choices=["nvlink", "node", "rack", "block", "any"], default="any",
                   help="the widest level the job may span (default: any)")
    p.add_argument("--prefer", action="append", default=None, metavar="PREFERENCE",
                   help="repeatable; where the job would rather run when several places fit, never whether "
                        "it runs: gpu-type=MODEL, label=KEY=VALUE, spread (the emptiest nodes), or the "
                        "topology level placement aims for (nvlink, node, rack, block, cluster; default nvlink)")
    p.add_argument("--checkpoint-dir", default=None, help="where the job's checkpoints live (resumed from there)")
    p.add_argument("--checkpoint", choices=["rank0", "all"], default="rank0",
                   help="which node ranks save a checkpoint: rank 0 alone (default) or every rank; a "
                        "checkpoint counts once all of them saved the same step")
    p.add_argument("--chdir", default=None, metavar="DIR",
                   help="the job's working directory (default: the directory you submit from)")
    p.add_argument("--export", default="NONE", metavar="NAMES",
                   help="your environment variables to pass to the job: NAME,NAME..., ALL or NONE "
                        "(default NONE: the job gets a clean environment plus --env; exported values "
                        "are stored in the log, so never export secrets)")
    p.add_argument("--name", default=None, help="a name shown next to the job id")
    p.add_argument("--env", action="append", metavar="KEY=VALUE", help="an environment variable of the job (repeatable; stored in plaintext in the log: no secrets)")
    add_resource_arguments(p)
    add_share_arguments(p)
    p.add_argument("--secret-env", action="append", metavar="NAME=@FILE",
                   help="pass FILE's content (a file on the nodes, owned by the job's user, not group/world "
                        "writable) as NAME; only the path is stored")
    p.add_argument("--on-failure", choices=["requeue", "fail"], default="requeue",
                   help="what a failed attempt does: requeue (up to --max-restarts) or fail the job")
    p.add_argument("--max-restarts", type=int, default=3, help="attempts after a failure before the job fails")
    _job_feature_options(p)
    p.add_argument("--request-id", default=None, help="idempotency key (default: a new one)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND...", help="the command the job runs")
    p.set_defaults(func=cmd_submit)

    _register_cancel(sub, common)



def register(sub) -> None:
    from .output import CONNECTION

    common = [CONNECTION, _client_parent()]
    _register_submit(sub, common)
    _register_quota(sub, common)
    _register_fold_settings(sub, common)
    _register_mig(sub, common)

    _register_job_edits(sub, common)

    p = sub.add_parser("drain", parents=common, help="keep new work off a node (--undo: allow it again)")
    p.add_argument("node", help="the node name")
    p.add_argument("--undo", action="store_true", help="undrain: allow new work again (and drop its windows)")
    p.add_argument("--reason", default="", help="why (kept in the log)")
    p.add_argument("--at", metavar="START", help="maintenance window start: ISO-8601, epoch seconds or +DURATION "
                                                 "(default: now); needs --until")
    p.add_argument("--until", metavar="END", help="maintenance window end (ISO-8601, epoch seconds or +2h): jobs "
                                                  "whose time limit reaches into [START, END) are kept off the node; "
                                                  "it returns by itself at END")
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser("restore", parents=common, help="put a quarantined GPU back into service (admin)")
    p.add_argument("gpu", help="NODE/INDEX, as `gpusched nodes --json` names it")
    p.add_argument("--reason", default="", help="why (kept in the log)")
    p.set_defaults(func=cmd_restore)
