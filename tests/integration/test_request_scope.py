"""Request ids are the client's, unique only among its own requests: two teams (or two users)
that pick the same one each get their own job. Before, admission derived the job id and the
`Nats-Msg-Id` from the bare request id, so the second team's submit was answered `ok` with the
first team's job and seq (JetStream's dedupe) and no job of its own: an acknowledged submit lost.
Through a real nats-server with the generated permissions and a real admission process."""

from __future__ import annotations

import asyncio

import pytest

from gpusched.bus.control_client import Client, ControlPlaneUnavailable, NotPermitted
from gpusched.bus.log import connect
from gpusched.core.model import JobSpec
from gpusched.security import identity

from ..e2e.harness import harness  # noqa: F401

PEOPLE = {"rs-alice": ("tenant", ["nlp"]), "rs-bob": ("tenant", ["vision"]), "rs-carol": ("tenant", ["nlp"])}


@pytest.fixture(scope="module")
def people(trust):
    for name, (role, teams) in PEOPLE.items():
        if trust.get(name) is None:
            trust.add(name, role, teams=teams)
    if trust.get("rs-node") is None:
        trust.add("rs-node", "node", node="node07")
    return {name: trust.creds(name) for name in (*PEOPLE, "rs-node")}


async def test_the_same_request_id_from_two_teams_at_once_makes_two_jobs_every_time(people, harness, tmp_path):  # noqa: F811
    harness.start("admission")
    await harness.ready("admission")
    url = harness.nats_url
    async with await Client.connect(url, creds=str(people["rs-alice"])) as alice, \
            await Client.connect(url, creds=str(people["rs-bob"])) as bob, \
            await Client.connect(url, creds=str(people["rs-carol"])) as carol:
        rounds = 100
        replies = await asyncio.gather(*[c.submit(JobSpec(team=team, gpus=1), request_id=f"same-{i}")
                                         for i in range(rounds)
                                         for c, team in ((alice, "nlp"), (bob, "vision"), (carol, "nlp"))])
        for i in range(rounds):
            a, b, c = replies[3 * i:3 * i + 3]
            assert a.ok and b.ok and c.ok, (a.error, b.error, c.error)
            assert not (a.duplicate or b.duplicate or c.duplicate), i
            assert len({a.job_id, b.job_id, c.job_id}) == 3 and len({a.seq, b.seq, c.seq}) == 3, i
        # a retry is still the same job, for each of them
        again = await asyncio.gather(alice.submit(JobSpec(team="nlp", gpus=1), request_id="same-0"),
                                     bob.submit(JobSpec(team="vision", gpus=1), request_id="same-0"))
        assert [r.job_id for r in again] == [r.job_id for r in replies[:2]] and all(r.duplicate for r in again)
        # carol (alice's team) retrying after bob reused the id: still her own job
        retry = await carol.submit(JobSpec(team="nlp", gpus=1), request_id="same-0")
        assert retry.duplicate and retry.job_id == replies[2].job_id
        with pytest.raises(NotPermitted):  # bob cannot reach nlp's request ids
            await bob.submit(JobSpec(team="nlp", gpus=1), request_id="same-0")
    async with await Client.connect(url, creds=str(people["rs-node"]), timeout=0.5) as node:
        with pytest.raises(ControlPlaneUnavailable):  # a node's credential submits nothing: the server drops it
            await node.submit(JobSpec(team="nlp", gpus=1), request_id="same-0")
    stranger = identity.create("rs-stranger", "tenant", tmp_path, teams=["nlp"]).seed_file
    with pytest.raises(PermissionError):  # a key the server never heard of: no connection at all
        await connect(url, creds=str(stranger), max_reconnect_attempts=0)
    state = await harness.wait_for("every submit folded", lambda s: len(s.jobs) >= 3 * rounds and s)
    assert len(state.jobs) == 3 * rounds  # and not one more (the refused ones made none)
    teams = [state.jobs[r.job_id].spec.team for r in replies]
    users = [state.jobs[r.job_id].user for r in replies]
    assert teams == ["nlp", "vision", "nlp"] * rounds
    assert users == ["rs-alice", "rs-bob", "rs-carol"] * rounds
