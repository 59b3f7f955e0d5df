"""Gang placement: the tightest set, then best fit; naive first-free; never wider than required."""

from __future__ import annotations

import pytest

from gpusched.policy.placement import Pool, explain_no_fit, first_free, place

from .policy_helpers import Scenario, gpus


def _busy(s: Scenario, holdings: dict[str, list[str]]) -> None:
    for job, gs in holdings.items():
        s.run(job, gs)


# name: (cluster kwargs, GPUs held by other jobs, request size, required, want nodes used, want level)
CASES = {
    "small job on an empty node: one NVLink domain": (
        dict(racks=1, nodes=2), {}, 4, "cluster", {"r0n0"}, "nvlink"),
    "best fit: the node with the fewest free GPUs that still fits": (
        dict(racks=1, nodes=3), {"x": gpus("r0n1", 0, 1, 2, 3, 4), "y": gpus("r0n2", 0, 1)}, 3, "cluster",
        {"r0n1"}, "nvlink"),
    "whole free node kept free for the next big job": (
        dict(racks=1, nodes=2), {"x": gpus("r0n1", 0, 1, 2, 3)}, 4, "cluster", {"r0n1"}, "nvlink"),
    "16 GPUs: two whole nodes of one rack, not across racks": (
        dict(racks=2, nodes=2), {"x": gpus("r0n0", 0)}, 16, "cluster", {"r1n0", "r1n1"}, "rack"),
    "rack: fewest nodes beats best-fit rack": (
        dict(racks=2, nodes=3),
        {"x": gpus("r0n0", 0, 1, 2, 3), "y": gpus("r0n1", 0, 1, 2, 3), "z": gpus("r0n2", 0, 1, 2, 3),
         "w": gpus("r1n2", 0, 1, 2, 3, 4, 5, 6, 7)},
        12, "cluster", {"r1n0", "r1n1"}, "rack"),
    "rack: best fit among racks needing as few nodes": (
        dict(racks=2, nodes=2), {"x": gpus("r1n1", 0, 1, 2, 3)}, 12, "cluster", {"r1n0", "r1n1"}, "rack"),
    "across racks when no rack holds the gang": (
        dict(racks=2, nodes=1), {}, 12, "cluster", {"r0n0", "r1n0"}, "cluster"),
    "quads: a 4-GPU job gets one whole quad": (
        dict(racks=1, nodes=1, nvlink="quads"), {"x": gpus("r0n0", 0)}, 4, "cluster", {"r0n0"}, "nvlink"),
    "pairs: a 2-GPU job takes the domain pair, not one GPU of two pairs": (
        dict(racks=1, nodes=1, nvlink="pairs"), {"x": gpus("r0n0", 0, 3)}, 2, "cluster", {"r0n0"}, "nvlink"),
    "no NVLink (PCIe only): a 2-GPU job spans the node": (
        dict(racks=1, nodes=1, nvlink="none"), {}, 2, "cluster", {"r0n0"}, "node"),
    "required node: no fit across nodes": (
        dict(racks=1, nodes=2), {"x": gpus("r0n0", 0, 1, 2, 3), "y": gpus("r0n1", 0, 1, 2, 3)}, 6, "node",
        None, None),
    "required rack: no fit across racks": (
        dict(racks=2, nodes=1), {}, 12, "rack", None, None),
    "blocks: 24 GPUs stay within one block": (
        dict(racks=4, nodes=1, blocks=2), {"x": gpus("r0n0", 0)}, 16, "block", {"r1n0", "r3n0"}, "block"),
    "more than free: none": (
        dict(racks=1, nodes=1), {"x": gpus("r0n0", 0)}, 8, "cluster", None, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_place(name):
    cluster, holdings, n, required, want_nodes, want_level = CASES[name]
    s = Scenario(**cluster)
    _busy(s, holdings)
    p = place(Pool(s.state), n, required)
    if want_nodes is None:
        assert p is None
        return
    assert p is not None and len(p.gpus) == n and len(set(p.gpus)) == n
    assert {g.split("/")[0] for g in p.gpus} == want_nodes, p
    assert p.level == want_level == s.state.span(p.gpus)
    assert all(s.state.gpus[g].holder is None for g in p.gpus)


FIRST_FREE = {
    "takes the first free GPUs in node order": (dict(racks=1, nodes=2), {"x": gpus("r0n0", 0, 1)}, 8, "cluster",
                                                gpus("r0n0", 2, 3, 4, 5, 6, 7) + gpus("r0n1", 0, 1)),
    "within one node when required": (dict(racks=1, nodes=2), {"x": gpus("r0n0", 0, 1)}, 8, "node",
                                      gpus("r0n1", *range(8))),
    "none when nothing fits": (dict(racks=1, nodes=1), {"x": gpus("r0n0", 0)}, 8, "cluster", None),
}


@pytest.mark.parametrize("name", list(FIRST_FREE))
def test_first_free(name):
    cluster, holdings, n, required, want = FIRST_FREE[name]
    s = Scenario(**cluster)
    _busy(s, holdings)
    p = first_free(Pool(s.state), n, required)
    assert (p.gpus if p else None) == want


def test_pool_tracks_taken_and_released_gpus_without_touching_the_state():
    s = Scenario(racks=1, nodes=1)
    s.run("x", gpus("r0n0", 0, 1, 2, 3))
    pool = Pool(s.state)
    pool.take(gpus("r0n0", 4, 5))
    assert pool.count == 2 and pool.free_on("r0n0") == gpus("r0n0", 6, 7)
    pool.add(gpus("r0n0", 0, 1, 2, 3))
    assert pool.count == 6 and place(pool, 6).gpus == gpus("r0n0", 6, 7, 0, 1, 2, 3)
    assert s.state.free_count == 4 and list(s.state.nodes["r0n0"].free) == gpus("r0n0", 4, 5, 6, 7)


def test_explain_no_fit_names_the_free_counts_that_matter():
    s = Scenario(racks=2, nodes=2)
    s.run("x", gpus("r0n0", *range(8)) + gpus("r0n1", 0, 1, 2, 3, 4, 5, 6))
    s.run("y", gpus("r1n0", *range(8)) + gpus("r1n1", 0, 1))
    assert explain_no_fit(Pool(s.state), 16, "rack") == "waiting for 16 GPUs within one rack; 6 free in rack r1, 1 in r0"
    assert explain_no_fit(Pool(s.state), 16, "cluster") == "waiting for 16 GPUs; 7 free"
