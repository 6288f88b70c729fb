"""Trace context and request ids (pure parts): traceparent parsing, start / headers / adopt,
the log filter, and no OpenTelemetry import while export is off."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import pytest

from shared import tracing

TID, SID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture(autouse=True)
def fresh_context():
    token = tracing._current.set(None)
    yield
    tracing._current.reset(token)
    tracing.setup("test")  # export off again


def test_parse_traceparent():
    assert tracing.parse_traceparent(f"00-{TID}-{SID}-01") == (TID, SID, True)
    assert tracing.parse_traceparent(f"00-{TID.upper()}-{SID}-00") == (TID, SID, False)
    for bad in (None, "", "garbage", f"01-{TID}-{SID}-01", f"00-{'0' * 32}-{SID}-01", f"00-{TID}-{'0' * 16}-01",
                f"00-{TID[:-1]}-{SID}-01"):
        assert tracing.parse_traceparent(bad) is None


def test_start_continues_a_client_trace_or_begins_one():
    ctx = tracing.start("chatcmpl-1", f"00-{TID}-{SID}-01")
    assert (ctx.trace_id, ctx.span_id, ctx.request_id) == (TID, SID, "chatcmpl-1")
    assert tracing.headers() == {"traceparent": f"00-{TID}-{SID}-01", "Tandem-Request-Id": "chatcmpl-1"}
    new = tracing.start("chatcmpl-2", "not a traceparent")
    assert new.trace_id != TID and len(new.trace_id) == 32 and len(new.span_id) == 16
    assert tracing.parse_traceparent(new.traceparent) == (new.trace_id, new.span_id, True)


def test_no_context_no_headers():
    assert tracing.current() is None and tracing.headers() is None
    assert tracing.adopt(None) is None and tracing.adopt({}) is None


def test_adopt_takes_the_senders_context_in_its_own_task():
    sent = {"traceparent": f"00-{TID}-{SID}-01", "Tandem-Request-Id": "cmpl-9"}

    async def handler():
        tracing.adopt(sent)
        await asyncio.sleep(0)
        return tracing.current()

    async def main():
        got = await asyncio.create_task(handler())
        return got, tracing.current()   # the caller's context is untouched

    got, outer = asyncio.run(main())
    assert (got.trace_id, got.span_id, got.request_id) == (TID, SID, "cmpl-9") and outer is None
    # a message without trace headers still gets the request id from its body
    assert tracing.adopt({}, "r-5").request_id == "r-5"


def test_log_lines_carry_the_request_id():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    h = Keep()
    h.addFilter(tracing.RequestIdFilter())
    h.setFormatter(logging.Formatter(tracing.LOG_FORMAT))
    log = logging.getLogger("test.tracing")
    log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        log.info("outside")
        tracing.start("chatcmpl-abc")
        log.info("inside")
    finally:
        log.removeHandler(h)
    assert "[-] outside" in records[0] and "[chatcmpl-abc] inside" in records[1]


def test_export_off_costs_no_opentelemetry_import():
    code = ("import sys; from shared import tracing, bus; tracing.setup('x'); tracing.start('r');"
            "\nwith tracing.span('s'): pass\nprint(any(m.startswith('opentelemetry') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_spans_when_export_is_on():
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    assert tracing.setup("test", exporter=exporter)
    tracing.start("r-1", f"00-{TID}-{SID}-01")
    with tracing.span("outer"):
        inner_parent = tracing.current().span_id
        with tracing.span("inner"):
            pass
    assert tracing.current().span_id == SID              # restored after the span
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {format(s.context.trace_id, "032x") for s in spans.values()} == {TID}
    assert format(spans["outer"].parent.span_id, "016x") == SID
    assert format(spans["inner"].parent.span_id, "016x") == inner_parent == format(spans["outer"].context.span_id, "016x")
    assert spans["inner"].attributes["tandem.request_id"] == "r-1"


def test_tap_shows_the_trace_id():
    from services.tap import format_line
    from shared.schemas import Abort, encode

    data = encode(Abort("r-1"))
    line = format_line("tandem.abort", data, headers={"traceparent": f"00-{TID}-{SID}-01"})
    assert f"trace={TID[:8]}  request_id=r-1" in line
    assert "trace=" not in format_line("tandem.abort", data)
