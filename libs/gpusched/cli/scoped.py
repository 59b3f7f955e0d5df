"""Reads for tenants and platforms: `jobs`, `teams`, `show`, `history` and `logs` with nothing
but their credential. They may not read the log or Redis; they ask the reader service
(`services/reader.py`) on `gpusched.read.<kind>.<team>.<user>`, which the server lets them
publish for their own team(s) only, and the reader answers for that team's jobs only.
Admin, auditors and services read the log (and Redis) directly, as before.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec

from gpusched.security.identity import Identity

#: The listings a tenant's credential gets from the reader (the others are admin's and auditors').
SCOPED_LISTINGS = ("jobs", "teams")
#: Roles the reader answers for every team (its unscoped subjects).
UNSCOPED = ("admin", "auditor")
READER_HINT = "is `gpusched up` running with its reader service? (`gpusched service run reader`)"
READ_TIMEOUT_S = 15.0


class ReadDenied(PermissionError):
    """A read outside the caller's teams (refused before asking: the server would refuse it)."""

    exit_code = 1


class ReadFailed(Exception):
    """The reader answered with an error (its reason is the message)."""

    exit_code = 1


def reader_identity(creds: str | None = None) -> Identity | None:
    """The caller's identity (`creds`, else $GPUSCHED_CREDS, else the client config's) when it
    reads through the reader (a tenant or platform), else None."""
    from gpusched.bus import dial

    path = dial.creds_file(creds)
    if not path:
        return None
    try:
        ident = dial.load_identity(path)
    except Exception:  # noqa: BLE001 - an unreadable card: the direct path says what is wrong
        return None
    return ident if ident.role in ("tenant", "platform") else None


def teams_asked(ident: Identity, team_arg: str | None) -> list[str]:
    """The teams a listing asks for: `--team` (each one of the caller's), else all of the caller's."""
    if not team_arg:
        return list(ident.teams)
    wanted = [t for t in team_arg.split(",") if t]
    outside = [t for t in wanted if t not in ident.teams]
    if outside:
        raise ReadDenied(f"permission denied: {ident.name} (role {ident.role}) reads team(s) "
                         f"{', '.join(ident.teams)} only, not {', '.join(outside)}")
    return wanted


@asynccontextmanager
async def session(nats: str | None, nc=None, creds: str | None = None) -> AsyncIterator[Any]:
    """A connection as the caller's identity, `creds` (`nc`: one already open, left open)."""
    from gpusched.bus import connection
    from gpusched.bus.dial import connect

    if nc is not None:
        yield nc
        return
    nc = await connect(nats, name="gpusched-cli", creds=creds)
    try:
        yield nc
    finally:
        connection.expect_close(nc)
        await nc.close()


