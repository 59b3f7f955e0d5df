"""`gpusched jobs | nodes | teams | queue | show JOB`: what the cluster looks like, and why a job waits.

Listings read the Redis read models when Redis answers and a projector has written them (fast),
else fold the log directly (always correct, slower); `--fold` forces the latter. Both paths build
the same documents (`gpusched.readmodel`), so `--json` is identical either way.
`show` always reads the job's history from the log (filtered by subject) and explains a pending
job with `policy.explain` over a fold (a Redis snapshot plus the log's tail when there is one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from gpusched import readmodel
from gpusched.core.state import ClusterState

from .output import AT, CONNECTION, FILTERS, Field, columns, emit, filter_docs, iso, output_parent

COLORS = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta",
          "bright_green", "bright_yellow", "bright_blue", "bright_red"]


def _team_color(team: str | None, teams: list[str]) -> str:
    if team is None:
        return "grey50"
    return COLORS[teams.index(team) % len(COLORS)] if team in teams else "white"


# --- where the data comes from ----------------------------------------------------------------


class Snapshot:
    """The documents one listing needs, and where they came from."""

    def __init__(self, source: str, seq: int, at: float):
        self.source, self.seq, self.at = source, seq, at
        self.state: ClusterState | None = None


async def _open_log(nats: str | None):
    from gpusched.bus.log import NATS_HINT, EventLog, Unreachable, nats_url

    try:
        return await asyncio.wait_for(EventLog.open(nats, name="gpusched-cli"), 5)
    except Unreachable:
        raise
    except (TimeoutError, OSError) as err:
        raise Unreachable("NATS", nats_url(nats), err, NATS_HINT) from err


async def fold_state(nats: str | None, redis: str | None = None, use_snapshot: bool = True,
                     half_life_s: float | None = 7 * 24 * 3600.0, at: str | None = None) -> ClusterState:
    """The cluster state now, or `at` a log sequence or time: a Redis snapshot (when it is not
    past the cut) plus the log up to the cut, or the log from its start (folded with the running
    policy's usage half-life)."""
    from gpusched.store import fold_log

    log = await _open_log(nats)
    try:
        until = await cut_seq(log, at)
        state = await verified_snapshot(log, redis, half_life_s, until) if use_snapshot else None
        return await fold_log(log, state, until, half_life_s=half_life_s)
    finally:
        await log.close()


async def verified_snapshot(log, redis: str | None, half_life_s: float | None,
                            until: int | None = None) -> ClusterState | None:
    """A snapshot to fold on from, never past `until`: Redis's cached one if the log's latest
    seal vouches for it (anyone who can write Redis could otherwise show held GPUs as free),
    else (for the state now) the newest verified one in JetStream; None: fold from the start. Only a shortcut, so
    any failure means None."""
    from gpusched.bus import subjects
    from gpusched.store import SnapshotStore, load_snapshot, untrusted

    state = None
    if _redis_configured(redis):
        r = _redis_client(redis)
        try:
            state = await asyncio.wait_for(load_snapshot(r, half_life_s), 3)
            if state is not None and await untrusted(log, state) is not None:
                state = None
        except Exception:  # noqa: BLE001 - a snapshot is only a shortcut
            state = None
        finally:
            await r.aclose()
    if state is None and until is None:
        try:
            info = (await log.js.stream_info(subjects.STREAM)).state
            state, _ = await SnapshotStore(log).latest(half_life_s, info.first_seq, info.last_seq)
        except Exception:  # noqa: BLE001
            state = None
    return None if state is None or (until is not None and state.last_seq > until) else state


async def cut_seq(log, at: str | None) -> int | None:
    """The log sequence `--at` names: a sequence as given (at most the last one), or the last
    one the server had stored at that time (`EventLog.seq_at_time`); None: now."""
    from .output import parse_at

    seq, when = parse_at(at)
    if seq is None and when is None:
        return None
    last = await log.last_seq()
    if seq is not None:
        return min(seq, last)
    return await log.seq_at_time(when)  # type: ignore[arg-type]


def _redis_configured(redis: str | None) -> bool:
    from gpusched.security import clientconfig

    return bool(clientconfig.resolve("redis", redis, "GPUSCHED_REDIS_URL"))


def _redis_client(redis: str | None):
    from gpusched.views import redis_client

    return redis_client(redis)


async def _views(args) -> Any:
    """The Redis views when they answer and have been written; else None."""
    if getattr(args, "fold", False) or not _redis_configured(args.redis):
        return None
    from gpusched.views import Views

    views = Views.connect(args.redis)
    try:
        await asyncio.wait_for(views.r.ping(), 1.5)
        meta = await asyncio.wait_for(views.meta(), 2)
    except Exception as err:  # noqa: BLE001 - the log answers instead; say so once
        meta = None
        args.redis_failed = True
        print(f"gpusched {args.command}: Redis read models unreachable ({type(err).__name__}: {err}); "
              "folding the log instead", file=sys.stderr)
    if meta is None:
        await views.close()
        return None
    views.meta_doc = meta  # type: ignore[attr-defined]
    return views


def _policy(args):
    """The policy named by `--policy`/`--policy-set`, or None when not given."""
    if getattr(args, "policy", None) is None:
        return None
    from gpusched.services.shell import policy_of

    return policy_of(args)


async def load(args, what: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Documents of one kind (`jobs`, `nodes`, `teams`, `queue`) and where they came from. With
    `--policy`, the queue is folded from the log and ordered by that policy; without, the
    projector's order (the stack's running policy) or, folding, the default preset's."""
    config = _policy(args)
    at = getattr(args, "at", None)
    if at is not None:  # the past: always a fold of the log up to the cut
        state = await fold_state(args.nats, args.redis, at=at)
        return docs_from_state(state, what, config), {"source": "log", "seq": state.last_seq, "at": state.now,
                                                       "past": True}
    views = None if config is not None and what == "queue" else await _views(args)
    if views is not None:
        try:
            docs = await getattr(views, what)()
            meta = views.meta_doc  # type: ignore[attr-defined]
            return docs, {"source": "redis", "seq": meta["seq"], "at": meta["at"]}
        finally:
            await views.close()
    kw = {} if config is None else {"half_life_s": config.half_life_s}
    state = await fold_state(args.nats, args.redis, use_snapshot=not getattr(args, "redis_failed", False), **kw)
    return docs_from_state(state, what, config), {"source": "log", "seq": state.last_seq, "at": state.now}


async def usage(redis: str | None) -> dict[str, dict[str, Any]]:
    """The reconciler's used-versus-held read model (empty without Redis or a reconciler)."""
    if not _redis_configured(redis):
        return {}
    from gpusched.views import Views

    views = Views.connect(redis)
    try:
        return await asyncio.wait_for(views.usage(), 3)
    except Exception:  # noqa: BLE001 - telemetry is optional
        return {}
    finally:
        await views.close()


def with_accounting(what: str, docs: list[dict[str, Any]], now: float,
                    used: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Jobs and teams with GPU-hours held and busy (and efficiency) as of `now`; running jobs
    with their mean utilization and memory over the reconciler's last window (`usage`)."""
    if what not in ("jobs", "teams"):
        return docs
    out = []
    for d in docs:
        d = {**d, **readmodel.accounting(d, now)}
        if what == "jobs":
            u = (used or {}).get(d["job_id"])
            d["usage"] = u if u is not None and u.get("attempt") == d["attempt"] and d["gpus"] else None
        out.append(d)
    return out


def docs_from_state(state: ClusterState, what: str, config=None) -> list[dict[str, Any]]:
    if what == "jobs":
        jobs = sorted(state.jobs.values(), key=lambda j: (j.submitted_at, j.job_id))
        return [{**readmodel.job_doc(state, j), "seq": state.last_seq} for j in jobs]
    if what == "nodes":
        return [{**readmodel.node_doc(state, n), "seq": state.last_seq}
                for n in sorted(state.nodes, key=readmodel.natural_key)]
    if what == "teams":
        return [{**readmodel.team_doc(state, t), "seq": state.last_seq} for t in sorted(state.teams)]
    if what == "queue":
        return [{**q, "seq": state.last_seq} for q in readmodel.queue_docs(state, config)]
    raise ValueError(what)


# --- formatting --------------------------------------------------------------------------------


def compress_gpus(gpus: list[dict[str, Any]]) -> str:
    """`[{node: n0, index: 0}, ...]` -> `n0[0-3] n1[0,2]`."""
    per: dict[str, list[int]] = {}
    for g in gpus:
        per.setdefault(g["node"], []).append(g["index"])
    parts = []
    for node, idx in per.items():
        idx.sort()
        runs, start, prev = [], idx[0], idx[0]
        for i in idx[1:] + [None]:  # type: ignore[list-item]
            if i is not None and i == prev + 1:
                prev = i
                continue
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            if i is not None:
                start = prev = i
        parts.append(f"{node}[{','.join(runs)}]")
    return " ".join(parts)


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0.0, float(seconds))
    if s < 60:
        return f"{s:.0f}s" if s >= 10 else f"{s:.1f}s"
    if s < 3600:
        return f"{s / 60:.0f}m{s % 60:02.0f}s"
    if s < 86400:
        return f"{s / 3600:.0f}h{(s % 3600) / 60:02.0f}m"
    return f"{s / 86400:.1f}d"


def eta_text(eta_s: float | None, span: list[float] | tuple[float, float] | None = None) -> str:
    """An ETA as shown: a duration, or a range ("20–45 min") when the estimate is uncertain."""
    if eta_s is None:
        return "-"
    if not span:
        return _dur(eta_s)
    low, high = max(0.0, float(span[0])), max(0.0, float(span[1]))
    if high < 3600:
        return f"{low / 60:.0f}–{max(1.0, high / 60):.0f} min"
    if low >= 3600 and high < 86400:
        return f"{low / 3600:.0f}–{high / 3600:.0f} h"
    if low >= 86400:
        return f"{low / 86400:.1f}–{high / 86400:.1f} d"
    return f"{_dur(low)}–{_dur(high)}"


def _console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


def display_now(meta: dict[str, Any]) -> float:
    """Ages are shown against the wall clock on a live cluster, against the log's last event
    time when the log is old (an audit of a past day) or the listing is of the past (`--at`)."""
    at = meta.get("at") or 0.0
    if meta.get("past"):
        return at
    wall = time.time()
    return max(at, wall) if abs(wall - at) < 86400 else at


def _caption(meta: dict[str, Any]) -> str:
    return f"from {meta['source']} at log seq {meta['seq']}"


STATE_STYLE = {"pending": "yellow", "starting": "cyan", "running": "green", "completed": "dim",
               "failed": "red", "cancelled": "dim", "timeout": "red"}


def print_jobs(docs: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    from rich.table import Table

    now = display_now(meta)
    table = Table(caption=_caption(meta), header_style="bold")
    for col in ("JOB", "TEAM/USER", "STATE", "PRIO", "GPUS", "HELD ON", "AGE", "USE", "DETAIL"):
        table.add_column(col, no_wrap=col != "DETAIL", overflow="fold" if col == "HELD ON" else "ellipsis",
                         min_width=20 if col == "DETAIL" else None)
    for d in docs:
        held = len(d["gpus"])
        want = d["gpus_requested"] if d["min_gpus"] == d["gpus_requested"] else f"{d['min_gpus']}-{d['gpus_requested']}"
        gpus = f"{held}/{want}" if d["state"] in ("starting", "running") else f"{want}"
        if d["state"] == "pending":
            detail = d["pending_reason"] or "waiting for the next placement cycle"
        elif d["state"] in ("starting", "running"):
            detail = f"{d['level']} via {d['placer']}" + (" (backfill)" if d["backfill"] else "")
            if d.get("idle"):
                detail = f"[red]idle {_dur(now - d['idle']['since'])}[/] (< {d['idle']['threshold_pct']:g}%); " + detail
            if d.get("preemption"):
                p = d["preemption"]
                detail += "; idle timeout: yielding" if p.get("cause") == "idle" else f"; preempting for {p['for_job']}"
            if d.get("unhealthy_gpus"):
                detail += f"; [red]on unhealthy GPU {compress_gpus(d['unhealthy_gpus'])}[/]"
        else:
            detail = d["end_reason"]
        since = d["started_at"] if d["state"] in ("starting", "running") else d["submitted_at"]
        age = _dur(now - since) if d["state"] not in ("completed", "failed", "cancelled", "timeout") else "-"
        style = STATE_STYLE.get(d["state"], "")
        table.add_row(d["job_id"], d["team"] + (f"/{d['user']}" if d.get("user") else ""), f"[{style}]{d['state']}[/]", d["priority"], gpus,
                      compress_gpus(d["gpus"]), age, _use(d), detail)
    _console().print(table)


def _use(d: dict[str, Any]) -> str:
    """Mean utilization and memory per GPU over the last window; GPU efficiency once it ran."""
    u = d.get("usage")
    eff = d.get("efficiency")
    parts = []
    if u:
        parts.append(f"{u['util_pct']:.0f}% {u['memory_mb'] / 1024:.1f}G")
    if eff is not None:
        parts.append(f"eff {eff:.0%}")
    return " ".join(parts) or "-"


def print_nodes(docs: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    from rich.table import Table

    teams = sorted({g["team"] for d in docs for g in d["gpus"] if g["team"]})
    table = Table(caption=_caption(meta) + ("; GPUs: team initial (reversed: idle), . free, x down" if docs else ""),
                  header_style="bold")
    for col in ("NODE", "RACK", "STATUS", "FREE", "GPUS", "JOBS"):
        table.add_column(col, no_wrap=True)
    for d in docs:
        cells = []
        for g in d["gpus"]:
            if g["status"] == "held" and g.get("idle"):
                cells.append(f"[reverse {_team_color(g['team'], teams)}]{(g['team'] or '?')[0]}[/]")
            elif g["status"] == "held":
                cells.append(f"[{_team_color(g['team'], teams)}]{(g['team'] or '?')[0]}[/]")
            elif g["status"] == "free":
                cells.append("[grey50].[/]")
            else:
                cells.append("[red]x[/]")
        status = "lost" if d["lost"] else "drained" if d["drained"] else "ok"
        jobs = sorted({g["job_id"] for g in d["gpus"] if g["job_id"]})
        table.add_row(d["node"], d["rack"], status, f"{d['free']}/{d['total']}", "".join(cells), " ".join(jobs))
    _console().print(table)


def print_teams(docs: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(caption=_caption(meta) + "; SHARE: held / guaranteed share of the cluster; GPU-h: held, busy "
                  "(not idle), EFF = busy / held", header_style="bold")
    for col in ("TEAM", "HELD", "GUAR", "LIMIT", "WEIGHT", "SHARE", "RUN", "QUEUED", "USAGE", "GPU-h", "EFF"):
        table.add_column(col, no_wrap=True, justify="left" if col == "TEAM" else "right",
                         min_width=max([4] + [len(d["team"]) for d in docs]) if col == "TEAM" else None)
    for d in docs:
        held = f"[{'yellow' if d['under_guarantee'] else 'green'}]{d['held']}[/]"
        table.add_row(d["team"], held, str(d["guaranteed"]), "-" if d["limit"] is None else str(d["limit"]),
                      f"{d['weight']:g}", f"{d['share']:.0%}/{d['entitled_share']:.0%}", str(d["running_jobs"]),
                      f"{d['pending_jobs']}j {d['pending_gpus']}g", f"{d['usage_gpu_s'] / 3600:.1f}h",
                      f"{d['gpu_hours_held']:.2f}/{d['gpu_hours_busy']:.2f}",
                      "-" if d["efficiency"] is None else f"{d['efficiency']:.0%}")
    _console().print(table)


def print_queue(docs: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(caption=_caption(meta), header_style="bold")
    for col in ("#", "JOB", "TEAM", "PRIO", "GPUS", "WAITING", "ETA", "REASON"):
        table.add_column(col, no_wrap=col != "REASON")
    now = display_now(meta)
    for d in docs:
        table.add_row(str(d["position"]), d["job_id"], d["team"], d["priority"], str(d["gpus"]), _dur(now - d["submitted_at"]),
                      eta_text(d["eta_s"], d.get("eta_range")), d["reason"] or "-")
    _console().print(table)


PRINTERS = {"jobs": print_jobs, "nodes": print_nodes, "teams": print_teams, "queue": print_queue}


# --- plain columns (pipes, -o wide, --format) -------------------------------------------------


def _want(d: dict[str, Any]) -> str:
    return str(d["gpus_requested"]) if d["min_gpus"] == d["gpus_requested"] else f"{d['min_gpus']}-{d['gpus_requested']}"


def _job_gpus(d: dict[str, Any], _now: float) -> str:
    return f"{len(d['gpus'])}/{_want(d)}" if d["state"] in ("starting", "running") else _want(d)


def _job_age(d: dict[str, Any], now: float) -> str:
    if d["state"] in ("completed", "failed", "cancelled"):
        return "-"
    return _dur(now - (d["started_at"] if d["state"] in ("starting", "running") else d["submitted_at"]))


def _job_reason(d: dict[str, Any], _now: float) -> str:
    if d["state"] == "pending":
        return d["pending_reason"] or "waiting for the next placement cycle"
    if d["state"] in ("starting", "running"):
        text = f"{d['level']} via {d['placer']}" + (" (backfill)" if d["backfill"] else "")
        return text + (f"; preempting for {d['preemption']['for_job']}" if d.get("preemption") else "")
    return d["end_reason"] or "-"


def _s(key: str, fmt=str) -> Any:
    return lambda d, _now: "-" if d.get(key) in (None, "") else fmt(d[key])


JOB_FIELDS = [
    Field("job", "JOB", _s("job_id")), Field("team", "TEAM", _s("team")), Field("user", "USER", _s("user")),
    Field("state", "STATE", _s("state")), Field("priority", "PRIO", _s("priority")),
    Field("gpus", "GPUS", _job_gpus), Field("nodelist", "HELD ON", lambda d, _n: compress_gpus(d["gpus"]) or "-"),
    Field("age", "AGE", _job_age, right=False), Field("reason", "REASON", _job_reason),
    Field("name", "NAME", _s("name"), wide=True), Field("attempt", "ATTEMPT", _s("attempt"), wide=True),
    Field("submitted", "SUBMITTED", _s("submitted_at", iso), wide=True),
    Field("started", "STARTED", _s("started_at", iso), wide=True),
    Field("finished", "FINISHED", _s("finished_at", iso), wide=True),
    Field("preemptible", "PREEMPTIBLE", lambda d, _n: "yes" if d["preemptible"] else "no", wide=True),
    Field("preemptions", "PREEMPTED", _s("preemptions"), wide=True),
    Field("restarts", "RESTARTS", _s("restarts"), wide=True),
    Field("lost_gpu_s", "LOST_GPU_S", _s("lost_gpu_s", lambda x: f"{x:.0f}"), wide=True),
    Field("topology", "TOPOLOGY", _s("required"), wide=True),
    Field("use", "USE", lambda d, _n: _use(d), wide=True),
    Field("gpu_hours_held", "GPUH_HELD", _s("gpu_hours_held", lambda x: f"{x:.3f}"), wide=True),
    Field("gpu_hours_busy", "GPUH_BUSY", _s("gpu_hours_busy", lambda x: f"{x:.3f}"), wide=True),
]


def _gpu_cells(d: dict[str, Any]) -> str:
    return "".join((g["team"] or "?")[0] if g["status"] == "held" else "." if g["status"] == "free" else "x"
                   for g in d["gpus"])


def _holders(d: dict[str, Any]) -> str:
    """`0-3:j-1 4:j-2`: which job holds which GPU index."""
    per: dict[str, list[int]] = {}
    for g in d["gpus"]:
        if g["job_id"]:
            per.setdefault(g["job_id"], []).append(g["index"])
    return " ".join(compress_gpus([{"node": j, "index": i} for i in idx]).replace(f"{j}[", "[", 1) + f"={j}"
                    for j, idx in per.items()) or "-"


NODE_FIELDS = [
    Field("node", "NODE", _s("node")), Field("rack", "RACK", _s("rack")),
    Field("status", "STATUS", lambda d, _n: "lost" if d["lost"] else "drained" if d["drained"] else "ok"),
    Field("free", "FREE", lambda d, _n: f"{d['free']}/{d['total']}"), Field("gpus", "GPUS", lambda d, _n: _gpu_cells(d)),
    Field("jobs", "JOBS", lambda d, _n: " ".join(sorted({g["job_id"] for g in d["gpus"] if g["job_id"]})) or "-"),
    Field("holders", "GPU=JOB", lambda d, _n: _holders(d), wide=True),
    Field("block", "BLOCK", _s("block"), wide=True), Field("nvlink", "NVLINK", _s("nvlink"), wide=True),
    Field("model", "MODEL", lambda d, _n: ",".join(sorted({g["model"] or "?" for g in d["gpus"]})) or "-", wide=True),
]

TEAM_FIELDS = [
    Field("team", "TEAM", _s("team")), Field("held", "HELD", _s("held"), right=True),
    Field("guaranteed", "GUAR", _s("guaranteed"), right=True), Field("limit", "LIMIT", _s("limit"), right=True),
    Field("weight", "WEIGHT", _s("weight", lambda x: f"{x:g}"), right=True),
    Field("share", "SHARE", lambda d, _n: f"{d['share']:.0%}/{d['entitled_share']:.0%}", right=True),
    Field("running", "RUN", _s("running_jobs"), right=True),
    Field("queued", "QUEUED", lambda d, _n: f"{d['pending_jobs']}j {d['pending_gpus']}g", right=True),
    Field("usage", "USAGE", lambda d, _n: f"{d['usage_gpu_s'] / 3600:.1f}h", right=True),
    Field("under_guarantee", "UNDER_GUAR", lambda d, _n: "yes" if d["under_guarantee"] else "no", wide=True),
]

QUEUE_FIELDS = [
    Field("position", "#", _s("position"), right=True), Field("job", "JOB", _s("job_id")),
    Field("team", "TEAM", _s("team")), Field("priority", "PRIO", _s("priority")), Field("gpus", "GPUS", _s("gpus")),
    Field("waiting", "WAITING", lambda d, now: _dur(now - d["submitted_at"])),
    Field("eta", "ETA", lambda d, _n: eta_text(d["eta_s"], d.get("eta_range"))), Field("reason", "REASON", _s("reason")),
    Field("blockers", "BLOCKERS", lambda d, _n: ",".join(d.get("blockers") or []) or "-", wide=True),
    Field("preemptions", "PREEMPTED", _s("preemptions"), wide=True),
]

FIELDS = {"jobs": JOB_FIELDS, "nodes": NODE_FIELDS, "teams": TEAM_FIELDS, "queue": QUEUE_FIELDS}


def _listing(what: str):
    def run(args) -> int:
        columns(FIELDS[what], args)  # a bad --format is refused before any connection
        docs, meta = asyncio.run(load(args, what))
        if what == "nodes":  # n2 before n10, whichever path answered
            docs.sort(key=lambda d: readmodel.natural_key(d["node"]))
        if what == "nodes" and getattr(args, "team", None):  # nodes where the team holds GPUs
            teams = set(args.team.split(","))
            docs = [d for d in docs if any(g["team"] in teams for g in d["gpus"])]
        else:
            docs = filter_docs(docs, args)
        if getattr(args, "active", False):
            docs = [d for d in docs if d.get("state") in ("pending", "starting", "running")]
        used = asyncio.run(usage(args.redis)) if what == "jobs" else None
        docs = with_accounting(what, docs, display_now(meta), used)
        emit(docs, FIELDS[what], args, display_now(meta), lambda: PRINTERS[what](docs, meta))
        return 0

    return run


# --- show JOB ----------------------------------------------------------------------------------


async def read_subject(event_log, subject: str) -> list[Any]:
    """Every record of the stream matching `subject`, in log order (stops at what exists now)."""
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from gpusched.bus import subjects as subj

    info = await event_log.js.stream_info(subj.STREAM, subjects_filter=subject)
    count = sum((info.state.subjects or {}).values())
    if count == 0:
        return []
    out = []
    sub = await event_log.js.subscribe(subject, stream=subj.STREAM, ordered_consumer=True,
                                       config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
    try:
        from gpusched.core.events import decode_event

        while len(out) < count:
            msg = await sub.next_msg(timeout=10)
            try:
                event = decode_event(msg.data)
            except Exception:  # noqa: BLE001 - dead letters are shown by `replay`
                count -= 1
                continue
            from gpusched.bus.log import Record

            out.append(Record(msg.metadata.sequence.stream, event, msg.subject, msg.headers))
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return out


async def job_history(event_log, job_id: str) -> list[Any]:
    """Every fact about a job, plus the preemptions made for it, in log order."""
    from gpusched.bus import subjects as subj

    own = [r for subject in subj.job_subjects(job_id) for r in await read_subject(event_log, subject)
           if getattr(r.event, "job_id", None) == job_id]
    # what its nodes reported about it lives on their node subjects
    nodes = sorted({g.rsplit("/", 1)[0] for r in own for g in [*getattr(r.event, "gpus", []),
                                                                *getattr(r.event, "added", [])]})
    seen = {r.seq for r in own}
    own += [r for node in nodes for r in await read_subject(event_log, subj.node_subjects(node))
            if getattr(r.event, "job_id", None) == job_id and r.seq not in seen]
    served = [r for r in await read_subject(event_log, "gpusched.evt.*.PreemptionRequested.*")
              if getattr(r.event, "for_job", None) == job_id and r.event.job_id != job_id]  # (idle: itself)
    return sorted(own + served, key=lambda r: r.seq)


async def show_data(nats: str | None, redis: str | None, job_id: str, config=None) -> dict[str, Any]:
    """A job's document, history and preemptions; for a pending job, why it waits under the
    running policy `config` (default: the default preset)."""
    from gpusched.policy.config import DEFAULT
    from gpusched.policy.explain import explain_pending, explain_preemptions
    from gpusched.store import fold_log

    config = config or DEFAULT
    event_log = await _open_log(nats)
    try:
        state = await verified_snapshot(event_log, redis, config.half_life_s)
        state = await fold_log(event_log, state, half_life_s=config.half_life_s)
        if job_id in state.forgotten:
            return forgotten_doc(state, job_id)
        if job_id not in state.jobs:
            return {"job_id": job_id, "error": _not_a_job(state, job_id)}
        history = await job_history(event_log, job_id)
    finally:
        await event_log.close()
    job = state.jobs[job_id]
    own = [(r.seq, r.event) for r in history if getattr(r.event, "job_id", None) == job_id]
    used = await usage(redis) if job.holding else {}
    data: dict[str, Any] = {
        "job": with_accounting("jobs", [readmodel.job_doc(state, job)], display_now({"at": state.now}), used)[0],
        "seq": state.last_seq,
        "now": state.now,
        "history": [{**readmodel.event_line(r.seq, r.event),
                     "served_by_preemption": getattr(r.event, "for_job", None) == job_id and r.event.job_id != job_id}
                    for r in history],
        "preemptions": explain_preemptions(own),
        "preempted_for_it": [{"seq": r.seq, "at": r.event.at, "victim": r.event.job_id, "reason": r.event.reason}
                             for r in history if getattr(r.event, "for_job", None) == job_id
                             and r.event.job_id != job_id],
    }
    if job.state == "pending":
        data["why_pending"] = explain_pending(state, job_id, config=config)
    data["partitioned_nodes"] = sorted({state.gpus[g].node for g in job.gpus if state.nodes[state.gpus[g].node].partitioned})
    return data


def _history_hint(job_id: str) -> str:
    from gpusched.store import HORIZON_ENV

    return (f"Its whole history is in the log: `{HORIZON_ENV}=none gpusched show {job_id}` folds the stream "
            f"keeping every job; if the stream was bounded, `gpusched replay --from-file SEGMENT...` over the "
            f"exported segments.")


def _not_a_job(state: ClusterState, job_id: str) -> str:
    """`show` of an id the fold holds no job for: a job array's, a retired job's, or none."""
    if job_id in state.arrays:
        first, last = state.arrays[job_id]
        return f"{job_id} is a job array: show one of its tasks, {job_id}_{first} .. {job_id}_{last}"
    if state.knows(job_id):
        return retired_note(state, job_id)
    return f"no job {job_id} in the log (at seq {state.last_seq})"


def retired_note(state: ClusterState, job_id: str) -> str:
    """`show` of a job (or array) past the second horizon: the fold kept only its id."""
    return f"job {job_id} ended long ago (past the fold's second horizon): only its id is kept. {_history_hint(job_id)}"


def forgotten_doc(state: ClusterState, job_id: str) -> dict[str, Any]:
    """`show` of a job that ended before the fold's horizon: what the fold kept, and where the
    rest of its history is."""
    tomb = state.forgotten[job_id]
    return {"job_id": job_id, "seq": state.last_seq, "forgotten": {
        "state": tomb.state, "finished_at": tomb.finished_at, "request_id": tomb.request_id, "team": tomb.team,
        "array_job": tomb.array_job, "forget_after_s": state.forget_after_s,
        "history": f"ended {iso(tomb.finished_at)}, more than {state.forget_after_s:g} s of log time before "
                   f"the latest event, so the fold kept only its end. {_history_hint(job_id)}"}}


def _why_lines(why: dict[str, Any], d: dict[str, Any], now: float) -> list[str]:
    """The lines of the "why is it pending?" panel: the reason the running policy recorded
    first, then what the state says around it."""
    waited = display_now({"at": now}) - d["submitted_at"]
    w = [f"[bold yellow]why pending:[/] {why['summary']}  (waiting {_dur(waited)}, "
         f"queue position {why['queue']['position']} of {why['queue']['of']})"]
    if why["policy"].get("why"):
        typed = why["policy"]["why"]
        w.append(f"reason recorded by the policy: {typed['kind']} "
                 + " ".join(f"{k}={v}" for k, v in typed.items() if k != "kind"))
    if why["policy"]["blockers"]:
        w.append(f"blockers (policy): {', '.join(why['policy']['blockers'])}")
    if why.get("held"):
        w.append(f"[red]held by {why['held']}[/]")
    if why.get("dependency"):
        w.append(f"dependencies: {', '.join(why['dependency'])}")
    tq = why["team_quota"]
    lim = "none" if tq["limit"] is None else tq["limit"]
    w.append(f"team {why['team']}: holds {tq['held']}, guaranteed {tq['guaranteed']}, limit {lim}"
             + ("  [red]limit stops it[/]" if tq["limit_blocks"] else "")
             + ("  (under its guarantee: may reclaim from over-share teams)" if tq["under_guarantee"] else ""))
    topo = why["topology"]
    w.append(f"needs {why['needs']['min_gpus']} GPU(s) within one {topo['level']}: {topo['free_total']} of "
             f"{topo['gpus_total']} free in the cluster; {topo['domains_considered']} {topo['level']}(s) considered"
             + (f"; fits now in {', '.join(topo['fits_now_in'])}" if topo["fits_now_in"] else ""))
    if topo.get("impossible"):
        w.append(f"[red]{topo['impossible']}[/]")
    if topo["level"] != "cluster":
        doms = "  ".join(f"{x['domain']}: {x['free']}/{x['total']} free" for x in topo["domains"][:6])
        w.append(f"  {doms}")
    if why["holders"]:
        w.append("held by: " + ", ".join(
            f"{h['job_id']} ({h['team']}, {h['gpus']} GPUs, {h['priority']}{', preemptible' if h['preemptible'] else ''})"
            for h in why["holders"][:5]))
    if why["held_by_team"]:
        w.append("GPUs held per team: " + ", ".join(f"{t} {n}" for t, n in why["held_by_team"].items()))
    if why["queue"]["ahead"]:
        w.append(f"ahead in the queue: {', '.join(why['queue']['ahead'])}"
                 + (" …" if why["queue"]["ahead_jobs"] > len(why["queue"]["ahead"]) else ""))
    for u in why["unblock"]:
        w.append(f"[green]would unblock:[/] {u}")
    eta = why["eta_s"]
    w.append(f"estimated start: {'unknown' if eta is None else 'in ' + eta_text(eta, why.get('eta_range'))}")
    return w


def print_show(data: dict[str, Any]) -> None:
    from rich.panel import Panel
    from rich.table import Table

    console = _console()
    if "error" in data:
        console.print(f"[red]{data['error']}[/]")
        return
    if "forgotten" in data:
        f = data["forgotten"]
        console.print(f"[bold]{data['job_id']}[/]  team [bold]{f['team']}[/]  "
                      f"[{STATE_STYLE.get(f['state'], '')}]{f['state']}[/]  (forgotten)\n{f['history']}")
        return
    d = data["job"]
    now = data["now"]
    head = (f"[bold]{d['job_id']}[/] {d['name']}  team [bold]{d['team']}[/]"
            + (f" user [bold]{d['user']}[/]" if d.get("user") else "") + f"  {d['priority']}  "
            f"[{STATE_STYLE.get(d['state'], '')}]{d['state']}[/]  wants {d['gpus_requested']} GPU(s)"
            + (f" (min {d['min_gpus']})" if d["min_gpus"] != d["gpus_requested"] else "")
            + ("  preemptible" if d["preemptible"] else "")
            + (f"  topology <= {d['required']}" if d["required"] != "cluster" else ""))
    lines = [head]
    if d["gpus"]:
        lines.append(f"holds {len(d['gpus'])} GPU(s): {compress_gpus(d['gpus'])} ({d['level']}, via {d['placer']})")
    if d["checkpoint"]:
        c = d["checkpoint"]
        lines.append(f"last checkpoint: step {c['step']} at {c['path']} ({_dur(now - c['at'])} ago)")
    lines += _used_lines(d, now)
    if d["preemptions"] or d["restarts"] or d["lost_gpu_s"]:
        lines.append(f"preempted {d['preemptions']}x, restarted {d['restarts']}x, lost work {d['lost_gpu_s']:.0f} GPU-s")
    if d["end_reason"]:
        lines.append(f"ended: {d['end_reason']}")
    if d.get("unhealthy_gpus"):
        lines.append(f"[red]runs on unhealthy GPU(s) {compress_gpus(d['unhealthy_gpus'])}: {d['unhealthy_reason']}[/]")
    if data.get("partitioned_nodes"):
        lines.append(f"[red]node(s) {', '.join(data['partitioned_nodes'])} in a declared partition (silent with many "
                     "others): the job is kept, not requeued, until their heartbeats return or an admin confirms "
                     "them lost (gpusched partition confirm)[/]")
    if d.get("workdir"):
        lines.append(f"runs in {d['workdir']}; checkpoints: {d.get('checkpoint_mode', 'rank0')}")
    for ref in d.get("logs", [])[-8:]:
        gen = f".{ref['generation']}" if ref["generation"] else ""
        lines.append(f"log of attempt {ref['attempt']}{gen} rank {ref['rank']}: {ref['node']}:{ref['path']}  "
                     f"(gpusched logs {d['job_id']} --attempt {ref['attempt']} --rank {ref['rank']})")
    console.print(Panel("\n".join(lines), title=f"job {d['job_id']}", subtitle=f"log seq {data['seq']}"))

    why = data.get("why_pending")
    if why:
        w = _why_lines(why, d, now)
        console.print(Panel("\n".join(w), title="why is it pending?", border_style="yellow"))

    for p in data["preemptions"]:
        ck = p.get("checkpoint")
        what = ("idle timeout" if p.get("cause") == "idle" else f"preempted for [bold]{p['for_job']}[/]")
        txt = (f"{what} at seq {p['seq']} ({p['reason']}); "
               + (f"released {'forcibly' if p['forced'] else 'after checkpoint'}, lost {p['lost_gpu_s']:.0f} GPU-s"
                  if p["released_at"] is not None else f"checkpoint due in {_dur(p['deadline'] - now)}")
               + (f"; resumes from step {ck['step']} ({ck['path']})" if ck else "; no checkpoint: restarts from scratch"))
        console.print(f"[magenta]{txt}[/]")
    for p in data["preempted_for_it"]:
        console.print(f"[cyan]preempted {p['victim']} for it at seq {p['seq']} ({p['reason']})[/]")

    table = Table(title="history", header_style="bold", show_edge=False)
    table.add_column("SEQ", justify="right", no_wrap=True)
    table.add_column("T+", justify="right", no_wrap=True)
    table.add_column("EVENT", no_wrap=True)
    table.add_column("")
    t0 = d["submitted_at"]
    for h in data["history"]:
        table.add_row(str(h["seq"]), _dur(h["at"] - t0), h["type"], h["text"])
    console.print(table)


def _used_lines(d: dict[str, Any], now: float) -> list[str]:
    """Used versus held: the last window's utilization, the idle conclusion, GPU-hours."""
    lines = []
    u = d.get("usage")
    if u:
        lines.append(f"using: mean {u['util_pct']:.0f}% utilization, {u['memory_mb']:.0f} MB memory per GPU "
                     f"over the last {u['window_s']:.0f} s")
    idle = d.get("idle")
    if idle:
        lines.append(f"[red]IDLE[/]: all its GPUs under {idle['threshold_pct']:g}% utilization since "
                     f"{_dur(now - idle['since'])} ago (mean {idle['util_pct']:.1f}%, max {idle['util_pct_max']:.1f}%, "
                     f"{idle['memory_mb']:.0f} MB per GPU; reported by the reconciler)")
    if d.get("yielded_idle"):
        lines.append("requeued by its idle timeout: waits behind the queue until granted again")
    if d.get("gpu_hours_held"):
        eff = d["efficiency"]
        lines.append(f"GPU-hours held {d['gpu_hours_held']:.3f}, busy {d['gpu_hours_busy']:.3f}"
                     + ("" if eff is None else f" (efficiency {eff:.0%})")
                     + (f"; idle timeouts {d['idle_requeues']}" if d.get("idle_requeues") else ""))
    return lines


def _show(args) -> int:
    data = asyncio.run(show_data(args.nats, args.redis, args.job_id, _policy(args)))
    if args.json:
        json.dump(data, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print_show(data)
    return 1 if "error" in data else 0


# --- registration -----------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    for what, help_ in (("jobs", "list jobs with their state and the GPUs they hold"),
                        ("nodes", "list nodes and their GPUs, coloured by team (-o wide: which job holds which GPU)"),
                        ("teams", "list teams: GPUs held vs guaranteed share and limit"),
                        ("queue", "list pending jobs in the order the policy considers them, with why")):
        parents = [CONNECTION, output_parent(f.name for f in FIELDS[what])]
        if what in ("jobs", "queue"):
            parents.append(FILTERS)
        parents.append(AT)
        p = sub.add_parser(what, help=help_, description=help_, parents=parents)
        p.add_argument("--fold", action="store_true", help="fold the log even when Redis read models answer")
        if what in ("nodes", "teams"):
            p.add_argument("--team", default=None, help="only this team (comma-separated for several)")
        if what == "queue":
            _policy_flags(p)
        if what == "jobs":
            p.add_argument("--active", action="store_true", help="only pending, starting and running jobs")
        p.set_defaults(func=_listing(what))
    p = sub.add_parser("show", help="a job's history and why it is pending", parents=[CONNECTION, output_parent()],
                       description="A job's history from the log; for a pending job, what blocks it, what "
                                   "would unblock it and an estimated start; for a preempted one, which job it "
                                   "served, its checkpoint and the work lost.")
    p.add_argument("job_id", help="the job id")
    _policy_flags(p)
    p.set_defaults(func=_show)


def _policy_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default=None,
                   help="the running policy preset (default: the projector's order, else full)")
    p.add_argument("--policy-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field of the preset, as given to the services (repeatable)")


__all__ = ["register", "load", "fold_state", "show_data", "job_history", "docs_from_state", "compress_gpus"]
