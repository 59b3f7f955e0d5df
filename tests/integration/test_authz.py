"""Who may do what on the bus, against a real nats-server with the generated permissions.

The matrix: every role x every subject family and JetStream API it might touch -> allowed or
refused. A refused publish or subscription comes back as the server's `-ERR 'Permissions
Violation ...'`, which nats-py hands to the error callback while it reads that line; the server
answers a PING only after it, so after `flush()` the verdict is in: deterministic, no sleeps.

Expectations are written from the rules (the README's security model and `roles.EVENT_WRITERS`),
not from `security.authz`, so a permission that drifts from the rules fails here.
"""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from nats.js.errors import APIError

from gpusched.bus import subjects
from gpusched.bus.control_client import Client, NotPermitted
from gpusched.bus.log import EventLog, connect
from gpusched.core import events as ev
from gpusched.core.model import JobSpec
from gpusched.security.roles import EVENT_WRITERS, SERVICE_ROLES

from ..e2e.harness import harness  # noqa: F401

NODE = "node01"  # the single-node identity's node; nodeagent (the sim host) holds node00..node63
OTHER = "node70"  # a node nobody in this table speaks for but admin
PEOPLE = {  # name -> (role, teams, node)
    "alice": ("tenant", ["nlp"], None),
    "bob": ("tenant", ["vision"], None),
    "plat": ("platform", ["nlp", "research"], None),
    "audit": ("auditor", [], None),
    "gpu01": ("node", [], NODE),
}
ROLES = ["admin", *SERVICE_ROLES, "nodeagent", *PEOPLE]


@pytest.fixture(scope="module")
def people(trust):
    for name, (role, teams, node) in PEOPLE.items():
        if trust.get(name) is None:
            trust.add(name, role, teams=teams, node=node)
    return {name: trust.creds(name) for name in ROLES}


def role_of(who: str) -> str:
    return PEOPLE[who][0] if who in PEOPLE else ("node" if who == "nodeagent" else who)


# --- the rules ----------------------------------------------------------------------------------


def kind_subject(kind: str, node: str | None = None) -> str:
    tree = "alloc" if getattr(ev, kind).ALLOC else "info"
    return f"gpusched.evt.{tree}.{kind}." + (f"node.{node}" if node else "s00")


