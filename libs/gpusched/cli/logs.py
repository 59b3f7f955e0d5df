"""`gpusched logs JOB [--rank R] [--attempt N] [-f]`: a job's stdout/stderr, kept per rank and
attempt on the node that ran it and served by that node's daemon over NATS."""

from __future__ import annotations

import argparse
import asyncio
import sys

import msgspec

from gpusched.core.heartbeat import LogReply, LogRequest
from gpusched.core.state import TERMINAL

CHUNK = 64 * 1024


async def _request(nc, node: str, req: LogRequest, timeout: float) -> LogReply:
    from gpusched.bus import subjects

    msg = await nc.request(subjects.node_logs_subject(node), msgspec.json.encode(req), timeout=timeout)
    return msgspec.json.decode(msg.data, type=LogReply)


def _target(state, job_id: str, attempt: int | None, rank: int) -> tuple[str, int, int] | str:
    """(node, attempt, generation) of the log asked for, or why there is none."""
    job = state.jobs.get(job_id)
    if job is None:
        return f"no job {job_id} in the log"
    refs = [r for r in job.logs if r.rank == rank and (attempt is None or r.attempt == attempt)]
    if not refs:
        return (f"no log of {job_id} rank {rank}" + (f" attempt {attempt}" if attempt is not None else "")
                + " (it has not started there)")
    ref = max(refs, key=lambda r: (r.attempt, r.generation))
    return ref.node, ref.attempt, ref.generation


def _running(state, job_id: str, attempt: int, generation: int) -> bool:
    job = state.jobs.get(job_id)
    return job is not None and job.holding and (job.attempt, job.generation) == (attempt, generation)


async def _wait_for_start(folded, args: argparse.Namespace) -> tuple[str, int, int] | str:
    """`logs -f` of a job that has not started (on that rank): wait until it does, or ends
    without (then why there is no log), saying once that it waits."""
    said = False
    while True:
        target = _target(folded.state, args.job_id, args.attempt, args.rank)
        job = folded.state.jobs.get(args.job_id)
        if not isinstance(target, str) or job is None or job.state in TERMINAL:
            return target
        if not said:
            print(f"gpusched logs: {args.job_id} is {job.state}; waiting for it to start", file=sys.stderr)
            said = True
        await folded.wait_changed(args.interval * 4)


async def run_logs(args: argparse.Namespace, out=sys.stdout) -> int:
    from gpusched.cli import scoped
    from gpusched.cli.reads import open_log
    from gpusched.services.runtime import FoldedLog

    if (ident := scoped.reader_identity(getattr(args, "creds", None))) is not None:  # a tenant's or platform's: through the reader
        return await scoped.logs(args, ident, out)
    event_log = await open_log(args.nats, getattr(args, "creds", None))
    folded = FoldedLog(event_log)
    try:
        await folded.start()
        target = _target(folded.state, args.job_id, args.attempt, args.rank)
        if isinstance(target, str) and args.follow:
            target = await _wait_for_start(folded, args)
        if isinstance(target, str):
            print(f"gpusched logs: {target}", file=sys.stderr)
            return 1
        node, attempt, generation = target
        offset = 0
        while True:
            req = LogRequest(job_id=args.job_id, attempt=attempt, rank=args.rank, generation=generation,
                             offset=offset, max_bytes=CHUNK)
            try:
                reply = await _request(event_log.nc, node, req, args.timeout)
            except Exception as err:  # noqa: BLE001 - no responder, timeout: the node is not answering
                print(f"gpusched logs: node {node} does not answer ({type(err).__name__})", file=sys.stderr)
                return 2
            if not reply.ok:
                print(f"gpusched logs: {reply.error}", file=sys.stderr)
                return 1
            out.write(reply.data)
            out.flush()
            offset = reply.offset
            if offset < reply.size:
                continue
            if not args.follow or not _running(folded.state, args.job_id, attempt, generation):
                return 0
            await asyncio.sleep(args.interval)
    finally:
        await folded.stop()
        await event_log.close()


def _logs(args: argparse.Namespace) -> int:
    return asyncio.run(run_logs(args))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logs", help="a job's stdout/stderr (per rank and attempt, from its node)",
                       description="Print a job's output as its node keeps it: one rank of one attempt "
                                   "(default: rank 0 of the latest). -f follows a running job.")
    p.add_argument("job_id", help="the job id")
    p.add_argument("--rank", type=int, default=0, help="node rank (default 0)")
    p.add_argument("--attempt", type=int, default=None, help="attempt (default: the latest)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing while the job runs (waits for a job not yet started)")
    p.add_argument("--interval", type=float, default=0.5, help="follow: seconds between polls")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the node's answer")
    p.add_argument("--nats", default=None, help="NATS URL (default: $GPUSCHED_NATS_URL or nats://127.0.0.1:4222)")
    p.set_defaults(func=_logs)


__all__ = ["register", "run_logs"]
