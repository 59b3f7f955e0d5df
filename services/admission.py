"""Admission: answers the commands (`SubmitJob`, `CancelJob`, `HoldJob`, `UpdateJob`,
`SetTeamQuota`, `DrainNode`, `RestoreGpu`) on
request/reply subjects and appends the accepted facts.

Several instances may run: they share the queue group `admission`. The decision (`admit`) is a
pure function of the fold and the command; the shell only decodes, decides, appends, replies.
Submits are idempotent by the client's request id, scoped by team and user (`request_scope`:
two teams may pick the same id): the job id is derived from the scope, the append carries
`Nats-Msg-Id: submit-<team>/<user>/<request id>` (JetStream's duplicate window), and the fold
answers repeats after the window (`known_submit`). Well-formed submits that are refused are
appended as `JobRejected` for audit; malformed messages only get an error reply.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import msgspec
import structlog
from nats.aio.msg import Msg
from nats.errors import ConnectionReconnectingError, NoRespondersError, StaleConnectionError
from nats.js.errors import APIError, NoStreamResponseError
from opentelemetry.trace import SpanKind

from gpusched import metrics, telemetry
from gpusched.bus import subjects
from gpusched.bus.cas import catch_up_after
from gpusched.bus.log import Conflict
from gpusched.core import events as ev
from gpusched.core import limits as L
from gpusched.core.commands import (
    CancelJob,
    Command,
    CommandReply,
    DrainNode,
    HoldJob,
    LabelNode,
    RestoreGpu,
    SetFoldSettings,
    SetMigGeometry,
    SetTeamQuota,
    SubmitJob,
    UpdateJob,
)
from gpusched.core.fold.arrays import array_tasks
from gpusched.core.mig import geometry_problem
from gpusched.core.model import LEVEL_RANK, ModelQuota, TeamQuota, gpu_id
from gpusched.core.pools import canonical_model, model_guaranteed
from gpusched.core.reasons import NoMatchingNode
from gpusched.core.state import TERMINAL, ClusterState, Job
from gpusched.policy.eligibility import constrained, matching, not_eligible, wants
from gpusched.policy.placement import Topology
from gpusched.policy.resources import never_fits
from gpusched.services.runtime import FoldedLog, notify_ready
from gpusched.services.shell import common_arguments

log = structlog.get_logger()

QUEUE_GROUP = "admission"
SUBJECT_COMMANDS: dict[str, type[Command]] = {
    subjects.CMD_SUBMIT: SubmitJob,
    subjects.CMD_CANCEL: CancelJob,
    subjects.CMD_QUOTA: SetTeamQuota,
    subjects.CMD_FOLD: SetFoldSettings,
    subjects.CMD_DRAIN: DrainNode,
    subjects.CMD_RESTORE: RestoreGpu,
    subjects.CMD_HOLD: HoldJob,
    subjects.CMD_UPDATE: UpdateJob,
    subjects.CMD_LABEL: LabelNode,
    subjects.CMD_MIG: SetMigGeometry,
}
_DECODERS = {subject: msgspec.json.Decoder(cls) for subject, cls in SUBJECT_COMMANDS.items()}
_encode_reply = msgspec.json.Encoder().encode

#: How long admission keeps retrying an append the log cannot take right now (a JetStream leader
#: election, a frozen or reconnecting server) before it answers that the log is unavailable.
APPEND_PATIENCE_S = 10.0
#: How many times one command is decided again after its compare-and-set lost to another writer.
MAX_REDECIDES = 20


@dataclass(frozen=True)
class Caller:
    """Who sent a command, as the subject the server allowed says: `team` None is admin's form
    (`gpusched.cmd.<kind>[.<user>]`, which only admin and the dashboard may publish); a team is
    a tenant's or platform's (`gpusched.cmd.<kind>.<team>.<user>`), held to that team."""

    user: str = "admin"
    team: str | None = None
    #: A platform submitting on behalf of `user` (`gpusched.cmd.submit.<team>.<platform>.<user>`,
    #: which the server allows a platform for its own teams only), or None.
    via: str | None = None


ADMIN = Caller()


def split_subject(subject: str) -> tuple[str, Caller] | str:
    """The command's base subject and its caller, or why the subject is not a command's."""
    parts = subject.split(".")
    if len(parts) < 3 or parts[:2] != ["gpusched", "cmd"]:
        return f"unknown command subject {subject!r}"
    base = ".".join(parts[:3])
    if len(parts) == 3:
        return base, ADMIN
    if len(parts) == 4:
        return base, Caller(user=parts[3])
    if len(parts) == 5:
        return base, Caller(user=parts[4], team=parts[3])
    if len(parts) == 6 and base == subjects.CMD_SUBMIT:  # a platform for one of its teams' users
        return base, Caller(user=parts[5], team=parts[3], via=parts[4])
    if len(parts) == 6:
        return f"only a submit may be sent on behalf of a user, not {subject!r}"
    return f"unknown command subject {subject!r}"


def caller_problem(state: ClusterState, cmd: Command, caller: Caller) -> str | None:
    """Why this caller may not send this command (the team comes from the subject, never the
    payload), or None."""
    if caller.team is None:
        return None
    if isinstance(cmd, SubmitJob) and cmd.spec.team != caller.team:
        return (f"spec.team {cmd.spec.team!r} is not the team these credentials submit for "
                f"({caller.team!r} by the subject the server allowed)")
    if isinstance(cmd, (CancelJob, HoldJob, UpdateJob)):
        job = state.jobs.get(cmd.job_id)
        if job is not None and job.spec.team != caller.team:
            return f"job {cmd.job_id} belongs to team {job.spec.team!r}; these credentials act for {caller.team!r}"
    if isinstance(cmd, (SetTeamQuota, DrainNode, RestoreGpu, LabelNode, SetFoldSettings, SetMigGeometry)):
        return f"{type(cmd).__name__} needs the admin role"
    return None


@dataclass(frozen=True)
class AdmissionConfig:
    #: A job of a team nobody created (no `gpusched quota` yet) creates it with the default terms
    #: (nothing guaranteed, weight 1, no limit but the cluster). Off by default: a typo in a team
    #: name is refused instead of starting an unlimited team. `gpusched up` turns it on.
    auto_create_teams: bool = False
    #: Jobs without a command (simulated placeholders that hold GPUs without a process):
    #: "refuse" (real clusters), "bounded" (only with a time limit or GPUSCHED_SIM_DURATION_S:
    #: `gpusched up`), "any" (tests that play the node daemon).
    placeholders: str = "refuse"
    #: Where a job may name its checkpoint_dir (the nodes' checkpoint roots); () = anywhere.
    checkpoint_roots: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decision:
    """What admission decided: the fact to append (if any), its message id, and the reply
    (whose `seq` the shell fills in after the append)."""

    reply: CommandReply
    event: ev.Event | None = None
    msg_id: str | None = None
    #: facts appended after `event`, each with its message id (a job array's other tasks)
    more: tuple[tuple[ev.Event, str], ...] = ()


# --- the pure part ------------------------------------------------------------------------


def request_scope(cmd: Command, caller: Caller) -> str:
    """The request id as admission keys it: `<team>/<user>/<request id>`. A client's request id
    is unique only among its own requests; two teams (or two users of a team) may pick the same
    one, and each must get its own job, message id and in-flight answer. The team of a submit is
    its spec's (a tenant's subject already holds it to that team); other commands use the
    subject's ('' for admin). `/` is in no team or user name, so scopes never run together."""
    team = cmd.spec.team if isinstance(cmd, SubmitJob) else (caller.team or "")
    user = caller.user if caller.via is None else f"{caller.user}@{caller.via}"  # each platform's own ids
    return f"{team}/{user}/{cmd.request_id}"


