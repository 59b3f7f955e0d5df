"""A node speaks only for itself, and time comes from the server (issue 24), through a real
nats-server with the generated permissions: with one node's credential, facts on its own
subjects about another node's job, and about itself dated 400 days ahead, are stored (the
permissions allow them) and move nothing in the fold; the audit names them."""

from __future__ import annotations

import time

import pytest

from gpusched.bus.log import EventLog
from gpusched.cli.replay import audit_stream
from gpusched.core import events as ev
from gpusched.core.fold.checks import AT_LEAD_S
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.security.audit import Audit
from gpusched.store import fold_log

VICTIM, ATTACKER = "node71", "node73"  # nodes of identities of their own (the sim host holds node00..63)


@pytest.fixture
def node_creds(trust):
    """Two node identities, added before the test's server starts (it renders the keyring)."""
    for node in (VICTIM, ATTACKER):
        if trust.get(f"speaks-{node}") is None:
            trust.add(f"speaks-{node}", "node", node=node)
    return {node: trust.creds(f"speaks-{node}") for node in (VICTIM, ATTACKER)}


def registered(node: str, at: float) -> ev.NodeRegistered:
    return ev.NodeRegistered(at=at, node=node, rack="r0", gpus=[GpuInfo(index=i, uuid=f"{node}-{i}") for i in range(2)])


async def test_a_node_credential_cannot_end_another_nodes_job_or_move_the_clock(trust, node_creds, nats_url):
    admin = await EventLog.open(nats_url, name="admin")
    victim = await EventLog.open(nats_url, name="victim", creds=node_creds[VICTIM])
    attacker = await EventLog.open(nats_url, name="attacker", creds=node_creds[ATTACKER])
    try:
        now = time.time()
        await victim.append(registered(VICTIM, now))
        await attacker.append(registered(ATTACKER, now))
        await admin.append(ev.JobSubmitted(at=now, job_id="j", spec=JobSpec(team="b", gpus=2, time_limit_s=3600.0)))
        await admin.append(ev.GpusGranted(at=now, job_id="j", attempt=1, gpus=[f"{VICTIM}/0", f"{VICTIM}/1"]))
        await victim.append(ev.JobStarted(at=now, job_id="j", attempt=1, node=VICTIM))
        forged = [await attacker.append(ev.JobCompleted(at=now, job_id="j", attempt=1, node=ATTACKER)),
                  await attacker.append(ev.GpusReleased(at=now, job_id="j", reason="process_failed", lost_gpu_s=5000,
                                                        node=ATTACKER))]
        ahead = await attacker.append(registered(ATTACKER, now + 400 * 86_400.0))
        state = await fold_log(admin)  # the services' fold: records with the server's store times
    finally:
        for log in (admin, victim, attacker):
            await log.close()
    job = state.jobs["j"]
    assert (job.state, job.gpus, job.restarts, job.lost_gpu_s) == ("running", [f"{VICTIM}/0", f"{VICTIM}/1"], 0, 0.0)
    assert [(v.seq, v.rule) for v in state.broken] == [(forged[0], "foreign_node"), (forged[1], "foreign_node"),
                                                       (ahead, "clock_ahead")]
    assert now - 5 < state.now < time.time() + 1  # the server's clock, not the forged `at`
    assert state.nodes[ATTACKER].registered_at <= state.now + AT_LEAD_S
    audit = Audit(trust.ring())
    await audit_stream(nats_url, audit)
    assert [(f.seq, f.rule) for f in audit.findings] == [(seq, "foreign_node") for seq in forged]
    assert audit.state.jobs["j"].state == "running"