def publish_cases(who: str) -> dict[str, bool]:
    """subject -> may `who` publish it."""
    role = role_of(who)
    admin = role == "admin"
    speaks_for_node = who in ("gpu01", "nodeagent")
    reads_log = role not in ("tenant", "platform")
    cases: dict[str, bool] = {}
    for kind, writers in EVENT_WRITERS.items():  # a tenant (and everyone else) forging each kind
        cases[kind_subject(kind)] = admin or (role in writers and role != "node")
        if kind in subjects.NODE_KINDS:
            cases[kind_subject(kind, NODE)] = admin or speaks_for_node
            cases[kind_subject(kind, OTHER)] = admin  # a node publishing for another node
    cases.update({
        subjects.heartbeat_subject(NODE): admin or speaks_for_node,  # spoofed heartbeats
        subjects.heartbeat_subject(OTHER): admin,
        subjects.node_control_subject(NODE): admin,  # SimulateCrash, InjectStray, KillProcesses...
        subjects.node_kill_subject(NODE): admin or role == "reconciler",
        subjects.node_reset_subject(NODE): admin or role == "reconciler",  # --reset-leaked
        subjects.node_logs_subject(NODE): admin or role in ("dashboard", "reader"),  # not tenants, not nodes
        subjects.node_logs_subject(OTHER): admin or role in ("dashboard", "reader"),
        "gpusched.cmd.submit.nlp.alice": admin or who == "alice",
        "gpusched.cmd.cancel.nlp.alice": admin or who == "alice",
        "gpusched.cmd.hold.nlp.alice": admin or who == "alice",  # hold/release/update: own team's jobs
        "gpusched.cmd.update.nlp.alice": admin or who == "alice",
        "gpusched.cmd.hold.vision.alice": admin,
        "gpusched.cmd.update.vision.alice": admin,
        "gpusched.cmd.label.nlp.alice": admin,  # node labels are admin's
        subjects.CMD_LABEL: admin or role == "dashboard",
        "gpusched.cmd.submit.vision.alice": admin,  # alice submitting for another team
        "gpusched.cmd.submit.vision.bob": admin or who == "bob",
        "gpusched.cmd.quota.nlp.alice": admin,  # quotas are admin's
        "gpusched.cmd.submit.nlp.plat": admin or who == "plat",
        "gpusched.cmd.submit.research.plat": admin or who == "plat",
        "gpusched.cmd.submit.vision.plat": admin,  # not one of the platform's teams
        "gpusched.cmd.submit.nlp.plat.alice": admin or who == "plat",  # on behalf of a user of its team
        "gpusched.cmd.submit.vision.plat.bob": admin,  # ... of a team not its own
        "gpusched.cmd.cancel.nlp.plat.alice": admin,  # only a submit is sent on behalf
        "gpusched.cmd.submit.nlp.alice.bob": admin,  # a tenant may not act for another user
        subjects.CMD_SUBMIT: admin or role == "dashboard",  # admin's form: any team
        subjects.CMD_QUOTA + ".someone": admin or role == "dashboard",
        subjects.CMD_DRAIN: admin or role == "dashboard",
        subjects.CMD_FOLD: admin or role == "dashboard",  # the fold's settings: admin's alone
        subjects.CMD_MIG: admin or role == "dashboard",  # a GPU's MIG geometry: admin's alone
        "gpusched.cmd.mig.nlp.alice": admin,
        "gpusched.ctl.placement": admin or role == "dashboard",
        subjects.Q_SHARES: admin or role == "dashboard",  # every team's standing: not a tenant's to read
        # reads through the reader service: a tenant's or platform's own team(s) and name only
        subjects.read_subject("show", "nlp", "alice"): admin or who == "alice",
        subjects.read_subject("jobs", "vision", "alice"): admin,  # alice asking as another team
        subjects.read_subject("jobs", "nlp", "bob"): admin,  # bob asking as a user of nlp
        subjects.read_subject("logs", "research", "plat"): admin or who == "plat",
        subjects.read_subject("logs", "vision", "plat"): admin,
        subjects.read_subject("jobs"): admin or role == "auditor",  # unscoped: every team's
        "gpusched.dead.x": admin or role in SERVICE_ROLES,  # a node may not: it could flood the dead letters
        f"$JS.API.STREAM.INFO.{subjects.STREAM}": admin or reads_log,
        f"$JS.API.CONSUMER.CREATE.{subjects.STREAM}": admin or reads_log,
        "$JS.API.STREAM.LIST": admin,
        "gpusched.anything.else": admin,
        # the snapshot store: the projector writes it; services, nodes and auditors read it
        f"$O.{subjects.SNAPSHOT_BUCKET}.C.probe": admin or role == "projector",  # a forged snapshot
        f"$O.{subjects.SNAPSHOT_BUCKET}.M.probe": admin or role == "projector",
        f"$JS.API.STREAM.PURGE.{subjects.SNAPSHOT_STREAM}": admin or role == "projector",
        f"$JS.API.STREAM.INFO.{subjects.SNAPSHOT_STREAM}": admin or reads_log,
        f"$JS.API.STREAM.MSG.GET.{subjects.SNAPSHOT_STREAM}": admin or reads_log,
        f"$JS.API.DIRECT.GET.{subjects.SNAPSHOT_STREAM}": admin or reads_log,
        f"$JS.API.CONSUMER.CREATE.{subjects.SNAPSHOT_STREAM}": admin or reads_log,
        "$JS.API.STREAM.NAMES": admin or reads_log,
    })
    for subject in [c for c in cases if c.startswith(("gpusched.cmd.", "gpusched.read."))]:
        cases[subject] = cases[subject] or role == "api"  # the HTTP API sends as the caller it authenticated
    cases.update(lease_cases(role))
    for api in ("CREATE", "UPDATE", "DELETE", "PURGE", "MSG.DELETE", "SNAPSHOT", "RESTORE"):
        for stream in (subjects.STREAM, subjects.DEAD_STREAM, subjects.SNAPSHOT_STREAM,
                       subjects.LEASE_STREAM):  # only admin changes one
            if api == "PURGE" and stream == subjects.SNAPSHOT_STREAM:
                continue  # the projector drops a replaced snapshot's chunks (above)
            cases[f"$JS.API.STREAM.{api}.{stream}"] = admin
    cases[f"$JS.API.CONSUMER.DURABLE.CREATE.{subjects.STREAM}.x"] = admin
    return cases


