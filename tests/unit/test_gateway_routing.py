"""The gateway's NatsBackend when no router answers (a router killed holding the route request,
the bus reconnecting): the route request is asked again within TANDEM_RESUME_WAIT_S and the
request is served once a router answers; only when none does in time is it a 504. A fake bus
(no NATS), so the waits are short."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway import nats_backend
from services.gateway.backend import BackendError, GenerationRequest
from services.gateway.nats_backend import NatsBackend
from shared import subjects
from shared.bus import BusError
from shared.engine.sampling import SamplingParams
from shared.schemas import Ack, GenerateRequest, RoutePlan, RouteRequest, StreamChunk
from shared.settings import GatewaySettings

pytestmark = pytest.mark.timeout(60)


class FakeSub:
    def __init__(self):
        self.q: asyncio.Queue = asyncio.Queue()

    async def next(self, timeout=None):
        try:
            return await asyncio.wait_for(self.q.get(), timeout)
        except asyncio.TimeoutError:
            raise BusError("timeout", "quiet") from None

    async def unsubscribe(self) -> None:
        pass


class FakeBus:
    """A router that answers only from ``router_back`` route requests on (the ones before time
    out, as a request a dead router took with it does); one worker that streams "ok"."""
    request_timeout = 10.0

    def __init__(self, router_back: int | None):
        self.router_back = router_back
        self.routes: list[tuple[RouteRequest, float]] = []
        self.subs: dict[str, FakeSub] = {}

    def connected_for(self) -> float:
        return 100.0

    def down_for(self) -> float:
        return 0.0

    async def subscribe(self, subject, expected=None, flush=True, skip_invalid=False):
        self.subs[subject] = FakeSub()
        return self.subs[subject]

    async def publish(self, subject, msg) -> None:
        pass

    async def request(self, subject, msg, timeout=None, expected=None):
        if subject == subjects.ROUTE:
            self.routes.append((msg, timeout))
            if self.router_back is None or len(self.routes) <= self.router_back:
                await asyncio.sleep(timeout)
                raise BusError("timeout", f"no reply on {subject} within {timeout}s")
            return RoutePlan(request_id=msg.request_id, prefill_worker=None, decode_worker="w",
                             decode_role=subjects.CPU_DECODE, reason="to w")
        assert subject == subjects.worker_generate("w") and isinstance(msg, GenerateRequest)
        self.subs[msg.stream_subject].q.put_nowait(StreamChunk(
            request_id=msg.request_id, seq=0, token_ids=[1], text="ok", worker="w", finish_reason="stop", offset=0))
        return Ack(worker="w")


def backend(bus: FakeBus, wait: float) -> NatsBackend:
    return NatsBackend(bus, "m", 1024, tokenizer=None,
                       settings=GatewaySettings(liveness_check_s=0.1, resume_wait_s=wait))


def request() -> GenerationRequest:
    return GenerationRequest("r-1", "m", [1, 2, 3], SamplingParams(max_tokens=4), "standard", None)


async def test_a_route_request_no_router_answers_is_asked_again(monkeypatch):
    monkeypatch.setattr(nats_backend, "ROUTE_TRY_S", 0.2)
    bus = FakeBus(router_back=3)          # three route requests lost, the fourth answered
    outs = [o async for o in backend(bus, wait=30.0).generate(request())]
    assert "".join(o.text for o in outs) == "ok" and outs[-1].finish_reason == "stop"
    assert len(bus.routes) == 4 and all(t == 0.2 for _, t in bus.routes)


async def test_no_router_within_the_wait_is_a_504(monkeypatch):
    monkeypatch.setattr(nats_backend, "ROUTE_TRY_S", 0.2)
    bus = FakeBus(router_back=None)
    with pytest.raises(BackendError) as e:
        _ = [o async for o in backend(bus, wait=1.0).generate(request())]
    assert e.value.code == "timeout" and e.value.status == 504 and "tried for 1 s" in e.value.message
    assert len(bus.routes) >= 2      # asked again before giving up
