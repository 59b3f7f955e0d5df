"""The fold refuses a fact at a writer chain position it applied already (`replayed`), keyed by
the scope of its subject, so that a forged header on one writer's subjects cannot push up the
number of another writer's chain and drop its next genuine fact."""

from __future__ import annotations

from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.core.state import ClusterState, Position
from gpusched.security.signing import writer_scope

PLACEMENT = "U" + "P" * 55
NODE = "U" + "N" * 55


def at(subject: str, signer: str, chain: str, n: int) -> Position:
    return Position(f"{writer_scope(subject)} {signer} {chain}", n)


def granted(state: ClusterState, job: str, gpus: list[str], n: int, signer: str = PLACEMENT) -> None:
    state.apply(ev.GpusGranted(at=3, job_id=job, attempt=1, gpus=gpus),
                position=at(f"gpusched.evt.alloc.GpusGranted.{job}", signer, "c1", n))


def cluster() -> ClusterState:
    s = ClusterState()
    s.apply(ev.NodeRegistered(at=1, node="n0", rack="r", gpus=[GpuInfo(index=i, uuid=f"u{i}") for i in range(4)]))
    for job in ("a", "b"):
        s.apply(ev.JobSubmitted(at=2, job_id=job, spec=JobSpec(team="t", gpus=2)))
    return s


def test_a_copy_of_an_applied_position_is_refused_without_effect_and_the_next_number_is_applied():
    s = cluster()
    granted(s, "a", ["n0/0", "n0/1"], 1)
    release = ev.GpusReleased(at=4, job_id="a", reason="preempted")
    s.apply(release, position=at("gpusched.evt.alloc.GpusReleased.a", "U" + "R" * 55, "r1", 1))
    granted(s, "a", ["n0/0", "n0/1"], 2)
    s.apply(release, position=at("gpusched.evt.alloc.GpusReleased.a", "U" + "R" * 55, "r1", 1))  # the copy
    assert s.jobs["a"].holding and s.jobs["a"].preemptions == 1
    assert [(v.seq, v.rule) for v in s.broken] == [(s.last_seq, "replayed")]
    granted(s, "b", ["n0/2", "n0/3"], 3)
    assert s.jobs["b"].holding


def test_a_forged_number_on_a_nodes_subject_does_not_block_placements_chain():
    s = cluster()
    granted(s, "a", ["n0/0", "n0/1"], 1)
    # a node writes, on its own subject, a fact claiming placement's key and chain at number 1000
    s.apply(ev.NodeRegistered(at=3, node="n0", rack="r", gpus=[GpuInfo(index=i, uuid=f"u{i}") for i in range(4)]),
            position=at("gpusched.evt.info.NodeRegistered.node.n0", PLACEMENT, "c1", 1000))
    granted(s, "b", ["n0/2", "n0/3"], 2)
    assert s.jobs["b"].holding and s.broken == []


def test_the_chain_positions_survive_a_snapshot():
    s = cluster()
    granted(s, "a", ["n0/0", "n0/1"], 1)
    restored = ClusterState.restore(s.snapshot())
    granted(restored, "b", ["n0/2", "n0/3"], 1)  # a copy's number, after a restart from the snapshot
    assert not restored.jobs["b"].holding and [v.rule for v in restored.broken] == ["replayed"]


def test_the_scope_of_a_subject_is_its_kind_and_for_a_node_its_node():
    assert writer_scope("gpusched.evt.alloc.GpusReleased.node.node03") == "GpusReleased.node.node03"
    assert writer_scope("gpusched.evt.alloc.GpusGranted.j-1") == "GpusGranted"