def lease_cases(role: str) -> dict[str, bool]:
    """The lease bucket: placement writes its lease, the fallback its own; each reads what it
    watches (the dashboard: placement's). A forged, deleted or purged lease is a publish to the
    key's subject, so these are the whole write surface."""
    admin = role == "admin"
    kv, get = f"$KV.{subjects.LEASE_BUCKET}", f"$JS.API.DIRECT.GET.{subjects.LEASE_STREAM}"
    return {
        f"{kv}.placement": admin or role == "placement",
        f"{kv}.placement.standby": admin or role == "placement",
        f"{kv}.fallback": admin or role == "fallback",
        f"{kv}.other": admin,
        f"{get}.{kv}.placement": admin or role in ("placement", "fallback", "dashboard"),
        f"{get}.{kv}.fallback": admin or role == "fallback",
        f"{get}": admin,  # a get by body could name any key
        f"$JS.API.STREAM.MSG.GET.{subjects.LEASE_STREAM}": admin,
        f"$JS.API.STREAM.INFO.{subjects.LEASE_STREAM}": admin or role in ("placement", "fallback", "dashboard"),
        f"$JS.API.CONSUMER.CREATE.{subjects.LEASE_STREAM}": admin,  # a watcher reads every key
    }


def subscribe_cases(who: str) -> dict[tuple[str, str | None], bool]:
    """(subject, queue group) -> may `who` subscribe."""
    role = role_of(who)
    admin = role == "admin"
    return {
        ("gpusched.cmd.>", "admission"): admin or role == "admission",  # a rogue joining admission's group
        ("gpusched.cmd.>", None): admin,  # sniffing every command (and its env)
        ("gpusched.cmd.submit.nlp.alice", None): admin,
        (subjects.HEARTBEATS, None): admin or role == "reconciler",
        (subjects.node_control_subject(NODE), None): admin or who in ("gpu01", "nodeagent"),
        (subjects.node_control_subject(OTHER), None): admin,
        (subjects.node_reset_subject(NODE), None): admin or who in ("gpu01", "nodeagent"),
        (subjects.node_reset_subject(OTHER), None): admin,
        (subjects.node_logs_subject(NODE), None): admin or who in ("gpu01", "nodeagent"),  # serving logs
        (subjects.node_logs_subject(OTHER), None): admin,
        (subjects.Q_SHARES, "quota_ledger"): admin or role == "quota_ledger",
        (subjects.READ_ANY, "reader"): admin or role == "reader",  # a rogue answering reads
        (subjects.READ_ANY, None): admin,  # sniffing others' read requests
        (subjects.EVENTS, None): admin,  # the log is read through JetStream consumers
        ("_INBOX.>", None): admin,  # everybody's replies
        ("gpusched.ctl.placement", None): admin,
    }


# --- the probe ----------------------------------------------------------------------------------


