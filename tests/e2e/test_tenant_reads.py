"""The red team of tenant reads: with nothing but the credential `gpusched user add` gives, a
tenant reads its own team's work (`jobs`, `show`, `history`, `logs`, `teams`) through the
reader service, a teammate's jobs included, and nothing of another team's: not by asking for it,
not by asking the reader on another team's subject, not by reading the log or the node's logs
itself. Real nats-server with the generated permissions, real service processes and a real
node daemon running real processes, the CLI as a user runs it."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys

import msgspec
import pytest

from gpusched import readmodel
from gpusched.bus import subjects
from gpusched.bus.control_client import Client
from gpusched.bus.log import connect
from gpusched.cli.render import cluster_text
from gpusched.core.events import GpusGranted
from gpusched.core.model import JobSpec

from ..verdicts import Attacker
from .harness import harness  # noqa: F401

PEOPLE = {"ra-alice": ("tenant", ["nlp"]), "ra-carol": ("tenant", ["nlp"]), "ra-bob": ("tenant", ["vision"]),
          "ra-plat": ("platform", ["nlp", "research"]), "ra-audit": ("auditor", [])}


@pytest.fixture
def people(trust, nats_server):
    for name, (role, teams) in PEOPLE.items():
        if trust.get(name) is None:
            trust.add(name, role, teams=teams)
    nats_server.reload()
    return {name: str(trust.creds(name)) for name in PEOPLE}


async def acli(h, creds: str, *argv: str) -> subprocess.CompletedProcess:
    """The CLI as a tenant runs it (its credential, no Redis, no client config), without blocking
    the loop: several run at once."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPUSCHED_REDIS_URL",)}
    env.update(GPUSCHED_NATS_URL=h.nats_url, GPUSCHED_CREDS=creds)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gpusched.cli.main", *argv, env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return subprocess.CompletedProcess(argv, proc.returncode or 0, out.decode(), err.decode())


def ok_json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


async def _submit(h, creds: str, team: str, command: list[str]) -> str:
    async with await Client.connect(h.nats_url, creds=creds, timeout=10) as c:
        reply = await c.submit(JobSpec(team=team, gpus=1, command=command))
    assert reply.ok, reply.error
    return reply.job_id


async def _stack(h) -> None:
    h.start("admission")
    h.start("placement")
    h.start("reader")
    h.start("nodeagent", "--backend", "sim", "--count", "1", "--gpus", "4", "--heartbeat-s", "0.5",
            "--work-dir", str(h.tmp / "work"), "--uid-range", "none")
    await h.ready("admission", "placement", "reader", "nodeagent")
    await h.wait_for("node registered", lambda s: list(s.nodes))


async def test_a_tenant_reads_its_team_and_nothing_of_another(harness, people):  # noqa: F811
    h = harness
    await _stack(h)
    alice = await _submit(h, people["ra-alice"], "nlp", ["/bin/sh", "-c", "echo alice-secret-output"])
    bob = await _submit(h, people["ra-bob"], "vision", ["/bin/sh", "-c", "echo bob-secret-output"])
    await h.wait_for("both done", lambda s: all(s.jobs[j].state == "completed" for j in (alice, bob)), timeout=30)

    # every read at once (they are independent; 14 CLI starts one after another take long)
    carol, b, plat, audit = (people[n] for n in ("ra-carol", "ra-bob", "ra-plat", "ra-audit"))
    await h.sync()
    granted = next(seq for seq, e in h.records if isinstance(e, GpusGranted) and e.job_id == alice)
    calls = {
        "teams then": (carol, "teams", "--json", "--at", str(granted)),
        "jobs": (carol, "jobs", "--json"), "show": (carol, "show", alice, "--json"), "logs": (carol, "logs", alice),
        "history": (carol, "history", "--json"), "teams": (carol, "teams", "--json"), "teams piped": (carol, "teams"),
        "plat teams": (plat, "teams", "--json"), "audit teams": (audit, "teams", "--json"),
        "b jobs": (b, "jobs", "--json"), "b show": (b, "show", alice, "--json"), "b logs": (b, "logs", alice),
        "b history": (b, "history", "--json"), "b asks nlp": (b, "jobs", "--team", "nlp"),
        "plat jobs": (plat, "jobs", "--json"), "plat show": (plat, "show", alice, "--json"),
        "plat show none": (plat, "show", "j-00000000", "--json"),
        "audit jobs": (audit, "jobs", "--json", "--fold"),
    }
    got = dict(zip(calls, await asyncio.gather(*(acli(h, *argv) for argv in calls.values()))))

    # a teammate reads alice's job: listing, show, logs, history, its team's standing
    jobs = ok_json(got["jobs"])
    assert [d["job_id"] for d in jobs] == [alice] and jobs[0]["user"] == "ra-alice"
    shown = ok_json(got["show"])
    assert shown["job"]["state"] == "completed" and "JobCompleted" in {e["type"] for e in shown["history"]}
    assert got["logs"].returncode == 0 and "alice-secret-output" in got["logs"].stdout, got["logs"].stderr
    assert [(d["job_id"], d["user"]) for d in ok_json(got["history"])] == [(alice, "ra-alice")]
    assert [d["team"] for d in ok_json(got["teams"])] == ["nlp"]
    # ... and the cluster's totals beside it, in JSON and piped, as everyone reads them
    totals = readmodel.cluster_totals(h.state)
    assert totals["total_gpus"] == 4 and totals["free_gpus"] == 4 and totals["nodes"] == 1
    assert [d["cluster"] for d in ok_json(got["teams"])] == [totals]
    assert got["teams piped"].stdout.splitlines()[-1] == cluster_text(totals), got["teams piped"].stdout
    assert "cluster: 4 GPUs on 1 nodes, 4 free, 0 held" in got["teams piped"].stdout
    assert {d["team"]: d["cluster"] for d in ok_json(got["plat teams"])} == {"nlp": totals}  # (research: no row yet)
    assert all(d["cluster"] == totals for d in ok_json(got["audit teams"]))
    # ... and as it stood when alice's job was granted (`--at`), not as it stands now
    then = ok_json(got["teams then"])
    assert [(d["team"], d["held"], d["seq"]) for d in then] == [("nlp", 1, granted)], then

    # bob (vision) reads none of it, and sees only his own job
    assert [d["job_id"] for d in ok_json(got["b jobs"])] == [bob]
    denied = got["b show"]
    outside = f"permission denied: ra-bob (role tenant) reads team(s) vision only; no job {alice} among them"
    assert denied.returncode == 1 and json.loads(denied.stdout)["error"] == outside  # who, which role, what it reads
    assert "alice-secret" not in denied.stdout
    nothing = got["b logs"]
    assert nothing.returncode == 1 and "alice-secret-output" not in nothing.stdout + nothing.stderr
    assert nothing.stderr == f"gpusched logs: {outside}\n"
    assert [d["job_id"] for d in ok_json(got["b history"])] == [bob]
    asked = got["b asks nlp"]
    assert asked.returncode == 1 and "reads team(s) vision only, not nlp" in asked.stderr

    # the platform reads its teams' jobs; the auditor (not scoped) everything, from the log
    assert [d["job_id"] for d in ok_json(got["plat jobs"])] == [alice]
    assert ok_json(got["plat show"])["job"]["job_id"] == alice
    none = got["plat show none"]  # all its teams named, not only the last one asked
    assert none.returncode == 1 and json.loads(none.stdout)["error"] == (
        "permission denied: ra-plat (role platform) reads team(s) nlp, research only; no job j-00000000 among them")
    assert {d["job_id"] for d in ok_json(got["audit jobs"])} == {alice, bob}

    await _around_the_cli(h, b, alice)


