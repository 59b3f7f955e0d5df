from pathlib import Path

import msgspec
import pytest

from gpusched.core import commands, schemas
from gpusched.core import events as ev

ROOT = Path(__file__).resolve().parents[2]


def test_schemas_dir_matches_the_code():
    from gpusched import openapi
    from gpusched.bus import asyncapi

    stale = schemas.drift(ROOT / "schemas") + asyncapi.drift(ROOT / "schemas") + openapi.drift(ROOT / "schemas")
    assert stale == [], f"schemas/ drifted from the msgspec types: {stale}; run `gpusched schemas`"


def test_every_event_type_is_in_the_events_schema():
    names = set(schemas.all_schemas()["events.schema.json"]["$defs"])
    assert set(ev.EVENT_TYPES) <= names


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b'{"type":"SubmitJob","request_id":"r1","spec":{"team":"a","gpus":0}}', "`$.spec.gpus`"),
        (b'{"type":"SubmitJob","request_id":"r1","spec":{"team":"a","gpus":2,"priority":"urgent"}}', "$.spec.priority"),
        (b'{"type":"SubmitJob","request_id":"r1","spec":{"team":"a b","gpus":2}}', "$.spec.team"),
        (b'{"type":"LaunchMissiles","request_id":"r1"}', "Invalid value 'LaunchMissiles'"),
        (b'{"type":"CancelJob"}', "missing required field"),
        (b'not json', "JSON is malformed"),
    ],
)
def test_malformed_commands_get_a_precise_reason(raw, fragment):
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)) as err:
        commands.decode_command(raw)
    assert fragment in str(err.value)


def test_asyncapi_documents_every_command_and_event_subject():
    """Integrators find every subject in schemas/asyncapi.json, each the code's own pattern."""
    from gpusched.bus import asyncapi, subjects
    from gpusched.bus.control_client import COMMAND_SUBJECTS

    doc = asyncapi.document()
    addresses = {c["address"] for c in doc["channels"].values()}
    assert set(ev.EVENT_TYPES) <= set(doc["components"]["messages"])
    assert {t.__name__ for t in commands.AnyCommand.__args__} <= set(doc["components"]["messages"])
    assert set(COMMAND_SUBJECTS.values()) <= addresses
    assert subjects.Q_SHARES in addresses
    # a real event's subject matches its documented pattern, token by token
    grant = ev.GpusGranted(at=1, job_id="j-1", attempt=1, gpus=["n0/0"], level="nvlink")
    pattern = doc["channels"]["GpusGranted"]["address"].split(".")
    real = subjects.event_subject(grant).split(".")
    assert len(pattern) == len(real)
    assert all(p == r or p.startswith("{") for p, r in zip(pattern, real))
    for channel in doc["channels"].values():
        for ref in channel["messages"].values():
            assert ref["$ref"].split("/")[-1] in doc["components"]["messages"]


def test_asyncapi_follows_the_command_subjects_the_code_has(monkeypatch):
    """When command subjects carry the team and user (`command_subject(kind, team, user)`), the
    document shows the tenant form with its parameters: it is generated, not written by hand."""
    from gpusched.bus import asyncapi, subjects

    def command_subject(kind, team=None, user=None):
        if team is not None:
            return f"gpusched.cmd.{kind}.{subjects.token(team)}.{subjects.token(user or '_')}"
        return f"gpusched.cmd.{kind}"

    monkeypatch.setattr(subjects, "command_subject", command_subject, raising=False)
    channels = asyncapi.document()["channels"].values()
    tenant = [c for c in channels if c["address"] == "gpusched.cmd.submit.{team}.{user}"]
    assert tenant and set(tenant[0]["parameters"]) == {"team", "user"}