class Observer:
    """The verdict on one action of a probe connection, from two signals that always come:
    allowed - an admin connection subscribed to everything sees the probe's message (or the
    probe's subscription receives the observer's); refused - the server's `Permissions
    Violation` for that very subject reaches the probe's error callback. Whichever arrives
    first decides; neither is a guess from silence. (Across two connections nats-server does
    not order one's PONG after a message routed to the other, so a single flush is not proof.)"""

    def __init__(self) -> None:
        self.nc = None
        self.sub = None
        self.seen: set[bytes] = set()
        self.errors: list[str] = []

    async def open(self, url: str) -> Observer:
        self.nc = await connect(url, name="observer")
        self.sub = await self.nc.subscribe(">")  # no callback: the read loop queues what arrives
        await self.nc.flush()
        return self

    async def on_probe_error(self, err: Exception) -> None:
        self.errors.append(str(err).lower())

    def violation(self, what: str, subject: str) -> bool:
        needle = f'permissions violation for {what} to "{subject.lower()}"'
        return any(needle in e for e in self.errors)

    async def published(self, probe, subject: str, token: bytes) -> bool:
        await probe.publish(subject, token)
        await probe.flush(timeout=5)
        for _ in range(500):
            self.seen |= await drain(self.sub)
            if token in self.seen:
                return True
            if self.violation("publish", subject):
                return False
            await self.nc.flush(timeout=5)
            await asyncio.sleep(0.01)
        raise AssertionError(f"no verdict on publishing {subject}")

    async def subscribed(self, probe, subject: str, queue: str | None, token: bytes) -> bool:
        before = len(self.errors)
        sub = await probe.subscribe(subject, queue=queue or "")
        await probe.flush(timeout=5)
        try:
            for _ in range(500):
                await self.nc.publish(subject.replace(">", "probe").replace("*", "probe"), token)
                await self.nc.flush(timeout=5)
                await probe.flush(timeout=5)
                if token in await drain(sub):
                    return True
                needle = f'permissions violation for subscription to "{subject.lower()}"'
                if any(needle in e for e in self.errors[before:]):
                    return False
                await asyncio.sleep(0.01)
            raise AssertionError(f"no verdict on subscribing {subject}")
        finally:
            await drain(self.sub)
            try:
                await sub.unsubscribe()
            except Exception:  # a refused subscription may already be gone
                pass


async def drain(sub) -> set[bytes]:
    """What the read loop has queued for a callback-less subscription, now."""
    out = set()
    for _ in range(sub.pending_msgs):
        out.add((await sub.next_msg(timeout=1)).data)
    return out


#: What admin's own probe does not really send: it would do it (delete the stream...).
DESTRUCTIVE = ("$JS.API.STREAM.DELETE.", "$JS.API.STREAM.RESTORE.", "$JS.API.STREAM.SNAPSHOT.",
               "$JS.API.STREAM.UPDATE.", "$JS.API.STREAM.CREATE.", "$JS.API.STREAM.MSG.DELETE.")


@pytest.mark.parametrize("who", ROLES)
async def test_authorization_matrix(who, people, nats_url):
    observer = await Observer().open(nats_url)
    probe = await connect(nats_url, name="probe", creds=people[who], error_cb=observer.on_probe_error)
    wrong = []
    try:
        for i, (subject, allowed) in enumerate(publish_cases(who).items()):
            if who == "admin" and subject.startswith(DESTRUCTIVE):
                continue
            ok = await observer.published(probe, subject, f"probe-{i}".encode())
            if ok != allowed:
                wrong.append(f"publish {subject}: {'allowed' if ok else 'refused'}, expected "
                             f"{'allowed' if allowed else 'refused'}")
        for i, ((subject, queue), allowed) in enumerate(subscribe_cases(who).items()):
            ok = await observer.subscribed(probe, subject, queue, f"sub-{i}".encode())
            if ok != allowed:
                wrong.append(f"subscribe {subject} queue={queue}: {'allowed' if ok else 'refused'}")
    finally:
        await probe.close()
        await observer.nc.close()
    assert not wrong, f"{who} ({role_of(who)}):\n" + "\n".join(wrong)
    # and the stream is still there, still denying delete and purge, whatever was tried
    log = await EventLog.open(nats_url)
    info = await log.js.stream_info(subjects.STREAM)
    assert info.config.deny_delete and info.config.deny_purge
    await log.close()


