"""Idle GPUs and leaked memory, the pure parts: the fold's held/busy accounting, the idle-timeout
policy (a table of named scenarios), the reconciler's idle and leak decisions (another table),
and the simulated backend's utilization and leak hooks."""

from __future__ import annotations

import pytest

from gpusched.core import events as ev
from gpusched.core.heartbeat import GpuSample, Heartbeat
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.core.state import fold
from gpusched.policy.config import PRESETS
from gpusched.policy.idle import idle_timeouts
from gpusched.policy.ordering import ordered
from gpusched.services.nodeagent.backends import SimBackend, sim_util
from gpusched.services.reconciler import (
    Observations,
    ReconcilerConfig,
    decide,
    usage_docs,
)

from .policy_helpers import Scenario

FULL = PRESETS["full"]


def idle_fact(job_id: str, at: float, since: float, attempt: int = 1) -> ev.JobIdle:
    return ev.JobIdle(at=at, job_id=job_id, attempt=attempt, since=since, window_s=at - since, threshold_pct=5.0,
                      util_pct=0.5, util_pct_max=1.0, memory_mb=300.0)


# --- the fold: idle status, held and busy GPU-seconds -------------------------------------------


def test_held_and_busy_gpu_seconds_add_up_per_job_and_team():
    s = Scenario(nodes=1, gpus=8)
    s.run("idle", ["r0n0/0", "r0n0/1"], at=0.0, priority="interactive")
    s.run("busy", ["r0n0/2", "r0n0/3", "r0n0/4"], at=0.0)
    s.run("other", ["r0n0/5"], at=0.0, team="b")
    s.apply(idle_fact("idle", at=700.0, since=100.0))  # idle since 100, concluded at 700
    st = s.state
    assert st.jobs["idle"].idle is not None and "idle" in st.idle_jobs
    assert st.jobs["idle"].gpu_seconds(1000.0) == (2000.0, 200.0)  # busy only 0..100
    s.apply(ev.JobBusy(at=1000.0, job_id="idle", attempt=1, util_pct=80.0, gpu="r0n0/0"))
    assert st.jobs["idle"].idle is None and "idle" not in st.idle_jobs
    s.finish("idle", at=1500.0)
    s.finish("busy", at=2000.0)
    assert st.jobs["idle"].gpu_seconds(3000.0) == (3000.0, 1200.0)  # 900 s idle on 2 GPUs
    assert st.jobs["busy"].gpu_seconds(3000.0) == (6000.0, 6000.0)
    held, busy = st.team_gpu_seconds("a", 3000.0)
    assert (held, busy) == (9000.0, 7200.0)  # the team is the sum of its jobs
    assert st.team_gpu_seconds("b", 3000.0) == (3000.0, 3000.0)  # still running
    assert st.summary()["teams"]["a"]["busy_gpu_s"] == 7200.0


def test_idle_time_of_an_elastic_resize_and_a_requeue_is_counted_on_the_gpus_held():
    s = Scenario(nodes=1, gpus=8)
    s.run("e", ["r0n0/0", "r0n0/1"], at=0.0, size=4, min_gpus=1)
    s.apply(idle_fact("e", at=100.0, since=0.0),
            ev.JobResized(at=200.0, job_id="e", added=["r0n0/2", "r0n0/3"]))
    assert s.state.team_gpu_seconds("a", 300.0) == (800.0, 0.0)  # 2 GPUs x 200 s + 4 x 100 s
    s.apply(ev.GpusReleased(at=300.0, job_id="e", reason="node_lost"))
    assert s.state.jobs["e"].gpu_seconds(400.0) == (800.0, 0.0)
    assert s.state.team("a").idle_gpus == 0 and not s.state.idle_jobs


def test_a_late_idle_report_of_an_ended_attempt_changes_nothing():
    s = Scenario(nodes=1, gpus=8)
    s.run("j", ["r0n0/0"], at=0.0)
    s.apply(ev.GpusReleased(at=50.0, job_id="j", reason="no_process"))
    s.apply(idle_fact("j", at=60.0, since=0.0))
    assert s.state.jobs["j"].idle is None and not s.state.idle_jobs