def job_id_for(scope: str, state: ClusterState, taken: Mapping[str, str] = MappingProxyType({})) -> str:
    """A short, readable id derived from the scoped request id (`request_scope`: so every
    admission instance, and every retry, names the job the same way); on the rare collision with
    another request's job, the next 8 hex digits. `taken` (job id -> scope: appended, maybe not
    folded yet) collides only when another request took the id: a retry whose first reply was
    lost must be answered with the job its first append created, not a fresh id nobody created."""
    for candidate in _candidates(scope):
        if not state.knows(candidate) and taken.get(candidate, scope) == scope:
            return candidate
    return "j-" + _digest(scope)  # 2^-256 territory


def _digest(scope: str) -> str:
    return hashlib.blake2b(scope.encode(), digest_size=32).hexdigest()


def _candidates(scope: str) -> list[str]:
    digest = _digest(scope)
    return ["j-" + digest[i:i + 8] for i in range(0, len(digest) - 7, 8)]


def _owned(state: ClusterState, job_id: str, team: str, user: str) -> bool:
    """Whether `job_id` is the job this team and user submitted (a tombstone keeps the team
    only; a job the fold holds no record of is taken as the caller's, as it always was)."""
    job = state.jobs.get(job_id)
    if job is not None:
        return job.spec.team == team and job.user in (user, "")
    tomb = state.forgotten.get(job_id)
    return tomb is None or not tomb.team or tomb.team == team


def known_submit(state: ClusterState, cmd: SubmitJob, caller: Caller) -> str | None:
    """The job this caller's earlier submit with this request id created, or None. The fold's
    `requests` map holds the latest job per bare request id; when another team (or user) reused
    the id since, this caller's own job is still found under the id its scope derives."""
    rid, team, user = cmd.request_id, cmd.spec.team, caller.user
    known = state.requests.get(rid)
    if known is not None and _owned(state, known, team, user):
        return known
    for candidate in _candidates(request_scope(cmd, caller)):
        if not state.knows(candidate):
            return None
        job = state.jobs.get(candidate)
        tomb = state.forgotten.get(candidate)
        request_id = job.request_id if job is not None else (tomb.request_id if tomb is not None else "")
        if request_id == rid and _owned(state, candidate, team, user):
            return candidate
    return None


class Capacity:
    """The largest GPU count at each topology level, cached per cluster shape (topology only
    changes when a node registers)."""

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._largest: dict[str, int] = {}
        self._matching: dict[tuple, dict[str, int]] = {}
        self._topology: Topology | None = None

    def topology(self, state: ClusterState) -> Topology:
        """The cluster's shape, which keeps the nodes matching each constraint (`eligibility.matching`)."""
        t = self._topology
        if t is None or t.nodes is not state.nodes or len(t.names) != len(state.nodes):
            t = self._topology = Topology(state)
        return t

    def largest(self, state: ClusterState) -> dict[str, int]:
        key = (len(state.nodes), len(state.gpus))
        if key != self._key:
            self._largest = self._count(state, state.gpus.values())
            self._key = key
        return self._largest

    def largest_matching(self, state: ClusterState, spec) -> dict[str, int]:
        """The same over the GPUs a constrained job may hold (`--gpu-type`: GPUs of that model,
        `--constraint`: on nodes with those labels), cached per constraint and cluster shape."""
        key = (len(state.nodes), len(state.gpus), state.label_changes, spec.gpu_type,
               tuple(sorted(spec.constraints.items())))
        if key not in self._matching:
            if len(self._matching) >= 256:
                self._matching.clear()
            want = (spec.gpu_type or "").lower()
            nodes = set(matching(state, spec, self.topology(state)))
            self._matching[key] = self._count(state, (g for g in state.gpus.values()
                                                      if g.node in nodes and want in g.model.lower()))
        return self._matching[key]

    @staticmethod
    def _count(state: ClusterState, gpus) -> dict[str, int]:
        """The largest GPU count at each topology level among `gpus` (drained nodes count: a
        drain ends, the cluster as configured stays)."""
        nvlink: dict[tuple[str, int], int] = {}
        node: dict[str, int] = {}
        rack: dict[str, int] = {}
        block: dict[str, int] = {}
        total = 0
        for g in gpus:
            total += 1
            n = state.nodes[g.node]
            nvlink[(g.node, g.nvlink_domain)] = nvlink.get((g.node, g.nvlink_domain), 0) + 1
            node[g.node] = node.get(g.node, 0) + 1
            rack[n.rack] = rack.get(n.rack, 0) + 1
            if n.block is not None:
                block[n.block] = block.get(n.block, 0) + 1
        return {
            "nvlink": max(nvlink.values(), default=0),
            "node": max(node.values(), default=0),
            "rack": max(rack.values(), default=0),
            "block": max(block.values(), default=max(rack.values(), default=0)),
            "cluster": total,
        }