async def test_every_service_and_node_identity_reads_the_log_and_appends_only_its_kinds(people, nats_url):
    """The allow-lists are wide enough to work: each writer appends one of its kinds through
    the real `EventLog` (JetStream publish acked), and reads it back."""
    samples = {
        "admission": ev.TeamQuotaSet(at=1.0, team="t", quota=msgspec.convert({}, ev.TeamQuota)),
        "placement": ev.PlacementRecovered(at=1.0),
        "fallback": ev.PlacementDegraded(at=1.0, reason="test"),
        "preemptor": ev.JobFailed(at=1.0, job_id="j-1", attempt=1, reason="test"),
        "reconciler": ev.GpuRestored(at=1.0, gpu="node01/0"),
        "gpu01": ev.JobStarted(at=1.0, job_id="j-1", attempt=1, node=NODE),
    }
    for who, event in samples.items():
        log = await EventLog.open(nats_url, name=f"probe-{who}", creds=people[who])
        try:
            seq = await asyncio.wait_for(log.append(event), 5)
            got = [r async for r in log.records(seq, seq)]
            assert got and got[0].event == event, who
        finally:
            await log.close()
    auditor = await EventLog.open(nats_url, creds=people["audit"])
    assert len([r async for r in auditor.records()]) == len(samples)
    await auditor.close()


async def test_only_admin_changes_the_stream_and_nobody_deletes_or_purges(people, nats_url):
    placement = await EventLog.open(nats_url, creds=people["placement"])
    await placement.append(ev.PlacementRecovered(at=1.0))
    with pytest.raises(Exception):  # no permission: no reply at all
        await placement.js.purge_stream(subjects.STREAM, timeout=0.5)
    await placement.close()
    admin = await EventLog.open(nats_url)
    with pytest.raises(APIError):  # deny_purge: JetStream itself refuses, admin included
        await admin.js.purge_stream(subjects.STREAM)
    with pytest.raises(APIError):  # deny_delete
        await admin.js.delete_msg(subjects.STREAM, 1)
    assert (await admin.js.stream_info(subjects.STREAM)).state.messages == 1
    await admin.close()


async def test_a_node_cannot_slip_another_nodes_fact_under_its_own_subject(people, nats_url):
    """The permissions let node01 publish on its subjects; the reader checks the payload is the
    fact that subject is for: a NodeRegistered for node02 published there is dead-lettered."""
    node = await EventLog.open(nats_url, creds=people["gpu01"])
    forged = ev.NodeRegistered(at=1.0, node="node02", rack="r", gpus=[])
    await node.js.publish(subjects.event_subject(ev.NodeRegistered(at=1.0, node=NODE, rack="r", gpus=[])),
                          ev.encode_event(forged))
    await node.append(ev.NodeRegistered(at=2.0, node=NODE, rack="r", gpus=[]))
    dead: list[int] = []
    got = [r.event async for r in node.records(on_dead=lambda seq, subject: dead.append(seq))]
    assert dead == [1] and [e.node for e in got] == [NODE]
    await node.close()


