"""JSON Schemas of every command and event, generated from the msgspec types.

`schemas/` is the contract for other platforms; `gpusched schemas` regenerates it and a
test fails when it drifts from the code.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import msgspec

from . import limits
from .commands import AnyCommand, CommandReply
from .events import AnyEvent
from .heartbeat import SCHEMAS as BUS_SCHEMAS


def _schema(tp: object) -> dict:
    return _clean(msgspec.json.schema(tp))


def _clean(node):
    """Dedent docstring descriptions the same way whatever the msgspec version (0.23 dedents,
    earlier ones do not), so `schemas/` is stable across installs."""
    if isinstance(node, dict):
        return {k: inspect.cleandoc(v) if k == "description" and isinstance(v, str) else _clean(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_clean(v) for v in node]
    return node


def all_schemas() -> dict[str, dict]:
    """File name -> schema: the log's events, admission's commands, and what node daemons say
    outside the log (heartbeats, node-control requests)."""
    types = {"events.schema.json": AnyEvent, "commands.schema.json": AnyCommand,
             "command-reply.schema.json": CommandReply, **BUS_SCHEMAS}
    return {name: _schema(tp) for name, tp in types.items()}


def render(schema: dict) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


LIMITS_DOC = "LIMITS.md"


def all_files() -> dict[str, str]:
    """File name -> text of everything `schemas/` holds: the schemas and the limits table."""
    return {**{name: render(schema) for name, schema in all_schemas().items()}, LIMITS_DOC: limits.document()}


def write_file(directory: Path, name: str, text: str) -> Path:
    """One generated file of `schemas/` (the bus's AsyncAPI and the HTTP API's OpenAPI use it too)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(text)
    return path


def drifted(directory: Path, name: str, text: str) -> bool:
    """Whether `schemas/NAME` is missing or differs from what the code generates."""
    path = directory / name
    return not path.exists() or path.read_text() != text


def write(directory: Path) -> list[Path]:
    return [write_file(directory, name, text) for name, text in all_files().items()]


def drift(directory: Path) -> list[str]:
    """Names of schema files that differ from what the code generates (or are missing)."""
    return [name for name, text in all_files().items() if drifted(directory, name, text)]
