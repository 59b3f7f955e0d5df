"""What `show` says about a pending job's team is true of the fold it was drawn from, over random
clusters (hypothesis): "limit stops it" exactly when the team's holdings plus the job's gang pass
its limit, "may reclaim" only when something is reclaimable for it, and the policy's team-limit
reason never claims the job needs "more" GPUs than it asks for. (The issue's wider "show is
true" property, every ETA and reason against what happened next in simulated runs, is in
test_show_true.py.)"""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.cli.render import _why_lines
from gpusched.cli.stack import simulated_nodes
from gpusched.core import events as ev
from gpusched.core import reasons as rs
from gpusched.core.model import JobSpec, TeamQuota
from gpusched.core.state import ClusterState
from gpusched.policy.explain import explain_pending

TEAMS = ("nlp", "vision")
running = st.lists(st.tuples(st.sampled_from(TEAMS), st.integers(1, 4), st.booleans()), max_size=6)
quota = st.tuples(st.integers(0, 16), st.one_of(st.none(), st.integers(1, 16)))


def _fold(quotas, jobs, need: int) -> ClusterState:
    state = ClusterState()
    for e in simulated_nodes(4, 4, 2, "pairs", at=1.0):
        state.apply(e)
    for team, (guaranteed, limit) in zip(TEAMS, quotas):
        state.apply(ev.TeamQuotaSet(at=1.0, team=team, quota=TeamQuota(guaranteed=min(guaranteed, limit or 16),
                                                                        limit=limit)))
    free = sorted(state.gpus)
    for i, (team, gpus, preemptible) in enumerate(jobs):
        if gpus > len(free):
            break
        state.apply(ev.JobSubmitted(at=2.0, job_id=f"j-{i:08x}", spec=JobSpec(team=team, gpus=gpus,
                                                                                preemptible=preemptible)))
        state.apply(ev.GpusGranted(at=3.0, job_id=f"j-{i:08x}", attempt=1, gpus=free[:gpus]))
        free = free[gpus:]
    state.apply(ev.JobSubmitted(at=4.0, job_id="j-ffffffff", spec=JobSpec(team="nlp", gpus=need)))
    return state


@settings(max_examples=60, deadline=None)
@given(st.tuples(quota, quota), running, st.integers(1, 8))
def test_what_show_says_of_the_team_is_true_of_the_fold(quotas, jobs, need):
    state = _fold(quotas, jobs, need)
    why = explain_pending(state, "j-ffffffff", now=5.0)
    lines = " ".join(_why_lines(why, {"state": "pending", "submitted_at": 4.0}, 5.0))
    team = state.teams["nlp"]
    stops = team.quota.limit is not None and team.held + need > team.quota.limit
    assert ("limit stops it" in lines) == stops
    assert f"holds {team.held}," in lines
    if "may reclaim" in lines:
        assert why["reclaimable_gpus"] > 0 and team.held < team.quota.guaranteed


def test_the_team_limit_reason_names_the_gang_not_more():
    text = rs.TeamLimit("nlp", 32, 32).text
    assert text == "team nlp at its limit 32 with this job's 32 GPU(s)"
    assert not re.search(r"needs \d+ more", text)
