"""How listings and `show` look: rich tables and panels on a terminal, plain columns (every
cell whole) in a pipe or with `-o wide`/`--format`/`--no-header`; durations truncated, never
rounded up (`2m59s`)."""

from __future__ import annotations

import sys
from typing import Any

from gpusched import readmodel
from gpusched.core.pools import pool_text

from .output import Field, display_now, iso

COLORS = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta",
          "bright_green", "bright_yellow", "bright_blue", "bright_red"]


def _team_color(team: str | None, teams: list[str]) -> str:
    if team is None:
        return "grey50"
    return COLORS[teams.index(team) % len(COLORS)] if team in teams else "white"



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


def dur(seconds: float | None) -> str:
    """A duration as shown, truncated, never rounded up (179.9 s is 2m59s, as `squeue` would):
    under 10 s with a tenth, then whole seconds, minutes, hours, days."""
    if seconds is None:
        return "-"
    s = max(0.0, float(seconds))
    if s < 10:
        return f"{int(s * 10) / 10:.1f}s"
    whole = int(s)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def eta_text(eta_s: float | None, span: list[float] | tuple[float, float] | None = None) -> str:
    """An ETA as shown: a duration, or a range ("20–45 min") when the estimate is uncertain."""
    if eta_s is None:
        return "-"
    if not span:
        return dur(eta_s)
    low, high = max(0.0, float(span[0])), max(0.0, float(span[1]))
    if high < 3600:
        return f"{low / 60:.0f}–{max(1.0, high / 60):.0f} min"
    if low >= 3600 and high < 86400:
        return f"{low / 3600:.0f}–{high / 3600:.0f} h"
    if low >= 86400:
        return f"{low / 86400:.1f}–{high / 86400:.1f} d"
    return f"{dur(low)}–{dur(high)}"


#: How wide a pipe may be: wide enough that rich never cuts a line (boxes fit their content).
PIPE_WIDTH = 100_000


def _console():
    """A terminal's own width; a pipe's as wide as the widest line, never the 80 columns rich
    assumes (then `| less -S` or a file keeps every character)."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else PIPE_WIDTH)


def _panel(text: str, **kw):
    """A box around `text`: the terminal's width, or in a pipe its content's."""
    from rich.panel import Panel

    return Panel(text, expand=sys.stdout.isatty(), **kw)


def _caption(meta: dict[str, Any]) -> str:
    text = f"from {meta['source']} at log seq {meta['seq']}"
    c = meta.get("cluster")  # `teams`: the cluster's totals beside the teams' rows
    return text + f"; {cluster_text(c)}" if c else text


def cluster_text(c: dict[str, Any]) -> str:
    """The cluster's totals (`readmodel.cluster_totals`) in words: the table's caption, the
    plain output's last line."""
    free = f"{c['free_gpus']} free, " if "free_gpus" in c else ""  # (a reader from before it)
    return (f"cluster: {c['total_gpus']} GPUs on {c['nodes']} nodes, {free}{c['held_gpus']:g} held, "
            f"{c['running_jobs']} running and {c['pending_jobs']} pending jobs in {c['teams']} teams")


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
                detail = f"[red]idle {dur(now - d['idle']['since'])}[/] (< {d['idle']['threshold_pct']:g}%); " + detail
            if d.get("preemption"):
                p = d["preemption"]
                detail += "; idle timeout: yielding" if p.get("cause") == "idle" else f"; preempting for {p['for_job']}"
            if d.get("unhealthy_gpus"):
                detail += f"; [red]on unhealthy GPU {compress_gpus(d['unhealthy_gpus'])}[/]"
        else:
            detail = d["end_reason"]
        since = d["started_at"] if d["state"] in ("starting", "running") else d["submitted_at"]
        age = dur(now - since) if d["state"] not in ("completed", "failed", "cancelled", "timeout") else "-"
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


#: A MIG GPU's cell: some slices held, or partitioned with every slice free.
_MIG_CELLS = {"sliced": "#", "mig": ":"}


