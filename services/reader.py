"""The reader: answers read requests (`jobs`, `teams`, `show`, `history`, `logs`, `events`) for
people who may not read the log themselves, each scoped by who asks.

A tenant or platform asks on `gpusched.read.<kind>.<team>.<user>`: the server lets a user
publish only its own team(s) and name (`security.authz.read_requests`), so the subject is the
caller's verified identity and the answer holds that team's jobs only; nothing in the payload
widens it. Admin and auditors ask on `gpusched.read.<kind>` (every team). Another team's job is
answered exactly like a job that does not exist, and other teams' job ids in an answer (the
holders that block a pending job, a victim preempted for it) are masked (`mask_foreign`).

Answers come from a live fold of the log (the running policy's, as `show` explains with it);
`jobs --at` and `history` fold the log on demand; `logs` asks the node that ran the job, after
the team check. Several instances may run: they share the queue group `reader`.
"""

from __future__ import annotations

import argparse
import asyncio
import re
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from gpusched.bus import subjects
from gpusched.cli.output import UsageError
from gpusched.core.events import JobSubmitted, encode_event
from gpusched.core.state import TERMINAL, ClusterState
from gpusched.services.runtime import ExplainIndexes, FoldedLog, notify_ready
from gpusched.services.shell import common_arguments, policy_arguments, policy_of

log = structlog.get_logger()

QUEUE_GROUP = "reader"
#: Admission's job ids (`j-` + 8 hex digits, `_N` for an array's task). Without the word boundary
#: before it (`mask_foreign` checks that one): the literal start lets the search skip ahead, six
#: times quicker over a listing of 1,000 jobs.
JOB_ID = re.compile(rb"j-[0-9a-f]{8}(?:_[0-9]+)?\b")
_WORD = re.compile(rb"\w")
FOREIGN = b"j-(another team)"
_json = msgspec.json.Encoder()


class ReadError(Exception):
    """A request the reader refuses; the message is the reply's `error`."""


@dataclass(frozen=True)
class Asker:
    """Who asks, from the subject the server allowed: `team` None is the unscoped form (admin,
    auditors)."""

    kind: str
    team: str | None = None
    user: str | None = None


def asker_of(subject: str) -> Asker:
    parts = subject.split(".")
    if parts[:2] != ["gpusched", "read"] or len(parts) not in (3, 5) or parts[2] not in subjects.READ_KINDS:
        raise ReadError(f"unknown read subject {subject!r} (kinds: {', '.join(subjects.READ_KINDS)})")
    return Asker(parts[2], *(parts[3:5] if len(parts) == 5 else ()))


def visible(state: ClusterState, job_id: str, team: str | None) -> bool:
    """Whether a job (or a forgotten one's tombstone, or an array) is this team's."""
    if team is None:
        return True
    job = state.jobs.get(job_id)
    if job is not None:
        return job.spec.team == team
    tomb = state.forgotten.get(job_id)
    if tomb is not None:
        return tomb.team == team
    if job_id in state.arrays:
        first, _ = state.arrays[job_id]
        return visible(state, f"{job_id}_{first}", team)
    return False


def mask_foreign(payload: bytes, state: ClusterState, team: str | None, asked: str | None = None) -> bytes:
    """The encoded answer with every job id that is not `team`'s replaced (None: unchanged);
    `asked`, the id the caller named itself, stays."""
    if team is None:
        return payload
    own = {j.encode() for j, job in state.jobs.items() if job.spec.team == team}
    if asked:
        own.add(asked.encode())
    own |= {j.encode() for j, tomb in state.forgotten.items() if tomb.team == team}

    def mask(m: re.Match) -> bytes:
        start = m.start()
        if m.group(0) in own or (start and _WORD.match(payload, start - 1)):  # own, or inside a word
            return m.group(0)
        return FOREIGN

    return JOB_ID.sub(mask, payload)


