"""CPUs and memory as resources (policy/resources.py): the fold counts each job's per-node amounts
on every node it holds GPUs of, the filter keeps a job off nodes without them free, the cycle
never overbooks a node within one cycle, and a job that waits for them says so."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec, TopologyConstraint
from gpusched.core.reasons import NoFreeCpuMem, NoNodeCpuMem, NoRoom, Topology
from gpusched.core.rules import BatchCheck
from gpusched.policy.placement import Pool
from gpusched.policy.placer import FILTERS, Placer
from gpusched.policy.resources import by_resources, hold, never_fits

from .policy_helpers import Scenario, gpus, grants


def _cluster(*nodes: tuple[str, float, int], gpus_per_node: int = 8) -> Scenario:
    """Nodes (name, CPUs, MiB) in one rack; 0 means not declared."""
    s = Scenario(racks=0)
    for name, cpus, mem in nodes:
        infos = [GpuInfo(index=i, uuid=f"{name}-{i}") for i in range(gpus_per_node)]
        s.apply(ev.NodeRegistered(at=0.0, node=name, rack="r0", gpus=infos, nvlink="all", cpus=cpus, memory_mb=mem))
    return s


def _spec(n: int = 1, cpus: float | None = None, mem: int | None = None, required: str = "cluster") -> JobSpec:
    return JobSpec(team="a", gpus=n, cpus=cpus, memory_mb=mem, topology=TopologyConstraint(required=required))


def test_the_filter_is_on_the_seam():
    assert by_resources in FILTERS


def test_the_fold_counts_a_job_on_each_node_it_holds_and_frees_it_when_it_ends():
    s = _cluster(("n0", 16, 65536), ("n1", 16, 65536))
    s.run("j", gpus("n0", 0, 1) + gpus("n1", 0), cpus=6, memory_mb=1000)
    n0, n1 = s.state.nodes["n0"], s.state.nodes["n1"]
    assert (n0.cpus_used, n0.memory_used_mb, n1.cpus_used, n1.memory_used_mb) == (6, 1000, 6, 1000)  # per node, not per GPU
    s.finish("j", at=1.0)
    assert (n0.cpus_used, n0.memory_used_mb, n1.cpus_used) == (0, 0, 0)


def test_a_resize_counts_only_the_nodes_a_job_enters_or_leaves():
    s = _cluster(("n0", 16, 0), ("n1", 16, 0))
    s.run("e", gpus("n0", 0), cpus=4, min_gpus=1, size=4)
    s.apply(ev.JobResized(at=1.0, job_id="e", added=gpus("n0", 1) + gpus("n1", 0)))
    assert (s.state.nodes["n0"].cpus_used, s.state.nodes["n1"].cpus_used) == (4, 4)
    s.apply(ev.JobResized(at=2.0, job_id="e", removed=gpus("n1", 0)))
    assert (s.state.nodes["n0"].cpus_used, s.state.nodes["n1"].cpus_used) == (4, 0)


def test_a_requeue_after_a_lost_node_frees_its_cpus():
    s = _cluster(("n0", 16, 0))
    s.run("j", gpus("n0", 0), cpus=10)
    s.apply(ev.NodeLost(at=1.0, node="n0", reason="silent"))
    assert s.state.nodes["n0"].cpus_used == 0


# name: (nodes (name, CPUs, MiB, GPUs busy by a job of `busy_cpus`), job spec, nodes left usable)
FILTER_CASES = {
    "asks nothing: every node": ([("n0", 4, 0), ("n1", 4, 0)], _spec(1), {"n0", "n1"}),
    "CPUs: only the node with enough": ([("n0", 4, 0), ("n1", 32, 0)], _spec(1, cpus=8), {"n1"}),
    "memory: only the node with enough": ([("n0", 0, 1024), ("n1", 0, 8192)], _spec(1, mem=4096), {"n1"}),
    "both must hold": ([("n0", 32, 1024), ("n1", 4, 8192), ("n2", 32, 8192)], _spec(1, cpus=8, mem=4096), {"n2"}),
    "an undeclared node is not counted": ([("n0", 0, 0), ("n1", 4, 0)], _spec(1, cpus=8), {"n0"}),
    "fractions add up exactly": ([("n0", 0.3, 0)], _spec(1, cpus=0.3), {"n0"}),
}


@pytest.mark.parametrize("name", list(FILTER_CASES))
def test_the_filter_keeps_only_nodes_that_hold_the_per_node_amounts(name):
    nodes, spec, usable = FILTER_CASES[name]
    s = _cluster(*nodes)
    pool = by_resources(Pool(s.state), spec, None)
    assert {n for n in s.state.nodes if pool.n_free(n) > 0} == usable


def test_what_running_jobs_and_this_cycle_hold_counts_and_a_release_gives_it_back():
    s = _cluster(("n0", 16, 0), ("n1", 16, 0))
    s.run("big", gpus("n0", 0), cpus=12)
    pool = Pool(s.state)
    spec = _spec(1, cpus=8)
    assert {n for n in s.state.nodes if by_resources(pool, spec, None).n_free(n)} == {"n1"}
    for i in (0, 1):  # this cycle granted two such jobs on n1 (as `CyclePlan.grant` does)
        pool.take(gpus("n1", i))
        hold(pool, spec, gpus("n1", i))
    assert by_resources(pool, spec, None).count == 0
    hold(pool, s.state.jobs["big"].spec, gpus("n0", 0), -1)  # a what-if: big leaves n0
    assert {n for n in s.state.nodes if by_resources(pool, spec, None).n_free(n)} == {"n0"}


def test_a_gang_over_several_nodes_needs_its_amounts_on_each():
    """Two 8-GPU nodes with 16 CPUs and one with 4: a 16-GPU gang asking 8 CPUs per node takes
    the two big nodes, never the small one, though the small one has the free GPUs."""
    s = _cluster(("small", 4, 0), ("a", 16, 0), ("b", 16, 0))
    p = Placer("topo").place(Pool(s.state), _spec(16, cpus=8), 16)
    assert p is not None and {g.split("/")[0] for g in p.gpus} == {"a", "b"}
    assert Placer("topo").place(Pool(s.state), _spec(17, cpus=8), 17) is None


def test_one_cycle_never_overbooks_a_nodes_cpus():
    """Four 1-GPU jobs of 6 CPUs each on one 8-GPU node of 16 CPUs: two start, two wait, saying why."""
    s = _cluster(("n0", 16, 0))
    for i in range(4):
        s.submit(f"j{i}", gpus=1, cpus=6)
    out = s.cycle("fifo")
    assert set(grants(out)) == {"j0", "j1"}
    assert s.state.nodes["n0"].cpus_used == 12
    why = s.state.jobs["j2"].pending_why
    assert isinstance(why, NoFreeCpuMem)
    assert s.state.jobs["j2"].pending_reason == "fits on GPUs but no node has 6 CPUs free (per node; needs 1 GPUs)"


def test_a_job_waiting_for_gpus_keeps_the_gpu_reason():
    s = _cluster(("n0", 64, 0), gpus_per_node=2)
    s.run("x", gpus("n0", 0, 1), cpus=1)
    s.submit("j", gpus=1, cpus=4)
    s.cycle("fifo")
    assert isinstance(s.state.jobs["j"].pending_why, (NoRoom, Topology))  # the head's detail is Topology


def test_a_job_no_node_can_ever_hold_says_so_and_blocks_nobody():
    s = _cluster(("n0", 2, 4096), ("n1", 2, 4096))
    s.submit("huge", gpus=1, cpus=64)
    s.submit("small", gpus=1, cpus=1)
    out = s.cycle("fifo")
    assert set(grants(out)) == {"small"}  # strict FIFO, yet the never-fitting job does not block
    why = s.state.jobs["huge"].pending_why
    assert isinstance(why, NoNodeCpuMem)
    assert "no node can hold 64 CPUs per node for 1 GPUs (the largest node offers 2 CPUs)" == why.text


# name: (nodes, spec, never fits)
NEVER = {
    "fits one node": ([("n0", 64, 0)], _spec(1, cpus=64), False),
    "more than any node": ([("n0", 8, 0), ("n1", 8, 0)], _spec(1, cpus=9), True),
    "a gang over the capable nodes": ([("n0", 8, 0), ("n1", 64, 0)], _spec(16, cpus=32), True),
    "a gang that fits the capable nodes": ([("n0", 64, 0), ("n1", 64, 0)], _spec(16, cpus=32), False),
    "within one node, two capable nodes are not enough": ([("n0", 64, 0), ("n1", 64, 0)],
                                                         _spec(9, cpus=32, required="node"), True),
    "an undeclared node may hold it": ([("n0", 8, 0), ("n1", 0, 0)], _spec(1, cpus=64), False),
    "memory": ([("n0", 0, 1024)], _spec(1, mem=2048), True),
}


@pytest.mark.parametrize("name", list(NEVER))
def test_never_fits(name):
    nodes, spec, never = NEVER[name]
    s = _cluster(*nodes)
    assert (never_fits(s.state, spec) is not None) == never


def test_the_writers_recheck_refuses_a_batch_that_overbooks_a_node():
    s = _cluster(("n0", 8, 0))
    s.submit("a", gpus=1, cpus=6)
    s.submit("b", gpus=1, cpus=6)
    check = BatchCheck(s.state)
    assert check.problem(ev.GpusGranted(at=1.0, job_id="a", attempt=1, gpus=gpus("n0", 0))) is None
    assert check.problem(ev.GpusGranted(at=1.0, job_id="b", attempt=1, gpus=gpus("n0", 1))) == \
        "grant of 6 CPUs on node n0 with 2 free"
    assert check.problem(ev.GpusReleased(at=1.0, job_id="a", reason="preempted")) is not None  # a is not holding yet


def test_the_preemptors_what_if_frees_the_victims_cpus_with_its_gpus():
    """A high-priority job needs the GPUs and the CPUs a preemptible low job holds on the only
    node: the what-if counts the victim's CPUs as leaving with its GPUs, so it preempts."""
    s = _cluster(("n0", 16, 0), gpus_per_node=2)
    s.run("low", gpus("n0", 0, 1), cpus=12, preemptible=True, priority="low", at=0.0)
    s.submit("high", gpus=1, cpus=8, priority="high", at=1000.0)  # past the victim's minimum runtime
    out = s.cycle("full")
    assert any(isinstance(e, ev.PreemptionRequested) and e.job_id == "low" for e in out)