def print_nodes(docs: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    from rich.table import Table

    teams = sorted({g["team"] for d in docs for g in d["gpus"] if g["team"]})
    table = Table(caption=_caption(meta) + ("; GPUs: team initial (reversed: idle), % shared, # MIG slices held, : MIG free, . free, x down" if docs else ""),
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
            elif g["status"] == "shared":
                cells.append("[cyan]%[/]")
            elif g["status"] in _MIG_CELLS:
                cells.append(f"[magenta]{_MIG_CELLS[g['status']]}[/]")
            else:
                cells.append("[red]x[/]")
        status = "lost" if d["lost"] else "drained" if d["drained"] else "ok"
        jobs = sorted({g["job_id"] for g in d["gpus"] if g["job_id"]} | {j for g in d["gpus"] for j in g.get("shares", {})}
                      | {j for g in d["gpus"] for j in g.get("mig", {}).get("slices", {}).values()})
        table.add_row(d["node"], d["rack"], status, f"{d['free']}/{d['total']}", "".join(cells), " ".join(jobs))
    _console().print(table)


def print_teams(docs: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(caption=_caption(meta) + "; SHARE: held / guaranteed share of the cluster; GPU-h: held, busy "
                  "(not idle), EFF = busy / held", header_style="bold")
    for col in ("TEAM", "HELD", "GUAR", "LIMIT", "WEIGHT", "SHARE", "RUN", "QUEUED", "USAGE", "GPU-h", "EFF"):
        table.add_column(col, no_wrap=True, justify="left" if col == "TEAM" else "right",
                         min_width=max([4] + [len(d["team"]) for d in docs]) if col == "TEAM" else None)
    pooled = any(d.get("pools") for d in docs)
    if pooled:
        table.add_column("POOLS held/guar<=limit", no_wrap=True)
        table.caption = str(table.caption) + "; POOLS: per GPU model"
    for d in docs:
        held = f"[{'yellow' if d['under_guarantee'] else 'green'}]{d['held']}[/]"
        table.add_row(d["team"], held, str(d["guaranteed"]), "-" if d["limit"] is None else str(d["limit"]),
                      f"{d['weight']:g}", f"{d['share']:.0%}/{d['entitled_share']:.0%}", str(d["running_jobs"]),
                      f"{d['pending_jobs']}j {d['pending_gpus']}g", f"{d['usage_gpu_s'] / 3600:.1f}h",
                      f"{d['gpu_hours_held']:.2f}/{d['gpu_hours_busy']:.2f}",
                      "-" if d["efficiency"] is None else f"{d['efficiency']:.0%}",
                      *([pool_text(d["pools"])] if pooled else []))
    _console().print(table)


def print_queue(docs: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(caption=_caption(meta), header_style="bold")
    for col in ("#", "JOB", "TEAM", "PRIO", "GPUS", "WAITING", "ETA", "REASON"):
        table.add_column(col, no_wrap=col != "REASON")
    now = display_now(meta)
    for d in docs:
        table.add_row(str(d["position"]), d["job_id"], d["team"], d["priority"], str(d["gpus"]), dur(now - d["submitted_at"]),
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
    return dur(now - (d["started_at"] if d["state"] in ("starting", "running") else d["submitted_at"]))


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
    return "".join((g["team"] or "?")[0] if g["status"] == "held" else "." if g["status"] == "free"
                   else "%" if g["status"] == "shared" else _MIG_CELLS.get(g["status"], "x")
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
    Field("pools", "POOLS", lambda d, _n: pool_text(d.get("pools") or {}) or "-", wide=True),
]

QUEUE_FIELDS = [
    Field("position", "#", _s("position"), right=True), Field("job", "JOB", _s("job_id")),
    Field("team", "TEAM", _s("team")), Field("priority", "PRIO", _s("priority")), Field("gpus", "GPUS", _s("gpus")),
    Field("waiting", "WAITING", lambda d, now: dur(now - d["submitted_at"])),
    Field("eta", "ETA", lambda d, _n: eta_text(d["eta_s"], d.get("eta_range"))), Field("reason", "REASON", _s("reason")),
    Field("blockers", "BLOCKERS", lambda d, _n: ",".join(d.get("blockers") or []) or "-", wide=True),
    Field("preemptions", "PREEMPTED", _s("preemptions"), wide=True),
]

FIELDS = {"jobs": JOB_FIELDS, "nodes": NODE_FIELDS, "teams": TEAM_FIELDS, "queue": QUEUE_FIELDS}



def _why_lines(why: dict[str, Any], d: dict[str, Any], now: float) -> list[str]:
    """The lines of the "why is it pending?" panel: the reason the running policy recorded
    first, then what the state says around it."""
    waited = display_now({"at": now}) - d["submitted_at"]
    w = [f"[bold yellow]why pending:[/] {why['summary']}  (waiting {dur(waited)}, "
         f"queue position {why['queue']['position']} of {why['queue']['of']})"]
    if why["policy"].get("why"):
        typed = why["policy"]["why"]
        w.append(f"reason recorded by the policy: {typed['kind']} "
                 + " ".join(f"{k}={v}" for k, v in typed.items() if k != "kind"))
    if why["policy"]["blockers"]:
        w.append(f"blockers (policy): {', '.join(why['policy']['blockers'])}")
    if why.get("held"):
        w.append(f"[red]held by {why['held']}[/]")
    if why.get("last_attempt"):
        w.append(f"[red]{why['last_attempt']}[/]")
    if why.get("dependency"):
        w.append(f"dependencies: {', '.join(why['dependency'])}")
    tq = why["team_quota"]
    lim = "none" if tq["limit"] is None else tq["limit"]
    # what the preemption rules would take from other teams for it now (policy/explain._takeable)
    reclaims = any(n for t, n in (why.get("reclaimable_by_team") or {}).items() if t != why["team"])
    w.append(f"team {why['team']}: holds {tq['held']}, guaranteed {tq['guaranteed']}, limit {lim}"
             + ("  [red]limit stops it[/]" if tq["limit_blocks"] else "")
             + ("  (under its guarantee: may reclaim from over-share teams)"
                if tq["under_guarantee"] and reclaims else ""))
    if why.get("pools"):
        gp = why["pools"]
        w.append("GPU pools: " + "  ".join(f"{p} {r['free']}/{r['gpus']} free" for p, r in gp["rows"].items())
                 + f"; accepts {', '.join(gp['accepts']) or 'any'}"
                 + (f"; not accepted: {', '.join(gp['not_accepted'])}" if gp["not_accepted"] else "")
                 + (f"; team {why['team']} held/guar<=limit: {pool_text(gp['rows'])}" if gp["terms"] else "")
                 + (f"  [red]per-model limit stops it on {', '.join(gp['at_limit'])}[/]" if gp.get("at_limit") else "")
                 + (f"  (under its per-model guarantee on {', '.join(gp['under_guarantee'])}: may reclaim there)"
                    if gp.get("under_guarantee") and reclaims else ""))
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


def _wants(d: dict[str, Any]) -> str:
    """What a job asks for, as `show` heads it: GPUs, or a share of one (docs/gpu-sharing.md)."""
    if d.get("mig") is not None:
        return f"{d['mig_count']} MIG {d['mig']} slice(s) of one GPU"
    if d.get("gpu_fraction") is not None:
        return f"{d['gpu_fraction']:g} of a GPU"
    if d.get("gpu_memory_mb") is not None:
        return f"{d['gpu_memory_mb']} MiB of a GPU"
    return f"{d['gpus_requested']} GPU(s)"


def _holds(d: dict[str, Any]) -> str:
    if d.get("mig_slices") is not None:
        return (f"holds MIG slice(s) {', '.join(map(str, d['mig_slices']))} of GPU {compress_gpus(d['gpus'])} "
                f"(charged {d['gpu_share']:g} of a GPU, via {d['placer']})")
    if d.get("gpu_share") is not None:
        return f"holds {d['gpu_share']:g} of GPU {compress_gpus(d['gpus'])} (shared with other fractional jobs, via {d['placer']})"
    return f"holds {len(d['gpus'])} GPU(s): {compress_gpus(d['gpus'])} ({d['level']}, via {d['placer']})"


def _where_lines(d: dict[str, Any]) -> list[str]:
    """The job's image and working directory."""
    lines = []
    if d.get("image"):
        lines.append(f"image: {d['image']} (podman, pulled when missing on the node)")
    if d.get("workdir"):
        lines.append(f"runs in {d['workdir']}; checkpoints: {d.get('checkpoint_mode', 'rank0')}")
    elif d.get("image"):
        lines.append(f"runs in the image's working directory; checkpoints: {d.get('checkpoint_mode', 'rank0')}")
    return lines


def print_show(data: dict[str, Any]) -> None:
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
            + (f" user [bold]{d['user']}[/]" if d.get("user") else "")
            + (f" (via {d['via']})" if d.get("via") else "") + f"  {d['priority']}  "
            f"[{STATE_STYLE.get(d['state'], '')}]{d['state']}[/]  wants {_wants(d)}"
            + (f" (min {d['min_gpus']})" if d["min_gpus"] != d["gpus_requested"] else "")
            + _per_node(d.get("cpus"), d.get("memory_mb"))
            + ("  preemptible" if d["preemptible"] else "")
            + (f"  topology <= {d['required']}" if d["required"] != "cluster" else ""))
    lines = [head]
    if d["gpus"]:
        lines.append(_holds(d))
    if d["checkpoint"]:
        c = d["checkpoint"]
        lines.append(f"last checkpoint: step {c['step']} at {c['path']} ({dur(now - c['at'])} ago)")
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
    lines += _where_lines(d)
    for ref in d.get("logs", [])[-8:]:
        lines.append(f"log of {readmodel.attempt_text(ref['attempt'], ref['generation'])} rank {ref['rank']}: {ref['node']}:{ref['path']}  "
                     f"(gpusched logs {d['job_id']} --attempt {ref['attempt']} --rank {ref['rank']})")
    console.print(_panel("\n".join(lines), title=f"job {d['job_id']}", subtitle=f"log seq {data['seq']}"))

    why = data.get("why_pending")
    if why:
        w = _why_lines(why, d, now)
        console.print(_panel("\n".join(w), title="why is it pending?", border_style="yellow"))

    for p in data["preemptions"]:
        ck = p.get("checkpoint")
        what = ("idle timeout" if p.get("cause") == "idle" else f"preempted for [bold]{p['for_job']}[/]")
        txt = (f"{what} at seq {p['seq']} ({p['reason']}); "
               + (f"released {'forcibly' if p['forced'] else 'after checkpoint'}, lost {p['lost_gpu_s']:.0f} GPU-s"
                  if p["released_at"] is not None else f"checkpoint due in {dur(p['deadline'] - now)}")
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
        table.add_row(str(h["seq"]), dur(h["at"] - t0), h["type"], h["text"])
    console.print(table)


def _per_node(cpus: float | None, memory_mb: int | None) -> str:
    """', 8 CPUs and 16G per node' (what the job reserves on each node it uses), or ''."""
    parts = ([f"{cpus:g} CPUs"] if cpus else []) + (
        [f"{memory_mb / 1024:g}G" if memory_mb >= 1024 else f"{memory_mb}M"] if memory_mb else [])
    return f", {' and '.join(parts)} per node" if parts else ""


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
                     f"{dur(now - idle['since'])} ago (mean {idle['util_pct']:.1f}%, max {idle['util_pct_max']:.1f}%, "
                     f"{idle['memory_mb']:.0f} MB per GPU; reported by the reconciler)")
    if d.get("yielded_idle"):
        lines.append("requeued by its idle timeout: waits behind the queue until granted again")
    if d.get("gpu_hours_held"):
        eff = d["efficiency"]
        lines.append(f"GPU-hours held {d['gpu_hours_held']:.3f}, busy {d['gpu_hours_busy']:.3f}"
                     + ("" if eff is None else f" (efficiency {eff:.0%})")
                     + (f"; idle timeouts {d['idle_requeues']}" if d.get("idle_requeues") else ""))
    return lines


__all__ = ["compress_gpus", "dur", "eta_text", "PRINTERS", "FIELDS", "print_show"]