_LEVEL_NAMES = {"nvlink": "NVLink domain", "node": "node", "rack": "rack", "block": "block", "cluster": "cluster"}


def submit_problem(state: ClusterState, cmd: SubmitJob, config: AdmissionConfig, capacity: Capacity) -> str | None:
    """Why a well-formed submission cannot be admitted, or None."""
    spec = cmd.spec
    problem = placeholder_problem(spec, config) or L.checkpoint_dir_problem(spec.checkpoint_dir, config.checkpoint_roots)
    if problem:
        return problem
    if spec.min_gpus is not None and spec.min_gpus > spec.gpus:
        return f"spec.min_gpus ({spec.min_gpus}) exceeds spec.gpus ({spec.gpus})"
    problem = share_spec_problem(state, spec)
    if problem:
        return problem
    topo = spec.topology
    if LEVEL_RANK[topo.preferred] > LEVEL_RANK[topo.required]:
        return (f"spec.topology.preferred ({topo.preferred}) is wider than spec.topology.required "
                f"({topo.required})")
    team = state.teams.get(spec.team)
    if team is None and not config.auto_create_teams:
        return (f"unknown team {spec.team!r}: nobody created it (create it with `gpusched quota {spec.team} ...`, "
                "or run admission with --auto-create-teams)")
    problem = time_limit_problem(team.quota if team is not None else None, spec.time_limit_s)
    if problem:
        return problem
    problem = dependency_problem(state, spec) or array_problem(spec)
    if problem:
        return problem
    if (spec.gpu_type is not None or spec.constraints) and state.gpus:
        barred = not_eligible(state, Job("", spec, 0.0), topo=capacity.topology(state))
        if isinstance(barred, NoMatchingNode):
            return f"{barred.text} (nodes register their GPU model; labels: `gpusched node label`)"
    never = never_fits(state, with_defaults(state, spec),
                       matching(state, spec, capacity.topology(state)) if constrained(spec) else None)
    if never is not None:
        return f"{never.text}: ask less per node (--cpus, --mem) or spread the job over more nodes"
    need = spec.gang_min
    if team is not None and team.quota.limit is not None and need > team.quota.limit:
        return f"team {spec.team!r} has a limit of {team.quota.limit} GPUs; the job needs {need}"
    return size_problem(state, spec, capacity) if state.gpus else None  # no node yet: jobs may queue


def size_problem(state: ClusterState, spec, capacity: Capacity) -> str | None:
    """A gang bigger than the cluster as configured (drains aside) holds, at its required level,
    or among the GPUs it may hold (`--gpu-type`, `--constraint`)."""
    need, level = spec.gang_min, spec.topology.required
    largest = capacity.largest(state)
    if need > largest["cluster"]:
        return f"the cluster has {largest['cluster']} GPUs; the job needs {need}"
    if level != "cluster" and need > largest[level]:
        return (f"spec.topology.required is {level}, but the largest {_LEVEL_NAMES[level]} "
                f"has {largest[level]} GPUs; the job needs {need}")
    if constrained(spec):  # it can never fit among the GPUs it may hold
        return _never_fits_matching(capacity.largest_matching(state, spec), spec, need)
    return None


def _never_fits_matching(largest: dict[str, int], spec, need: int) -> str | None:
    """Why a constrained job can never fit the GPUs matching it (drains aside), or None."""
    level = spec.topology.required
    if need > largest["cluster"]:
        return (f"the cluster has {largest['cluster']} GPUs matching {wants(spec)} (drains aside); the job needs "
                f"{need} (nodes register their GPU model; labels: `gpusched node label`)")
    if level != "cluster" and need > largest[level]:
        return (f"spec.topology.required is {level}, but the largest {_LEVEL_NAMES[level]} has {largest[level]} "
                f"GPUs matching {wants(spec)}; the job needs {need}")
    return None


def share_spec_problem(state: ClusterState, spec) -> str | None:
    """A memory ask (`--gpu-memory`) some registered GPU can hold, a MIG ask (`--mig`) some MIG
    GPU offers (the spec's own bounds: `limits.share_problem`, `limits.mig_problem`)."""
    if spec.gpu_memory_mb is not None and state.gpus and all(
            spec.share_on(g.memory_mb) is None for g in state.gpus.values()):
        most = max(g.memory_mb for g in state.gpus.values())
        return f"no GPU has {spec.gpu_memory_mb} MiB of memory (the largest has {most} MiB)"
    if spec.mig is not None and state.gpus:
        most = max((p.instances for g in state.gpus.values() if g.mig is not None
                    for p in g.mig.profiles if p.name == spec.mig), default=0)
        if most < spec.mig_count:
            offered = sorted({p.name for g in state.gpus.values() if g.mig is not None for p in g.mig.profiles})
            return (f"no MIG GPU offers {spec.mig_count} x {spec.mig} slices (MIG profiles offered: "
                    f"{', '.join(offered) or 'none: no GPU is in MIG mode'})")
    return None


