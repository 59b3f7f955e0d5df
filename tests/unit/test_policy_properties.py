"""Properties over random clusters and queues: whatever `cycle` decides, the fold accepts it.

Each example builds a random cluster, teams and jobs, then runs a few cycles of a random preset
with a random world in between (jobs finish, checkpoint, GPUs fail), applying every decision to
the state and checking the invariants of the README after each one.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.core import events as ev
from gpusched.core.model import LEVEL_RANK, JobSpec, TopologyConstraint
from gpusched.core.state import ClusterState
from gpusched.policy.config import PRESETS
from gpusched.policy.cycle import cycle, naive_cycle

from .policy_helpers import Scenario

LEVELS_REQ = ["nvlink", "node", "rack", "cluster", "cluster", "cluster"]


@st.composite
def worlds(draw):
    racks = draw(st.integers(1, 3))
    nodes = draw(st.integers(1, 3))
    gpus = draw(st.sampled_from([2, 4, 8]))
    nvlink = draw(st.sampled_from(["all", "pairs", "quads", "none"]))
    if nvlink == "quads" and gpus < 4:
        nvlink = "pairs"
    blocks = draw(st.sampled_from([None, 1, 2]))
    teams = {}
    for t in ["a", "b", "c"][: draw(st.integers(1, 3))]:
        teams[t] = (draw(st.integers(0, 8)), draw(st.sampled_from([0.5, 1.0, 2.0])),
                    draw(st.sampled_from([None, None, 4, 8, 16])))
    jobs = []
    for i in range(draw(st.integers(1, 14))):
        size = draw(st.integers(1, min(16, racks * nodes * gpus)))
        elastic = draw(st.booleans()) and size > 1
        jobs.append(dict(
            job_id=f"j{i}", at=float(draw(st.integers(0, 50))), team=draw(st.sampled_from(sorted(teams))),
            gpus=size, min_gpus=draw(st.integers(1, size - 1)) if elastic else None,
            priority=draw(st.sampled_from(["interactive", "high", "normal", "low"])),
            preemptible=draw(st.booleans()), required=draw(st.sampled_from(LEVELS_REQ)),
            time_limit_s=draw(st.sampled_from([None, 100.0, 1000.0])),
        ))
    preset = draw(st.sampled_from(list(PRESETS) + ["naive"]))
    overrides = {}
    if preset not in ("naive", "fifo"):
        overrides = dict(min_runtime_s=draw(st.sampled_from([0.0, 50.0])), las=draw(st.booleans()),
                         backfill=draw(st.booleans()) if preset == "full" else False,
                         las_predicted=draw(st.booleans()))
    steps = draw(st.lists(st.tuples(st.integers(1, 200), st.integers(0, 2**16)), min_size=1, max_size=8))
    return dict(racks=racks, nodes=nodes, gpus=gpus, nvlink=nvlink, blocks=blocks, teams=teams, jobs=jobs,
                preset=preset, overrides=overrides, steps=steps)


def _decide(state: ClusterState, now: float, w: dict):
    if w["preset"] == "naive":
        return naive_cycle(state, now)
    return cycle(state, now, PRESETS[w["preset"]].replace(**w["overrides"]))


def _check(state: ClusterState, decided) -> None:
    assert state.violations() == [], state.violations()
    for name, t in state.teams.items():
        assert t.quota.limit is None or t.held <= t.quota.limit, name
    for e in decided:
        if isinstance(e, ev.GpusGranted):
            spec = state.jobs[e.job_id].spec
            assert spec.gang_min <= len(e.gpus) <= spec.gpus
            assert LEVEL_RANK[state.span(e.gpus)] <= LEVEL_RANK[spec.topology.required]
            assert e.level == state.span(e.gpus)
        if isinstance(e, ev.JobResized) and e.added:
            job = state.jobs[e.job_id]
            assert LEVEL_RANK[state.span(job.gpus)] <= LEVEL_RANK[job.spec.topology.required]
    held = {}
    for jid in state.running:
        for g in state.jobs[jid].gpus:
            assert g not in held, f"{g} held by {held.get(g)} and {jid}"
            held[g] = jid
            assert state.gpus[g].holder == jid


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_cycle_decisions_are_always_valid(w):
    s = Scenario(racks=w["racks"], nodes=w["nodes"], gpus=w["gpus"], nvlink=w["nvlink"], blocks=w["blocks"])
    for t, (g, weight, limit) in w["teams"].items():
        s.team(t, guaranteed=g, weight=weight, limit=limit)
    state = s.state
    jobs = sorted(w["jobs"], key=lambda j: j["at"])
    now = 0.0
    queue = list(jobs)
    for dt, luck in w["steps"]:
        now += dt
        while queue and queue[0]["at"] <= now:
            j = queue.pop(0)
            spec = JobSpec(team=j["team"], gpus=j["gpus"], min_gpus=j["min_gpus"], priority=j["priority"],
                           preemptible=j["preemptible"], time_limit_s=j["time_limit_s"],
                           topology=TopologyConstraint(required=j["required"]))
            state.apply(ev.JobSubmitted(at=now, job_id=j["job_id"], spec=spec))
        # the world: some running jobs finish or checkpoint, a GPU may break
        for k, jid in enumerate(list(state.running)):
            job = state.jobs[jid]
            roll = (luck >> (k % 16)) & 3
            if roll == 0:
                state.apply(ev.JobCompleted(at=now, job_id=jid, attempt=job.attempt))
            elif roll == 1 or job.preemption is not None:
                state.apply(ev.CheckpointSaved(at=now, job_id=jid, attempt=job.attempt, path="p", step=1))
        if luck % 7 == 0 and state.gpus:
            g = sorted(state.gpus)[luck % len(state.gpus)]
            if state.gpus[g].holder is None:
                state.apply(ev.GpuQuarantined(at=now, gpu=g, reason="xid 79"))
        decided = _decide(state, now, w)
        for e in decided:
            state.apply(e)
        _check(state, decided)
        # a second cycle at the same time on the same state must not repeat itself
        again = _decide(state, now, w)
        assert not [e for e in again if isinstance(e, ev.JobPending)
                    and (state.jobs[e.job_id].pending_reason, state.jobs[e.job_id].pending_blockers)
                    == (e.reason, e.blockers)]
        for e in again:
            state.apply(e)
        _check(state, again)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_cycle_is_deterministic_and_independent_of_its_memo(w):
    """A restored snapshot (fresh indexes) decides exactly what the live state decides."""
    s = Scenario(racks=w["racks"], nodes=w["nodes"], gpus=w["gpus"], nvlink=w["nvlink"], blocks=w["blocks"])
    for t, (g, weight, limit) in w["teams"].items():
        s.team(t, guaranteed=g, weight=weight, limit=limit)
    state = s.state
    now = 0.0
    for j in sorted(w["jobs"], key=lambda j: j["at"]):
        spec = JobSpec(team=j["team"], gpus=j["gpus"], min_gpus=j["min_gpus"], priority=j["priority"],
                       preemptible=j["preemptible"], time_limit_s=j["time_limit_s"],
                       topology=TopologyConstraint(required=j["required"]))
        state.apply(ev.JobSubmitted(at=j["at"], job_id=j["job_id"], spec=spec))
        now = max(now, j["at"])
        for e in _decide(state, now, w):
            state.apply(e)
    for dt, luck in w["steps"]:
        now += dt
        for k, jid in enumerate(list(state.running)):
            if (luck >> (k % 16)) & 1:
                state.apply(ev.JobCompleted(at=now, job_id=jid, attempt=state.jobs[jid].attempt))
        fresh = ClusterState.restore(state.snapshot())
        assert _decide(fresh, now, w) == _decide(state, now, w)
        for e in _decide(state, now, w):
            state.apply(e)


# --- one cycle's output: each running job touched once, each GPU given once ------------------


@st.composite
def contended(draw):
    """A full-ish cluster: running jobs (many elastic, most preemptible) of teams with
    guarantees, preemptions possibly in flight, and a queue of jobs that want their GPUs."""
    racks, nodes = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    gpus = draw(st.sampled_from([4, 8]))
    teams = {t: (draw(st.integers(0, 12)), draw(st.sampled_from([None, None, 8, 16])))
             for t in ["a", "b", "c"][: draw(st.integers(2, 3))]}
    names = [f"r{r}n{n}/{i}" for r in range(racks) for n in range(nodes) for i in range(gpus)]
    order = draw(st.permutations(names))
    running = []
    for i in range(draw(st.integers(1, 10))):
        held = draw(st.integers(1, 8))
        elastic = draw(st.integers(0, 2)) > 0
        size = held + draw(st.integers(0, 4)) if elastic else held
        running.append(dict(job_id=f"r{i}", held=held, size=size,
                            min_gpus=draw(st.integers(1, held)) if elastic and size > 1 else None,
                            team=draw(st.sampled_from(sorted(teams))), at=float(draw(st.integers(0, 900))),
                            priority=draw(st.sampled_from(["low", "normal", "high"])),
                            preemptible=draw(st.integers(0, 3)) > 0, asked=draw(st.integers(0, 4)) == 0))
    pending = [dict(job_id=f"p{i}", gpus=draw(st.integers(1, 8)), team=draw(st.sampled_from(sorted(teams))),
                    priority=draw(st.sampled_from(["low", "normal", "high", "interactive"])),
                    required=draw(st.sampled_from(LEVELS_REQ)), at=float(draw(st.integers(900, 1000))),
                    min_gpus=draw(st.sampled_from([None, None, 1])))
               for i in range(draw(st.integers(1, 12)))]
    preset = draw(st.sampled_from(["preempt", "fairshare", "full", "full", "full"]))
    overrides = dict(min_runtime_s=draw(st.sampled_from([0.0, 0.0, 300.0])),
                     max_preemptors_per_cycle=draw(st.sampled_from([1, 4, 4, 8])))
    if preset == "full":
        overrides.update(checkpoint=draw(st.integers(0, 3)) > 0, backfill=draw(st.booleans()))
    return dict(racks=racks, nodes=nodes, gpus=gpus, teams=teams, order=order, running=running,
                pending=pending, preset=preset, overrides=overrides, steps=draw(st.integers(1, 4)))


def _check_once(state: ClusterState, out) -> None:
    granted: dict[str, str] = {}
    removed: dict[str, str] = {}
    touched: dict[str, str] = {}  # running job -> what the cycle did to it
    for e in out:
        for g in (e.gpus if isinstance(e, ev.GpusGranted) else e.added if isinstance(e, ev.JobResized) else []):
            assert g not in granted, f"{g} given to {granted[g]} and {e.job_id}"
            granted[g] = e.job_id
        if isinstance(e, ev.JobResized):
            for g in e.removed:
                assert g not in removed, f"{g} taken back twice"
                removed[g] = e.job_id
            # an elastic job may give back GPUs for several blocked jobs (one JobResized each)
            assert touched.get(e.job_id) in (None, "resized"), f"{e.job_id}: {touched[e.job_id]}, then resized"
            touched[e.job_id] = "resized"
        elif isinstance(e, ev.PreemptionRequested):
            assert e.job_id not in touched, f"{e.job_id}: {touched[e.job_id]}, then preempted"
            touched[e.job_id] = "preempted"
        elif isinstance(e, ev.GpusReleased):
            # only a job preempted earlier (this cycle without checkpoint, or an earlier one)
            assert touched.get(e.job_id) in (None, "preempted"), f"{e.job_id}: {touched[e.job_id]}, then released"
            touched[e.job_id] = "released"


def contended_state(w) -> ClusterState:
    """The state a `contended()` example describes (running jobs, preemptions in flight, queue)."""
    s = Scenario(racks=w["racks"], nodes=w["nodes"], gpus=w["gpus"])
    for t, (g, limit) in w["teams"].items():
        s.team(t, guaranteed=g, limit=limit)
    state = s.state
    free = list(w["order"])
    for r in w["running"]:
        t = state.teams[r["team"]]
        if len(free) < r["held"] or (t.quota.limit is not None and t.held + r["held"] > t.quota.limit):
            continue
        mine, free = free[: r["held"]], free[r["held"]:]
        s.run(r["job_id"], mine, at=r["at"], size=r["size"], min_gpus=r["min_gpus"], team=r["team"],
              priority=r["priority"], preemptible=r["preemptible"])
    for r in w["running"]:  # some preemptions already in flight (fairly: the fold must accept them)
        job = state.jobs.get(r["job_id"])
        if job is not None and r["asked"] and job.spec.preemptible and job.holding:
            s.apply(ev.PreemptionRequested(at=950.0, job_id=job.job_id, for_job=job.job_id, reason="test",
                                           deadline=1030.0))
    for p in w["pending"]:
        lo = p["min_gpus"] if p["min_gpus"] is not None and p["gpus"] > 1 else None
        s.submit(p["job_id"], p["gpus"], at=p["at"], team=p["team"], priority=p["priority"],
                 required=p["required"], min_gpus=lo)
    return state


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(contended())
def test_one_cycle_touches_each_job_once_and_gives_each_gpu_once(w):
    state = contended_state(w)
    config = PRESETS[w["preset"]].replace(**w["overrides"])
    now = 1000.0
    for _ in range(w["steps"]):
        out = cycle(state, now, config)
        _check_once(state, out)
        for e in out:
            state.apply(e)
            assert state.violations() == [], (e, state.violations())
        _check(state, out)
        for jid in list(state.running):  # half the victims checkpoint, the rest run to their deadline
            job = state.jobs[jid]
            if job.preemption is not None and int(jid[1:]) % 2 == 0:
                state.apply(ev.CheckpointSaved(at=now + 5, job_id=jid, attempt=job.attempt, path="p", step=1))
        now += 20.0
