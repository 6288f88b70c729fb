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


async def test_a_silent_holder_is_blamed_only_while_other_services_are_heard():
    """The holder does not answer its Where and sends no heartbeat. While other services' beats
    arrive it is resumed without (silent); while none at all arrive — this gateway's own nats-server
    frozen, its host cut off — its link is the suspect: it waits (a probe saw "worker decode-b
    stopped answering" while decode-b streamed on through another server), for up to
    TANDEM_RESUME_WAIT_S."""
    from shared import liveness
    from shared.schemas import Heartbeat

    class Silent(FakeBus):
        async def request(self, subject, msg, timeout=None, expected=None):
            raise BusError("timeout", f"no reply on {subject}")

    b = backend(Silent(router_back=None), wait=5.0)
    resumed = []

    async def resume(st, why, dead, lost=True, silent=False):
        resumed.append((why, dead, silent))
    b._resume = resume
    st = nats_backend._Flight(request(), SamplingParams(max_tokens=4), holder="w")

    def beat(worker: str, at: float) -> None:
        b.heartbeats.seen(Heartbeat(worker_id=worker, role=subjects.ROUTER, device="cpu", model="m", ready=True,
                                    queue_depth=0, running=0, free_kv_blocks=0, total_kv_blocks=0, max_context=0,
                                    data_host="", data_port=0, ts=0.0, interval=1.0), at)
    now = liveness.clock()
    beat("w", now - 10)                       # the holder: silent for 10 s
    beat("router-1", now - 10)                # ... and every other service too
    await b._check(st)
    assert resumed == [] and st.deaf_since is not None
    st.deaf_since -= 5.1                      # deaf for longer than TANDEM_RESUME_WAIT_S
    await b._check(st)
    assert resumed == [("worker w stopped answering (no heartbeat)", "w", True)]
    resumed.clear()
    st.deaf_since = None
    beat("router-1", liveness.clock())        # another service is heard: the holder is the silent one
    await b._check(st)
    assert resumed == [("worker w stopped answering (no heartbeat)", "w", True)] and st.deaf_since is None
