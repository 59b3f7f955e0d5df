"""The bus: NATS subjects, the event log, request/reply clients.

nats-py imports, at its start, three things that a gpusched client that only asks and answers
(a tenant's `jobs` through the reader) never uses: together about a third of such a call's start.
So nats is first imported here without them, each loaded as usual by whoever needs it later:
- aiohttp (for its WebSocket transport; gpusched's URLs are nats:// and tls://), when it is
  installed, unless it is loaded already (the dashboard);
- importlib.metadata, to read nats-py's own version: read here from its dist-info's name;
- its JetStream package `nats.js` (some fifty dataclasses): the client refers to it as
  `nats.js.…` only when it handles a status header or makes a JetStream context, so it stands in
  as `Deferred` until then (`bus.log` imports it at once: every user of the log has it as before).
  Of a status header (a request's 503 "no responders": admin's `jobs` when no reader runs) it
  reads only the three names of `StatusHeader`, so those are answered without loading it.
"""

import enum as _enum
import os as _os
import sys as _sys
import types as _types

from gpusched.deferred import Deferred
from gpusched.deferred import dist_version as _dist_version


class StatusHeader(str, _enum.Enum):
    """The names of `nats.js.api.Header` that nats-py's client reads of a message with a status
    (tests/unit/test_bus_imports.py checks them against nats-py's source and values)."""

    STATUS = "Status"
    DESCRIPTION = "Description"
    CONSUMER_STALLED = "Nats-Consumer-Stalled"


def _hidden(names: list[str]) -> list[str]:
    """Make `import NAME` fail softly for these (those not loaded yet); the ones it applies to."""
    hidden = [n for n in names if n not in _sys.modules]
    for n in hidden:
        _sys.modules[n] = None  # type: ignore[assignment]
    return hidden


if "nats" not in _sys.modules:
    import importlib.machinery as _machinery
    import importlib.util as _util

    _top = _util.find_spec("nats")  # found, not imported (as `find_spec("nats.js")` would)
    _spec = _machinery.PathFinder.find_spec("nats.js", _top.submodule_search_locations) if _top else None
    _deferred = None
    _hid = _hidden(["aiohttp", "importlib.metadata"])
    try:
        if _spec is not None:
            _deferred = Deferred(_spec.name)
            _deferred.__spec__ = _spec  # what `import nats.js` reads of a module already there
            _deferred.api = Deferred(_spec.name + ".api")  # type: ignore[attr-defined] # any other name: the real one
            _deferred.api.Header = StatusHeader  # type: ignore[attr-defined]
            _sys.modules[_spec.name] = _deferred
        import nats.aio.client  # noqa: F401 - its imports of the hidden fail softly
    finally:
        for _name in _hid:
            del _sys.modules[_name]
        if _deferred is not None and _sys.modules.get("nats.js") is _deferred:
            del _sys.modules["nats.js"]  # importing nats.js (or a module of it) loads the real one
    if _deferred is not None and not isinstance(getattr(nats, "js", None), _types.ModuleType):
        nats.js = _deferred  # type: ignore[attr-defined] # what `import nats.js` would have set
    import nats.aio.client as _client

    _client.__version__ = _dist_version(_os.path.dirname(nats.__file__), "nats-py")  # type: ignore[attr-defined]
