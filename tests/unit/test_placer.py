"""Placement as filters and scorers: soft preferences change which GPUs a job gets, never
whether it gets any; without one, the scorers choose what the search always chose."""

from __future__ import annotations

import random

import pytest

from gpusched.core import events as ev
from gpusched.core.model import LEVELS, GpuInfo, JobSpec, Preferences, TopologyConstraint, nvlink_domains
from gpusched.policy.placement import Pool, candidates, place
from gpusched.policy.placer import FILTERS, SCORERS, Placer

from .policy_helpers import Scenario, gpus
from .test_placement_index import LAYOUTS, _cluster


def _node(s: Scenario, name: str, rack: str, model: str = "A100", labels: dict[str, str] | None = None,
          n: int = 8, nvlink: str = "all") -> None:
    doms = nvlink_domains(nvlink, n)
    infos = [GpuInfo(index=i, uuid=f"{name}-{i}", model=model, nvlink_domain=doms[i]) for i in range(n)]
    s.apply(ev.NodeRegistered(at=0.0, node=name, rack=rack, gpus=infos, nvlink=nvlink, labels=labels or {}))


def _mixed() -> Scenario:
    """a0 (A100, 2 free: best fit), h0 (H100, 8 free, zone=b), a1 (A100, 8 free, zone=b)."""
    s = Scenario(racks=0)
    _node(s, "a0", "r0")
    _node(s, "h0", "r0", model="NVIDIA H100 80GB", labels={"zone": "b"})
    _node(s, "a1", "r1", labels={"zone": "b"})
    s.run("x", gpus("a0", 0, 1, 2, 3, 4, 5))
    s.run("y", gpus("a1", 0))
    return s


def _spec(n: int, required: str = "cluster", **prefer) -> JobSpec:
    return JobSpec(team="a", gpus=n, topology=TopologyConstraint(required=required),
                   prefer=Preferences(**prefer) if prefer else None)


def _nodes(p) -> set[str]:
    return {g.split("/")[0] for g in p.gpus}


# name: (job size, required, preferences, nodes chosen)
CASES = {
    "no preference: best fit, the node with the fewest free": (2, "cluster", {}, {"a0"}),
    "gpu model: the H100 node, though a0 fits tighter": (2, "cluster", {"gpu_type": "h100"}, {"h0"}),
    "label: zone=b, the best fit of the labelled nodes": (2, "cluster", {"labels": {"zone": "b"}}, {"a1"}),
    "model and label: the node with both": (2, "cluster", {"gpu_type": "H100", "labels": {"zone": "b"}}, {"h0"}),
    "spread: the emptiest node": (1, "cluster", {"spread": True}, {"h0"}),
    "a preference nothing has: as without one": (2, "cluster", {"gpu_type": "B200"}, {"a0"}),
    "never a level wider for a preference": (8, "cluster", {"gpu_type": "A100", "labels": {"zone": "b"}}, {"h0"}),
    "too big for the preferred model: one rack all the same": (9, "cluster", {"gpu_type": "H100"}, {"h0", "a0"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_preferences_choose_among_what_fits(name):
    n, required, prefer, want = CASES[name]
    s = _mixed()
    p = Placer("topo").place(Pool(s.state), _spec(n, required, **prefer), n)
    assert p is not None and _nodes(p) == want, (name, p)


def test_preferences_reach_the_grant_through_a_cycle():
    s = _mixed()
    s.submit("j", gpus=2, prefer=Preferences(gpu_type="H100"))
    s.submit("k", gpus=2)
    granted = {e.job_id: _nodes(e) for e in s.cycle("full") if isinstance(e, ev.GpusGranted)}
    assert granted == {"j": {"h0"}, "k": {"a0"}}


@pytest.mark.parametrize("layouts", [("all",), LAYOUTS], ids=["all", "mixed"])
def test_a_preference_never_changes_feasibility_and_none_changes_nothing(layouts):
    """On random clusters: with no preference, the scorers' best is the search's answer; with
    any, a set is found exactly when one is found without it, within the same required level."""
    rng = random.Random(27)
    placer, checked = Placer("topo"), 0
    for _ in range(25):
        s = _cluster(rng, layouts)
        for i, node in enumerate(s.state.nodes.values()):  # some labels to prefer
            if i % 2:
                s.apply(ev.NodeLabeled(at=0.0, node=node.name, labels={"zone": "b"}))
        pool = Pool(s.state)
        for n in range(1, pool.topo.max_node * 2 + 1):
            for required in LEVELS:
                plain = place(pool, n, required)
                found = candidates(pool, n, required)
                assert (found[0].gpus, found[0].level) == (plain.gpus, plain.level) if plain else not found
                for prefer in ({"labels": {"zone": "b"}}, {"spread": True}, {"gpu_type": "unknown"}):
                    p = placer.place(pool, _spec(n, required, **prefer), n)
                    assert (p is None) == (plain is None), (n, required, prefer)
                    if p is not None:
                        assert p.level == plain.level and len(set(p.gpus)) == n
                        checked += 1
    assert checked > 500


def test_one_line_adds_a_filter_or_a_scorer():
    """The stack is data: a placer over other lists uses them, the module's lists untouched."""
    s = _mixed()
    spec = _spec(2)
    no_a0 = Placer("topo", filters=[*FILTERS, lambda pool, sp, now: pool.without(s.state.nodes["a0"].gpus)])
    assert _nodes(no_a0.place(Pool(s.state), spec, 2)) == {"a1"}
    assert _nodes(Placer("topo").place(Pool(s.state), spec, 2)) == {"a0"}
    assert [x.name for x in SCORERS] == ["tightness", "gpu_model", "labels", "spread"]


# --prefer as typed: (arguments, topology level aimed for, the job's soft preferences)
CLI_CASES = {
    "none": ([], "nvlink", None),
    "a level, as before": (["--prefer", "rack"], "rack", None),
    "gpu model": (["--prefer", "gpu-type=H100"], "nvlink", Preferences(gpu_type="H100")),
    "labels add up, with a level": (["--prefer", "label=zone=b", "--prefer", "label=ib=yes", "--prefer", "node"],
                                    "node", Preferences(labels={"zone": "b", "ib": "yes"})),
    "spread": (["--prefer", "spread"], "nvlink", Preferences(spread=True)),
}


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_submit_prefer_builds_the_spec(name):
    from gpusched.cli.commands import spec_from_args
    from gpusched.cli.main import build_parser

    argv, level, prefer = CLI_CASES[name]
    args = build_parser().parse_args(["submit", "--team", "a", "--gpus", "2", *argv, "--", "true"])
    spec = spec_from_args(args)
    assert (spec.topology.preferred, spec.prefer) == (level, prefer)


@pytest.mark.parametrize("bad", ["gpu-type=", "label=zone", "nearby", "label==b"])
def test_submit_prefer_rejects_what_it_cannot_read(bad):
    from gpusched.cli.commands import spec_from_args
    from gpusched.cli.main import build_parser

    args = build_parser().parse_args(["submit", "--team", "a", "--gpus", "2", "--prefer", bad, "--", "true"])
    with pytest.raises(SystemExit, match="--prefer"):
        spec_from_args(args)
