"""Properties over random clusters and queues: whatever `cycle` decides, the fold accepts it.

Each example builds a random cluster, teams and jobs, then runs a few cycles of a random preset
with a random world in between (jobs finish, checkpoint, GPUs fail), applying every decision to
the state and checking the invariants of DESIGN.md after each one.
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
                         backfill=draw(st.booleans()) if preset == "full" else False)
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