class JobDocs:
    """Job documents kept between answers (1,000 of them cost ~30 ms to build): rebuilt only for
    the jobs a record named since, as the projector's dirty marks do, and all of them after a
    record that names no job (or submits an array: its tasks are not named). A kept document's
    GPU-seconds are as of when it was built, with their `at`: `accounting` extrapolates them,
    as it does the projector's."""

    def __init__(self) -> None:
        self.docs: dict[str, dict[str, Any]] = {}
        self.dirty: set[str] = set()
        self.all_dirty = True

    def listener(self, rec, state: ClusterState) -> None:
        e = rec.event
        job_id = getattr(e, "job_id", None)
        if job_id and not (isinstance(e, JobSubmitted) and e.spec.array is not None):
            self.dirty.add(job_id)
        else:
            self.all_dirty = True

    def of(self, state: ClusterState, team: str | None) -> list[dict[str, Any]]:
        """`docs_from_state(state, "jobs", team=team)`, from what is kept where it still holds."""
        from gpusched import readmodel

        if self.all_dirty or len(self.docs) > 2 * len(state.jobs) + 64:  # forgotten jobs linger
            self.docs, self.all_dirty = {}, False
        for job_id in self.dirty:
            self.docs.pop(job_id, None)
        self.dirty = set()
        jobs = sorted((j for j in state.jobs.values() if team is None or j.spec.team == team),
                      key=lambda j: (j.submitted_at, j.job_id))
        out = []
        for job in jobs:
            doc = self.docs.get(job.job_id)
            if doc is None:
                doc = self.docs[job.job_id] = readmodel.job_doc(state, job)
            out.append({**doc, "seq": state.last_seq})
        return out


