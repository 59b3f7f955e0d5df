"""Job features through real admission and placement on NATS: hold/release, update, dependencies
and per-team time limits, each decided by admission, kept in the log and honoured by placement,
with the reason `gpusched show` prints."""

from __future__ import annotations

from gpusched.core.model import JobSpec, TeamQuota
from gpusched.core.reasons import DependencyWait, Held

from .harness import harness  # noqa: F401


async def test_hold_release_update_dependency_and_team_time_limits(harness):
    h = harness
    await h.scheduler(1, 8)
    c = h.client
    # per-team time limits: the default is filled in, over the maximum is refused
    assert (await c.set_quota("a", TeamQuota(default_time_limit_s=600.0, max_time_limit_s=3600.0),
                              only=["default_time_limit_s", "max_time_limit_s"])).ok

    refused = await c.submit(JobSpec(team="a", gpus=1, time_limit_s=7200.0))
    assert refused.error == "spec.time_limit_s (7200 s) exceeds the team's maximum time limit (3600 s)"

    big = await h.submit(team="a", gpus=8)
    await h.wait_for("big placed", lambda s: h.holding(big))
    assert h.state.jobs[big].spec.time_limit_s == 600.0
    held = await h.submit(team="a", gpus=8)
    assert (await c.hold(held, reason="data not ready")).ok
    after = await h.submit(team="a", gpus=8, dependency=[{"kind": "afterok", "job": big}])
    assert (await c.update(after, priority="high", time_limit_s=900.0)).ok
    st = await h.wait_for("reasons", lambda s: s.jobs[held].pending_why is not None
                          and s.jobs[after].pending_why is not None and s)
    assert st.jobs[held].pending_why == Held("admin: data not ready")
    assert st.jobs[after].pending_why == DependencyWait([f"afterok:{big}"])
    assert (st.jobs[after].spec.priority, st.jobs[after].spec.time_limit_s) == ("high", 900.0)
    # precise refusals: not pending, already held
    assert (await c.hold(big)).error == f"cannot hold job {big}: it is starting, not pending"
    assert (await c.hold(held)).error == f"job {held} is already held"
    assert (await c.update(big, priority="low")).error.startswith(f"cannot update job {big}: it is ")

    await h.complete(big)  # the dependency is satisfied: `after` starts, the held job does not
    await h.wait_for("after placed", lambda s: h.holding(after))
    assert h.state.jobs[held].state == "pending"
    await h.complete(after)
    assert (await c.hold(held, hold=False)).ok
    await h.wait_for("released job placed", lambda s: h.holding(held))


async def test_node_labels_and_constraints_through_admission_and_placement(harness):
    h = harness
    await h.scheduler(2, 8)
    st = await h.sync()
    first, second = sorted(st.nodes)
    assert (await h.client.label_node(second, {"zone": "b"})).ok
    assert (await h.client.label_node("node-x", {"zone": "b"})).error == "unknown node 'node-x'"
    refused = await h.client.submit(JobSpec(team="a", gpus=1, constraints={"zone": "c"}))
    assert refused.error.startswith("no node matches constraint zone=c with 1 GPUs")
    jobs = [await h.submit(team="a", gpus=4, constraints={"zone": "b"}) for _ in range(3)]
    st = await h.wait_for("two placed", lambda s: sum(h.holding(j) for j in jobs) == 2 and s)
    assert {g.split("/")[0] for j in jobs for g in st.jobs[j].gpus} == {second}  # never on the other node
    waiting = next(j for j in jobs if not h.holding(j))
    assert st.nodes[second].labels == {"zone": "b"} and not st.nodes[first].labels
    await h.wait_for("its reason", lambda s: s.jobs[waiting].pending_reason.startswith("waiting for 4 GPUs; 0 free"))


async def test_a_job_array_through_admission_and_placement(harness):
    h = harness
    await h.scheduler(1, 8)
    arr = await h.submit(team="a", gpus=1, array={"first": 0, "last": 9, "max_running": 3})
    tasks = [f"{arr}_{i}" for i in range(10)]
    st = await h.wait_for("three tasks placed", lambda s: sum(h.holding(t) for t in tasks) == 3 and s)
    assert st.jobs[tasks[7]].spec.env["GPUSCHED_ARRAY_INDEX"] == "7"
    first = next(t for t in tasks if h.holding(t))
    await h.complete(first)
    await h.wait_for("a fourth task placed", lambda s: sum(1 for t in tasks if s.jobs[t].state != "pending") == 4)
    st = await h.sync()
    assert sum(h.holding(t) for t in tasks) == 3
    waiting = next(t for t in tasks if st.jobs[t].state == "pending")
    await h.wait_for("its reason", lambda s: s.jobs[waiting].pending_reason == f"array {arr} has 3 tasks running, its limit")
    # cancelling the array's id cancels every task not yet ended (running ones too), as scancel does
    cancelled = await h.client.cancel(arr, request_id="cancel-the-array")
    assert cancelled.ok and cancelled.job_id == arr
    st = await h.wait_for("every task ended", lambda s: all(s.jobs[t].state in ("completed", "cancelled") for t in tasks) and s)
    assert [st.jobs[t].state for t in tasks].count("completed") == 1 and st.running == {}
    again = await h.client.cancel(arr)
    assert not again.ok and again.error == f"job array {arr}: all 10 tasks already ended"
