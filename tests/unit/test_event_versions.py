"""Facts evolve: every shape ever appended still reads, and a newer writer's added fields do
not break this reader (the rule in `core/events.py`)."""

from __future__ import annotations

import msgspec
import pytest

from gpusched.core import events as ev
from gpusched.core.model import JobSpec, Preferences, TeamQuota, TopologyConstraint

# name: (a stored fact as an older writer appended it, what it reads as today)
OLD_SHAPES = {
    "GpusGranted v1, before handover": (
        b'{"type":"GpusGranted","at":5,"v":1,"job_id":"j","attempt":1,"gpus":["n0/0"],"placer":"topo",'
        b'"level":"nvlink","backfill":false}',
        ev.GpusGranted(at=5, v=1, job_id="j", attempt=1, gpus=["n0/0"], level="nvlink")),
    "GpusGranted v2, before slices (a whole-GPU or fractional grant)": (
        b'{"type":"GpusGranted","at":5,"v":2,"job_id":"j","attempt":1,"gpus":["n0/0"],"placer":"topo",'
        b'"level":"nvlink","backfill":false,"handover":true}',
        ev.GpusGranted(at=5, v=2, job_id="j", attempt=1, gpus=["n0/0"], level="nvlink", handover=True, slices=[])),
    "JobSubmitted v5, before mig and mig_count (no MIG ask)": (
        b'{"type":"JobSubmitted","at":1,"v":5,"job_id":"j","spec":{"team":"a","gpus":1,"gpu_fraction":0.5,'
        b'"gpu_type":"H100","gpu_type_fallback":["A100"]},"request_id":"r1","user":"u","via":""}',
        ev.JobSubmitted(at=1, v=5, job_id="j", request_id="r1", user="u",
                        spec=JobSpec(team="a", gpus=1, gpu_fraction=0.5, gpu_type="H100", gpu_type_fallback=["A100"],
                                     mig=None, mig_count=1))),
    "GpusGranted v1, before backfill and level": (
        b'{"type":"GpusGranted","at":5,"v":1,"job_id":"j","attempt":1,"gpus":["n0/0","n0/1"]}',
        ev.GpusGranted(at=5, v=1, job_id="j", attempt=1, gpus=["n0/0", "n0/1"])),
    "JobSubmitted v1, before prefer, array, constraints, gpu_type, dependency": (
        b'{"type":"JobSubmitted","at":1,"v":1,"job_id":"j","spec":{"team":"a","gpus":2,"min_gpus":null,'
        b'"priority":"high","preemptible":true,"topology":{"required":"node","preferred":"nvlink"},'
        b'"time_limit_s":60.0,"command":["true"],"env":{},"checkpoint_dir":null,"on_failure":"requeue",'
        b'"max_restarts":3,"name":""},"request_id":"r1"}',
        ev.JobSubmitted(at=1, v=1, job_id="j", request_id="r1",
                        spec=JobSpec(team="a", gpus=2, priority="high", preemptible=True, time_limit_s=60.0,
                                     topology=TopologyConstraint(required="node"), command=["true"]))),
    "NodeRegistered v1, before labels": (
        b'{"type":"NodeRegistered","at":0,"v":1,"node":"n0","rack":"r0","gpus":[{"index":0,"uuid":"u0"}]}',
        msgspec.convert({"type": "NodeRegistered", "at": 0, "v": 1, "node": "n0", "rack": "r0",
                         "gpus": [{"index": 0, "uuid": "u0"}]}, ev.AnyEvent)),
    "NodeRegistered v1, before cpus and memory_mb (not declared: not counted)": (
        b'{"type":"NodeRegistered","at":0,"v":1,"node":"n0","rack":"r0","gpus":[],"labels":{"zone":"a"}}',
        ev.NodeRegistered(at=0, v=1, node="n0", rack="r0", gpus=[], labels={"zone": "a"}, cpus=0.0, memory_mb=0)),
    "TeamQuotaSet v1, before default_cpus and default_memory_mb": (
        b'{"type":"TeamQuotaSet","at":0,"v":1,"team":"a","quota":{"guaranteed":2,"weight":1.0,"limit":null,'
        b'"default_time_limit_s":60.0,"max_time_limit_s":null}}',
        ev.TeamQuotaSet(at=0, v=1, team="a", quota=TeamQuota(guaranteed=2, default_time_limit_s=60.0))),
}