def test_an_idle_requeue_waits_behind_the_queue_and_is_not_a_preemption():
    s = Scenario(nodes=1, gpus=4)
    s.run("nb", ["r0n0/0", "r0n0/1", "r0n0/2", "r0n0/3"], at=0.0, priority="interactive")
    s.submit("later", gpus=4, at=10.0)  # normal priority, submitted after the notebook
    s.apply(idle_fact("nb", at=700.0, since=0.0))
    out = s.cycle(FULL.replace(idle_timeout_s={"interactive": 1000.0}), now=1000.0)
    request = [e for e in out if isinstance(e, ev.PreemptionRequested)]
    assert [(e.job_id, e.for_job, e.cause) for e in request] == [("nb", "nb", "idle")]
    assert "idle timeout of 1000 s for interactive jobs" in request[0].reason
    assert "under 5% utilization for 1000 s" in request[0].reason
    s.checkpoint("nb", at=1005.0)
    out = s.cycle(FULL, now=1006.0)
    kinds = [(e.kind, getattr(e, "job_id", "")) for e in out if not isinstance(e, ev.JobPending)]
    assert kinds == [("GpusReleased", "nb"), ("GpusGranted", "later")]
    nb = s.state.jobs["nb"]
    assert (nb.preemptions, nb.idle_requeues, nb.yielded_idle, nb.pending_reason) == (
        0, 1, True, "requeued: idle timeout")
    assert s.state.violations() == []


def test_the_yielded_job_sorts_after_every_waiting_job_until_granted_again():
    s = Scenario(nodes=1, gpus=1)
    s.run("nb", ["r0n0/0"], at=0.0, priority="interactive")
    s.submit("low", at=5.0, priority="low")
    s.apply(idle_fact("nb", at=10.0, since=0.0),
            ev.PreemptionRequested(at=20.0, job_id="nb", for_job="nb", reason="idle", deadline=20.0, cause="idle"),
            ev.GpusReleased(at=20.0, job_id="nb", reason="preempted", forced=True))
    assert [j.job_id for j in ordered(s.state, 21.0, FULL)] == ["low", "nb"]


# --- the idle-timeout policy: a table of named scenarios ------------------------------------------

def _idle_world(priority="interactive", idle_since=0.0, preempted=False, checkpointed_at=None, busy_again=False):
    s = Scenario(nodes=1, gpus=2)
    s.run("j", ["r0n0/0"], at=0.0, priority=priority, preemptible=True)
    s.run("other", ["r0n0/1"], at=0.0)
    if idle_since is not None:
        s.apply(idle_fact("j", at=idle_since + 600.0, since=idle_since))
    if busy_again:
        s.apply(ev.JobBusy(at=1500.0, job_id="j", attempt=1, util_pct=90.0))
    if preempted:
        s.apply(ev.PreemptionRequested(at=1500.0, job_id="j", for_job="j", reason="idle", deadline=1600.0,
                                       cause="idle"))
    if checkpointed_at is not None:
        s.checkpoint("j", at=checkpointed_at)
    return s.state


TIMEOUT = FULL.replace(idle_timeout_s={"interactive": 1800.0})
IDLE_CASES = {
    "interactive idle past its timeout: checkpoint and requeue": (
        dict(), TIMEOUT, 1800.0, [("PreemptionRequested", "idle")]),
    "interactive idle not yet long enough": (dict(), TIMEOUT, 1799.0, []),
    "batch class has no timeout by default": (dict(priority="normal"), TIMEOUT, 99999.0, []),
    "batch with a timeout configured": (
        dict(priority="normal"), FULL.replace(idle_timeout_s={"normal": 60.0}), 700.0,
        [("PreemptionRequested", "idle")]),
    "action end fails the job with the reason": (
        dict(), TIMEOUT.replace(idle_action={"interactive": "end"}), 1800.0, [("JobFailed", "")]),
    "not idle: nothing": (dict(idle_since=None), TIMEOUT, 99999.0, []),
    "busy again: nothing": (dict(busy_again=True), TIMEOUT, 99999.0, []),
    "already asked to checkpoint: never again": (dict(preempted=True), TIMEOUT, 1550.0, []),
    "without preemption the policy settles its own request on a checkpoint": (
        dict(preempted=True, checkpointed_at=1510.0), TIMEOUT.replace(preemption=False), 1520.0,
        [("GpusReleased", "")]),
    "without preemption, the deadline forces the release": (
        dict(preempted=True), TIMEOUT.replace(preemption=False), 1600.0, [("GpusReleased", "forced")]),
    "without checkpoints the release is immediate": (
        dict(), TIMEOUT.replace(checkpoint=False), 1800.0, [("PreemptionRequested", "idle"), ("GpusReleased", "forced")]),
}


