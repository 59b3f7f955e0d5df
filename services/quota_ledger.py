"""Quota ledger: each team's usage (decayed GPU-seconds), holding, and standing against its
guaranteed share, its entitled share and its hard limit, published for the CLI, the dashboard
and the other services.

Published two ways, both derived and rebuildable from the log: a Redis hash
`gpusched:teams` (field: team, value: JSON; plus `gpusched:teams:meta` with the log sequence)
and the NATS request/reply subject `gpusched.q.shares` (the whole table as JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import msgspec
import structlog

from gpusched.bus import subjects
from gpusched.core.state import ClusterState
from gpusched.redis_client import connect_redis
from gpusched.services.runtime import FoldedLog, notify_ready

from .shell import common_arguments, policy_arguments, wait_wake

log = structlog.get_logger()

TEAMS_KEY = "gpusched:teams"
TEAMS_META_KEY = "gpusched:teams:meta"


class Standing(msgspec.Struct, frozen=True, kw_only=True):
    team: str
    held: int | float  # whole GPUs plus fractional jobs' shares (TeamUsage.held)
    pending_gpus: int
    running_jobs: int
    pending_jobs: int
    usage_gpu_s: float
    guaranteed: int
    weight: float
    limit: int | None
    entitled: float  # guaranteed + weighted part of the rest, capped by limit (water-filling)
    standing: str  # under | within | over | at_limit
    share_of_cluster: float


def entitled_shares(total: int, teams: dict[str, tuple[int, float, int | None]]) -> dict[str, float]:
    """Guaranteed GPUs first, then the rest by weight, capped by each team's limit; what a
    capped team cannot take is shared again among the others (water-filling)."""
    share = {t: float(min(g, lim) if lim is not None else g) for t, (g, _, lim) in teams.items()}
    rest = max(0.0, total - sum(share.values()))
    open_teams = {t for t, (_, _, lim) in teams.items() if lim is None or share[t] < lim}
    while rest > 1e-9 and open_teams:
        weight = sum(teams[t][1] for t in open_teams)
        given = 0.0
        for t in sorted(open_teams):
            add = rest * teams[t][1] / weight
            lim = teams[t][2]
            if lim is not None and share[t] + add >= lim:
                add = lim - share[t]
                open_teams.discard(t)
            share[t] += add
            given += add
        rest -= given
        if given <= 1e-9:
            break
    return share


def standings(state: ClusterState, now: float) -> list[Standing]:
    """Every team's standing, as of `now` (pure)."""
    pending_gpus: dict[str, int] = {}
    pending_jobs: dict[str, int] = {}
    running_jobs: dict[str, int] = {}
    for job_id in state.pending:
        job = state.jobs[job_id]
        pending_gpus[job.team] = pending_gpus.get(job.team, 0) + job.spec.gang_min
        pending_jobs[job.team] = pending_jobs.get(job.team, 0) + 1
    for job_id in state.running:
        team = state.jobs[job_id].team
        running_jobs[team] = running_jobs.get(team, 0) + 1
    total = state.total_gpus
    terms = {name: (t.quota.guaranteed, t.quota.weight, t.quota.limit) for name, t in state.teams.items()}
    entitled = entitled_shares(total, terms)
    out: list[Standing] = []
    for name in sorted(state.teams):
        t = state.teams[name]
        q = t.quota
        if q.limit is not None and t.held >= q.limit:
            standing = "at_limit"
        elif t.held < q.guaranteed:
            standing = "under"
        elif t.held > entitled[name] + 1e-9:
            standing = "over"
        else:
            standing = "within"
        out.append(Standing(
            team=name, held=t.held, pending_gpus=pending_gpus.get(name, 0),
            running_jobs=running_jobs.get(name, 0), pending_jobs=pending_jobs.get(name, 0),
            usage_gpu_s=round(state.team_usage(name, max(now, state.now)), 3), guaranteed=q.guaranteed,
            weight=q.weight, limit=q.limit, entitled=round(entitled[name], 3), standing=standing,
            share_of_cluster=round(t.held / total, 4) if total else 0.0,
        ))
    return out


def table(state: ClusterState, now: float) -> dict:
    return {"seq": state.last_seq, "at": now, "total_gpus": state.total_gpus,
            "teams": {s.team: msgspec.to_builtins(s) for s in standings(state, now)}}


class QuotaLedger:
    def __init__(self, folded: FoldedLog, redis, interval_s: float = 1.0):
        self.folded = folded
        self.redis = redis
        self.interval_s = interval_s
        self.published_seq = -1

    async def on_request(self, msg) -> None:
        await msg.respond(msgspec.json.encode(table(self.folded.state, time.time())))

    async def publish(self) -> None:
        data = table(self.folded.state, time.time())
        mapping = {team: msgspec.json.encode(row) for team, row in data["teams"].items()}
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(TEAMS_KEY)
        if mapping:
            pipe.hset(TEAMS_KEY, mapping=mapping)
        pipe.hset(TEAMS_META_KEY, mapping={"seq": data["seq"], "at": data["at"], "total_gpus": data["total_gpus"]})
        await pipe.execute()
        self.published_seq = data["seq"]

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.publish()
            except Exception as err:  # Redis blips: the next round publishes again
                log.warning("publish_failed", error=str(err))
            await wait_wake(self.folded, stop, self.interval_s, debounce_s=0.1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser)
    policy_arguments(parser)  # the running policy (its standings order teams as placement does)
    parser.add_argument("--interval-ms", type=float, default=1000.0,
                        help="republish at least this often (usage decays with time)")


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    redis = connect_redis(args.redis)
    folded = await FoldedLog.open(args.nats, name="gpusched-quota-ledger")
    ledger = QuotaLedger(folded, redis, args.interval_ms / 1000.0)
    sub = await folded.log.nc.subscribe(subjects.Q_SHARES, queue="quota_ledger", cb=ledger.on_request)
    await folded.log.nc.flush()
    log.info("quota_ledger_ready", seq=folded.seen_seq)
    notify_ready()
    try:
        await ledger.run(stop)
    finally:
        await sub.unsubscribe()
        await folded.close()
        await redis.aclose()
