"""MIG slices (docs/gpu-sharing.md#mig-slices): the admin's geometry only on idle GPUs, slices packed on
GPUs already partitioned (fewest partly used), never mixed with whole GPUs or shares, the
writer's re-check, and the charge by compute slices."""

from __future__ import annotations

import pytest

from gpusched.core import events as ev
from gpusched.core import limits
from gpusched.core.commands import SetMigGeometry
from gpusched.core.mig import published_profiles
from gpusched.core.model import GpuInfo, JobSpec, gpu_id
from gpusched.core.rules import BatchCheck
from gpusched.core.state import ClusterState
from gpusched.policy.config import PRESETS
from gpusched.services.admission import Capacity, mig_geometry_problem
from gpusched.services.nodeagent.backends import SimBackend

from .policy_helpers import run_full_cycle as run_cycle
from .policy_helpers import submit_one as submit

FULL = PRESETS["full"]
H100 = 80 * 1024


def cluster(gpus: int = 3, mig: bool = True) -> ClusterState:
    """One node of H100 80GB GPUs, in MIG mode as the simulated backend reports them."""
    infos = SimBackend("n0", gpus, model="H100", memory_mb=H100, mig=mig).mig()
    st = ClusterState()
    st.apply(ev.NodeRegistered(at=0, node="n0", rack="r0", block=None, gpus=[
        GpuInfo(index=i, uuid=f"GPU-{i}", model="H100", memory_mb=H100, mig=infos[i] if mig else None)
        for i in range(gpus)]))
    return st


def partition(st: ClusterState, index: int, profiles: list[str], at: float = 0.5) -> None:
    assert mig_geometry_problem(st, SetMigGeometry(request_id="r", node="n0", gpu=index, profiles=profiles)) is None
    st.apply(ev.MigGeometrySet(at=at, gpu=gpu_id("n0", index), profiles=profiles))


