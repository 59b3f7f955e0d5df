"""`policy.explain`: why a job waits, as a table of small clusters."""

from __future__ import annotations

import pytest

from gpusched.cli.render import _why_lines
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec, TeamQuota, TopologyConstraint
from gpusched.core.state import fold
from gpusched.policy.config import PRESETS
from gpusched.policy.explain import explain_pending, explain_preemptions


def _cluster(nodes=2, gpus=4):
    return [ev.NodeRegistered(at=0, node=f"n{i}", rack=f"r{i}", gpus=[GpuInfo(index=g, uuid=f"{i}-{g}") for g in range(gpus)])
            for i in range(nodes)]


def _run(job_id, team, gpus_, at, time_limit=None, preemptible=False, on=()):
    return [ev.JobSubmitted(at=at, job_id=job_id, spec=JobSpec(team=team, gpus=gpus_, time_limit_s=time_limit,
                                                              preemptible=preemptible)),
            ev.GpusGranted(at=at, job_id=job_id, attempt=1, gpus=list(on))]


CASES = {
    "team limit stops it": dict(
        events=[ev.TeamQuotaSet(at=0, team="a", quota=TeamQuota(guaranteed=2, limit=4)),
                *_run("r1", "a", 4, 1, time_limit=100, on=[f"n0/{i}" for i in range(4)]),
                ev.JobSubmitted(at=2, job_id="w", spec=JobSpec(team="a", gpus=2))],
        limit_blocks=True, fits=["cluster"], eta=99.0, unblock="limit be raised to 6"),
    "no node has room": dict(
        events=[*_run("r1", "b", 3, 1, time_limit=50, on=["n0/0", "n0/1", "n0/2"]),
                *_run("r2", "b", 2, 1, time_limit=20, on=["n1/0", "n1/1"]),
                ev.JobSubmitted(at=10, job_id="w", spec=JobSpec(team="a", gpus=3, topology=TopologyConstraint(required="node")))],
        limit_blocks=False, fits=[], eta=11.0, unblock="1 more GPU(s) free in node n1: held by r2 (2)"),
    "fits now": dict(
        events=[ev.JobSubmitted(at=1, job_id="w", spec=JobSpec(team="a", gpus=2))],
        limit_blocks=False, fits=["cluster"], eta=0.0, unblock="should start on the next placement cycle"),
    "can never fit": dict(
        events=[ev.JobSubmitted(at=1, job_id="w", spec=JobSpec(team="a", gpus=6, topology=TopologyConstraint(required="node")))],
        limit_blocks=False, fits=[], eta=None, unblock="it can never fit"),
    "holders without time limit: unknown start": dict(
        events=[*_run("r1", "b", 8, 1, on=[f"n{n}/{g}" for n in range(2) for g in range(4)]),
                ev.JobSubmitted(at=2, job_id="w", spec=JobSpec(team="a", gpus=1))],
        limit_blocks=False, fits=[], eta=None, unblock="1 more GPU(s) free: held by r1 (8)"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_explain_pending(name):
    case = CASES[name]
    state = fold([*_cluster(), *case["events"]])
    x = explain_pending(state, "w")
    assert x["team_quota"]["limit_blocks"] is case["limit_blocks"]
    assert x["topology"]["fits_now_in"] == case["fits"]
    assert x["eta_s"] == case["eta"]
    assert any(case["unblock"] in u for u in x["unblock"]), x["unblock"]
    assert x["summary"]


def test_explain_preemptions_names_beneficiary_checkpoint_and_loss():
    history = list(enumerate([
        ev.CheckpointSaved(at=5, job_id="v", attempt=1, path="/c/1", step=10),
        ev.PreemptionRequested(at=6, job_id="v", for_job="hi", reason="priority", deadline=9),
        ev.CheckpointSaved(at=7, job_id="v", attempt=1, path="/c/2", step=12),
        ev.GpusReleased(at=7.5, job_id="v", reason="preempted", lost_gpu_s=2.0),
        ev.PreemptionRequested(at=20, job_id="v", for_job="hi2", reason="fair share", deadline=23),
        ev.GpusReleased(at=23, job_id="v", reason="preempted", forced=True, lost_gpu_s=30.0),
    ], 1))
    first, second = explain_preemptions(history)
    assert (first["for_job"], first["checkpoint"]["step"], first["checkpoint"]["on_request"], first["lost_gpu_s"]) == ("hi", 12, True, 2.0)
    assert (second["for_job"], second["forced"], second["checkpoint"]["step"], second["checkpoint"]["on_request"]) == ("hi2", True, 12, False)


# --- "may reclaim N": what the policy's preemption rules would take, no more ------------------

def _reclaim_case(b_jobs):
    """Team a, under its guarantee of 4, waits for 4 (`w`; 5 with two b jobs); team b, guaranteed 4,
    runs `b_jobs` (preemptible, sizes), team c the rest of the 8 GPUs, not preemptible."""
    gpus, events = [f"n{n}/{g}" for n in range(2) for g in range(4)], []
    for i, size in enumerate(b_jobs):
        events += _run(f"b{i}", "b", size, 1, preemptible=True, on=gpus[:size])
        gpus = gpus[size:]
    events += _run("c0", "c", len(gpus), 1, on=gpus)
    return fold([*_cluster(), *(ev.TeamQuotaSet(at=0, team=t, quota=TeamQuota(guaranteed=4)) for t in "abc"),
                 *events, ev.JobSubmitted(at=2, job_id="w", spec=JobSpec(team="a", gpus=5 if len(b_jobs) > 1 else 4))])


def test_a_team_at_its_guarantee_is_not_reclaimable():
    # b holds exactly its guarantee: reclaim takes nothing from it (the old count said 4, and
    # `show` "under its guarantee: may reclaim from over-share teams")
    x = explain_pending(_reclaim_case([4]), "w", now=1000.0)
    assert x["team_quota"]["under_guarantee"] and x["reclaimable_gpus"] == 0 and x["reclaimable_by_team"] == {}
    lines = " ".join(_why_lines(x, {"state": "pending", "submitted_at": 2.0}, 1000.0))
    assert "may reclaim" not in lines and "reclaimable GPU" not in " ".join(x["unblock"])


def test_reclaim_counts_one_set_not_each_victim_alone():
    # b holds 6 of its 4 in two 3-GPU jobs: taking one leaves b under its guarantee, so the
    # rule takes the second no more (each alone, both were takeable: the old count said 6)
    x = explain_pending(_reclaim_case([3, 3]), "w", now=1000.0)
    assert x["reclaimable_gpus"] == 3 and x["reclaimable_by_team"] == {"b": 3}
    lines = " ".join(_why_lines(x, {"state": "pending", "submitted_at": 2.0}, 1000.0))
    assert "under its guarantee: may reclaim from over-share teams" in lines


def test_nothing_is_reclaimable_where_the_policy_never_preempts():
    x = explain_pending(_reclaim_case([3, 3]), "w", now=1000.0, config=PRESETS["fifo"])
    assert x["reclaimable_gpus"] == 0
