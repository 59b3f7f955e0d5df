"""JSON Schemas of every command and event, generated from the msgspec types.

`schemas/` is the contract for other platforms; `gpusched schemas` regenerates it and a
test fails when it drifts from the code.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from .commands import AnyCommand, CommandReply
from .events import AnyEvent


def _schema(tp: object) -> dict:
    return msgspec.json.schema(tp)


def all_schemas() -> dict[str, dict]:
    """File name -> schema. Extra telemetry types register through `EXTRA_SCHEMAS`."""
    out = {
        "events.schema.json": _schema(AnyEvent),
        "commands.schema.json": _schema(AnyCommand),
        "command-reply.schema.json": _schema(CommandReply),
    }
    for name, tp in EXTRA_SCHEMAS.items():
        out[name] = _schema(tp)
    return out


#: Types outside the log that integrators still see on the bus (e.g. node heartbeats).
EXTRA_SCHEMAS: dict[str, object] = {}


def render(schema: dict) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in all_schemas().items():
        path = directory / name
        path.write_text(render(schema))
        written.append(path)
    return written


def drift(directory: Path) -> list[str]:
    """Names of schema files that differ from what the code generates (or are missing)."""
    return [name for name, schema in all_schemas().items()
            if not (directory / name).exists() or (directory / name).read_text() != render(schema)]