def _tag(e: ev.Event) -> str:
    if isinstance(e, ev.PreemptionRequested):
        return e.cause
    if isinstance(e, ev.GpusReleased):
        return "forced" if e.forced else ""
    return ""


@pytest.mark.parametrize("world, config, now, want", IDLE_CASES.values(), ids=IDLE_CASES.keys())
def test_idle_timeout_policy(world, config, now, want):
    state = _idle_world(**world)
    got = idle_timeouts(state, now, config)
    assert [(e.kind, _tag(e)) for e in got] == want
    assert all(e.job_id == "j" for e in got)
    for e in got:
        state.apply(e)
    assert state.violations() == []


def test_a_job_the_same_cycle_already_touched_is_left_alone():
    state = _idle_world()
    ended = ev.JobFailed(at=1800.0, job_id="j", attempt=1, reason="time limit")
    assert idle_timeouts(state, 1800.0, TIMEOUT, [ended]) == []


def test_the_cycle_carries_the_idle_decision_and_its_evidence():
    s = Scenario(nodes=1, gpus=2)
    s.run("j", ["r0n0/0"], at=0.0, priority="interactive")
    s.apply(idle_fact("j", at=600.0, since=0.0))
    out = s.cycle(TIMEOUT, now=1900.0)
    (req,) = [e for e in out if isinstance(e, ev.PreemptionRequested)]
    assert req.cause == "idle" and "mean 0.5%, max 1.0%, 300 MB used per GPU" in req.reason


# --- the reconciler's idle and leak decisions: a table ------------------------------------------

RCFG = ReconcilerConfig(node_timeout_s=100, no_process_grace_s=50, zombie_grace_s=30, idle_util_pct=5.0,
                        idle_after_s=10.0, leak_min_mb=1024, leak_grace_s=5.0)


def world(*extra: ev.Event):
    gpus = [GpuInfo(index=i, uuid=f"u{i}") for i in range(3)]
    return fold([ev.NodeRegistered(at=0, node="n", rack="r", gpus=gpus),
                 ev.JobSubmitted(at=0, job_id="j", spec=JobSpec(team="t", gpus=2)),
                 ev.GpusGranted(at=100, job_id="j", attempt=1, gpus=["n/0", "n/1"]),
                 ev.JobStarted(at=100, job_id="j", attempt=1, node="n"), *extra])


def hb(u0=0.0, u1=0.0, mem2=0, pids2=()) -> Heartbeat:
    """GPUs 0 and 1 run j (pid 11) at these utilizations; GPU 2 is free with `mem2` MB used."""
    return Heartbeat(node="n", at=0, agent_id="a", seq=1, backend="sim", gpus=[
        GpuSample(index=0, uuid="u0", pids=[11], utilization_pct=u0, memory_used_mb=2000),
        GpuSample(index=1, uuid="u1", pids=[11], utilization_pct=u1, memory_used_mb=1000),
        GpuSample(index=2, uuid="u2", pids=list(pids2), memory_used_mb=mem2)])


def ticks(start: float, end: float, beat: Heartbeat, step: float = 2.0):
    t = start
    while t <= end:
        yield t, beat
        t += step


