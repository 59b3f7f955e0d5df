"""`gpusched jobs | nodes | teams | queue | show JOB`: what the cluster looks like, and why a job
waits. The documents come from `cli.reads`, their look from `cli.render`; this module is the
commands' arguments."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from gpusched import readmodel

from .output import AT, CONNECTION, FILTERS, columns, display_now, emit, filter_docs, output_parent
from .reads import _policy, load, show_data, usage, with_accounting
from .render import FIELDS, PRINTERS, cluster_text, print_show


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
        used = meta["usage"] if "usage" in meta else asyncio.run(usage(args.redis)) if what == "jobs" else None
        docs = with_accounting(what, docs, display_now(meta), used)
        cluster = meta.get("cluster") if what == "teams" else None
        if cluster:  # each team's row carries the cluster's totals, as the table's caption shows them
            docs = [{**d, "cluster": cluster} for d in docs]
        emit(docs, FIELDS[what], args, display_now(meta), lambda: PRINTERS[what](docs, meta),
             footer=cluster_text(cluster) if cluster else None)
        return 0

    return run




def _show(args) -> int:
    data = asyncio.run(show_data(args.nats, args.redis, args.job_id, _policy(args), getattr(args, "creds", None)))
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


__all__ = ["register"]

