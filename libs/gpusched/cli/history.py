"""`gpusched history`: accounting from the log, like Slurm's `sacct`.

Per job: owner, team, GPUs, wait, run time, GPU-hours, end state, attempts and lost work
(`gpusched.accounting` over a fold of the log); filters by team, user, state and time range;
table, `-o wide`, `--format`, `--json` or `-o csv`; `--by day|week` prints GPU-hours per team
and period instead.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from .output import CONNECTION, FILTERS, Field, columns, emit, filter_docs, iso, output_parent
from .reads import cut_seq, open_log
from .render import dur


def _s(key: str, fmt=str) -> Any:
    return lambda d, _now: "-" if d.get(key) in (None, "") else fmt(d[key])


JOB_FIELDS = [
    Field("job", "JOB", _s("job_id")), Field("user", "USER", _s("user")), Field("team", "TEAM", _s("team")),
    Field("gpus", "GPUS", _s("gpus"), right=True), Field("state", "STATE", _s("state")),
    Field("submitted", "SUBMITTED", _s("submitted_at", iso)),
    Field("wait", "WAIT", _s("wait_s", dur), right=True), Field("run", "RUN", _s("run_s", dur), right=True),
    Field("gpu_hours", "GPU_H", _s("gpu_hours", lambda x: f"{x:.2f}"), right=True),
    Field("attempts", "ATTEMPTS", _s("attempts"), right=True),
    Field("lost_gpu_s", "LOST_GPU_S", _s("lost_gpu_s", lambda x: f"{x:.0f}"), right=True),
    Field("name", "NAME", _s("name"), wide=True), Field("priority", "PRIO", _s("priority"), wide=True),
    Field("via", "VIA", _s("via"), wide=True),
    Field("started", "STARTED", _s("started_at", iso), wide=True),
    Field("finished", "FINISHED", _s("finished_at", iso), wide=True),
    Field("preemptions", "PREEMPTED", _s("preemptions"), wide=True),
    Field("restarts", "RESTARTS", _s("restarts"), wide=True),
    Field("busy_gpu_s", "BUSY_GPU_S", _s("busy_gpu_s", lambda x: f"{x:.0f}"), wide=True),
    Field("end_reason", "END_REASON", _s("end_reason"), wide=True),
    Field("pools", "POOLS", lambda d, _n: " ".join(f"{p}:{h:.2f}" for p, h in (d.get("gpu_hours_by_pool") or {}).items())
          or "-", wide=True),
]

PERIOD_FIELDS = [
    Field("period", "PERIOD", _s("period")), Field("team", "TEAM", _s("team")),
    Field("gpu_hours", "GPU_H", _s("gpu_hours", lambda x: f"{x:.2f}"), right=True),
    Field("submitted", "SUBMITTED", _s("submitted"), right=True), Field("started", "STARTED", _s("started"), right=True),
    Field("ended", "ENDED", _s("ended"), right=True),
    Field("median_wait", "MEDIAN_WAIT", _s("median_wait_s", dur), right=True),
    Field("lost_gpu_hours", "LOST_GPU_H", _s("lost_gpu_hours", lambda x: f"{x:.2f}"), right=True),
]


async def history_data(nats: str | None, at: str | None = None, creds: str | None = None) -> tuple[Any, Any]:
    """The fold of the log (up to `--at`) and its ledger."""
    from gpusched.accounting import Ledger
    from gpusched.core.state import ClusterState

    log = await open_log(nats, creds)
    try:
        until = await cut_seq(log, at)
        state, ledger = ClusterState(), Ledger()
        if until is None or until > 0:
            async for rec in log.records(1, until):
                state.apply(rec.event, rec.seq, rec.time, rec.position)
                ledger.observe(state, rec.event)
        return state, ledger
    finally:
        await log.close()


def cmd_history(args: argparse.Namespace) -> int:
    from gpusched.accounting import job_records, period_report

    from . import scoped

    fields = PERIOD_FIELDS if args.by else JOB_FIELDS
    columns(fields, args)  # a bad --format is refused before any connection
    if (ident := scoped.reader_identity(getattr(args, "creds", None))) is not None:  # a tenant's or platform's: its teams' jobs
        docs, now = asyncio.run(scoped.history(args.nats, ident, args))
        emit(docs, fields, args, now)
        return 0
    state, ledger = asyncio.run(history_data(args.nats, args.at, getattr(args, "creds", None)))
    docs = filter_docs(job_records(state, ledger), args)
    if args.by:
        docs = period_report(state, ledger, args.by, jobs=[d["job_id"] for d in docs])
    emit(docs, fields, args, state.now)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "history", help="accounting from the log (like sacct): per job wait, run, GPU-hours, end state; --by day|week",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        parents=[CONNECTION, output_parent([f.name for f in JOB_FIELDS] + ["(--by:)"] + [f.name for f in PERIOD_FIELDS]),
                 FILTERS])
    p.add_argument("--by", choices=["day", "week"], default=None,
                   help="a report per team and period (UTC days, ISO weeks) instead of one line per job")
    p.add_argument("--at", metavar="TIME|SEQ", default=None,
                   help="account the log only up to this sequence or time (default: all of it)")
    p.set_defaults(func=cmd_history)


__all__ = ["register", "history_data"]