async def test_tenants_act_only_for_their_team_and_jobs_carry_their_user(people, harness):  # noqa: F811
    harness.start("admission")
    await harness.ready("admission")
    url = harness.nats_url
    async with await Client.connect(url, creds=str(people["alice"])) as alice, \
            await Client.connect(url, creds=str(people["bob"])) as bob:
        mine = await alice.submit(JobSpec(team="nlp", gpus=1))
        assert mine.ok, mine.error
        theirs = await bob.submit(JobSpec(team="vision", gpus=1))
        with pytest.raises(NotPermitted):  # the client says so before the server drops it
            await alice.submit(JobSpec(team="vision", gpus=1))
        with pytest.raises(NotPermitted):
            await alice.set_quota("nlp", msgspec.convert({"guaranteed": 8}, ev.TeamQuota))
        # the payload names another team on alice's own subject: admission goes by the subject
        forged = {"type": "SubmitJob", "request_id": "forged-1", "spec": {"team": "vision", "gpus": 1}}
        reply = json.loads(await alice.request_raw("gpusched.cmd.submit.nlp.alice", json.dumps(forged).encode()))
        assert not reply["ok"] and "is not the team these credentials submit for" in reply["error"]
        refused = await alice.cancel(theirs.job_id)
        assert not refused.ok and "belongs to team 'vision'" in refused.error
        for refused in (await alice.hold(theirs.job_id), await alice.update(theirs.job_id, priority="high")):
            assert not refused.ok and "belongs to team 'vision'" in refused.error
        assert (await alice.hold(mine.job_id)).ok and (await alice.update(mine.job_id, priority="low")).ok
        assert (await alice.cancel(mine.job_id)).ok
    async with await Client.connect(url) as admin:  # admin cancels anyone's
        assert (await admin.cancel(theirs.job_id)).ok
    state = await harness.wait_for("both cancelled", lambda s: all(
        s.jobs.get(j) and s.jobs[j].state == "cancelled" for j in (mine.job_id, theirs.job_id)) and s)
    assert (state.jobs[mine.job_id].user, state.jobs[theirs.job_id].user) == ("alice", "bob")


async def test_a_user_added_connects_and_a_revoked_one_is_cut_off_without_a_restart(trust, nats_server, tmp_path):
    """Through the CLI, as an operator does it: `user add` and `user revoke` rewrite the
    server's config and reload it (SIGHUP); no restart."""
    from gpusched.cli.main import main

    creds = tmp_path / "carol.nk"
    with pytest.raises(PermissionError):  # not known to the server: refused
        await connect(nats_server.url, creds=str(people_seed(trust, "nobody", tmp_path)), max_reconnect_attempts=0)
    assert main(["user", "add", "carol", "--team", "nlp", "--out", str(creds), "--trust", str(trust.dir)]) == 0
    nc = await _connect_when_reloaded(nats_server.url, creds)
    try:
        async with Client(nc) as carol:  # a tenant's own command subject works
            with pytest.raises(Exception, match="no service answers|no reply"):
                await carol.submit(JobSpec(team="nlp", gpus=1))
        assert main(["user", "revoke", "carol", "--trust", str(trust.dir)]) == 0
        for _ in range(100):  # the server drops the revoked user's live connection on reload
            if not nc.is_connected:
                break
            await asyncio.sleep(0.05)
        assert not nc.is_connected
    finally:
        await nc.close()
    with pytest.raises(PermissionError):  # the holder still has the file: it no longer works
        await connect(nats_server.url, creds=creds, max_reconnect_attempts=0)


def people_seed(trust, name, tmp_path):
    """A well-formed nkey seed the server has never heard of."""
    from gpusched.security import identity

    return identity.create(name, "tenant", tmp_path, teams=["nlp"]).seed_file


async def _connect_when_reloaded(url, creds):
    for _ in range(100):  # SIGHUP is asynchronous: the reload lands within milliseconds
        try:
            return await connect(url, creds=creds, max_reconnect_attempts=0)
        except PermissionError:
            await asyncio.sleep(0.05)
    raise AssertionError("the reloaded server never accepted the new user")


async def test_a_spoofed_heartbeat_is_not_believed(people, nats_url):
    """node01 may publish heartbeats only on its own subject (the matrix); one there that claims
    to be node02 (to keep a dead node "alive", or to quarantine its GPUs) is dropped by the
    reconciler, while node01's own is observed."""
    from gpusched.core.heartbeat import Heartbeat
    from gpusched.core.model import GpuInfo
    from gpusched.services.reconciler import Reconciler, ReconcilerConfig

    admin = await EventLog.open(nats_url, name="test-admin")  # heartbeats count only from registered nodes
    for name in (NODE, "node02"):
        await admin.append(ev.NodeRegistered(at=0.5, node=name, rack="r0", gpus=[GpuInfo(index=0, uuid=f"u-{name}")]))
    await admin.close()
    rec = Reconciler(await EventLog.open(nats_url, name="test-reconciler", creds=people["reconciler"]),
                     ReconcilerConfig(tick_s=60))
    await rec.start()
    for _ in range(200):
        if {NODE, "node02"} <= set(rec.folded.state.nodes):
            break
        await asyncio.sleep(0.02)
    node = await connect(nats_url, creds=people["gpu01"])
    try:
        for claimed in ("node02", NODE):
            hb = Heartbeat(node=claimed, at=1.0, agent_id="a", seq=1, backend="sim", gpus=[])
            await node.publish(subjects.heartbeat_subject(NODE), msgspec.json.encode(hb))
        await node.flush()
        for _ in range(200):
            if NODE in rec.obs.heartbeats:
                break
            await asyncio.sleep(0.02)
        assert set(rec.obs.heartbeats) == {NODE}  # published first, node02's was seen and dropped
    finally:
        await node.close()
        await rec.stop()