def test_a_restarted_agent_may_offer_other_amounts_and_one_declaring_none_keeps_them():
    s = _cluster(("n0", 16, 4096))
    infos = [GpuInfo(index=i, uuid=f"n0-{i}") for i in range(8)]
    s.apply(ev.NodeLost(at=1.0, node="n0", reason="silent"),
            ev.NodeRegistered(at=2.0, node="n0", rack="r0", gpus=infos, cpus=12, memory_mb=2048))
    assert (s.state.nodes["n0"].cpus, s.state.nodes["n0"].memory_mb) == (12, 2048)
    s.apply(ev.NodeRegistered(at=3.0, node="n0", rack="r0", gpus=infos))  # an old agent: declares nothing
    assert (s.state.nodes["n0"].cpus, s.state.nodes["n0"].memory_mb) == (12, 2048)


def test_the_simulator_schedules_cpus_where_the_nodes_declare_them():
    """One 8-GPU node of 16 CPUs: a 12-CPU and an 8-CPU job of 100 s each run one after the
    other; with the node's CPUs not declared, side by side."""
    from gpusched.policy.config import PRESETS
    from gpusched.sim.engine import Cluster, Simulation
    from gpusched.sim.runtime_model import IDEAL
    from gpusched.sim.traces import TraceJob

    jobs = [TraceJob("a", 0, 100, 1, "x", cpus=12), TraceJob("b", 0, 100, 1, "x", cpus=8)]
    for cluster, b_start in ((Cluster(1, 1, 8, cpus=16), 100), (Cluster(1, 1, 8), 0)):
        sim = Simulation(jobs, cluster, PRESETS["fifo"], IDEAL, policy_name="fifo")
        sim.run()
        assert (sim.runs["a"].first_start, sim.runs["b"].first_start) == (0, b_start)


