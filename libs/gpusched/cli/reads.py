"""Where `jobs`, `nodes`, `teams`, `queue` and `show` get their documents: the Redis read models
when Redis answers and a projector has written them (fast), else a fold of the log (always
correct, slower); `--fold` forces the latter. Both paths build the same documents
(`gpusched.readmodel`), so `--json` is identical either way. `show` reads the job's history from
the log (filtered by subject) and explains a pending job with `policy.explain` over a fold (a
verified snapshot plus the log's tail when there is one).
"""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING, Any

from gpusched import readmodel

if TYPE_CHECKING:  # only its type: a listing from the reader or Redis never loads the fold
    from gpusched.bus.log import Record
    from gpusched.core.state import ClusterState

from .output import display_now, iso


async def open_log(nats: str | None, creds: str | None = None):
    """The log, as `creds` (a command's `--creds`; None: $GPUSCHED_CREDS, then the client config)."""
    from gpusched.bus.log import NATS_HINT, EventLog, Unreachable, nats_url

    try:
        return await asyncio.wait_for(EventLog.open(nats, name="gpusched-cli", creds=creds), 5)
    except Unreachable:
        raise
    except (TimeoutError, OSError) as err:
        raise Unreachable("NATS", nats_url(nats), err, NATS_HINT) from err


async def fold_state(nats: str | None, redis: str | None = None, use_snapshot: bool = True,
                     at: str | None = None, creds: str | None = None) -> ClusterState:
    """The cluster state now, or `at` a log sequence or time: a Redis snapshot (when it is not
    past the cut) plus the log up to the cut, or the log from its start (with the log's own
    fold settings)."""
    from gpusched.store import fold_log

    log = await open_log(nats, creds)
    try:
        until = await cut_seq(log, at)
        state = await verified_snapshot(log, redis, until) if use_snapshot else None
        return await fold_log(log, state, until)
    finally:
        await log.close()


async def verified_snapshot(log, redis: str | None, until: int | None = None) -> ClusterState | None:
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
            state = await asyncio.wait_for(load_snapshot(r), 3)
            if state is not None and await untrusted(log, state) is not None:
                state = None
        except Exception:  # noqa: BLE001 - a snapshot is only a shortcut
            state = None
        finally:
            await r.aclose()
    if state is None and until is None:
        try:
            info = (await log.js.stream_info(subjects.STREAM)).state
            state, _ = await SnapshotStore(log).latest(info.first_seq, info.last_seq)
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


