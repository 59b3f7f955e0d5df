"""The bus: NATS subjects, the event log, request/reply clients.

nats-py imports aiohttp (for its WebSocket transport, which gpusched never uses: its URLs are
nats:// and tls://) when it is installed: about a third of a CLI call's start. So nats is first
imported here with aiohttp hidden, unless aiohttp is loaded already (the dashboard); aiohttp stays
importable for whoever asks for it later.
"""

import sys as _sys

if "nats" not in _sys.modules and "aiohttp" not in _sys.modules:
    _sys.modules["aiohttp"] = None  # type: ignore[assignment]
    try:
        import nats.aio.transport  # noqa: F401 - its `import aiohttp` fails softly: no WebSocket transport
    finally:
        del _sys.modules["aiohttp"]