def time_limit_problem(quota: TeamQuota | None, limit_s: float | None) -> str | None:
    """A time limit over the team's maximum (a job without one gets the default; see `with_defaults`)."""
    if quota is None or quota.max_time_limit_s is None:
        return None
    top = quota.max_time_limit_s
    if limit_s is None and quota.default_time_limit_s is None:
        return (f"team's maximum time limit is {top:g} s and it has no default: give spec.time_limit_s "
                f"(--time-limit) of at most {top:g} s")
    if limit_s is not None and limit_s > top:
        return f"spec.time_limit_s ({limit_s:g} s) exceeds the team's maximum time limit ({top:g} s)"
    return None


def dependency_problem(state: ClusterState, spec) -> str | None:
    """Dependencies must name jobs whose state the fold keeps (their end state is checked when
    it comes): not an array's id, not a job retired past the second horizon."""
    for d in spec.dependency:
        if state.job_status(d.job) is not None:
            continue
        if d.job in state.arrays:
            return f"spec.dependency: {_array_named(d.job)}"
        if state.knows(d.job):
            return f"spec.dependency: job {d.job} ended too long ago: {_RETIRED}"
        return f"spec.dependency: unknown job {d.job!r} ({d.kind}:{d.job})"
    return None


def array_problem(spec) -> str | None:
    arr = spec.array
    if arr is None:
        return None
    if arr.first > arr.last:
        return f"spec.array: first index {arr.first} is after the last {arr.last}"
    if arr.size > L.MAX_ARRAY_TASKS:
        return f"spec.array has {arr.size} tasks; at most {L.MAX_ARRAY_TASKS}"
    return None


def with_defaults(state: ClusterState, spec):
    """The spec as admitted: the team's default time limit, CPUs and memory for those it gives none of."""
    team = state.teams.get(spec.team)
    if team is None:
        return spec
    q = team.quota
    changes = {name: default for name, default in (("time_limit_s", q.default_time_limit_s), ("cpus", q.default_cpus),
                                                   ("memory_mb", q.default_memory_mb))
               if default is not None and getattr(spec, name) is None}
    return msgspec.structs.replace(spec, **changes) if changes else spec


#: What the fold keeps of a job past its second horizon (`core.fold.forgetting.RETIRE_AFTER_HORIZONS`).
_RETIRED = "only its id is kept (past the fold's second horizon); its history is in the log and its exported segments"


def _array_named(job_id: str) -> str:
    return f"{job_id} is a job array; name one of its tasks ({job_id}_INDEX)"


def _unknown(state: ClusterState, job_id: str) -> str:
    """Why a command names no job it can act on: never in the log, a job array's id, or ended
    and forgotten or retired."""
    tomb = state.forgotten.get(job_id)
    if tomb is None:
        if job_id in state.arrays:
            return _array_named(job_id)
        return f"job {job_id} ended long ago: {_RETIRED}" if state.knows(job_id) else f"unknown job {job_id!r}"
    return (f"job {job_id} already {tomb.state} (ended long ago, past the fold's horizon: "
            f"`gpusched show {job_id}` points to its history)")


def pending_job_command(state: ClusterState, cmd: HoldJob | UpdateJob, now: float, caller: Caller) -> Decision:
    """Hold, release or update a job: only while it is pending (a precise refusal otherwise)."""
    job = state.jobs.get(cmd.job_id)
    verb = ("hold" if cmd.hold else "release") if isinstance(cmd, HoldJob) else "update"
    if job is None:
        return Decision(CommandReply(ok=False, error=_unknown(state, cmd.job_id)))
    if job.state != "pending":
        return Decision(CommandReply(ok=False, job_id=job.job_id,
                                     error=f"cannot {verb} job {job.job_id}: it is {job.state}, not pending"))
    event: ev.Event
    if isinstance(cmd, HoldJob):
        if (job.hold is not None) == cmd.hold:
            return Decision(CommandReply(ok=False, job_id=job.job_id,
                                         error=f"job {job.job_id} is {'already' if cmd.hold else 'not'} held"))
        event = ev.JobHeld(at=now, job_id=job.job_id, held=cmd.hold, reason=cmd.reason, user=caller.user)
    else:
        if cmd.priority is None and cmd.time_limit_s is None:
            return Decision(CommandReply(ok=False, job_id=job.job_id,
                                         error="nothing to update: give priority and/or time_limit_s"))
        team = state.teams.get(job.team)
        if cmd.time_limit_s is not None:
            problem = time_limit_problem(team.quota if team is not None else None, cmd.time_limit_s)
            if problem:
                return Decision(CommandReply(ok=False, job_id=job.job_id, error=problem))
        event = ev.JobUpdated(at=now, job_id=job.job_id, priority=cmd.priority, time_limit_s=cmd.time_limit_s,
                              user=caller.user)
    return Decision(CommandReply(ok=True, job_id=job.job_id), event, f"{verb}-{request_scope(cmd, caller)}")


def placeholder_problem(spec, config: AdmissionConfig) -> str | None:
    """An empty command holds GPUs with no process: only on simulated clusters, and (unless
    the config says "any") only when something ends it."""
    if spec.command or config.placeholders == "any":
        return None
    if config.placeholders == "refuse":
        return "spec.command is empty: a job needs a program to run"
    if spec.time_limit_s is None and "GPUSCHED_SIM_DURATION_S" not in spec.env:
        return ("spec.command is empty: a placeholder job needs spec.time_limit_s or "
                "env GPUSCHED_SIM_DURATION_S, or it would hold its GPUs forever")
    return None