async def _views(args, what: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """The documents of `what` from the Redis views and where they came from (with the usage
    for `jobs`), on one connection in two round trips (`Views.listing`), when Redis answers and
    a projector has written them; else None."""
    if getattr(args, "fold", False) or not _redis_configured(args.redis):
        return None
    from gpusched.views import Views

    views = Views.connect(args.redis)
    try:
        read = await asyncio.wait_for(views.listing(what, with_usage=what == "jobs"), 5)
    except Exception as err:  # noqa: BLE001 - the log answers instead; say so once
        read = None
        args.redis_failed = True
        print(f"gpusched {args.command}: Redis read models unreachable ({type(err).__name__}: {err}); "
              "folding the log instead", file=sys.stderr)
    finally:
        await views.close()
    if read is None:
        return None
    docs, meta, used = read
    return docs, {"source": "redis", "seq": meta["seq"], "at": meta["at"], **({} if used is None else {"usage": used}),
                  **({"cluster": meta["cluster"]} if what == "teams" and "cluster" in meta else {})}


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
    from . import scoped

    creds = getattr(args, "creds", None)
    if what in scoped.SCOPED_LISTINGS and (ident := scoped.reader_identity(creds)) is not None:
        return await scoped.listing(args, ident, what)
    quick = what in scoped.SCOPED_LISTINGS and not getattr(args, "fold", False) and _policy(args) is None
    if quick and (answer := await scoped.unscoped_listing(args, what)) is not None:
        return answer
    config = _policy(args)
    at = getattr(args, "at", None)
    if at is not None:  # the past: always a fold of the log up to the cut
        state = await fold_state(args.nats, args.redis, at=at, creds=creds)
        return docs_from_state(state, what, config), {"source": "log", "seq": state.last_seq, "at": state.now,
                                                       "past": True, **_totals(state, what)}
    read = None if config is not None and what == "queue" else await _views(args, what)
    if read is not None:
        return read
    state = await fold_state(args.nats, args.redis, use_snapshot=not getattr(args, "redis_failed", False),
                             creds=creds)
    return docs_from_state(state, what, config), {"source": "log", "seq": state.last_seq, "at": state.now,
                                                   **_totals(state, what)}


def _totals(state: ClusterState, what: str) -> dict[str, Any]:
    """`teams` carries the cluster's totals (`readmodel.cluster_totals`), as the reader answers them."""
    return {"cluster": readmodel.cluster_totals(state)} if what == "teams" else {}


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


def docs_from_state(state: ClusterState, what: str, config=None, team: str | None = None) -> list[dict[str, Any]]:
    """The documents of one kind; `team`: only that team's jobs (or its own row of `teams`)."""
    if what == "jobs":
        jobs = sorted((j for j in state.jobs.values() if team is None or j.spec.team == team),
                      key=lambda j: (j.submitted_at, j.job_id))
        return [{**readmodel.job_doc(state, j), "seq": state.last_seq} for j in jobs]
    if what == "nodes":
        return [{**readmodel.node_doc(state, n), "seq": state.last_seq}
                for n in sorted(state.nodes, key=readmodel.natural_key)]
    if what == "teams":
        return [{**readmodel.team_doc(state, t), "seq": state.last_seq} for t in sorted(state.teams)
                if team is None or t == team]
    if what == "queue":
        return [{**q, "seq": state.last_seq} for q in readmodel.queue_docs(state, config)]
    raise ValueError(what)



async def read_subject(event_log, subject: str) -> list[Any]:
    """Every record of the stream matching `subject`, in log order (stops at what exists now)."""
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from gpusched.bus import subjects as subj

    info = await event_log.js.stream_info(subj.STREAM, subjects_filter=subject)
    count = sum((info.state.subjects or {}).values())
    if count == 0:
        return []
    out: list[Record] = []
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

            out.append(Record(msg.metadata.sequence.stream, event, msg.subject, msg.headers, msg.metadata.timestamp.timestamp()))
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


async def show_data(nats: str | None, redis: str | None, job_id: str, config=None,
                    creds: str | None = None) -> dict[str, Any]:
    """A job's document, history and preemptions; for a pending job, why it waits under the
    running policy `config` (default: the default preset). A tenant's or platform's credentials
    ask the reader service instead (`cli.scoped`): it answers for their own team's jobs only."""
    from gpusched.policy.config import DEFAULT
    from gpusched.store import fold_log

    from . import scoped

    if (ident := scoped.reader_identity(creds)) is not None:
        return await scoped.show(nats, ident, job_id, creds)
    config = config or DEFAULT
    event_log = await open_log(nats, creds)
    try:
        state = await verified_snapshot(event_log, redis)
        state = await fold_log(event_log, state)
        job = state.jobs.get(job_id)
        used = await usage(redis) if job is not None and job.holding else {}
        return await show_from(event_log, state, job_id, config, used)
    finally:
        await event_log.close()


async def show_from(event_log, state: ClusterState, job_id: str, config, used: dict | None = None,
                    indexes=None) -> dict[str, Any]:
    """`show_data` over a fold at hand (the CLI's own, or the reader service's live one): the
    job's history comes from the log, filtered by subject. `indexes`: the fold's, kept by a
    service across answers (`explain_pending`)."""
    from gpusched.policy.explain import explain_pending, explain_preemptions

    if job_id in state.forgotten:
        return forgotten_doc(state, job_id)
    if job_id not in state.jobs:
        return {"job_id": job_id, "error": _not_a_job(state, job_id)}
    history = await job_history(event_log, job_id)
    job = state.jobs[job_id]
    own = [(r.seq, r.event) for r in history if getattr(r.event, "job_id", None) == job_id]
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
        data["why_pending"] = explain_pending(state, job_id, config=config, indexes=indexes)
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


__all__ = ["open_log", "fold_state", "verified_snapshot", "cut_seq", "load", "usage", "with_accounting",
           "docs_from_state", "read_subject", "job_history", "show_data", "show_from", "retired_note", "forgotten_doc"]