RECON_CASES = {
    "busy job: nothing": ((), list(ticks(101, 131, hb(90, 0))), []),
    "all GPUs idle past idle_after_s: JobIdle once": ((), list(ticks(101, 131, hb(1, 2))), ["JobIdle"]),
    "idle, not yet long enough": ((), list(ticks(101, 109, hb(1, 2))), []),
    "one GPU busy keeps the job busy": ((), list(ticks(101, 131, hb(1, 50))), []),
    "a spike restarts the idle clock": (
        (), [*ticks(101, 109, hb()), (111, hb(0, 60)), *ticks(113, 121, hb())], []),
    "idle in the fold, busy sample: JobBusy": ((idle_fact("j", 120, 105),), [(121, hb(70, 0))], ["JobBusy"]),
    "idle in the fold and still idle: nothing new": ((idle_fact("j", 120, 105),), list(ticks(121, 151, hb())), []),
    "leaked memory on a free GPU past grace: quarantined": ((), list(ticks(101, 107, hb(90, 90, mem2=4096))),
                                                            ["GpuQuarantined"]),
    "leaked memory within grace: nothing": ((), list(ticks(101, 104, hb(90, 90, mem2=4096))), []),
    "memory with a process is a zombie, not a leak": (
        (), list(ticks(101, 131, hb(90, 90, mem2=4096, pids2=[7]))), ["ZombieDetected"]),
    "small memory use is no leak": ((), list(ticks(101, 131, hb(90, 90, mem2=200))), []),
    "leak freed: restored": ((ev.GpuQuarantined(at=101, gpu="n/2", reason="leaked memory: 4096 MB"),),
                             [(102, hb(90, 90, mem2=0))], ["GpuRestored"]),
    "other quarantines stay when memory is free": ((ev.GpuQuarantined(at=101, gpu="n/2", reason="operator"),),
                                                   [(102, hb(90, 90, mem2=0))], []),
}


@pytest.mark.parametrize("extra, beats, want", RECON_CASES.values(), ids=RECON_CASES.keys())
def test_reconciler_idle_and_leak_decisions(extra, beats, want):
    state = world(*extra)
    obs = Observations(started_at=100.0)
    kinds = []
    for t, beat in beats:
        obs.observe(beat, t)
        got = decide(state, obs, t, RCFG)
        for e in got.events:
            state.apply(e)  # the service appends, the fold catches up: conclusions change once
        kinds += [e.kind for e in got.events]
    assert kinds == want
    assert state.violations() == []


def test_idle_fact_carries_its_evidence():
    state = world()
    obs = Observations(started_at=100.0)
    for t, beat in ticks(101, 111, hb(1, 3)):
        obs.observe(beat, t)
        got = decide(state, obs, t, RCFG).events
    (idle,) = got
    assert (idle.since, idle.window_s, idle.threshold_pct) == (101, 10.0, 5.0)
    assert (idle.util_pct, idle.util_pct_max, idle.memory_mb) == (2.0, 3.0, 1500.0)


def test_an_admin_restore_of_a_leaked_gpu_sticks_until_the_memory_is_freed():
    state = world()
    obs = Observations(started_at=100.0)
    for t, beat in ticks(101, 107, hb(90, 90, mem2=4096)):
        obs.observe(beat, t)
        for e in decide(state, obs, t, RCFG).events:
            state.apply(e)
    assert state.gpus["n/2"].quarantined.startswith("leaked memory: 4096 MB")
    state.apply(ev.GpuRestored(at=108, gpu="n/2", reason="admin"))
    for t, beat in ticks(109, 131, hb(90, 90, mem2=4096)):
        obs.observe(beat, t)
        assert decide(state, obs, t, RCFG).events == []
    obs.observe(hb(90, 90, mem2=0), 133)
    decide(state, obs, 133, RCFG)
    for t, beat in ticks(135, 141, hb(90, 90, mem2=4096)):  # a new leak is a new fact
        obs.observe(beat, t)
        kinds = [e.kind for e in decide(state, obs, t, RCFG).events]
    assert kinds == ["GpuQuarantined"]


