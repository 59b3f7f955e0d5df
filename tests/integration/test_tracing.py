"""One trace follows a job across services: the context travels in NATS headers (requests and
appended events), and every service's spans are children of the previous hop's."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from nats.errors import NoRespondersError
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gpusched import telemetry
from gpusched.bus import subjects
from gpusched.bus.log import EventLog
from gpusched.core import events as ev
from gpusched.core.commands import SubmitJob
from gpusched.core.model import GpuInfo, JobSpec


@pytest.fixture
def spans():
    telemetry.reset_for_tests()
    exporter = InMemorySpanExporter()
    telemetry.setup(exporter=exporter, json_logs=True)
    yield exporter
    telemetry.reset_for_tests()
    import structlog

    structlog.reset_defaults()


async def _follow_and_act(nats_url: str, service: str, handle, stop: asyncio.Event) -> None:
    """A minimal service shell: its own connection, reads the log, appends what `handle` says."""
    telemetry.set_service(service)
    log = await EventLog.open(nats_url, name=service)
    try:
        async for rec in log.records(1, follow=True):
            await handle(rec, log)
            if stop.is_set():
                return
    finally:
        await log.close()


async def test_job_trace_crosses_services(nats_url, spans):
    setup_log = await EventLog.open(nats_url, name="setup")
    await setup_log.append(ev.NodeRegistered(at=1.0, node="n0", rack="r0", gpus=[GpuInfo(index=0, uuid="u0")]))
    done = asyncio.Event()

    # admission: a request/reply handler that extracts the caller's context
    telemetry.set_service("admission")
    adm = await EventLog.open(nats_url, name="admission")

    async def on_submit(msg):
        with telemetry.consume_span("admission.SubmitJob", msg.headers, kind=telemetry.SpanKind.SERVER):
            cmd = msgspec.json.decode(msg.data, type=SubmitJob)
            seq = await adm.append(ev.JobSubmitted(at=2.0, job_id="j1", spec=cmd.spec, request_id=cmd.request_id))
            await msg.respond(str(seq).encode())

    await adm.nc.subscribe(subjects.CMD_SUBMIT, cb=on_submit)
    await adm.nc.flush()  # the server knows the responder before the request is sent

    async def placement(rec, log):  # a decision about the job: the grant continues its trace by itself
        if rec.event.kind == "JobSubmitted":
            await log.append(ev.GpusGranted(at=3.0, job_id="j1", attempt=1, gpus=["n0/0"]))

    async def nodeagent(rec, log):  # handles records explicitly: a consume span per record
        kind = rec.event.kind
        if kind == "GpusGranted":
            with telemetry.record_span("nodeagent.start", rec):
                await log.append(ev.JobStarted(at=4.0, job_id="j1", attempt=1, node="n0"))
        elif kind == "JobStarted":  # later facts of the job need no span of their own
            await log.append(ev.CheckpointSaved(at=5.0, job_id="j1", attempt=1, path="/ck/1", step=10))
        elif kind == "CheckpointSaved":
            await log.append(ev.JobCompleted(at=6.0, job_id="j1", attempt=1))
        elif kind == "JobCompleted":
            done.set()

    tasks = [
        asyncio.create_task(_follow_and_act(nats_url, "placement", placement, done)),
        asyncio.create_task(_follow_and_act(nats_url, "nodeagent", nodeagent, done)),
    ]
    # the client: a root span, its context injected into the request headers
    telemetry.set_service("cli")
    with telemetry.span("gpusched submit", kind=telemetry.SpanKind.CLIENT) as root:
        body = msgspec.json.encode(SubmitJob(request_id="r1", spec=JobSpec(team="a", gpus=1)))
        for _ in range(50):  # bounded: a loaded CI box once answered "no responders" here
            try:  # safe to repeat: a request nobody received changed nothing
                await setup_log.nc.request(subjects.CMD_SUBMIT, body, timeout=5, headers=telemetry.inject({}))
                break
            except NoRespondersError:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("admission's responder never became visible to the client")
    await asyncio.wait_for(done.wait(), 10)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await adm.close()
    await setup_log.close()

    finished = spans.get_finished_spans()
    trace_id = root.get_span_context().trace_id
    in_trace = [s for s in finished if s.context.trace_id == trace_id]
    by_id = {s.context.span_id: s for s in in_trace}

    def chain(name):
        span = next(s for s in in_trace if s.name == name)
        names = []
        while span is not None:
            names.append((span.resource.attributes["service.name"], span.name))
            span = by_id.get(span.parent.span_id) if span.parent else None
        return list(reversed(names))

    assert chain("append JobCompleted") == [
        ("gpusched-cli", "gpusched submit"),
        ("gpusched-admission", "admission.SubmitJob"),
        ("gpusched-admission", "append JobSubmitted"),
        ("gpusched-placement", "append GpusGranted"),
        ("gpusched-nodeagent", "nodeagent.start"),
        ("gpusched-nodeagent", "append JobStarted"),
        ("gpusched-nodeagent", "append CheckpointSaved"),
        ("gpusched-nodeagent", "append JobCompleted"),
    ]
    # the node registration is not about the job: its own trace
    assert all(s.name != "append NodeRegistered" for s in in_trace)


def test_logs_carry_trace_ids(spans, capsys):
    import json

    import structlog

    telemetry.configure_logging(json_logs=True)
    with telemetry.span("work") as s:
        structlog.get_logger().info("hello", x=1)
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line["trace_id"] == format(s.get_span_context().trace_id, "032x")
    assert line["span_id"] == format(s.get_span_context().span_id, "016x")
    assert line["event"] == "hello"


def _service_args(module, nats_url, redis_url, *argv):
    import argparse

    parser = argparse.ArgumentParser(conflict_handler="resolve")
    module.add_arguments(parser)
    return parser.parse_args(["--nats", nats_url, "--redis", redis_url, *argv])


async def test_real_services_continue_the_submit_trace(nats_url, redis_url, spans):
    """The real admission and placement services: the client's submit span is the root of the
    trace that contains admission's span and placement's grant."""
    from gpusched.bus.control_client import Client
    from gpusched.services import admission, placement

    log = await EventLog.open(nats_url, name="setup")
    await log.append(ev.NodeRegistered(at=1.0, node="n0", rack="r0", gpus=[GpuInfo(index=i, uuid=f"u{i}") for i in range(4)]))
    stop = asyncio.Event()

    async def as_service(name, coro):
        telemetry.set_service(name)
        await coro

    tasks = [
        asyncio.create_task(as_service("admission", admission.serve(_service_args(admission, nats_url, redis_url, "--placeholders", "any", "--auto-create-teams"), stop))),
        asyncio.create_task(as_service("placement", placement.serve(
            _service_args(placement, nats_url, redis_url, "--lease-ttl-ms", "1000"), stop))),
    ]
    try:
        telemetry.set_service("cli")
        client = await Client.connect(nats_url)
        for _ in range(50):  # admission subscribes after replaying the log
            try:
                with telemetry.span("gpusched submit", kind=telemetry.SpanKind.CLIENT) as root:
                    reply = await client.submit(JobSpec(team="a", gpus=2))
                break
            except Exception:
                await asyncio.sleep(0.2)
        assert reply.ok
        granted = None
        for _ in range(100):
            async for rec in log.records(1):
                if isinstance(rec.event, ev.GpusGranted) and rec.event.job_id == reply.job_id:
                    granted = rec
            if granted:
                break
            await asyncio.sleep(0.1)
        assert granted is not None, "placement never granted the job"
        await client.close()
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)
        await log.close()

    trace_id = root.get_span_context().trace_id
    in_trace = {s.context.span_id: s for s in spans.get_finished_spans() if s.context.trace_id == trace_id}
    grant = next(s for s in in_trace.values() if s.name == "append GpusGranted")
    chain = []
    span = grant
    while span is not None:
        chain.append((span.resource.attributes["service.name"], span.name))
        span = in_trace.get(span.parent.span_id) if span.parent else None
    chain.reverse()
    assert chain[0] == ("gpusched-cli", "gpusched submit")
    assert ("gpusched-admission", "append JobSubmitted") in chain
    assert chain[-1] == ("gpusched-placement", "append GpusGranted")
    assert granted.headers and "traceparent" in granted.headers