def test_the_simulated_h100_offers_the_published_profiles():
    assert [p.name for p in published_profiles("H100", H100)] == [
        "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]


def test_slices_pack_onto_the_partly_used_gpu_and_open_an_untouched_one_only_when_it_is_full():
    st = cluster()
    partition(st, 0, ["1g.10gb"] * 7)
    partition(st, 1, ["3g.40gb", "1g.10gb", "1g.10gb", "1g.10gb"])
    submit(st, "m0", mig="1g.10gb")
    run_cycle(st, 2)
    first = st.jobs["m0"].gpus[0]
    # both partitioned GPUs were untouched: the best fit is GPU 1 (3 free 1g slices, not 7)
    assert first == "n0/1" and st.jobs["m0"].slices == [1]
    for i in range(1, 4):
        submit(st, f"m{i}", at=3, mig="1g.10gb")
    run_cycle(st, 4)
    where = {j: (st.jobs[j].gpus[0], st.jobs[j].slices) for j in ("m1", "m2", "m3")}
    assert where["m1"] == ("n0/1", [2]) and where["m2"] == ("n0/1", [3])  # packed beside m0
    assert where["m3"] == ("n0/0", [0])  # GPU 1 has no 1g slice left: GPU 0 opens
    assert st.gpus["n0/1"].slices == {1: "m0", 2: "m1", 3: "m2"}
    submit(st, "big", at=5, mig="3g.40gb")
    run_cycle(st, 6)
    assert (st.jobs["big"].gpus, st.jobs["big"].slices) == (["n0/1"], [0])


def test_a_partitioned_gpu_is_never_held_whole_nor_shared_and_a_job_of_n_slices_takes_one_gpu():
    st = cluster(gpus=2)
    partition(st, 0, ["2g.20gb"] * 3)
    assert "n0/0" not in st.nodes["n0"].free and st.free_count == 1
    submit(st, "w0")
    run_cycle(st, 1.5)
    assert st.jobs["w0"].gpus == ["n0/1"]  # the only whole GPU
    submit(st, "w1", at=1.6)
    submit(st, "f", at=1.6, gpu_fraction=0.5)
    submit(st, "m", at=1.6, mig="2g.20gb", mig_count=2)
    run_cycle(st, 2)
    assert "w1" in st.pending and "f" in st.pending  # neither lands on the partitioned GPU
    assert (st.jobs["m"].gpus, st.jobs["m"].slices) == (["n0/0"], [0, 1])
    assert st.jobs["m"].weight == pytest.approx(4 / 7)  # charged its compute slices of 7
    assert st.teams["a"].held == pytest.approx(1 + 4 / 7)
    submit(st, "m2", at=3, mig="2g.20gb", mig_count=2)
    run_cycle(st, 4)
    assert "m2" in st.pending and st.jobs["m2"].pending_reason == "waiting for 2 free MIG 2g.20gb slices on one GPU"
    st.apply(ev.JobCompleted(at=5, job_id="m", attempt=1, exit_code=0))
    assert st.gpus["n0/0"].slices == {} and st.teams["a"].held == 1
    assert "n0/0" not in st.nodes["n0"].free  # still partitioned: free slices, not a free GPU
    run_cycle(st, 6)
    assert st.jobs["m2"].slices == [0, 1]


def test_the_geometry_changes_only_while_the_gpu_is_idle():
    st = cluster(gpus=2)
    partition(st, 0, ["1g.10gb"] * 7)
    submit(st, "m", mig="1g.10gb")
    submit(st, "w")
    run_cycle(st, 2)
    assert st.jobs["w"].gpus == ["n0/1"]
    cmd = SetMigGeometry(request_id="r", node="n0", gpu=0, profiles=["7g.80gb"])
    assert mig_geometry_problem(st, cmd) == ("GPU n0/0 is in use by m: its MIG geometry changes only while it is "
                                             "idle (drain the node or wait for its jobs to end)")
    assert "in use by w" in mig_geometry_problem(st, SetMigGeometry(request_id="r", node="n0", gpu=1,
                                                                   profiles=["1g.10gb"]))
    st.apply(ev.MigGeometrySet(at=3, gpu="n0/0", profiles=["7g.80gb"]))  # an operator's own append
    assert [v.rule for v in st.violations()] == ["geometry_of_busy_gpu"]
    assert st.gpus["n0/0"].geometry == ["1g.10gb"] * 7 and st.gpus["n0/0"].slices == {0: "m"}
    st.apply(ev.JobCompleted(at=4, job_id="m", attempt=1, exit_code=0))
    assert mig_geometry_problem(st, cmd) is None
    partition(st, 0, [], at=5)  # whole again
    assert "n0/0" in st.nodes["n0"].free


@pytest.mark.parametrize("profiles, why", [
    (["1g.10gb"] * 8, "fits at most 7 times"),
    (["4g.40gb", "4g.40gb"], "fits at most 1 times"),
    (["4g.40gb", "3g.40gb", "1g.10gb"], "take 8 compute slices"),
    (["1g.5gb"], "not offered by this GPU"),
])
def test_a_geometry_the_gpu_cannot_hold_is_refused_precisely(profiles, why):
    st = cluster(gpus=1)
    problem = mig_geometry_problem(st, SetMigGeometry(request_id="r", node="n0", gpu=0, profiles=profiles))
    assert problem is not None and why in problem


def test_a_gpu_not_in_mig_mode_takes_no_geometry_and_admission_refuses_a_profile_nobody_offers():
    st = cluster(gpus=1, mig=False)
    problem = mig_geometry_problem(st, SetMigGeometry(request_id="r", node="n0", gpu=0, profiles=["1g.10gb"]))
    assert problem is not None and "not in MIG mode" in problem
    from gpusched.core.commands import SubmitJob
    from gpusched.services.admission import AdmissionConfig, submit_problem

    cmd = SubmitJob(request_id="s", spec=JobSpec(team="a", gpus=1, mig="1g.10gb"))
    assert "no MIG GPU offers 1 x 1g.10gb" in (submit_problem(st, cmd, AdmissionConfig(auto_create_teams=True, placeholders="any"),
                                                              Capacity()) or "")


def test_the_spec_bounds_of_a_mig_ask():
    assert limits.mig_problem(JobSpec(team="a", gpus=2, mig="1g.10gb")).startswith("a MIG job takes slices of one GPU")
    assert "exclusive" in limits.mig_problem(JobSpec(team="a", gpus=1, mig="1g.10gb", gpu_fraction=0.5))
    assert limits.mig_problem(JobSpec(team="a", gpus=1, mig_count=2)) == "spec.mig_count needs spec.mig (the profile of the slices)"
    assert limits.mig_problem(JobSpec(team="a", gpus=1, mig="1g.10gb", mig_count=3)) is None


def test_the_writers_recheck_refuses_a_slice_taken_in_the_same_batch_or_of_another_profile():
    st = cluster(gpus=1)
    partition(st, 0, ["3g.40gb", "1g.10gb", "1g.10gb"])
    submit(st, "a1", mig="1g.10gb")
    submit(st, "a2", mig="1g.10gb")
    check = BatchCheck(st)
    grant = ev.GpusGranted(at=2, job_id="a1", attempt=1, gpus=["n0/0"], slices=[1])
    assert check.problem(grant) is None
    again = ev.GpusGranted(at=2, job_id="a2", attempt=1, gpus=["n0/0"], slices=[1])
    assert "not free 1g.10gb slices" in check.problem(again)
    wrong = ev.GpusGranted(at=2, job_id="a2", attempt=1, gpus=["n0/0"], slices=[0])
    assert "not free 1g.10gb slices" in check.problem(wrong)
    assert check.problem(ev.GpusGranted(at=2, job_id="a2", attempt=1, gpus=["n0/0"], slices=[2])) is None


def test_a_mig_jobs_allow_list_env_and_cdi_name_only_its_own_slices(tmp_path):
    from gpusched.core.mig import slice_uuid
    from gpusched.core.state import Job
    from gpusched.services.nodeagent import container
    from gpusched.services.nodeagent.confine import limits_for
    from gpusched.services.nodeagent.devices import GpuDevice
    from gpusched.services.nodeagent.launcher import Launch, job_env

    gpu = {0: GpuDevice("/w/dev/nvidia0", 242, 64)}
    caps = {(0, s): GpuDevice(f"/w/dev/nvidia-caps/nvidia-cap0-{s}", 243, 512 + s) for s in range(7)}
    launch = Launch(job_id="m", attempt=1, node="n0", node_rank=0, num_nodes=1, gpus=(0,), gpu_ids=("n0/0",),
                    gpu_uuids=("GPU-a",), master_addr="127.0.0.1", command=("true",), env={},
                    checkpoint_dir=tmp_path / "ck", control_dir=tmp_path / "ctl", log_path=tmp_path / "log",
                    mig_slices=(2, 3), mig_uuids=(slice_uuid("GPU-a", 2), slice_uuid("GPU-a", 3)))
    job = Job("m", JobSpec(team="a", gpus=1, mig="1g.10gb", mig_count=2), 0.0)
    allow = limits_for(job, launch, gpu, ("c 195:255 rwm",), None, {k: (d,) for k, d in caps.items()}).devices
    assert allow == ("c 242:64 rwm", "c 195:255 rwm", "c 243:514 rwm", "c 243:515 rwm")  # GPU, control, its 2 slices
    env = job_env(launch, {})
    assert env["CUDA_VISIBLE_DEVICES"] == "MIG-a-2,MIG-a-3" and env["GPUSCHED_MIG_SLICES"] == "2,3"
    spec = container.cdi_spec(gpu, {0: "GPU-a"}, caps)
    by_name = {d["name"]: [n["hostPath"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]}
    assert by_name["GPU-a"] == ["/w/dev/nvidia0"]
    assert by_name["MIG-a-3"] == ["/w/dev/nvidia0", "/w/dev/nvidia-caps/nvidia-cap0-3"]  # no other slice's
    argv = container.run_argv(launch, None, set(), 3)
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--device"] == ["nvidia.com/gpu=MIG-a-2",
                                                                             "nvidia.com/gpu=MIG-a-3"]


def test_submit_mig_takes_a_profile_and_a_count():
    from gpusched.cli.commands import spec_from_args
    from gpusched.cli.main import build_parser

    def submit_args(*argv: str) -> JobSpec:
        return spec_from_args(build_parser().parse_args(["submit", "--team", "a", *argv, "--", "true"]))

    spec = submit_args("--mig", "1g.10gbx2")
    assert (spec.mig, spec.mig_count, spec.gpus, spec.sliced, spec.partial) == ("1g.10gb", 2, 1, True, True)
    assert submit_args("--mig", "3g.40gb").mig_count == 1
    with pytest.raises(SystemExit, match="a MIG profile such as 1g.10gb"):
        submit_args("--mig", "big")
    with pytest.raises(SystemExit, match="exclusive"):
        submit_args("--mig", "1g.10gb", "--gpu-fraction", "0.5")


def test_seven_one_slice_jobs_hold_exactly_one_gpu():
    st = cluster(gpus=1)
    partition(st, 0, ["1g.10gb"] * 7)
    for i in range(7):
        submit(st, f"m{i}", mig="1g.10gb")
    run_cycle(st, 2)
    assert len(st.running) == 7 and st.teams["a"].held == 1  # an int: no drift from sevenths


def test_show_says_what_frees_a_waiting_mig_job_and_bills_a_running_one_its_sevenths():
    from gpusched.policy.explain import explain_pending
    from gpusched.readmodel import accounting, job_doc

    st = cluster(gpus=1)
    partition(st, 0, ["3g.40gb"])
    submit(st, "a", mig="3g.40gb")
    submit(st, "b", mig="3g.40gb")
    run_cycle(st, 2)
    why = explain_pending(st, "b", 3)
    assert why["summary"] == "waiting for a free MIG 3g.40gb slice on one GPU"
    assert why["unblock"] == ["1 free 3g.40gb slice(s) on one GPU: held by a, or an admin's `gpusched mig set` "
                              "with 3g.40gb slices on an idle MIG GPU"]
    doc = job_doc(st, st.jobs["a"])
    assert (doc["mig"], doc["mig_slices"], doc["gpu_share"]) == ("3g.40gb", [0], pytest.approx(3 / 7))
    assert accounting(doc, now=2 + 7 * 3600)["gpu_hours_held"] == pytest.approx(3.0)  # 7 h of 3/7 of a GPU


def test_mig_set_reads_one_profile_per_slice_or_none():
    from gpusched.cli.commands import geometry_from_args
    from gpusched.cli.main import build_parser

    args = build_parser().parse_args(["mig", "set", "node00", "3", "3g.40gb,2g.20gb", "1g.10gb", "1G.10GB"])
    assert (args.node, args.gpu, geometry_from_args(args.profiles)) == (
        "node00", 3, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"])
    assert geometry_from_args(["none"]) == [] and geometry_from_args(["whole"]) == []


def test_a_teams_limits_count_its_slices_charge_the_per_model_one_too():
    from gpusched.core.model import ModelQuota, TeamQuota

    st = cluster(gpus=1)
    partition(st, 0, ["2g.20gb"] * 3)
    st.apply(ev.TeamQuotaSet(at=0.6, team="a", quota=TeamQuota(limit=1)))
    st.apply(ev.TeamQuotaSet(at=0.6, team="b", quota=TeamQuota(models={"H100": ModelQuota(guaranteed=0, limit=0)})))
    st.apply(ev.TeamQuotaSet(at=0.6, team="c", quota=TeamQuota(limit=0)))
    submit(st, "a1", mig="2g.20gb", mig_count=2)
    submit(st, "b1", team="b", mig="2g.20gb")
    submit(st, "c1", team="c", mig="2g.20gb")
    run_cycle(st, 2)
    assert st.jobs["a1"].slices == [0, 1] and st.teams["a"].held == pytest.approx(4 / 7)  # within its limit of 1
    assert st.gpus["n0/0"].free_slices("2g.20gb") == [2]  # one slice free, and yet:
    assert "b1" in st.pending and "H100" in st.jobs["b1"].pending_reason  # its per-model limit of 0
    assert "c1" in st.pending and "limit 0" in st.jobs["c1"].pending_reason  # its limit of 0
