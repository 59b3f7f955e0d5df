"""The dashboard's deltas: applying the delta between two models to the first gives the second
(what the page does), a grant at 1,000 nodes costs a few kB instead of the whole model, and a
page that holds an unknown or evicted version is told to take the whole model again."""

from __future__ import annotations

from collections import deque

import msgspec
import pytest

from gpusched import readmodel
from gpusched.cli.stack import simulated_nodes
from gpusched.core import events as ev
from gpusched.core.model import JobSpec, TeamQuota
from gpusched.core.state import ClusterState
from gpusched.services.dashboard.app import Series, page_model
from gpusched.services.dashboard.delta import KEYED, SERIES, Stale, Versions, apply, diff, index


class Page:
    """A fold with the dashboard's tail and share series: a model per version."""

    def __init__(self):
        self.state = ClusterState()
        self.series = Series(every_s=0.0)
        self.tail: deque = deque(maxlen=SERIES["tail"][1])
        self.seq = 0

    def feed(self, *events: ev.Event) -> dict:
        for e in events:
            self.seq += 1
            self.state.apply(e, self.seq)
            self.tail.append(readmodel.event_line(self.seq, e))
            self.series.observe(self.state)
        return page_model(self.state, self.seq, {}, list(self.series.points), list(self.tail))


def _nodes(n: int, per_rack: int = 4) -> list[ev.Event]:
    return simulated_nodes(n, 8, per_rack, "quads", at=0.0)


def _same(got: dict, want: dict) -> None:
    assert index(got) == index(want)
    for section, (key, _) in KEYED.items():
        assert [d[key] for d in got[section]] == [d[key] for d in want[section]] or section == "running", section
    for field, value in want.items():
        if field not in KEYED:
            assert got[field] == value, field


STEPS = {
    "a team and a job": [ev.TeamQuotaSet(at=1, team="vision", quota=TeamQuota(guaranteed=8)),
                         ev.JobSubmitted(at=2, job_id="a", spec=JobSpec(team="vision", gpus=8))],
    "a grant": [ev.GpusGranted(at=3, job_id="a", attempt=1, gpus=[f"node01/{g}" for g in range(8)])],
    "a queue that reorders": [ev.JobSubmitted(at=4, job_id="b", spec=JobSpec(team="nlp", gpus=2)),
                              ev.JobSubmitted(at=5, job_id="c", spec=JobSpec(team="nlp", gpus=2, priority="interactive")),
                              ev.JobPending(at=5, job_id="b", reason="waiting for 2 free GPUs")],
    "time passes only": [ev.JobPending(at=60, job_id="b", reason="waiting for 2 free GPUs")],
    "an end and a drain": [ev.JobCompleted(at=70, job_id="a", attempt=1, exit_code=0),
                           ev.NodeDrained(at=71, node="node02", drain=True, reason="maintenance")],
    "a node joins": _nodes(12, per_rack=4)[10:],
}


def test_applying_each_delta_gives_the_next_model():
    page = Page()
    old = page.feed(*_nodes(10))
    for name, events in STEPS.items():
        new = page.feed(*events)
        delta = msgspec.json.decode(msgspec.json.encode(diff(old, index(old), new, index(new))))  # as sent
        _same(apply(old, delta), new)
        if name == "time passes only":  # a pending job's wait grew; nobody's document changed
            assert "queue" not in delta and "nodes" not in delta and "running" not in delta
        if name == "a node joins":
            assert [d["node"] for d in delta["nodes"]["set"]] == ["node10", "node11"]
        old = new


def test_a_grant_at_1000_nodes_is_a_small_delta_and_racks_sort_by_number():
    page = Page()
    old = page.feed(*_nodes(1000), ev.TeamQuotaSet(at=1, team="vision", quota=TeamQuota(guaranteed=64)),
                    ev.JobSubmitted(at=2, job_id="a", spec=JobSpec(team="vision", gpus=8)))
    racks = list(dict.fromkeys(d["rack"] for d in old["nodes"]))
    assert racks[:3] == ["rack00", "rack01", "rack02"] and racks[99:102] == ["rack99", "rack100", "rack101"]
    versions = Versions()
    versions.publish(old)
    new = page.feed(ev.GpusGranted(at=3, job_id="a", attempt=1, gpus=[f"node500/{g}" for g in range(8)]))
    versions.publish(new)
    [(version, data)] = versions.since(old["version"])
    delta = msgspec.json.decode(data)
    assert version == new["version"] and delta["base"] == old["version"]
    assert [d["node"] for d in delta["nodes"]["set"]] == ["node500"]
    assert len(versions.full) > 1_000_000 and len(data) < 20_000, (len(versions.full), len(data))
    _same(apply(old, delta), new)


def test_a_page_that_missed_versions_gets_the_chain_or_the_whole_model():
    page = Page()
    versions = Versions(keep=3)
    models = [page.feed(*_nodes(4))]
    versions.publish(models[0])
    for i in range(5):
        models.append(page.feed(ev.JobSubmitted(at=10 + i, job_id=f"j{i}", spec=JobSpec(team="t", gpus=1))))
        versions.publish(models[-1])
    assert versions.since(models[-1]["version"]) == []
    chain = versions.since(models[2]["version"])
    assert [v for v, _ in chain] == [m["version"] for m in models[3:]]
    held = models[2]
    for _, data in chain:
        held = apply(held, msgspec.json.decode(data))
    _same(held, models[-1])
    assert versions.since(models[1]["version"]) is None  # evicted: the whole model again
    assert versions.since(999) is None  # a version of another server
    with pytest.raises(Stale):
        apply(models[1], msgspec.json.decode(chain[-1][1]))
