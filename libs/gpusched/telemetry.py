"""Tracing and logs that follow one job across services.

One trace follows a job from `submit` through admission, placement, the node daemon and its end:
the W3C `traceparent` travels in NATS headers, on command requests and on every appended event.
The log itself carries the context between services: every record read remembers the trace
context of the job it is about, so a service that decides something about a job (placement
granting it, a node daemon starting it) continues that job's trace without any bookkeeping.

Where the hooks are:
- `EventLog.append` calls `append_headers(event, headers)`: a short PRODUCER span per append, a
  child of the active span if any, else of the job's remembered context; its `traceparent` goes
  into the message headers.
- `EventLog.records` calls `observe(record)`: remembers the job's context from the headers.
- A request/reply client calls `inject(headers)`; a command handler wraps its work in
  `with consume_span("admission.SubmitJob", msg.headers):`.
- A service handling one record wraps it in `with record_span("nodeagent.start", rec):`.
- Every service calls `setup("placement")` once at start (idempotent, per process) and
  `set_service("placement")` at the top of its main task (a contextvar: several services can
  share one process and still name their own spans).

Exporters come from the standard variables, as the SDK documents them: `OTEL_TRACES_EXPORTER`
(`otlp`, `console`, `none`, comma-separated; unset: `otlp` when an OTLP endpoint is set, so
setting only `OTEL_EXPORTER_OTLP_ENDPOINT` exports, else `none`), `OTEL_EXPORTER_OTLP_ENDPOINT` /
`..._TRACES_ENDPOINT`, `..._PROTOCOL`, `..._HEADERS`, `OTEL_SERVICE_NAME` (prefix of each
service's name), `OTEL_RESOURCE_ATTRIBUTES`; `OTEL_SDK_DISABLED=true` turns tracing off
entirely. The OTLP/HTTP exporter is installed with gpusched. Tests pass an exporter to `setup`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import DefaultGetter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from structlog.typing import EventDict

#: The header names the propagator writes (W3C trace context).
TRACE_HEADERS = ("traceparent", "tracestate")

_propagator = TraceContextTextMapPropagator()
_service: contextvars.ContextVar[str] = contextvars.ContextVar("gpusched_service", default="gpusched")
_providers: dict[str, TracerProvider] = {}
_tracers: dict[str, trace.Tracer] = {}
_processors: list[SpanProcessor] = []
_configured = False
_disabled = False

#: job id -> carrier ({"traceparent": ...}) of the latest record about that job. Bounded: the
#: oldest jobs are forgotten first (a late event of a forgotten job starts a new trace).
_JOB_CONTEXT_CAP = 200_000
_job_context: OrderedDict[str, dict[str, str]] = OrderedDict()


class _HeaderGetter(DefaultGetter):
    """NATS headers are a plain dict (or None); names may arrive in any case."""

    def get(self, carrier: Mapping[str, str] | None, key: str) -> list[str] | None:  # type: ignore[override]
        if not carrier:
            return None
        value = carrier.get(key)
        if value is None:
            for k, v in carrier.items():
                if k.lower() == key:
                    value = v
                    break
        return None if value is None else [value]


_getter = _HeaderGetter()


# --- setup -------------------------------------------------------------------------------------


def default_exporter() -> str:
    """`OTEL_TRACES_EXPORTER` when set; else `otlp` (the SDK's documented default) as soon as an
    OTLP endpoint is configured, and `none` when nothing is (no error spam from a collector that
    was never asked for)."""
    named = os.environ.get("OTEL_TRACES_EXPORTER")
    if named is not None:
        return named
    endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return "otlp" if any(os.environ.get(v) for v in endpoints) else "none"


def _exporters_from_env() -> list[SpanProcessor]:
    names = [n.strip().lower() for n in default_exporter().split(",") if n.strip()]
    out: list[SpanProcessor] = []
    for name in names:
        if name in ("none", ""):
            continue
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
        elif name == "otlp":
            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
            )
            try:
                if protocol == "grpc":
                    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
                else:
                    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[no-redef]
            except ImportError as err:
                raise RuntimeError(
                    f"OTEL_TRACES_EXPORTER=otlp ({protocol}) needs the OTLP exporter: "
                    "pip install opentelemetry-exporter-otlp-proto-http (or -grpc)"
                ) from err
            out.append(BatchSpanProcessor(OTLPSpanExporter()))  # endpoint etc. from OTEL_EXPORTER_OTLP_*
        else:
            raise RuntimeError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r}; use none, console or otlp")
    return out


def setup(service: str | None = None, *, exporter: SpanExporter | None = None, json_logs: bool | None = None) -> None:
    """Configure tracing from `OTEL_*` (once per process) and structlog JSON logs with trace ids.
    `exporter` (tests) adds a synchronous exporter, e.g. an `InMemorySpanExporter`."""
    global _configured, _disabled
    if service:
        _service.set(service)
    if exporter is not None:
        add_processor(SimpleSpanProcessor(exporter))
    if _configured:
        return
    _configured = True
    _disabled = os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true"
    if not _disabled:
        for proc in _exporters_from_env():
            add_processor(proc)
    configure_logging(json_logs)


def add_processor(processor: SpanProcessor) -> None:
    _processors.append(processor)
    for provider in _providers.values():
        provider.add_span_processor(processor)


def reset_for_tests() -> None:
    """Forget processors and remembered contexts (each test gets a clean slate)."""
    global _configured
    for provider in _providers.values():
        provider.shutdown()
    _providers.clear()
    _tracers.clear()
    _processors.clear()
    _job_context.clear()
    _configured = False


def shutdown() -> None:
    """Flush batched spans (call on clean exit)."""
    for provider in _providers.values():
        provider.force_flush(5000)
    for proc in _processors:
        try:
            proc.force_flush(5000)
        except Exception:
            pass


def set_service(name: str) -> contextvars.Token:
    """Name the service whose spans this task (and the tasks it creates) records."""
    return _service.set(name)


def current_service() -> str:
    return _service.get()


def tracer(service: str | None = None) -> trace.Tracer:
    """The tracer of a service. One provider per service, so Jaeger shows each service by name
    even when `gpusched up` runs several in one process; all share the configured exporters."""
    if _disabled:
        return trace.NoOpTracer()
    name = service or _service.get()
    if name not in _providers:
        base = os.environ.get("OTEL_SERVICE_NAME") or "gpusched"  # Resource.create also reads OTEL_RESOURCE_ATTRIBUTES
        provider = TracerProvider(resource=Resource.create({"service.name": f"{base}-{name}",
                                                             "service.namespace": "gpusched"}))
        for proc in _processors:
            provider.add_span_processor(proc)
        _providers[name] = provider
        _tracers[name] = provider.get_tracer("gpusched")
    return _tracers[name]


# --- propagation -------------------------------------------------------------------------------


def inject(headers: MutableMapping[str, str] | None = None, ctx: otel_context.Context | None = None) -> dict[str, str]:
    """Write the current (or given) trace context into `headers` (created if None) and return it."""
    carrier: dict[str, str] = headers if headers is not None else {}  # type: ignore[assignment]
    _propagator.inject(carrier, context=ctx)
    return carrier


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The trace context carried by message headers (an empty context when there is none)."""
    return _propagator.extract(headers or {}, getter=_getter)


def _job_of(event: Any) -> str | None:
    job = getattr(event, "job_id", None)
    return job or None


def observe(record: Any) -> None:
    """Remember the trace context of the job a record is about (called for every record read)."""
    headers = getattr(record, "headers", None)
    job = _job_of(getattr(record, "event", None))
    if not job or not headers:
        return
    tp = _getter.get(headers, "traceparent")
    if not tp:
        return
    carrier = {"traceparent": tp[0]}
    ts = _getter.get(headers, "tracestate")
    if ts:
        carrier["tracestate"] = ts[0]
    _job_context[job] = carrier
    _job_context.move_to_end(job)
    if len(_job_context) > _JOB_CONTEXT_CAP:
        _job_context.popitem(last=False)


def job_context(job_id: str) -> otel_context.Context | None:
    """The remembered trace context of a job, if any record about it carried one."""
    carrier = _job_context.get(job_id)
    return None if carrier is None else extract(carrier)


def remember_job(job_id: str, headers: Mapping[str, str] | None) -> None:
    """Tie a job to a context explicitly (e.g. admission, before its JobSubmitted is read back)."""
    tp = _getter.get(headers, "traceparent")
    if tp:
        _job_context[job_id] = {"traceparent": tp[0]}
        _job_context.move_to_end(job_id)


def _has_active_span() -> bool:
    return trace.get_current_span().get_span_context().is_valid


def append_headers(event: Any, headers: dict[str, str]) -> dict[str, str]:
    """Called by `EventLog.append` before publishing: record a PRODUCER span for the append and
    put its context in `headers`. Parent: the active span, else the job's remembered context
    (this is how a job's trace crosses services through the log), else a new trace."""
    if _disabled or "traceparent" in headers:
        return headers
    if not _processors:  # nothing exports spans in this process: carry the context on, make no span
        if _has_active_span():
            inject(headers)
        else:
            job = _job_of(event)
            headers.update(_job_context.get(job, {}) if job else {})
        return headers
    parent = None if _has_active_span() else (_job_ctx_for(event))
    kind = type(event).__name__
    attrs = {"gpusched.event": kind, "messaging.system": "nats", "messaging.operation": "publish"}
    job = _job_of(event)
    if job:
        attrs["gpusched.job_id"] = job
    with tracer().start_as_current_span(f"append {kind}", context=parent, kind=SpanKind.PRODUCER,
                                        attributes=attrs):
        inject(headers)
    if job and "traceparent" in headers:
        remember_job(job, headers)
    return headers


def _job_ctx_for(event: Any) -> otel_context.Context | None:
    job = _job_of(event)
    return job_context(job) if job else None


# --- spans for handlers ------------------------------------------------------------------------


@contextlib.contextmanager
def consume_span(name: str, headers: Mapping[str, str] | None = None, *, job_id: str | None = None,
                 kind: SpanKind = SpanKind.CONSUMER, **attributes: Any) -> Iterator[Span]:
    """A span around handling one message (a command request, an event). Its parent is the
    context in `headers`, else the remembered context of `job_id`. Anything logged inside
    carries its trace id; appends inside become its children."""
    ctx = extract(headers)
    if not trace.get_current_span(ctx).get_span_context().is_valid and job_id:
        ctx = job_context(job_id) or ctx
    attrs = {k if "." in k else f"gpusched.{k}": v for k, v in attributes.items() if v is not None}
    if job_id:
        attrs["gpusched.job_id"] = job_id
    with tracer().start_as_current_span(name, context=ctx, kind=kind, attributes=attrs,
                                        record_exception=True, set_status_on_exception=True) as span:
        yield span


@contextlib.contextmanager
def record_span(name: str, record: Any, **attributes: Any) -> Iterator[Span]:
    """A span around handling one log record (`bus.log.Record`)."""
    event = record.event
    with consume_span(name, record.headers, job_id=_job_of(event), seq=record.seq,
                      event=type(event).__name__, **attributes) as span:
        yield span


@contextlib.contextmanager
def job_span(name: str, job_id: str, **attributes: Any) -> Iterator[Span]:
    """A span for a decision about a job (a grant, a preemption), in that job's trace."""
    with consume_span(name, None, job_id=job_id, kind=SpanKind.INTERNAL, **attributes) as span:
        yield span


@contextlib.contextmanager
def span(name: str, kind: SpanKind = SpanKind.INTERNAL, **attributes: Any) -> Iterator[Span]:
    """A plain span in the current context (e.g. the client's root `submit` span)."""
    attrs = {k if "." in k else f"gpusched.{k}": v for k, v in attributes.items() if v is not None}
    with tracer().start_as_current_span(name, kind=kind, attributes=attrs, record_exception=True,
                                        set_status_on_exception=True) as s:
        yield s


def mark_error(span_: Span, message: str) -> None:
    span_.set_status(Status(StatusCode.ERROR, message))


# --- logs --------------------------------------------------------------------------------------


def add_trace_ids(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    """structlog processor: the active span's trace_id and span_id (hex), and the service."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event_dict.setdefault("span_id", format(ctx.span_id, "016x"))
    event_dict.setdefault("service", _service.get())
    return event_dict


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is at the time (test runners swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(json_logs: bool | None = None, level: str | None = None) -> None:
    """structlog: JSON lines to stderr (or console rendering when `GPUSCHED_LOG_FORMAT=console`)."""
    if json_logs is None:
        json_logs = os.environ.get("GPUSCHED_LOG_FORMAT", "json") != "console"
    lvl = getattr(logging, (level or os.environ.get("GPUSCHED_LOG_LEVEL", "INFO")).upper(), logging.INFO)
    renderer = structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            add_trace_ids,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


__all__ = [
    "TRACE_HEADERS", "setup", "set_service", "current_service", "tracer", "inject", "extract", "observe",
    "job_context", "remember_job", "append_headers", "consume_span", "record_span", "job_span", "span",
    "add_trace_ids", "configure_logging", "shutdown", "reset_for_tests", "add_processor", "mark_error",
]