class Reader:
    def __init__(self, folded: FoldedLog, config, nats: str | None = None, redis: str | None = None):
        self.folded, self.config, self.nats, self.redis = folded, config, nats, redis
        self._tasks: set[asyncio.Task] = set()
        self.job_docs = JobDocs()
        self._views: Any = None  # gpusched.views.Views, opened on the first answer that needs it
        folded.listeners.append(self.job_docs.listener)
        self.indexes = ExplainIndexes(folded)  # `show`'s, kept for the fold's life

    def on_message(self, msg) -> None:
        """Each request in a task of its own: a history fold must not hold up a `jobs`."""
        task = asyncio.ensure_future(self.on_request(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def state(self) -> ClusterState:
        return self.folded.state

    async def on_request(self, msg) -> None:
        try:
            asker = asker_of(msg.subject)
            request = msgspec.json.decode(msg.data) if msg.data else {}
            if not isinstance(request, dict):
                raise ReadError("a read request is a JSON object")
            data = await getattr(self, f"read_{asker.kind}")(asker, request)
            asked = request.get("job_id") if isinstance(request.get("job_id"), str) else None
            reply = mask_foreign(_json.encode({"ok": True, "data": data}), self.state, asker.team, asked)
        except (ReadError, UsageError, msgspec.DecodeError, ValueError, TypeError) as err:  # the asker's mistake
            reply = _json.encode({"ok": False, "error": str(err)})
        except Exception as err:  # noqa: BLE001 - one bad request must not end the service
            log.exception("read_failed", subject=msg.subject)
            reply = _json.encode({"ok": False, "error": f"{type(err).__name__}: {err}"})
        await msg.respond(reply)

    async def _cut(self, request: dict) -> tuple[ClusterState, dict]:
        """The state a listing answers from, and its meta: the live fold, or with `at` (`--at`)
        a fold of the log up to that cut."""
        from gpusched.cli.reads import fold_state

        at = request.get("at")
        state = self.state if at is None else await fold_state(self.nats, None, at=str(at))
        return state, {"source": "reader", "seq": state.last_seq, "at": state.now, **({"past": True} if at else {})}

    async def read_jobs(self, asker: Asker, request: dict) -> dict:
        from gpusched.cli.reads import docs_from_state

        at = request.get("at")
        state, meta = await self._cut(request)
        docs = self.job_docs.of(state, asker.team) if at is None else docs_from_state(state, "jobs", team=asker.team)
        return {"docs": docs, "meta": meta, "usage": await self._usage(docs) if at is None else {}}

    async def _usage(self, docs: list[dict]) -> dict:
        """The reconciler's used-versus-held window of these jobs (Redis, through one client
        kept for the reader's life, not a connection per answer; none without it)."""
        from gpusched.cli.reads import _redis_configured

        if not any(d["gpus"] for d in docs) or not _redis_configured(self.redis):
            return {}
        if self._views is None:
            from gpusched.views import Views

            self._views = Views.connect(self.redis)
        try:
            used = await asyncio.wait_for(self._views.usage(), 3)
        except Exception:  # noqa: BLE001 - telemetry is optional
            used = {}
        return {d["job_id"]: used[d["job_id"]] for d in docs if d["job_id"] in used}

    async def close(self) -> None:
        if self._views is not None:
            await self._views.close()

    async def read_teams(self, asker: Asker, request: dict) -> dict:
        from gpusched import readmodel
        from gpusched.cli.reads import docs_from_state

        state, meta = await self._cut(request)  # `teams --at`: the standing then, as `jobs --at` reads the jobs then
        return {"docs": docs_from_state(state, "teams", team=asker.team), "cluster": readmodel.cluster_totals(state),
                "meta": meta}

    async def read_show(self, asker: Asker, request: dict) -> dict:
        from gpusched.cli.reads import show_from

        job_id = _job_id(request)
        if not visible(self.state, job_id, asker.team):
            return {"job_id": job_id, "error": f"no job {job_id} among team {asker.team}'s jobs"}
        return await show_from(self.folded.log, self.state, job_id, self.config, indexes=self.indexes())

    async def read_history(self, asker: Asker, request: dict) -> dict:
        from gpusched.accounting import job_records, period_report
        from gpusched.cli.history import history_data

        at = request.get("at")
        state, ledger = await history_data(self.nats, None if at is None else str(at))
        docs = [d for d in job_records(state, ledger) if asker.team is None or d["team"] == asker.team]
        by = request.get("by")
        if by is None:
            return {"docs": docs, "now": state.now}
        if by not in ("day", "week"):
            raise ReadError(f"by: expected day or week, not {by!r}")
        wanted = set(request.get("jobs") or [d["job_id"] for d in docs]) & {d["job_id"] for d in docs}
        rows = period_report(state, ledger, by, jobs=wanted)
        return {"docs": [r for r in rows if asker.team is None or r["team"] == asker.team], "now": state.now}

    async def read_logs(self, asker: Asker, request: dict) -> dict:
        """One chunk of a rank's log from the node that ran it; or, before the job started
        there, why not (and whether it may still start: `waiting`)."""
        from gpusched.cli.logs import _running, _target
        from gpusched.core.heartbeat import LogReply, LogRequest

        job_id, state = _job_id(request), self.state
        if not visible(state, job_id, asker.team):
            raise ReadError(f"no job {job_id} among team {asker.team}'s jobs")
        rank, attempt = int(request.get("rank", 0)), request.get("attempt")
        target = _target(state, job_id, None if attempt is None else int(attempt), rank)
        job = state.jobs.get(job_id)
        if isinstance(target, str):
            return {"ok": False, "error": target, "waiting": job is not None and job.state not in TERMINAL,
                    "state": None if job is None else job.state}
        node, attempt, generation = target
        if request.get("generation") is not None:  # the run the caller follows
            generation = int(request["generation"])
        req = LogRequest(job_id=job_id, attempt=attempt, rank=rank, generation=generation,
                         offset=int(request.get("offset", 0)), max_bytes=int(request.get("max_bytes", 64 * 1024)))
        try:
            msg = await self.folded.log.nc.request(subjects.node_logs_subject(node), _json.encode(req),
                                                   timeout=float(request.get("timeout", 5.0)))
        except Exception as err:  # noqa: BLE001 - no responder, timeout: the node is not answering
            return {"ok": False, "error": f"node {node} does not answer ({type(err).__name__})", "unreachable": True}
        reply = msgspec.json.decode(msg.data, type=LogReply)
        return {**msgspec.to_builtins(reply), "attempt": attempt, "generation": generation,
                "running": _running(self.state, job_id, attempt, generation)}

    async def read_events(self, asker: Asker, request: dict) -> dict:
        """A job's facts after log sequence `after` (for `gpusched.client`'s watch), encoded as
        in the log, and whether the job has ended."""
        from gpusched.cli.reads import job_history

        job_id, after = _job_id(request), int(request.get("after", 0))
        if not visible(self.state, job_id, asker.team):
            raise ReadError(f"no job {job_id} among team {asker.team}'s jobs")
        job = self.state.jobs.get(job_id)
        history = await job_history(self.folded.log, job_id)
        events = [[r.seq, encode_event(r.event).decode()] for r in history
                  if r.seq > after and getattr(r.event, "job_id", None) == job_id]
        return {"events": events, "ended": job is None or job.state in TERMINAL, "seq": self.state.last_seq}


def _job_id(request: dict) -> str:
    job_id = request.get("job_id")
    if not isinstance(job_id, str) or not job_id:
        raise ReadError("job_id: a job id is required")
    return job_id


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser)
    policy_arguments(parser)  # `show` explains a pending job under the running policy


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    config = policy_of(args)
    folded = await FoldedLog.open(args.nats, name="gpusched-reader")
    reader = Reader(folded, config, args.nats, args.redis)

    async def on_message(msg) -> None:
        reader.on_message(msg)

    sub = await folded.log.nc.subscribe(subjects.READ_ANY, queue=QUEUE_GROUP, cb=on_message)
    await folded.log.nc.flush()
    log.info("reader_ready", seq=folded.seen_seq)
    notify_ready()
    try:
        await stop.wait()
    finally:
        await sub.unsubscribe()
        await reader.close()
        await folded.close()


__all__ = ["Reader", "Asker", "asker_of", "visible", "mask_foreign", "serve", "add_arguments"]
