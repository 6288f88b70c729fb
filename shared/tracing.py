"""Request ids in every log line, and W3C / OpenTelemetry trace context across the bus.

A request's context (request id + trace context) lives in a ``ContextVar``:

- the gateway calls ``start(request_id, traceparent)`` when a request arrives (continuing the
  client's ``traceparent`` header when it sent one, else a new trace);
- ``Bus.request`` / ``Bus.publish`` put ``headers()`` on every NATS message sent while a
  context is current (``traceparent`` + ``Tandem-Request-Id``), and ``Bus._handle`` ``adopt()``s
  them in the receiving handler's task, so the context crosses gateway → router → prefill →
  decode (and the worker tasks spawned from a handler inherit it);
- ``RequestIdFilter`` (installed by ``setup_logging``) stamps ``%(request_id)s`` on every log record.

Span export is off by default and costs nothing then (the trace context is two random ids and
a header; opentelemetry is never imported). With ``TANDEM_OTLP_ENDPOINT`` set (e.g.
``http://127.0.0.1:4318``), ``setup(service)`` imports the OpenTelemetry SDK and the OTLP/HTTP
exporter (``pip install 'tandem-serve[otlp]'``) and ``span(name)`` records one span per hop,
each a child of the span that sent the message. Tests pass their own exporter to ``setup``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, Iterator, Mapping

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
REQUEST_ID = "Tandem-Request-Id"
OTLP_ENV = "TANDEM_OTLP_ENDPOINT"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"

_TRACEPARENT_RE = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


@dataclass(frozen=True)
class TraceContext:
    request_id: str          # the gateway's request id ("" outside a request)
    trace_id: str            # 32 hex digits, the same on every hop of a request
    span_id: str             # 16 hex digits, the sender's span (the receiver's parent)
    sampled: bool = True

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"


_current: ContextVar[TraceContext | None] = ContextVar("tandem_trace", default=None)
_tracer: Any = None   # an opentelemetry Tracer once setup() enabled export; None = off


def _hex(nbytes: int) -> str:
    while True:
        h = os.urandom(nbytes).hex()
        if h.strip("0"):  # all-zero ids are invalid in W3C trace context
            return h


def parse_traceparent(value: str | None) -> tuple[str, str, bool] | None:
    """(trace_id, span_id, sampled) of a W3C ``traceparent`` value; None when absent or malformed."""
    m = _TRACEPARENT_RE.match((value or "").strip().lower())
    if not m or not m.group(1).strip("0") or not m.group(2).strip("0"):
        return None
    return m.group(1), m.group(2), bool(int(m.group(3), 16) & 1)


def current() -> TraceContext | None:
    return _current.get()


def start(request_id: str, traceparent: str | None = None) -> TraceContext:
    """Make a request's context current: continue ``traceparent`` when valid, else a new trace."""
    parsed = parse_traceparent(traceparent)
    trace_id, parent, sampled = parsed if parsed else (_hex(16), _hex(8), True)
    ctx = TraceContext(request_id, trace_id, parent, sampled)
    _current.set(ctx)
    return ctx


def headers() -> dict[str, str] | None:
    """NATS headers carrying the current context (None outside a request)."""
    ctx = _current.get()
    if ctx is None:
        return None
    return {TRACEPARENT: ctx.traceparent, REQUEST_ID: ctx.request_id}


def adopt(hdrs: Mapping[str, str] | None, request_id: str = "") -> TraceContext | None:
    """Make the context a received message carries current (in the handler's own task)."""
    hdrs = hdrs or {}
    parsed = parse_traceparent(hdrs.get(TRACEPARENT))
    rid = hdrs.get(REQUEST_ID) or request_id
    if parsed is None:
        if not rid:
            return None
        return start(rid)
    ctx = TraceContext(rid, *parsed)
    _current.set(ctx)
    return ctx


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[None]:
    """One hop of the current request as a span (only when export is on; else nothing)."""
    ctx = _current.get()
    if _tracer is None or ctx is None:
        yield
        return
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    parent = trace.set_span_in_context(NonRecordingSpan(SpanContext(
        int(ctx.trace_id, 16), int(ctx.span_id, 16), is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED if ctx.sampled else 0))))
    with _tracer.start_as_current_span(name, context=parent, attributes={"tandem.request_id": ctx.request_id,
                                                                         **attributes}) as s:
        token = _current.set(replace(ctx, span_id=format(s.get_span_context().span_id, "016x")))
        try:
            yield
        finally:
            _current.reset(token)


def check_exporter(otlp: bool = True) -> None:
    """ValueError unless the OpenTelemetry SDK (and, with ``otlp``, its OTLP exporter) imports:
    said by ``tandem serve`` / ``tandem up`` before anything starts when TANDEM_OTLP_ENDPOINT is set."""
    import importlib
    try:
        importlib.import_module("opentelemetry.sdk.trace")
        if otlp:
            importlib.import_module("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    except ImportError:
        raise ValueError(f"{OTLP_ENV} is set but the OTLP exporter is not installed: "
                         "pip install 'tandem-serve[otlp]'") from None


def setup(service: str, exporter: Any = None, endpoint: str | None = None) -> bool:
    """Turn span export on when ``exporter`` is given or an OTLP endpoint is configured
    (``endpoint`` or TANDEM_OTLP_ENDPOINT). Returns whether export is on."""
    global _tracer
    endpoint = endpoint or os.environ.get(OTLP_ENV) or None
    if exporter is None and not endpoint:
        _tracer = None
        return False
    check_exporter(exporter is None)
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"tandem-{service}"}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
            endpoint=endpoint.rstrip("/") + "/v1/traces")))
    _tracer = provider.get_tracer("tandem")
    log.info("exporting trace spans (%s)", endpoint or type(exporter).__name__)
    return True


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (the current request's id, or "-") to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _current.get()
        record.request_id = ctx.request_id if ctx is not None and ctx.request_id else "-"
        return True


def setup_logging(level: int = logging.INFO) -> None:
    """Root logging with the request id in every line (services call this once at start)."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