def test_the_alibaba_loader_reads_each_pods_cpus_and_memory(tmp_path):
    from gpusched.sim.traces import load_alibaba

    path = tmp_path / "openb_pod_list_x.csv"
    path.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,"
                    "deletion_time,scheduled_time\n"
                    "p0,12000,16384,1,1000,,LS,Running,0,100,0\n"
                    "p1,0,0,2,1000,,BE,Running,5,50,10\n")
    a, b = load_alibaba(path)
    assert (a.cpus, a.memory_mb, b.cpus, b.memory_mb) == (12.0, 16384, None, None)


def test_the_node_read_model_shows_what_a_node_offers_and_holds():
    from gpusched.readmodel import node_doc

    s = _cluster(("n0", 16, 4096))
    s.run("j", gpus("n0", 0), cpus=6, memory_mb=1024)
    doc = node_doc(s.state, "n0")
    assert (doc["cpus"], doc["cpus_used"], doc["memory_mb"], doc["memory_used_mb"]) == (16, 6, 4096, 1024)


def _admit(s: Scenario, spec: JobSpec) -> str | None:
    from gpusched.core.commands import SubmitJob
    from gpusched.services.admission import AdmissionConfig, Capacity, submit_problem

    return submit_problem(s.state, SubmitJob(request_id="r1", spec=spec), AdmissionConfig(auto_create_teams=True, placeholders="any"),
                          Capacity())


