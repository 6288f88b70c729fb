"""A router and a real cpu-decode worker (the bundled model) on an embedded NATS server: a
request that ended leaves the router's count with the worker's next heartbeat, which an ended
request brings forward; and requests routed since the last beat wait (for admission) only
where the worker has no free sequence slot. So requests sent one after another are not counted
as a queue: with room for one waiting batch request, each is admitted (docs/routing.md)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from services.decode import DecodeWorker
from services.router import Router
from shared import subjects
from shared.bus import Bus
from shared.nats_server import EmbeddedNats
from shared.schemas import GenerateRequest, Heartbeat, RoutePlan, RouteRequest, StreamChunk
from shared.settings import NatsSettings, PoolSettings, RouterSettings, Settings, WorkerSettings

pytestmark = [pytest.mark.timeout(180)]

INTERVAL = 3.0     # heartbeat interval: the router would otherwise count an ended request 3-6 s


async def until(pred, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def test_an_ended_request_leaves_the_router_s_count_with_the_next_beat(bundled_model):
    server = EmbeddedNats()
    url = server.start()
    wid = f"fresh-{uuid.uuid4().hex[:6]}"
    worker = DecodeWorker(Settings(nats=NatsSettings(url=url), pool=PoolSettings(enabled=False),
                                   worker=WorkerSettings(worker_id=wid, threads=1, kv_blocks=64,
                                                         heartbeat_interval=INTERVAL, metrics_port=-1)),
                          subjects.CPU_DECODE)
    router = Router(Settings(nats=NatsSettings(url=url), router=RouterSettings(queue_batch=1),
                             worker=WorkerSettings(worker_id="router-fresh", heartbeat_interval=INTERVAL,
                                                   metrics_port=-1)))
    await worker.start()
    await router.start()
    client = await Bus.connect(url=url, name="fresh-client")
    beats = await client.subscribe(subjects.heartbeat(subjects.CPU_DECODE, wid), Heartbeat)
    try:
        await until(lambda: wid in router.workers, 30, "the router saw the worker")
        ids = worker.engine.tokenizer.encode("Say hello.")
        for i in range(3):
            rid = f"fresh-{i}-{uuid.uuid4().hex[:6]}"
            plan = await client.request(subjects.ROUTE, RouteRequest(
                request_id=rid, model=worker.model_name, tier="batch", session_id=None,
                num_prompt_tokens=len(ids), max_tokens=4, prompt_token_ids=ids), expected=RoutePlan)
            assert plan.decode_worker == wid and router.workers[wid].pending == {"batch": 1}
            stream = await client.subscribe(subjects.stream(rid), StreamChunk)
            await client.request(subjects.worker_generate(wid), GenerateRequest(
                request_id=rid, prompt_token_ids=ids, sampling={"max_tokens": 4, "temperature": 0,
                                                                "ignore_eos": True},
                tier="batch", stream_subject=subjects.stream(rid)))
            while (await stream.next(timeout=30)).finish_reason is None:
                pass
            await stream.unsubscribe()
            # the ended request's beat comes within a fraction of the interval, and says so
            await until(lambda: not router.workers[wid].routed, INTERVAL / 2,
                               f"the router stopped counting {rid}")
            while rid not in (beat := await beats.next(timeout=INTERVAL * 2)).ended:
                pass
            assert rid not in [r.request_id for r in beat.requests]
        # two routed back to back, before any beat: the first is no queue for the second (the
        # worker's beat said it runs 64 sequences at once, and none is running)
        assert beat.max_running == 64 and beat.running == 0
        for rid in ("burst-a", "burst-b"):
            plan = await client.request(subjects.ROUTE, RouteRequest(
                request_id=rid, model=worker.model_name, tier="batch", session_id=None,
                num_prompt_tokens=len(ids), max_tokens=4, prompt_token_ids=ids), expected=RoutePlan)
            assert plan.decode_worker == wid
        assert router.workers[wid].pending == {"batch": 2} and router.workers[wid].waiting("batch") == 0
    finally:
        await beats.unsubscribe()
        await client.close()
        await router.close()
        await worker.close()
        server.stop()
