from pathlib import Path

import msgspec
import pytest

from gpusched.core import commands, schemas
from gpusched.core import events as ev

ROOT = Path(__file__).resolve().parents[2]


def test_schemas_dir_matches_the_code():
    stale = schemas.drift(ROOT / "schemas")
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