def test_admission_gives_the_teams_default_cpus_and_memory_and_keeps_what_a_job_asks():
    from gpusched.core.model import TeamQuota
    from gpusched.services.admission import with_defaults

    s = _cluster(("n0", 16, 65536))
    s.apply(ev.TeamQuotaSet(at=0.0, team="a", quota=TeamQuota(default_cpus=4, default_memory_mb=8192,
                                                                default_time_limit_s=3600)))
    got = with_defaults(s.state, _spec(1))
    assert (got.cpus, got.memory_mb, got.time_limit_s) == (4, 8192, 3600)
    got = with_defaults(s.state, _spec(1, cpus=2))
    assert (got.cpus, got.memory_mb) == (2, 8192)


def test_admission_refuses_a_job_no_node_can_ever_hold_precisely():
    from gpusched.core.model import TeamQuota

    s = _cluster(("n0", 16, 65536), ("n1", 32, 65536))
    assert _admit(s, _spec(1, cpus=32)) is None
    assert _admit(s, _spec(1, cpus=33)) == (
        "no node can hold 33 CPUs per node for 1 GPUs (the largest node offers 32 CPUs): "
        "ask less per node (--cpus, --mem) or spread the job over more nodes")
    assert "no node can hold 32 CPUs and 128G memory per node" in _admit(s, _spec(1, cpus=32, mem=131072))
    s.apply(ev.TeamQuotaSet(at=0.0, team="a", quota=TeamQuota(default_memory_mb=131072)))
    assert "128G memory" in _admit(s, _spec(1))  # the team's default counts


def test_an_agent_offers_the_host_unless_told_and_simulated_nodes_nothing():
    import argparse

    from gpusched.services.nodeagent.main import host_resources, resources_from_args

    cpus, mem = host_resources()
    assert cpus is not None and cpus >= 1 and mem is not None and mem > 0
    args = argparse.Namespace(cpus=None, mem=None)
    assert resources_from_args(args, one_host=True) == {"cpus": cpus, "memory_mb": mem}
    assert resources_from_args(args, one_host=False) == {"cpus": None, "memory_mb": None}
    told = argparse.Namespace(cpus=6.0, mem="12G")
    assert resources_from_args(told, one_host=True) == {"cpus": 6.0, "memory_mb": 12288}
    assert resources_from_args(argparse.Namespace(cpus=0.0, mem="0"), one_host=True) == {"cpus": None, "memory_mb": None}
    with pytest.raises(SystemExit, match="--mem 'lots' is not a size"):
        resources_from_args(argparse.Namespace(cpus=None, mem="lots"), one_host=True)