def test_reset_is_asked_only_when_the_admin_allows_it():
    state = world(ev.GpuQuarantined(at=101, gpu="n/2", reason="leaked memory: 4096 MB"))
    for allowed, want in ((False, []), (True, [("n", "n/2")])):
        obs = Observations(started_at=100.0)
        obs.observe(hb(90, 90, mem2=4096), 102)
        cfg = ReconcilerConfig(**{**RCFG.__dict__, "reset_leaked": allowed})
        assert decide(state, obs, 102, cfg).resets == want


def test_usage_view_gives_mean_utilization_and_memory_over_the_window():
    state = world()
    obs = Observations(started_at=100.0, window_s=10.0)
    for t, beat in [(95, hb(100, 100)), (101, hb(10, 30)), (103, hb(30, 50))]:
        obs.observe(beat, t)
    doc = usage_docs(state, obs, 104.0)["j"]
    assert (doc["util_pct"], doc["memory_mb"], doc["samples"]) == (30.0, 1500.0, 4)  # before the start: not counted


# --- the simulated backend --------------------------------------------------------------------


@pytest.mark.parametrize("env, want", [({}, 97.0), ({"GPUSCHED_SIM_UTIL": "0"}, 0.0),
                                        ({"GPUSCHED_SIM_UTIL": "42.5"}, 42.5), ({"GPUSCHED_SIM_UTIL": "250"}, 100.0),
                                        ({"GPUSCHED_SIM_UTIL": "x"}, 97.0)])
def test_sim_util_from_the_environment(env, want):
    assert sim_util(env) == want


def test_sim_backend_shows_job_utilization_and_injected_leaks():
    b = SimBackend("n", 3)
    b.attach([0], 100, env={"GPUSCHED_SIM_UTIL": "0"})
    b.attach([1], 101, env={})
    b.detach(100)
    b.attach([0, 2], 100)  # an elastic resize keeps what the job's environment said
    s = b.sample()
    assert [g.utilization_pct for g in s] == [0.0, 97.0, 0.0]
    b.inject_leak(1, 2048)
    assert b.reset(1).startswith("refused")  # a process is on it
    b.detach(101)
    assert b.sample()[1].memory_used_mb == 2048 and b.sample()[1].pids == []
    assert b.reset(1) == "" and b.sample()[1].memory_used_mb == 0
    b.inject_leak(1, 512)
    b.inject_leak(1, 0)
    assert b.sample()[1].memory_used_mb == 0
    with pytest.raises(ValueError):
        b.inject_leak(7, 1)


def test_with_fair_share_the_yielded_job_waits_behind_every_team():
    s = Scenario(nodes=1, gpus=2)
    s.team("nb", guaranteed=2)  # under its share: its jobs would lead the order
    s.run("notebook", ["r0n0/0"], at=0.0, team="nb", priority="interactive")
    s.run("busy", ["r0n0/1"], at=0.0, team="batch")
    s.submit("train", team="batch", at=5.0)
    s.apply(idle_fact("notebook", at=10.0, since=0.0),
            ev.PreemptionRequested(at=20.0, job_id="notebook", for_job="notebook", reason="idle", deadline=20.0,
                                   cause="idle"),
            ev.GpusReleased(at=20.0, job_id="notebook", reason="preempted", forced=True))
    assert [j.job_id for j in ordered(s.state, 21.0, FULL)] == ["train", "notebook"]
    out = s.cycle(FULL, now=21.0)
    assert [e.job_id for e in out if isinstance(e, ev.GpusGranted)] == ["train"]
    s.finish("busy", at=30.0)
    out = s.cycle(FULL, now=30.0)
    assert [e.job_id for e in out if isinstance(e, ev.GpusGranted)] == ["notebook"]
    assert not s.state.jobs["notebook"].yielded_idle


