"""OpenTelemetry configured as the SDK documents it: setting only OTEL_EXPORTER_OTLP_ENDPOINT
exports (OTLP/HTTP, installed by default), and `gpusched submit` starts the trace that the
command request carries to admission."""

from __future__ import annotations

import asyncio
import http.server
import os
import sys
import threading

import msgspec
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from gpusched.bus import subjects
from gpusched.bus.log import connect
from gpusched.core.commands import CommandReply


@pytest.fixture
def collector():
    """A minimal OTLP/HTTP receiver: remembers every request's path and decoded spans."""
    received: list[tuple[str, list]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server API
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            spans = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
            received.append((self.path, spans))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()


def _env(endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint  # and nothing else
    return env


async def test_only_the_endpoint_set_exports_and_the_cli_starts_the_trace(nats_url, collector):
    endpoint, received = collector
    nc = await connect(nats_url)
    seen: list[dict] = []

    async def admission_stand_in(msg):
        seen.append(dict(msg.headers or {}))
        await msg.respond(msgspec.json.encode(CommandReply(ok=True, job_id="j-1")))

    await nc.subscribe(subjects.CMD_ANY, cb=admission_stand_in)  # admin form gpusched.cmd.submit.<user>
    await nc.flush()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpusched.cli.main", "submit", "--nats", nats_url, "--team", "a", "--gpus", "1",
        "--", "true", env=_env(endpoint), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    await nc.drain()
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == "j-1"
    assert seen and "traceparent" in seen[0]
    trace_id = seen[0]["traceparent"].split("-")[1]
    paths = [p for p, _ in received]
    assert "/v1/traces" in paths, f"nothing exported to {endpoint}: {paths}"
    roots = [s for _, spans in received for s in spans if s.name == "gpusched submit"]
    assert roots and roots[0].trace_id.hex() == trace_id and not roots[0].parent_span_id