def merged_quota(state: ClusterState, cmd: SetTeamQuota) -> TeamQuota:
    """The quota a command leaves the team with: only the fields it names change."""
    if not cmd.only:
        return cmd.quota
    team = state.teams.get(cmd.team)
    current = team.quota if team is not None else TeamQuota()
    fields = {f: getattr(cmd.quota, f) for f in cmd.only}
    if "models" in fields:
        fields["models"] = {**current.models, **cmd.quota.models}
    return msgspec.structs.replace(current, **fields)


def pooled_quota(q: TeamQuota, only: list[str]) -> TeamQuota | str:
    """Per-model terms keyed by canonical pool (`core/pools.py`), empty entries dropped, and
    the team's guarantee their sum; or why they are refused."""
    if not q.models:
        return q
    if "guaranteed" in only:
        return ("the team has per-model guarantees (quota.models): its guarantee is their sum; "
                "change them per model (`gpusched quota TEAM --model MODEL --guaranteed N`)")
    models: dict[str, ModelQuota] = {}
    for name, m in q.models.items():
        pool = canonical_model(name)
        if pool in models and models[pool] != m:
            return f"quota.models names pool {pool} twice ({name!r})"
        if m.limit is not None and m.guaranteed > m.limit:
            return f"quota.models[{name!r}].guaranteed ({m.guaranteed}) exceeds its limit ({m.limit})"
        if m.guaranteed or m.limit is not None:
            models[pool] = m
    return msgspec.structs.replace(q, models=models, guaranteed=sum(m.guaranteed for m in models.values()))


def _pool_warning(state: ClusterState, team: str, q: TeamQuota) -> str:
    """Per-model guarantees that add up to more than a pool's GPUs (or name a pool no node has)."""
    size: dict[str, int] = {}
    for rec in state.gpus.values():
        size[canonical_model(rec.model)] = size.get(canonical_model(rec.model), 0) + 1
    out = []
    for pool, m in q.models.items():
        promised = m.guaranteed + sum(model_guaranteed(t.quota, pool) for n, t in state.teams.items() if n != team)
        if state.gpus and promised > size.get(pool, 0):
            out.append(f"guarantees on {pool} add up to {promised} GPUs, more than its {size.get(pool, 0)}")
    return "; ".join(out)


def _set_quota(state: ClusterState, cmd: SetTeamQuota, now: float) -> Decision:
    pooled = pooled_quota(merged_quota(state, cmd), list(cmd.only))
    if isinstance(pooled, str):
        return Decision(CommandReply(ok=False, error=pooled))
    q = pooled
    if q.limit is not None and q.guaranteed > q.limit:
        return Decision(CommandReply(ok=False, error=f"quota.guaranteed ({q.guaranteed}) exceeds quota.limit ({q.limit})"))
    if (q.default_time_limit_s is not None and q.max_time_limit_s is not None
            and q.default_time_limit_s > q.max_time_limit_s):
        return Decision(CommandReply(ok=False, error=f"quota.default_time_limit_s ({q.default_time_limit_s:g}) "
                                                     f"exceeds quota.max_time_limit_s ({q.max_time_limit_s:g})"))
    promised = q.guaranteed + sum(t.quota.guaranteed for name, t in state.teams.items() if name != cmd.team)
    warning = ""
    if state.gpus and promised > state.total_gpus:
        warning = (f"guaranteed shares add up to {promised} GPUs, more than the cluster's {state.total_gpus}: "
                   f"not every team can get its guarantee at once")
    if q.models:
        warning = "; ".join(w for w in (warning, _pool_warning(state, cmd.team, q)) if w)
    return Decision(CommandReply(ok=True, warning=warning), ev.TeamQuotaSet(at=now, team=cmd.team, quota=q),
                    f"quota-{cmd.request_id}")


def _submit(state: ClusterState, cmd: SubmitJob, now: float, config: AdmissionConfig, capacity: Capacity,
            taken: Mapping[str, str], caller: Caller) -> Decision:
    rid, scope = cmd.request_id, request_scope(cmd, caller)
    known = known_submit(state, cmd, caller)
    if known is not None:
        return Decision(CommandReply(ok=True, job_id=known, duplicate=True))
    problem = submit_problem(state, cmd, config, capacity)
    if problem is not None:
        event: ev.Event = ev.JobRejected(at=now, request_id=rid, team=cmd.spec.team, reason=problem)
        return Decision(CommandReply(ok=False, error=problem), event, f"reject-{scope}")
    job_id = job_id_for(scope, state, taken)
    event = ev.JobSubmitted(at=now, job_id=job_id, spec=with_defaults(state, cmd.spec), request_id=rid,
                            user=caller.user, via=caller.via or "")
    return Decision(CommandReply(ok=True, job_id=job_id), event, f"submit-{scope}")


def window_problem(cmd: DrainNode, now: float) -> str | None:
    """What is wrong with a drain's maintenance window (None: nothing, or no window)."""
    if cmd.at is None and cmd.until is None:
        return None
    if not cmd.drain:
        return "--at/--until schedule a drain; an undrain (drain=false) takes neither"
    if cmd.until is None:
        return "a maintenance window needs an end (until); without one, drain the node when it starts"
    start = now if cmd.at is None else cmd.at
    if cmd.until <= start:
        return f"window ends ({cmd.until:.0f}) before it starts ({start:.0f})"
    if cmd.until <= now:
        return f"window already over (until {cmd.until:.0f} <= now {now:.0f})"
    return None