async def ask(nc, ident: Identity, kind: str, team: str | None, request: dict[str, Any],
              timeout: float = READ_TIMEOUT_S) -> Any:
    """The reader's answer to one request as `ident` for `team`; ReadFailed with its reason."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    from gpusched.bus import subjects
    from gpusched.bus.dial import Unreachable

    subject = subjects.read_subject(kind, team, ident.name)
    try:
        msg = await nc.request(subject, msgspec.json.encode(request), timeout=timeout)
    except NoRespondersError as err:
        raise Unreachable("the reader service", subject, "no responders", READER_HINT) from err
    except NatsTimeout as err:
        raise Unreachable("the reader service", subject, f"no reply within {timeout:g}s", READER_HINT) from err
    reply = msgspec.json.decode(msg.data)
    if not reply.get("ok"):
        raise ReadFailed(reply.get("error") or "the reader refused")
    return reply["data"]


async def listing(args: argparse.Namespace, ident: Identity, what: str, nc=None) -> tuple[list[dict], dict]:
    """`jobs` or `teams` of the caller's teams (`--team` narrows), as `reads.load` returns them;
    for admin and auditors (`UNSCOPED`), every team's. `meta["usage"]`: the reconciler's window
    of the running jobs listed."""
    teams: list[str | None] = [None] if ident.role in UNSCOPED else list(teams_asked(ident, getattr(args, "team", None)))
    request = {"at": getattr(args, "at", None)}
    docs: list[dict] = []
    meta: dict[str, Any] = {"usage": {}}
    async with session(args.nats, nc, getattr(args, "creds", None)) as conn:  # a platform's teams at once: one round trip, not one each
        for data in await asyncio.gather(*(ask(conn, ident, what, team, request) for team in teams)):
            docs += data["docs"]
            meta = {**data["meta"], **({"cluster": data["cluster"]} if "cluster" in data else {}),
                    "usage": {**meta["usage"], **data.get("usage", {})}}
    if what == "jobs":
        docs.sort(key=lambda d: (d["submitted_at"], d["job_id"]))
    return docs, {"source": "reader", "seq": 0, "at": 0.0, **meta}


async def unscoped_listing(args: argparse.Namespace, what: str) -> tuple[list[dict], dict] | None:
    """Admin's or an auditor's `jobs`/`teams` from the reader when one answers (a live fold, no
    Redis client to load: the quick path); None: no reader, or not such an identity (the caller
    then reads Redis or folds the log, as before)."""
    from nats.errors import NoRespondersError

    from gpusched.bus import dial
    from gpusched.bus.dial import Unreachable

    creds = getattr(args, "creds", None)
    path = dial.creds_file(creds)
    try:
        ident = dial.load_identity(path) if path else None
    except Exception:  # noqa: BLE001 - the direct path says what is wrong with the credentials
        return None
    if ident is None or ident.role not in UNSCOPED or getattr(args, "at", None) is not None:
        return None
    try:
        nc = await asyncio.wait_for(dial.connect(args.nats, name="gpusched-cli", creds=creds), 5)
    except (Unreachable, OSError, TimeoutError):  # PermissionError too: refused credentials
        return None  # NATS down: Redis may still answer
    try:
        return await listing(args, ident, what, nc)
    except Unreachable as err:
        if isinstance(err.__cause__, NoRespondersError):
            return None
        raise
    finally:
        from gpusched.bus import connection

        connection.expect_close(nc)
        await nc.close()


async def _first_answer(nc, ident: Identity, kind: str, request: dict[str, Any]) -> Any:
    """Ask each of the caller's teams in turn (a platform's job is one of its teams'); the
    first that holds the job answers. When none does, the refusal names who asks, its role and
    the teams it may read (another team's job reads as one that does not exist: never which)."""
    failed: ReadFailed | None = None
    data: Any = None
    for team in ident.teams:
        try:
            data = await ask(nc, ident, kind, team, request)
        except ReadFailed as err:
            failed = err
            continue
        if not (kind == "show" and "error" in data):
            return data
    from gpusched.security.roles import no_such_job_among

    job_id = request.get("job_id")
    outside = f"permission denied: {no_such_job_among(ident.name, ident.role, ident.teams, str(job_id))}"
    if failed is not None:
        raise ReadFailed(outside) if str(failed).startswith(f"no job {job_id} among") else failed
    return {**data, "error": outside}


async def show(nats: str | None, ident: Identity, job_id: str, creds: str | None = None) -> dict[str, Any]:
    async with session(nats, creds=creds) as nc:
        return await _first_answer(nc, ident, "show", {"job_id": job_id})


async def history(nats: str | None, ident: Identity, args: argparse.Namespace) -> tuple[list[dict], float]:
    """The accounting records of the caller's teams (then `--by`'s report over the filtered jobs)."""
    from .output import filter_docs

    teams = teams_asked(ident, getattr(args, "team", None))
    docs: list[dict] = []
    now = 0.0
    async with session(nats, creds=getattr(args, "creds", None)) as nc:
        for team in teams:
            data = await ask(nc, ident, "history", team, {"at": args.at})
            docs += data["docs"]
            now = max(now, data["now"])
        docs = filter_docs(docs, args)
        if args.by:
            ids = [d["job_id"] for d in docs]
            rows: list[dict] = []
            for team in teams:
                rows += (await ask(nc, ident, "history", team, {"at": args.at, "by": args.by, "jobs": ids}))["docs"]
            docs = sorted(rows, key=lambda r: (r["period"], r["team"]))
    return docs, now


async def logs(args: argparse.Namespace, ident: Identity, out=sys.stdout) -> int:
    """`gpusched logs` through the reader: chunk by chunk, following while the job runs (and
    waiting for its start with `-f`)."""
    offset, said, generation = 0, False, None
    async with session(args.nats, creds=getattr(args, "creds", None)) as nc:
        while True:
            request = {"job_id": args.job_id, "rank": args.rank, "attempt": args.attempt, "offset": offset,
                       "timeout": args.timeout, "generation": generation}
            reply = await _first_answer(nc, ident, "logs", request)
            if not reply["ok"]:
                if args.follow and reply.get("waiting"):
                    if not said:
                        print(f"gpusched logs: {args.job_id} is {reply['state']}; waiting for it to start",
                              file=sys.stderr)
                        said = True
                    await asyncio.sleep(args.interval * 4)
                    continue
                print(f"gpusched logs: {reply['error']}", file=sys.stderr)
                return 2 if reply.get("unreachable") else 1
            args.attempt, generation = reply["attempt"], reply["generation"]  # follow this run, not a later one
            out.write(reply["data"])
            out.flush()
            offset = reply["offset"]
            if offset < reply["size"]:
                continue
            if not args.follow or not reply["running"]:
                return 0
            await asyncio.sleep(args.interval)


__all__ = ["SCOPED_LISTINGS", "reader_identity", "teams_asked", "ask", "listing", "show", "history", "logs",
           "ReadDenied", "ReadFailed"]
