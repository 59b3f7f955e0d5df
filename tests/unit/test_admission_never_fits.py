"""Admission refuses a job that can never fit the cluster as configured, among the GPUs it may
hold (`--gpu-type`, `--constraint`), at the topology level it requires; drains aside (a drain
ends). Each refusal says why."""

from __future__ import annotations

import pytest

from gpusched.core import events as ev
from gpusched.core.commands import SubmitJob
from gpusched.core.model import GpuInfo, JobSpec, TopologyConstraint
from gpusched.core.state import ClusterState
from gpusched.services.admission import AdmissionConfig, Capacity, admit


def _node(name: str, rack: str, models: list[str], labels: dict[str, str] | None = None) -> ev.NodeRegistered:
    return ev.NodeRegistered(at=0.0, node=name, rack=rack, labels=labels or {},
                             gpus=[GpuInfo(index=i, uuid=f"{name}-{i}", model=m) for i, m in enumerate(models)])


def _state() -> ClusterState:
    """Two H100 nodes in two racks (one in zone b), one 16-GPU A100 node, one mixed node (4 H100 + 4 A100)
    in zone b; an H100 node drained."""
    state = ClusterState()
    for seq, e in enumerate([_node("h1", "r0", ["H100"] * 8), _node("h2", "r1", ["H100"] * 8, {"zone": "b"}),
                             _node("a1", "r0", ["A100"] * 16),
                             _node("m1", "r2", ["H100"] * 4 + ["A100"] * 4, {"zone": "b"}),
                             ev.NodeDrained(at=1.0, node="h1", reason="maintenance")], start=1):
        state.apply(e, seq)
    return state


CASES = {  # name: (spec, the refusal or None)
    "every H100 in the cluster, a drained node's too": (JobSpec(team="a", gpus=20, gpu_type="h100"), None),
    "one H100 more than there are": (
        JobSpec(team="a", gpus=21, gpu_type="H100"),
        "the cluster has 20 GPUs matching gpu_type=H100 (drains aside); the job needs 21"),
    "16 H100 within one rack": (
        JobSpec(team="a", gpus=16, gpu_type="H100", topology=TopologyConstraint(required="rack", preferred="node")),
        "spec.topology.required is rack, but the largest rack has 8 GPUs matching gpu_type=H100; the job needs 16"),
    "9 H100 on one node of zone b": (
        JobSpec(team="a", gpus=9, gpu_type="H100", constraints={"zone": "b"},
                topology=TopologyConstraint(required="node", preferred="node")),
        "spec.topology.required is node, but the largest node has 8 GPUs matching gpu_type=H100,zone=b; "
        "the job needs 9"),
    "12 H100 across zone b": (JobSpec(team="a", gpus=12, gpu_type="H100", constraints={"zone": "b"}), None),
    "an elastic job whose minimum fits": (JobSpec(team="a", gpus=32, min_gpus=8, gpu_type="A100"), None),
    "a job that asks for nothing, bigger than a node": (JobSpec(team="a", gpus=24), None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_job_that_can_never_fit_is_refused_saying_why(name):
    spec, refusal = CASES[name]
    d = admit(_state(), SubmitJob(request_id="r", spec=spec), 2.0, AdmissionConfig(auto_create_teams=True,
                                                                                   placeholders="any"), Capacity())
    if refusal is None:
        assert d.reply.ok, d.reply.error
    else:
        assert not d.reply.ok and d.reply.error.startswith(refusal), d.reply.error
        assert isinstance(d.event, ev.JobRejected)  # kept for audit