def _drain(state: ClusterState, cmd: DrainNode, now: float) -> Decision:
    if cmd.node not in state.nodes:
        return Decision(CommandReply(ok=False, error=f"unknown node {cmd.node!r}"))
    problem = window_problem(cmd, now)
    if problem is not None:
        return Decision(CommandReply(ok=False, error=problem))
    event = ev.NodeDrained(at=now, node=cmd.node, drain=cmd.drain, reason=cmd.reason,
                           start=None if cmd.until is None else (cmd.at if cmd.at is not None else now), until=cmd.until)
    return Decision(CommandReply(ok=True), event, f"drain-{cmd.request_id}")


def _label(state: ClusterState, cmd: LabelNode, now: float) -> Decision:
    if cmd.node not in state.nodes:
        return Decision(CommandReply(ok=False, error=f"unknown node {cmd.node!r}"))
    if not cmd.labels and not cmd.remove:
        return Decision(CommandReply(ok=False, error="nothing to change: give labels and/or remove"))
    return Decision(CommandReply(ok=True), ev.NodeLabeled(at=now, node=cmd.node, labels=dict(cmd.labels),
                                                          remove=list(cmd.remove)), f"label-{cmd.request_id}")


def mig_geometry_problem(state: ClusterState, cmd: SetMigGeometry) -> str | None:
    """Why the GPU's MIG geometry may not change now, or None: a known MIG GPU nobody holds (whole,
    a share or a slice), and profiles it offers that fit it (`core/mig.geometry_problem`)."""
    gid = gpu_id(cmd.node, cmd.gpu)
    rec = state.gpus.get(gid)
    if rec is None:
        return f"unknown GPU {gid}" + ("" if cmd.node in state.nodes else f" (no node {cmd.node!r})")
    if rec.occupied:
        return (f"GPU {gid} is in use by {', '.join(rec.holders)}: its MIG geometry changes only while it is idle "
                "(drain the node or wait for its jobs to end)")
    if list(rec.geometry) == list(cmd.profiles):
        return f"GPU {gid} already has this geometry ({', '.join(rec.geometry) or 'whole'})"
    problem = geometry_problem(rec.mig, rec.memory_mb, list(cmd.profiles))
    return None if problem is None else f"GPU {gid}: {problem}"


def _set_mig(state: ClusterState, cmd: SetMigGeometry, now: float, caller: Caller) -> Decision:
    problem = mig_geometry_problem(state, cmd)
    if problem is not None:
        return Decision(CommandReply(ok=False, error=problem))
    event = ev.MigGeometrySet(at=now, gpu=gpu_id(cmd.node, cmd.gpu), profiles=list(cmd.profiles),
                              reason=cmd.reason, user=caller.user)
    return Decision(CommandReply(ok=True), event, f"mig-{request_scope(cmd, caller)}")


def _cancel_array(state: ClusterState, cmd: CancelJob, now: float, caller: Caller) -> Decision:
    """Cancelling a job array's id cancels every task of it not yet ended (as `scancel` does).
    One fact per task, each with its own message id: a retried request cancels what is left
    and stores nothing twice."""
    ids = array_tasks(state, cmd.job_id)
    tasks = [state.jobs[t] for t in ids if t in state.jobs]
    if not tasks:
        if ids:
            return Decision(CommandReply(ok=False, job_id=cmd.job_id,
                                         error=f"job array {cmd.job_id}: every task ended long ago (forgotten)"))
        return Decision(CommandReply(ok=False, error=_unknown(state, cmd.job_id)))
    if caller.team is not None and tasks[0].spec.team != caller.team:
        return Decision(CommandReply(ok=False, error=f"job array {cmd.job_id} belongs to team {tasks[0].spec.team!r}; "
                                                     f"these credentials act for {caller.team!r}"))
    live = [j for j in tasks if j.state not in TERMINAL]
    if not live:
        return Decision(CommandReply(ok=False, job_id=cmd.job_id,
                                     error=f"job array {cmd.job_id}: all {len(tasks)} tasks already ended"))
    facts = [(ev.JobCancelled(at=now, job_id=j.job_id, reason=cmd.reason), f"cancel-{request_scope(cmd, caller)}-{j.job_id}")
             for j in live]
    (first, first_id), *rest = facts
    return Decision(CommandReply(ok=True, job_id=cmd.job_id), first, first_id, tuple(rest))


def admit(state: ClusterState, cmd: Command, now: float, config: AdmissionConfig, capacity: Capacity,
          taken: Mapping[str, str] = MappingProxyType({}), caller: Caller = ADMIN) -> Decision:
    """Decide one well-formed command from `caller` against the fold."""
    refused = caller_problem(state, cmd, caller)
    if refused is not None:
        return Decision(CommandReply(ok=False, error=refused))
    if isinstance(cmd, SubmitJob):
        return _submit(state, cmd, now, config, capacity, taken, caller)
    if isinstance(cmd, CancelJob):
        job = state.jobs.get(cmd.job_id)
        if job is None:
            return _cancel_array(state, cmd, now, caller)
        if job.state in TERMINAL:
            return Decision(CommandReply(ok=False, job_id=job.job_id,
                                         error=f"job {job.job_id} already {job.state} ({job.end_reason})"))
        event: ev.Event = ev.JobCancelled(at=now, job_id=job.job_id, reason=cmd.reason)
        return Decision(CommandReply(ok=True, job_id=job.job_id), event, f"cancel-{request_scope(cmd, caller)}")
    if isinstance(cmd, (HoldJob, UpdateJob)):
        return pending_job_command(state, cmd, now, caller)
    if isinstance(cmd, LabelNode):
        return _label(state, cmd, now)
    if isinstance(cmd, SetTeamQuota):
        return _set_quota(state, cmd, now)
    if isinstance(cmd, SetFoldSettings):  # the log's one record of them: every fold reads it
        return Decision(CommandReply(ok=True), ev.FoldSettingsSet(at=now, settings=cmd.settings, reason=cmd.reason),
                        f"fold-{cmd.request_id}")
    if isinstance(cmd, DrainNode):
        return _drain(state, cmd, now)
    if isinstance(cmd, SetMigGeometry):
        return _set_mig(state, cmd, now, caller)
    if isinstance(cmd, RestoreGpu):
        g = state.gpus.get(cmd.gpu)
        if g is None:
            return Decision(CommandReply(ok=False, error=f"unknown GPU {cmd.gpu!r} (expected NODE/INDEX)"))
        if g.quarantined is None:
            return Decision(CommandReply(ok=False, error=f"GPU {cmd.gpu} is not quarantined"))
        event = ev.GpuRestored(at=now, gpu=cmd.gpu, reason=f"restored by an operator: {cmd.reason or 'no reason given'}"
                               f" (was: {g.quarantined})")
        return Decision(CommandReply(ok=True), event, f"restore-{request_scope(cmd, caller)}")
    return Decision(CommandReply(ok=False, error=f"unsupported command {type(cmd).__name__}"))