def test_without_nodes_drops_every_placeable_gpu_of_a_node_at_once():
    s = _cluster(("n0", 0, 0), ("n1", 0, 0))
    s.run("x", gpus("n0", 0, 1))
    pool = Pool(s.state)
    pool.take(gpus("n0", 2))
    pool.add(gpus("n0", 0))  # released this cycle
    cut = pool.without_nodes(["n0"])
    assert cut.n_free("n0") == 0 and cut.free_on("n0") == [] and cut.count == 8
    assert pool.n_free("n0") == 6 and pool.count == 14  # the original is untouched


def test_alike_jobs_share_one_filtered_pool_until_the_pool_changes():
    s = _cluster(("n0", 4, 0), ("n1", 16, 0))
    pool = Pool(s.state)
    first = by_resources(pool, _spec(1, cpus=8), None)
    assert by_resources(pool, _spec(2, cpus=8), None) is first  # same per-node amounts
    assert by_resources(pool, _spec(1, cpus=2), None) is pool  # no node short
    pool.take(gpus("n1", 0))
    hold(pool, _spec(1, cpus=8), gpus("n1", 0))
    again = by_resources(pool, _spec(1, cpus=8), None)
    assert again is not first and again.n_free("n1") == 7  # 8 of 16 CPUs left on n1
    hold(pool, _spec(1, cpus=1), gpus("n1", 0))
    assert by_resources(pool, _spec(1, cpus=8), None).count == 0


@st.composite
def _worlds(draw):
    nodes = [(f"n{i}", float(draw(st.sampled_from([4, 8, 16]))), draw(st.sampled_from([0, 4096, 16384])))
             for i in range(draw(st.integers(1, 4)))]
    jobs = [dict(gpus=draw(st.integers(1, 6)), cpus=draw(st.sampled_from([None, 1.0, 2.5, 4.0, 8.0])),
                 mem=draw(st.sampled_from([None, 1024, 8192])), preemptible=draw(st.booleans()),
                 priority=draw(st.sampled_from(["high", "normal", "low"])),
                 required=draw(st.sampled_from(["node", "cluster"])), min_gpus=draw(st.sampled_from([None, 1])))
            for _ in range(draw(st.integers(1, 10)))]
    preset = draw(st.sampled_from(["fifo", "gang", "preempt", "full", "tiresias", "naive"]))
    return nodes, jobs, preset, draw(st.lists(st.integers(0, 2**16), min_size=1, max_size=6))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_worlds())
def test_no_policy_ever_overbooks_a_nodes_cpus_or_memory(w):
    """Every preset (and the fallback) on random nodes and jobs: what the jobs holding a node's
    GPUs ask never exceeds what it offers, the fold's count is that sum, and the writer's
    re-check accepts every decision."""
    from gpusched.policy.config import PRESETS
    from gpusched.policy.cycle import cycle, naive_cycle

    nodes, jobs, preset, steps = w
    s = _cluster(*nodes, gpus_per_node=4)
    st_ = s.state
    for i, j in enumerate(jobs):
        s.submit(f"j{i}", gpus=j["gpus"], cpus=j["cpus"], memory_mb=j["mem"], preemptible=j["preemptible"],
                 priority=j["priority"], required=j["required"],
                 min_gpus=j["min_gpus"] if j["min_gpus"] and j["gpus"] > 1 else None)
    now = 0.0
    for luck in steps:
        now += 100.0
        for k, jid in enumerate(list(st_.running)):
            job = st_.jobs[jid]
            if (luck >> (k % 16)) & 1:
                st_.apply(ev.JobCompleted(at=now, job_id=jid, attempt=job.attempt))
            elif job.preemption is not None:
                st_.apply(ev.CheckpointSaved(at=now, job_id=jid, attempt=job.attempt, path="p", step=1))
        decided = naive_cycle(st_, now) if preset == "naive" else cycle(st_, now, PRESETS[preset])
        check = BatchCheck(st_)
        assert [(e, p) for e in decided if (p := check.problem(e))] == []
        for e in decided:
            st_.apply(e)
        assert st_.violations() == []
        for name, node in st_.nodes.items():
            holding = [st_.jobs[j] for j in st_.running if any(g.startswith(f"{name}/") for g in st_.jobs[j].gpus)]
            cpus = sum(j.spec.cpus or 0 for j in holding)
            mem = sum(j.spec.memory_mb or 0 for j in holding)
            assert node.cpus_used == pytest.approx(cpus) and node.memory_used_mb == mem, name
            assert cpus <= node.cpus + 1e-6 and (not node.memory_mb or mem <= node.memory_mb), (name, cpus, mem)