async def test_tls_from_the_stack_ca_is_verified(trust, tmp_path, monkeypatch):
    """`up --tls`: NATS serves TLS from a generated CA; a client that trusts that CA connects
    (and is still held to its role), one that does not is refused by its own TLS check."""
    import ssl

    from gpusched.bus.servers import start_nats
    from gpusched.security import tlsgen
    from gpusched.security.bootstrap import create_streams_sync

    files = tlsgen.ensure(tmp_path / "tls")
    server = start_nats(trust=trust, tls=files)
    try:
        assert server.url.startswith("tls://")
        monkeypatch.setenv("GPUSCHED_CA", files["ca_file"])
        create_streams_sync(server.url, trust.creds("admin"))
        log = await EventLog.open(server.url, creds=trust.creds("placement"))
        assert await log.append(ev.PlacementRecovered(at=1.0)) == 1
        await log.close()
        monkeypatch.delenv("GPUSCHED_CA")
        with pytest.raises((ssl.SSLError, OSError, Exception)) as refused:
            await asyncio.wait_for(connect(server.url, creds=trust.creds("admin"), max_reconnect_attempts=0,
                                           allow_reconnect=False), 10)
        assert "certificate" in str(refused.value).lower() or isinstance(refused.value, ssl.SSLError)
    finally:
        server.stop()


async def test_the_reconciler_resets_a_leaked_gpu_on_its_own_subject(people, nats_url, tmp_path):
    """`reconciler --reset-leaked`: its ResetGpu, sent with its own identity on the reset subject,
    reaches node01's daemon and frees the leak; each reconciler subject takes only its own kind."""
    from gpusched.core.heartbeat import KillProcesses, NodeReply, ResetGpu
    from gpusched.services.nodeagent.agent_config import AgentConfig
    from gpusched.services.nodeagent.backends import SimBackend
    from gpusched.services.nodeagent.host import NodeHost

    host = NodeHost(await EventLog.open(nats_url, name="test-node", creds=people["gpu01"]), heartbeat_s=5)
    backend = SimBackend(NODE, 2, "pairs")
    host.add(AgentConfig(node=NODE, work_dir=tmp_path), backend)
    await host.start()
    rec = await EventLog.open(nats_url, name="test-reconciler", creds=people["reconciler"])

    async def ask(subject: str, request) -> NodeReply:
        msg = await rec.nc.request(subject, msgspec.json.encode(request), timeout=5)
        return msgspec.json.decode(msg.data, type=NodeReply)

    try:
        backend.inject_leak(0, 2048)
        assert [s.memory_used_mb for s in backend.sample()][0] >= 2048
        reset = ResetGpu(index=0, reason="leaked memory")
        wrong = await ask(subjects.node_kill_subject(NODE), reset)
        assert not wrong.ok and "ResetGpu" in wrong.error
        assert (await ask(subjects.node_reset_subject(NODE), reset)).ok
        assert [s.memory_used_mb for s in backend.sample()][0] < 2048
        kill = await ask(subjects.node_reset_subject(NODE), KillProcesses(pids=[1], gpu=f"{NODE}/0", reason="x"))
        assert not kill.ok and "KillProcesses" in kill.error
    finally:
        await rec.close()
        await host.stop()