def decode(subject: str, data: bytes) -> Command | str:
    """The command on `subject`, or a precise error naming the field (msgspec's own text, or
    the bound of `limits` it breaks): out-of-bounds commands are malformed, nothing is appended."""
    decoder = _DECODERS.get(subject)
    if decoder is None:
        return f"unknown command subject {subject[:200]!r}; expected one of {', '.join(sorted(_DECODERS))}"
    if len(data) > L.MAX_COMMAND_MESSAGE_BYTES:
        return f"command is {len(data)} bytes; at most {L.MAX_COMMAND_MESSAGE_BYTES} (see schemas/LIMITS.md)"
    try:
        cmd = decoder.decode(data)
    except msgspec.ValidationError as err:
        return f"invalid {SUBJECT_COMMANDS[subject].__name__}: {L.explain(str(err))}"
    except msgspec.DecodeError as err:
        return f"malformed JSON: {err}"
    if isinstance(cmd, SubmitJob):
        size = len(msgspec.json.encode(cmd.spec))
        if size > L.MAX_SPEC_BYTES:
            return f"invalid SubmitJob: spec is {size} bytes as JSON; at most {L.MAX_SPEC_BYTES}"
        problem = L.spec_problem(cmd.spec)
        if problem:
            return f"invalid SubmitJob: {problem}"
    return cmd


# --- the shell ----------------------------------------------------------------------------


class LogUnavailable(Exception):
    """The log did not take an append within the patience; whether it stored it is unknown."""

    def __init__(self, attempts: int, waited_s: float, last: BaseException):
        super().__init__(f"event log unavailable ({type(last).__name__}: {last or 'no answer'}) after {attempts} "
                         f"attempts over {waited_s:.1f}s; retry with the same request id (it never doubles a job)")


def transient(err: BaseException) -> bool:
    """Whether an append failure may heal by itself: the stream has no leader (503, no
    responders) or the server did not answer in time."""
    if isinstance(err, APIError):
        return err.code == 503
    return isinstance(err, (NoStreamResponseError, NoRespondersError, asyncio.TimeoutError,
                            ConnectionReconnectingError, StaleConnectionError))


