"""Chaos: `kill -9` the placement service. Jobs still get placed (naively, `placer="naive"`,
`PlacementDegraded` appended once); a restarted placement takes over again
(`PlacementRecovered` once) and topology-aware placement resumes. A standby placement instance
takes over from a dead active one without any degradation."""

from __future__ import annotations

from gpusched.core import events as ev

from .harness import LEASE_TTL_MS, harness  # noqa: F401


async def test_kill9_placement_degrades_to_naive_then_recovers(harness):
    h = harness
    h.start("admission")
    h.start("placement")
    h.start("fallback", "--grace-ms", str(LEASE_TTL_MS))
    await h.ready("admission", "placement", "fallback")
    await h.nodes(4, 8, per_rack=2, nvlink="pairs")

    first = await h.submit(team="a", gpus=2)
    await h.wait_for("topo grant", lambda s: h.holding(first))
    assert h.state.jobs[first].placer == "topo" and h.state.jobs[first].level == "nvlink"

    h.kill9("placement")
    await h.wait_for("degraded", lambda s: s.placement_degraded, timeout=10)
    during = [await h.submit(team="a", gpus=g) for g in (1, 3, 8)]
    await h.wait_for("naive grants", lambda s: all(h.holding(j) for j in during))
    assert {h.state.jobs[j].placer for j in during} == {"naive"}

    h.start("placement")
    await h.wait_for("recovered", lambda s: not s.placement_degraded, timeout=15)
    after = await h.submit(team="a", gpus=2)
    await h.wait_for("topo grant again", lambda s: h.holding(after))
    assert h.state.jobs[after].placer == "topo"
    assert len(h.events(ev.PlacementDegraded)) == 1 and len(h.events(ev.PlacementRecovered)) == 1
    degraded = h.events(ev.PlacementDegraded)[0]
    assert "placement lease" in degraded.reason


async def test_a_standby_placement_takes_over_without_degrading(harness):
    h = harness
    h.start("admission")
    h.start("placement", alias="active")
    await h.ready("admission", "active")
    h.start("placement", alias="standby")
    h.start("fallback", "--grace-ms", "3000")  # longer than a standby needs to take the lease
    await h.ready("standby", "fallback")
    await h.nodes(2, 8)
    h.kill9("active")
    job = await h.submit(team="a", gpus=4)
    await h.wait_for("granted by the standby", lambda s: h.holding(job), timeout=10)
    assert h.state.jobs[job].placer == "topo"
    assert not h.events(ev.PlacementDegraded)