async def _around_the_cli(h, creds: str, alice: str) -> None:
    """What bob's credential cannot do with a NATS client of his own: ask the reader on nlp's
    subject, read the log, or ask the node for the logs; what he may ask is scoped."""
    ask = msgspec.json.encode({"job_id": alice})
    red_team = Attacker(h.nats_url, creds)
    for subject in (subjects.read_subject("show", "nlp", "ra-bob"), subjects.read_subject("show"),
                    subjects.read_subject("show", "vision", "ra-alice"), subjects.node_logs_subject("node00"),
                    f"$JS.API.STREAM.INFO.{subjects.STREAM}"):
        assert await red_team.refused(subject, lambda nc, s=subject: nc.request(s, ask, timeout=5)), subject
    nc = await connect(h.nats_url, name="red-team", creds=creds)
    try:
        msg = await nc.request(subjects.read_subject("show", "vision", "ra-bob"),
                               msgspec.json.encode({"job_id": alice}), timeout=10)
        reply = msgspec.json.decode(msg.data)
        assert reply["ok"] and reply["data"] == {"job_id": alice, "error": f"no job {alice} among team vision's jobs"}
    finally:
        await nc.close()


async def test_admin_lists_every_team_from_the_reader_and_from_the_log_without_it(harness):  # noqa: F811
    """Admin's `jobs` takes the reader's unscoped answer when a reader runs (the quick path: no
    Redis client to load), and reads Redis or folds the log when none does: the same jobs."""
    from gpusched.cli import reads

    h = harness
    h.start("admission")
    h.start("reader")
    await h.ready("admission", "reader")
    ids = {await h.submit(team=team, gpus=1) for team in ("nlp", "vision")}
    args = argparse.Namespace(nats=h.nats_url, redis=h.redis_url, at=None, team=None, fold=False, policy=None,
                              command="jobs")
    docs, meta = await reads.load(args, "jobs")
    assert meta["source"] == "reader" and {d["job_id"] for d in docs} == ids
    h.kill9("reader")
    docs, meta = await reads.load(args, "jobs")  # no projector wrote Redis: the log is folded
    assert meta["source"] == "log" and {d["job_id"] for d in docs} == ids


async def test_a_platform_cancels_its_second_teams_jobs_without_naming_the_team(harness, people):  # noqa: F811
    """A platform of nlp and research cancels its research jobs by id and by filter, each cancel
    sent for its job's own team (its listing names it); before, all went for nlp, its first team,
    and admission refused them. A cancel that does nothing prints no empty line."""
    h, plat = harness, people["ra-plat"]
    h.start("admission")
    h.start("reader")
    await h.ready("admission", "reader")
    first = await _submit(h, plat, "research", ["sleep", "60"])
    second = await _submit(h, plat, "research", ["sleep", "60"])
    by_id = await acli(h, plat, "cancel", first)
    assert (by_id.returncode, by_id.stdout) == (0, f"cancelled {first}\n"), by_id.stderr
    by_filter = await acli(h, plat, "cancel", "--state", "pending")
    assert (by_filter.returncode, by_filter.stdout) == (0, f"cancelled {second}\n"), by_filter.stderr
    await h.wait_for("both cancelled", lambda s: {s.jobs[j].state for j in (first, second)} == {"cancelled"})
    again = await acli(h, plat, "cancel", first)
    assert again.returncode == 1 and again.stdout == "" and "already cancelled" in again.stderr