def test_explain_says_what_would_let_a_job_waiting_for_cpus_start():
    from gpusched.policy.explain import explain_pending

    s = _cluster(("n0", 4, 0))
    s.run("big", gpus("n0", 0), cpus=3)
    s.submit("w", gpus=1, cpus=2)
    s.cycle("fifo")
    unblock = explain_pending(s.state, "w")["unblock"]
    assert unblock == ["fits on GPUs but no node has 2 CPUs free (per node; needs 1 GPUs): it starts when jobs on "
                       "nodes with free GPUs end and free them"]


def test_a_node_declaring_its_cpus_late_counts_the_jobs_already_on_it():
    """A state from before the count (or a node that declared nothing): the jobs holding its
    GPUs count as soon as it declares what it offers."""
    s = _cluster(("n0", 0, 0))
    s.run("j", gpus("n0", 0, 1), cpus=3, memory_mb=512)
    s.state.nodes["n0"].cpus_used = 0.0  # as an older snapshot restores it
    infos = [GpuInfo(index=i, uuid=f"n0-{i}") for i in range(8)]
    s.apply(ev.NodeRegistered(at=1.0, node="n0", rack="r0", gpus=infos, cpus=8, memory_mb=4096))
    n0 = s.state.nodes["n0"]
    assert (n0.cpus, n0.cpus_used, n0.memory_used_mb) == (8, 3, 512)


def test_the_filtered_pool_is_never_reused_after_the_pool_changed_at_the_same_count():
    """A take and a release of other GPUs leave the free count as it was: the memo must still
    see the change (a stale copy would offer the GPU just taken)."""
    s = _cluster(("n0", 4, 0), ("n1", 16, 0))
    s.run("x", gpus("n1", 7))
    pool = Pool(s.state)
    first = by_resources(pool, _spec(1, cpus=8), None)
    pool.take(gpus("n1", 0))
    pool.add(gpus("n1", 7))  # x released this cycle (asked no CPUs): same count, other GPUs
    again = by_resources(pool, _spec(1, cpus=8), None)
    assert again is not first and "n1/0" not in again.free_on("n1") and "n1/7" in again.free_on("n1")


def test_a_job_waiting_for_cpus_alone_preempts_a_preemptible_cpu_hog_by_the_same_rules():
    """Free GPUs, but the only node's CPUs held by a low-priority preemptible job: a high one
    asks it to yield (a non-preemptible holder, or a job of the same class, is never taken)."""
    for hog, preempted in (({"preemptible": True, "priority": "low"}, True),
                           ({"preemptible": False, "priority": "low"}, False),
                           ({"preemptible": True, "priority": "high"}, False)):
        s = _cluster(("n0", 16, 0))
        s.run("hog", gpus("n0", 0), cpus=12, at=0.0, **hog)
        s.submit("high", gpus=1, cpus=8, priority="high", at=1000.0)
        out = s.cycle("preempt")
        asked = [e.job_id for e in out if isinstance(e, ev.PreemptionRequested)]
        assert asked == (["hog"] if preempted else []), hog
        if not preempted:
            assert isinstance(s.state.jobs["high"].pending_why, NoFreeCpuMem)