async def append_patiently(event_log, event: ev.Event, msg_id: str | None, patience_s: float = APPEND_PATIENCE_S,
                           expect_alloc_seq: int | None = None) -> int:
    """Append, retrying transient failures with backoff for up to `patience_s`. The message id
    stays the same, so JetStream's duplicate window stores the fact once however many attempts
    reached it (a repeat answers the first one's sequence, before any compare-and-set is
    checked). A `Conflict` is no transient failure: it is raised, for the caller to decide again."""
    start = time.monotonic()
    delay, attempts = 0.05, 0
    while True:
        attempts += 1
        try:
            return await event_log.append(event, msg_id=msg_id, expect_alloc_seq=expect_alloc_seq)
        except Exception as err:
            waited = time.monotonic() - start
            if not transient(err):
                raise
            if waited + delay > patience_s:
                raise LogUnavailable(attempts, waited, err) from err
            log.warning("append_retry", kind=event.kind, msg_id=msg_id, attempt=attempts, error=type(err).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


class Admission:
    def __init__(self, folded: FoldedLog, config: AdmissionConfig, max_in_flight: int = 256):
        self.folded = folded
        self.config = config
        self.capacity = Capacity()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._in_flight: dict[str, asyncio.Future[CommandReply]] = {}  # kind:scope -> reply
        self._taken: dict[str, str] = {}  # job id -> request scope: appended, maybe not folded yet
        self._tasks: set[asyncio.Task] = set()
        self.handled = 0
        self.append_patience_s = APPEND_PATIENCE_S

    async def on_message(self, msg: Msg) -> None:
        await self._slots.acquire()
        task = asyncio.create_task(self._handle(msg))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _handle(self, msg: Msg) -> None:
        split = split_subject(msg.subject)
        kind = SUBJECT_COMMANDS.get(split[0] if isinstance(split, tuple) else "", Command).__name__
        try:
            with telemetry.consume_span(f"admission.{kind}", msg.headers, kind=SpanKind.SERVER) as span:
                reply = await self.handle(msg.subject, msg.data)
                if not reply.ok:
                    telemetry.mark_error(span, reply.error)
                elif reply.job_id:
                    span.set_attribute("gpusched.job_id", reply.job_id)
        except Exception as err:  # the requester must hear something
            log.exception("command_failed", subject=msg.subject)
            reply = CommandReply(ok=False, error=f"internal error: {type(err).__name__}: {err}")
        self.handled += 1
        metrics.handled("admission", kind, "ok" if reply.ok else "refused")
        if msg.reply:
            await msg.respond(_encode_reply(reply))

    async def handle(self, subject: str, data: bytes) -> CommandReply:
        split = split_subject(subject)
        cmd = decode(split[0], data) if isinstance(split, tuple) else split
        if isinstance(cmd, str):
            log.info("command_malformed", subject=subject[:200], error=cmd[:300])
            return CommandReply(ok=False, error=cmd)
        caller = split[1] if isinstance(split, tuple) else ADMIN
        key = f"{type(cmd).__name__}:{request_scope(cmd, caller)}"
        running = self._in_flight.get(key)
        if running is not None:  # the same request is being appended right now: same answer
            reply = await asyncio.shield(running)
            return msgspec.structs.replace(reply, duplicate=True) if reply.ok else reply
        future: asyncio.Future[CommandReply] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        try:
            reply = await self._decide_and_append(cmd, caller)
            future.set_result(reply)
            return reply
        except BaseException as err:
            future.set_exception(err)
            future.exception()  # retrieved: nobody else may be waiting
            raise
        finally:
            del self._in_flight[key]

    async def _decide_and_append(self, cmd: Command, caller: Caller = ADMIN) -> CommandReply:
        """Decide, append, and on a lost compare-and-set (a cancel, a drain: facts of the alloc
        tree) fold what was missed and decide again."""
        for _ in range(MAX_REDECIDES):
            try:
                return await self._decide_once(cmd, caller)
            except Conflict as conflict:
                await catch_up_after(self.folded, conflict)
        return CommandReply(ok=False, error=f"GPU ownership changed under {MAX_REDECIDES} decisions in a row; "
                                            "retry with the same request id")

    async def _decide_once(self, cmd: Command, caller: Caller) -> CommandReply:
        state = self.folded.state
        view = self.folded.alloc_seq  # what the decision sees of the alloc tree (no await until `admit`)
        decision = admit(state, cmd, time.time(), self.config, self.capacity, self._taken, caller)
        if decision.event is None and not decision.reply.ok and await self._caught_up():
            # A refusal must not come from a lagging fold: the node the caller just registered,
            # the job it just submitted, may be in the log and not folded yet. Decide again.
            view = self.folded.alloc_seq
            decision = admit(state, cmd, time.time(), self.config, self.capacity, self._taken, caller)
        if decision.event is None:
            return decision.reply
        job_id = decision.event.job_id if isinstance(decision.event, ev.JobSubmitted) else None
        if job_id:
            self._taken[job_id] = request_scope(cmd, caller)
        try:
            seq = await self._append(decision, view)
        except LogUnavailable as err:
            self._taken.pop(job_id or "", None)  # a retry of this request must name the same job
            log.warning("command_unavailable", kind=decision.event.kind, request_id=cmd.request_id, error=str(err))
            return CommandReply(ok=False, error=str(err))
        if job_id and len(self._taken) > 4096:
            self._taken = {j: r for j, r in self._taken.items() if not state.knows(j)}
        (log.debug if decision.reply.ok else log.info)("command_decided", kind=decision.event.kind, ok=decision.reply.ok, seq=seq,
                 request_id=cmd.request_id, job_id=decision.reply.job_id, error=decision.reply.error or None)
        return msgspec.structs.replace(decision.reply, seq=seq)

    async def _append(self, decision: Decision, view: int) -> int:
        """The decision's facts in order; those of the alloc tree as compare-and-sets, the first
        against the view it was decided at, each next one against the one before (see
        `bus.cas.append_cas`: on a NATS cluster a plain append could slip under a grant's check).
        Raises `Conflict` when the tree moved: nothing more is appended."""
        expected, seq = view, 0
        for event, msg_id in ((decision.event, decision.msg_id), *decision.more):
            assert event is not None
            seq = await append_patiently(self.folded.log, event, msg_id, self.append_patience_s,
                                         expect_alloc_seq=expected if event.ALLOC else None)
            expected = seq if event.ALLOC else expected
        return seq

    async def _caught_up(self) -> bool:
        """Read barrier before a refusal: fold the log up to its head as of now. True when the
        fold moved (worth deciding again); False when it held the head already or the log does
        not answer (the refusal stands: it was decided on what admission knew)."""
        before = self.folded.seen_seq
        try:
            await self.folded.catch_up(timeout=self.append_patience_s)
        except Exception:  # noqa: BLE001 - no answer from the log: refuse on what the fold holds
            return False
        return self.folded.seen_seq != before

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser)
    parser.add_argument("--auto-create-teams", action="store_true",
                        help="a job of a team nobody created creates it with default terms (default: refused)")
    parser.add_argument("--placeholders", choices=["refuse", "bounded", "any"], default="refuse",
                        help="jobs without a command (simulated clusters only): refuse (default), bounded "
                             "(need a time limit or GPUSCHED_SIM_DURATION_S), any")
    parser.add_argument("--checkpoint-root", action="append", default=[], metavar="DIR",
                        help="a job's checkpoint_dir must be under one of these (the nodes' checkpoint roots; "
                             "repeatable; default: anywhere the path bounds allow)")


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    folded = await FoldedLog.open(args.nats, name="gpusched-admission")
    admission = Admission(folded, AdmissionConfig(auto_create_teams=getattr(args, "auto_create_teams", False),
                                                      placeholders=getattr(args, "placeholders", "refuse"),
                                                      checkpoint_roots=tuple(getattr(args, "checkpoint_root", []))))
    sub = await folded.log.nc.subscribe(subjects.CMD_ANY, queue=QUEUE_GROUP, cb=admission.on_message,
                                       pending_msgs_limit=100_000, pending_bytes_limit=64 * 2**20)  # bounded memory
    await folded.log.nc.flush()  # "ready" means the server routes commands here
    log.info("admission_ready", seq=folded.seen_seq)
    notify_ready()
    await stop.wait()
    await sub.unsubscribe()
    await admission.drain()
    await folded.close()
