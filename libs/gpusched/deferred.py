"""Modules that stand in for others until used (`Deferred`), so that a command starts without
importing what a client library loads at its start but it never uses: importlib.metadata (tens
of ms), read instead as a distribution's version from the name of its dist-info; nats-py's
JetStream package (`gpusched.bus`)."""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager


def dist_version(package_dir: str, dist: str) -> str:
    """A distribution's version from its `NAME-VERSION.dist-info` beside its package."""
    site = os.path.dirname(package_dir)
    prefix = dist.replace("-", "_") + "-"
    for name in os.listdir(site):
        if name.startswith(prefix) and name.endswith(".dist-info"):
            return name[len(prefix) : -len(".dist-info")]
    return "0.0.0"


class Deferred(types.ModuleType):
    """Stands in for a module (in `sys.modules`, or as its parent's attribute): the first name
    asked of it imports the real one (the usual way: `sys.modules`, the parent's attribute) and
    is read from it."""

    def __getattr__(self, name: str):  # only names this stand-in does not have
        import importlib

        return getattr(importlib.import_module(self.__name__), name)


@contextmanager
def metadata_deferred() -> Iterator[None]:
    """While this lasts, `from importlib import metadata` (not yet imported) binds a stand-in that
    imports the real module when first used; after it, importing it loads the real one."""
    name = "importlib.metadata"
    if name in sys.modules:
        yield
        return
    sys.modules[name] = Deferred(name)
    try:
        yield
    finally:
        del sys.modules[name]