@pytest.mark.parametrize("name", list(OLD_SHAPES))
def test_every_old_shape_reads_as_today(name):
    stored, want = OLD_SHAPES[name]
    assert ev.decode_event(stored) == want


# name: (a fact as a newer writer appends it, what this reader folds)
NEWER = {
    "an added top-level field": (
        b'{"type":"GpusGranted","at":5,"v":3,"job_id":"j","attempt":1,"gpus":["n0/0"],"pool":"shared"}',
        ev.GpusGranted(at=5, v=3, job_id="j", attempt=1, gpus=["n0/0"])),
    "an added field deep in the spec": (
        b'{"type":"JobSubmitted","at":1,"v":3,"job_id":"j","spec":{"team":"a","gpus":2,"nics":16,'
        b'"topology":{"required":"node","preferred":"node","switch":"s1"},'
        b'"prefer":{"spread":true,"nearby":"x"}}}',
        ev.JobSubmitted(at=1, v=3, job_id="j", spec=JobSpec(team="a", gpus=2, topology=TopologyConstraint(
            required="node", preferred="node"), prefer=Preferences(spread=True)))),
}


@pytest.mark.parametrize("name", list(NEWER))
def test_a_newer_writers_added_fields_are_dropped_not_dead_lettered(name):
    stored, want = NEWER[name]
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.json.decode(stored, type=ev.AnyEvent)  # what a strict reader did: dead-letter it
    assert ev.decode_event(stored) == want


# name: (a fact still refused: not an added field, a wrong one, with its reason)
STILL_BAD = {
    "a known field of the wrong type": (b'{"type":"GpusGranted","at":1,"job_id":"j","attempt":"1","gpus":[],"x":1}',
                                        "Expected `int`, got `str` - at `$.attempt`"),
    "a missing required field": (b'{"type":"GpusGranted","at":1,"job_id":"j","x":1}', "missing required field"),
    "an unknown event type": (b'{"type":"MeteorStrike","at":1}', "Invalid value 'MeteorStrike'"),
}


@pytest.mark.parametrize("name", list(STILL_BAD))
def test_what_is_not_an_added_field_is_still_refused_precisely(name):
    stored, reason = STILL_BAD[name]
    with pytest.raises(msgspec.ValidationError, match=reason.replace("$", r"\$").replace("`", ".")):
        ev.decode_event(stored)


def test_each_class_writes_its_version_and_says_what_each_added():
    for cls in ev.EVENT_TYPES.values():
        fields = {f.name: f for f in msgspec.structs.fields(cls)}
        assert fields["v"].default == cls.VERSION, cls.__name__
        assert sorted(cls.HISTORY) == list(range(1, cls.VERSION + 1)), cls.__name__


def test_an_upcaster_turns_a_stored_shape_into_the_next(monkeypatch):
    """The chain for a change that is not additive: v1 `gpu` (one GPU) became `gpus` (a list)."""
    monkeypatch.setitem(ev.UPCASTERS, ("GpusGranted", 1),
                        lambda raw: {**{k: v for k, v in raw.items() if k != "gpu"}, "gpus": [raw["gpu"]]})
    stored = b'{"type":"GpusGranted","at":5,"v":1,"job_id":"j","attempt":1,"gpu":"n0/3"}'
    assert ev.decode_event(stored) == ev.GpusGranted(at=5, v=2, job_id="j", attempt=1, gpus=["n0/3"])
