"""Trace context across bus hops on a real nats-server: gateway → router → prefill → decode,
each a Bus connection of its own, spans exported to memory."""

from __future__ import annotations

import asyncio

import pytest

from shared import subjects, tracing
from shared.bus import Bus
from shared.schemas import Abort, RoutePlan, RouteRequest, StreamChunk
from shared.settings import NatsSettings

pytestmark = pytest.mark.timeout(60)
TID = "0af7651916cd43dd8448eb211c80319c"


@pytest.fixture
def exporter():
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exp = InMemorySpanExporter()
    tracing.setup("test", exporter=exp)
    yield exp
    tracing.setup("test")


async def test_context_survives_every_hop(nats_server, exporter):
    buses = {n: await Bus.connect(NatsSettings(url=nats_server), name=n)
             for n in ("gateway", "router", "prefill", "decode")}
    seen: dict[str, tracing.TraceContext] = {}
    spawned = []

    async def route(req: RouteRequest) -> RoutePlan:
        seen["router"] = tracing.current()
        return RoutePlan(req.request_id, "p1", "d1", subjects.CPU_DECODE, "test")

    async def prefill(msg: Abort) -> None:
        seen["prefill"] = tracing.current()

        async def hand_off():  # a task spawned by the handler, as the prefill worker's is
            await buses["prefill"].publish(subjects.stream(msg.request_id), StreamChunk(msg.request_id, 0, [1], "a", "p1"))
            await buses["prefill"].request(subjects.worker_decode("d1"), msg)
        spawned.append(asyncio.create_task(hand_off()))

    async def decode(msg: Abort) -> None:
        seen["decode"] = tracing.current()
        await buses["decode"].publish(subjects.stream(msg.request_id), StreamChunk(msg.request_id, 1, [2], "b", "d1"))

    await buses["router"].serve(subjects.ROUTE, route, expected=RouteRequest)
    await buses["prefill"].serve(subjects.worker_prefill("p1"), prefill, expected=Abort)
    await buses["decode"].serve(subjects.worker_decode("d1"), decode, expected=Abort)
    raw = await buses["gateway"].subscribe_raw(subjects.stream("r-1"))

    async def gateway():
        tracing.start("r-1", f"00-{TID}-b7ad6b7169203331-01")
        with tracing.span("gateway.dispatch"):
            await buses["gateway"].request(subjects.ROUTE, RouteRequest("r-1", "m", "standard", None, 3, 2))
            await buses["gateway"].request(subjects.worker_prefill("p1"), Abort("r-1"))

    try:
        await asyncio.create_task(gateway())
        chunks = [await asyncio.wait_for(raw.messages.__anext__(), 5) for _ in range(2)]
        await asyncio.gather(*spawned)
    finally:
        for b in buses.values():
            await b.close()

    assert {h: c.trace_id for h, c in seen.items()} == {"router": TID, "prefill": TID, "decode": TID}
    assert {c.request_id for c in seen.values()} == {"r-1"}
    for m in chunks:  # the stream chunks (from prefill and decode) carry it too
        assert tracing.parse_traceparent(m.headers["traceparent"])[0] == TID
        assert m.headers["Tandem-Request-Id"] == "r-1"
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) >= {"gateway.dispatch", subjects.ROUTE, subjects.worker_prefill("p1"),
                          subjects.worker_decode("d1")}
    assert {format(s.context.trace_id, "032x") for s in spans.values()} == {TID}
    sid = {n: s.context.span_id for n, s in spans.items()}
    assert spans[subjects.ROUTE].parent.span_id == sid["gateway.dispatch"]
    assert spans[subjects.worker_prefill("p1")].parent.span_id == sid["gateway.dispatch"]
    assert spans[subjects.worker_decode("d1")].parent.span_id == sid[subjects.worker_prefill("p1")]
