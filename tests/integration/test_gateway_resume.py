"""The gateway's NatsBackend on a real NATS server with scripted workers (fakes of the bus
protocol, no engine): a worker that dies holding the dispatch (no ack, then gone) costs the
request nothing — the liveness check finds it gone and the request goes to another worker."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.backend import GenerationRequest
from services.gateway.nats_backend import NatsBackend
from shared import subjects
from shared.bus import Bus
from shared.engine.sampling import SamplingParams
from shared.nats_server import EmbeddedNats
from shared.schemas import Ack, GenerateRequest, RoutePlan, RouteRequest, StreamChunk
from shared.settings import GatewaySettings, NatsSettings, Settings

pytestmark = pytest.mark.timeout(60)


async def test_a_worker_that_dies_holding_the_dispatch_loses_nothing():
    server = EmbeddedNats()
    url = server.start()
    s = Settings(nats=NatsSettings(url=url, request_timeout=0.5))
    gw_bus, router, dead, live = [await Bus.connect(s, name=n) for n in ("gw", "router", "w-dead", "w-live")]
    routed: list[RouteRequest] = []

    async def route(req: RouteRequest) -> RoutePlan:
        routed.append(req)
        worker = "w-live" if "w-dead" in req.exclude else "w-dead"
        return RoutePlan(request_id=req.request_id, prefill_worker=None, decode_worker=worker,
                         decode_role=subjects.CPU_DECODE, reason=f"to {worker}")

    got_dispatch = asyncio.Event()

    async def swallow(req: GenerateRequest):  # takes the message, dies before it answers
        got_dispatch.set()
        await asyncio.sleep(3600)

    async def generate(req: GenerateRequest) -> Ack:
        async def stream():
            for seq, word in enumerate(["all ", "of ", "it"]):
                await live.publish(req.stream_subject, StreamChunk(
                    request_id=req.request_id, seq=seq, token_ids=[seq], text=word, worker="w-live",
                    finish_reason="stop" if seq == 2 else None, attempt=req.resume.attempt if req.resume else 0))
        asyncio.get_running_loop().create_task(stream())
        return Ack(worker="w-live")

    await router.serve(subjects.ROUTE, route, expected=RouteRequest)
    await dead.serve(subjects.worker_generate("w-dead"), swallow, expected=GenerateRequest)
    await live.serve(subjects.worker_generate("w-live"), generate, expected=GenerateRequest)
    backend = NatsBackend(gw_bus, "m", 1024, tokenizer=None,
                          settings=GatewaySettings(liveness_check_s=0.2, resume_wait_s=5.0))
    await backend.start()
    try:
        req = GenerationRequest("r-1", "m", [1, 2, 3], SamplingParams(max_tokens=8), "standard", None)

        async def run():
            return [o async for o in backend.generate(req)]

        task = asyncio.create_task(run())
        await asyncio.wait_for(got_dispatch.wait(), 10)
        await dead.close()  # the worker holding the message dies: no ack ever comes
        outs = await asyncio.wait_for(task, 30)
        assert "".join(o.text for o in outs) == "all of it" and outs[-1].finish_reason == "stop"
        assert [r.exclude for r in routed] == [[], ["w-dead"]] and backend.resumes == 1
    finally:
        await backend.close()
        for b in (gw_bus, router, live):
            await b.close()
        server.stop()