def test_nvml_reset_refuses_a_gpu_with_processes_and_runs_nvidia_smi_otherwise(monkeypatch, tmp_path):
    import sys

    from gpusched.services.nodeagent.backends import NvmlBackend

    from .test_node_side import FakeNvml

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    backend = NvmlBackend()
    s = backend.sample()  # the fields the reconciler reads, from the stand-in driver
    assert [(g.utilization_pct, g.memory_used_mb, g.pids) for g in s[:2]] == [(50.0, 0, [1000]), (50.0, 1024, [])]
    assert backend.reset(0).startswith("refused: 1 process")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert backend.reset(1) == "nvidia-smi not found"
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\n[ "$1 $2 $3" = "--gpu-reset -i 1" ] && exit 0\necho "bad args: $*" >&2; exit 3\n')
    smi.chmod(0o755)
    assert backend.reset(1) == ""
    assert backend.reset(2) == "bad args: --gpu-reset -i 2"
    backend.close()


@pytest.mark.parametrize("gpu, quarantine, ok, error", [
    ("n/2", "leaked memory: 4096 MB", True, ""),
    ("n/2", None, False, "GPU n/2 is not quarantined"),
    ("n/9", None, False, "unknown GPU 'n/9'"),
])
def test_an_operator_restores_a_quarantined_gpu(gpu, quarantine, ok, error):
    from gpusched.core.commands import RestoreGpu
    from gpusched.services.admission import AdmissionConfig, Capacity, admit

    state = world(*([ev.GpuQuarantined(at=101, gpu="n/2", reason=quarantine)] if quarantine else []))
    d = admit(state, RestoreGpu(request_id="r", gpu=gpu, reason="checked by hand"), 200.0, AdmissionConfig(), Capacity())
    assert d.reply.ok is ok and error in d.reply.error
    if ok:
        assert isinstance(d.event, ev.GpuRestored) and "checked by hand" in d.event.reason
        assert "was: leaked memory" in d.event.reason


# --- the simulator: a trace's utilization ---------------------------------------------------------


def _sim(config):
    from gpusched.sim.engine import Cluster, Simulation
    from gpusched.sim.runtime_model import IDEAL
    from gpusched.sim.traces import TraceJob

    jobs = [TraceJob("nb", 0.0, 36000.0, 2, "lab", "interactive", False, util_pct=0.0),
            TraceJob("train", 10.0, 3600.0, 2, "lab", "normal", False)]
    sim = Simulation(jobs, Cluster.parse("1x1x2"), config, IDEAL, policy_name="full")
    return sim, sim.run()


@pytest.mark.parametrize("action, train_start, idle_requeues, idle_ended", [
    (None, 36000.0, 0, 0),  # no timeout: the idle notebook holds both GPUs for its whole session
    # yields at 30 min, resumes behind the queue once train is done, and yields again every 30 min:
    # the 10 h session runs as 20 attempts (the simulator counts the session as the job's work)
    ("requeue", 1800.0, 19, 0),
    ("end", 1800.0, 0, 1),
])
def test_the_simulator_reports_idle_jobs_and_applies_the_timeout(action, train_start, idle_requeues, idle_ended):
    config = FULL.replace(idle_timeout_s={} if action is None else {"interactive": 1800.0},
                          idle_action={} if action is None else {"interactive": action})
    sim, out = _sim(config)
    assert sim.runs["train"].first_start == train_start
    assert (out["idle_requeues"], out["idle_ended"], out["unfinished"]) == (idle_requeues, idle_ended, 0)
    assert out["idle_reports"] >= 1 and out["held_efficiency"] < 1.0
    held, busy = sim.state.team_gpu_seconds("lab")
    assert round(held / 3600, 3) == out["gpu_hours_held"] and round(busy / 3600, 3) == out["gpu_hours_busy"]
    assert busy == 2 * 3600.0  # train's; the notebook was idle from each start (the evidence is backdated)


def test_trace_utilization_column(tmp_path):
    from gpusched.sim.traces import TraceError, load_csv

    p = tmp_path / "t.csv"
    p.write_text("job_id,submit_time_s,duration_s,num_gpus,team,util_pct\na,0,10,1,x,0\nb,1,10,1,x,\n")
    assert [j.util_pct for j in load_csv(p)] == [0.0, None]
    p.write_text("job_id,submit_time_s,duration_s,num_gpus,team,util_pct\na,0,10,1,x,101\n")
    with pytest.raises(TraceError, match="util_pct: 101.0 is above 100"):
        load_csv(p)
