"""The wedged decider of issue 24: placement and the preemptor failed every round with a
`KeyError` in `policy/ordering.py` after fuzzed node facts. The trigger, found by the property
below: a node fact dated far ahead (the fold's clock was `max(at)`) makes the fold forget, in
that one step, a job that ended while the queue index still held it; `_remove` then looked the
job up in the fold. The index keeps each entry's queue itself now; and the fold's clock is the
log's store time (test_node_speaks.py), so such a jump no longer comes from a writer at all."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec
from gpusched.core.state import FORGET_AFTER_S, ClusterState
from gpusched.policy.config import PolicyConfig
from gpusched.policy.ordering import QueueIndex, queue_mode

DAY = 86_400.0
FACTS = st.lists(st.tuples(st.sampled_from(["submit", "cancel", "node"]), st.floats(0, 400 * DAY),
                           st.sampled_from(["a", "b"])), min_size=1, max_size=30)


@settings(max_examples=150, deadline=None)
@given(FACTS, st.booleans())
def test_node_facts_never_wedge_the_queue_index(facts, fairshare):
    state = ClusterState(forget_after_s=FORGET_AFTER_S)  # the services' fold forgets
    config = PolicyConfig(fairshare=fairshare)
    idx = QueueIndex(state, config, queue_mode(config))
    t, n = 0.0, 0
    for kind, jump, team in facts:
        if kind == "submit":
            n += 1
            state.apply(ev.JobSubmitted(at=t, job_id=f"j{n}", spec=JobSpec(team=team, gpus=1)))
        elif kind == "cancel" and state.pending:
            state.apply(ev.JobCancelled(at=t, job_id=next(iter(state.pending))))
        else:  # a node's own fact, dated as it likes (a bare fold: the events' `at` is the clock)
            state.apply(ev.NodeRegistered(at=t + jump, node="n0", rack="r", gpus=[GpuInfo(index=0, uuid="u0")]))
        idx.update()
        order = [j.job_id for j in idx.ordered(state.now, lambda name: state.teams[name].held)]
        assert sorted(order) == sorted(state.pending)
