"""The gateway's NatsBackend on a real NATS server with scripted workers (fakes of the bus
protocol, no engine): a worker that dies holding the dispatch (no ack, then gone) costs the
request nothing — the liveness check finds it gone and the request goes to another worker; a
worker that drops a request (its stream ends "abort") is a lost holder: the request is resumed
elsewhere, or, with no worker left, ends with a clear worker_lost error; two copies of one
attempt streaming chunks cut at different tokens never make a drifted text; a decode worker a
prefill's hand-off could not reach is left out of the resume."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from services.gateway.backend import BackendError, GenerationRequest
from services.gateway.nats_backend import NatsBackend
from shared import subjects
from shared.bus import Bus, BusError, error_reply_for
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


@contextlib.asynccontextmanager
async def gateway_without_a_bus(resume_wait_s: float):
    """A gateway backend whose NATS server has just been stopped: (its bus, the backend)."""
    server = EmbeddedNats()
    url = server.start()
    gw_bus = await Bus.connect(Settings(nats=NatsSettings(url=url, request_timeout=0.5)), name="gw")
    backend = NatsBackend(gw_bus, "m", 1024, tokenizer=None,
                          settings=GatewaySettings(liveness_check_s=0.2, resume_wait_s=resume_wait_s))
    await backend.start()
    try:
        server.stop()
        yield gw_bus, backend
    finally:
        await backend.close()
        await gw_bus.close()


async def _first_error(backend: NatsBackend, rid: str) -> BackendError:
    req = GenerationRequest(rid, "m", [1, 2, 3], SamplingParams(max_tokens=8), "standard", None)
    with pytest.raises(BackendError) as e:
        await asyncio.wait_for(backend.generate(req).__anext__(), 30)
    return e.value


async def test_a_request_while_the_bus_is_down_gets_a_503_not_a_timeout():
    """The whole bus down for the request's wait: a 503 saying so, with Retry-After (it was a
    504 "timeout: no reply on tandem.router.route", the router blamed for NATS)."""
    async with gateway_without_a_bus(1.5) as (_, backend):
        e = await _first_error(backend, "r-down")
    assert (e.status, e.code, e.retry_after) == (503, "no_workers", 5)
    assert "NATS" in e.message and "unreachable" in e.message


async def test_a_new_request_during_a_long_bus_outage_is_a_503_at_once(monkeypatch):
    """A bus that has been down past BUS_DOWN_S (an outage, not a restart): a new request is a 503
    with Retry-After at once, not after the whole TANDEM_RESUME_WAIT_S; within it, the wait as
    before (a NATS restart is ridden out)."""
    from services.gateway import nats_backend
    monkeypatch.setattr(nats_backend, "BUS_DOWN_S", 1.0)
    async with gateway_without_a_bus(20.0) as (gw_bus, backend):
        deadline = time.monotonic() + 10
        while gw_bus.down_for() <= 1.0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert gw_bus.down_for() > 1.0 and gw_bus.connected_for() == 0.0
        t0 = time.monotonic()
        e = await _first_error(backend, "r-out")
        assert time.monotonic() - t0 < 5.0                       # not the 20 s wait
    assert (e.status, e.code, e.retry_after) == (503, "no_workers", 5)
    assert "has been unreachable from this gateway for" in e.message


WORDS = ["all ", "of ", "it"]


def chunk(req: GenerateRequest, worker: str, seq: int, offset: int, ids: list[int],
          finish: str | None = None) -> StreamChunk:
    """Chunk ``seq`` of ``req``'s stream: ``offset`` tokens before it, then the words ``ids``
    (token i is WORDS[i])."""
    return StreamChunk(request_id=req.request_id, seq=seq, token_ids=ids, text="".join(WORDS[i] for i in ids),
                       worker=worker, finish_reason=finish, attempt=req.resume.attempt if req.resume else 0,
                       offset=offset)


class Scripted:
    """A real NATS server, a gateway backend, a router sending each attempt to the first worker
    of ``order`` not excluded (none left: no workers), and workers whose GenerateRequest handler
    is ``script(bus, req)`` (it publishes the chunks)."""

    def __init__(self, order: list[str], scripts: dict, resume_wait_s: float = 5.0):
        self.order, self.scripts, self.wait = order, scripts, resume_wait_s
        self.routed: list[RouteRequest] = []

    async def __aenter__(self) -> "Scripted":
        self.server = EmbeddedNats()
        s = Settings(nats=NatsSettings(url=self.server.start(), request_timeout=2.0))
        self.buses = {n: await Bus.connect(s, name=n) for n in ["gw", "router", *self.scripts]}

        async def route(req: RouteRequest) -> RoutePlan:
            self.routed.append(req)
            left = [w for w in self.order if w not in req.exclude]
            if not left:
                raise BusError("unavailable", "no decode worker is ready")
            return RoutePlan(request_id=req.request_id, prefill_worker=None, decode_worker=left[0],
                             decode_role=subjects.CPU_DECODE, reason=f"to {left[0]}")

        await self.buses["router"].serve(subjects.ROUTE, route, expected=RouteRequest)
        for name, script in self.scripts.items():
            bus = self.buses[name]

            async def generate(req: GenerateRequest, bus=bus, script=script) -> Ack:
                asyncio.get_running_loop().create_task(script(bus, req))
                return Ack()
            await bus.serve(subjects.worker_generate(name), generate, expected=GenerateRequest)
        self.backend = NatsBackend(self.buses["gw"], "m", 1024, tokenizer=None,
                                   settings=GatewaySettings(liveness_check_s=0.2, resume_wait_s=self.wait))
        await self.backend.start()
        return self

    async def run(self) -> list:
        req = GenerationRequest("r-1", "m", [1, 2, 3], SamplingParams(max_tokens=8), "standard", None)
        return await asyncio.wait_for(self._collect(req), 30)

    async def _collect(self, req) -> list:
        return [o async for o in self.backend.generate(req)]

    async def __aexit__(self, *exc) -> None:
        await self.backend.close()
        for b in self.buses.values():
            await b.close()
        self.server.stop()


async def finishing(bus: Bus, req: GenerateRequest) -> None:
    """A worker that streams the words from where the client is, to the end."""
    start = len(req.resume.output_token_ids) if req.resume else 0
    seq = req.resume.next_seq if req.resume else 0
    for i in range(start, len(WORDS)):
        await bus.publish(req.stream_subject, chunk(req, "w-live", seq + i - start, i, [i],
                                                    "stop" if i == len(WORDS) - 1 else None))


async def dropping(bus: Bus, req: GenerateRequest) -> None:
    """A worker that streams one word, then drops the request (an engine abort nobody asked for)."""
    await bus.publish(req.stream_subject, chunk(req, "w-drop", 0, 0, [0]))
    await bus.publish(req.stream_subject, chunk(req, "w-drop", 1, 1, [], "abort"))


async def test_a_request_a_worker_dropped_is_resumed_elsewhere():
    async with Scripted(["w-drop", "w-live"], {"w-drop": dropping, "w-live": finishing}) as t:
        outs = await t.run()
        assert "".join(o.text for o in outs) == "all of it" and outs[-1].finish_reason == "stop"
        assert [o.finish_reason for o in outs[:-1]] == [None] * (len(outs) - 1)  # "abort" never came out
        assert [r.exclude for r in t.routed] == [[], ["w-drop"]] and t.backend.resumes == 1


async def test_a_worker_back_from_a_pause_takes_the_request_again():
    """The only worker that can hold the request stops answering (SIGSTOP, a long GC or swap
    pause): the gateway resumes without it — and, once it sends heartbeats again under the same
    id, routes to it again (it was excluded for good: the request waited TANDEM_RESUME_WAIT_S for
    a worker that was back, then ended worker_lost). A worker killed never beats again under its id."""
    from shared.schemas import Heartbeat

    async def pausing(bus: Bus, req: GenerateRequest) -> None:
        if req.resume:   # back: the rest from where the client is
            return await finishing(bus, req)
        await bus.publish(req.stream_subject, chunk(req, "w-only", 0, 0, [0]))   # then silent, no Where

    async with Scripted(["w-only"], {"w-only": pausing}, resume_wait_s=10.0) as t:
        async def beat_later():
            await asyncio.sleep(1.5)
            for _ in range(10):
                await t.buses["w-only"].publish(subjects.heartbeat(subjects.CPU_DECODE, "w-only"), Heartbeat(
                    worker_id="w-only", role=subjects.CPU_DECODE, device="cpu", model="m", ready=True,
                    queue_depth=0, running=0, free_kv_blocks=1, total_kv_blocks=1, max_context=1024,
                    data_host="", data_port=0, ts=0.0, interval=1.0))
                await asyncio.sleep(0.5)
        beating = asyncio.create_task(beat_later())
        outs = await t.run()
        beating.cancel()
        assert "".join(o.text for o in outs) == "all of it" and outs[-1].finish_reason == "stop"
        assert t.routed[1].exclude == ["w-only"] and t.routed[-1].exclude == [] and t.backend.resumes == 1


async def test_a_dropped_request_with_no_worker_left_is_a_clear_error():
    async with Scripted(["w-drop"], {"w-drop": dropping}, resume_wait_s=1.0) as t:
        with pytest.raises(BackendError) as e:
            await t.run()
        assert e.value.code == "worker_lost" and e.value.status == 502 and "dropped it" in e.value.message


async def test_a_message_on_the_stream_that_is_no_chunk_is_skipped():
    """A peer with any JetStream permission can have the server send an API answer (JSON without
    an envelope) to a client's stream subject as its reply subject: that ended the request with a
    500 (SchemaError). It is skipped; the stream is exact."""
    async def interrupted(bus: Bus, req: GenerateRequest) -> None:
        await bus.publish(req.stream_subject, chunk(req, "w-live", 0, 0, [0]))
        await bus.nc.publish(req.stream_subject, b'{"type": "io.nats.jetstream.api.v1.stream_info_response"}')
        await bus.nc.publish(req.stream_subject, b"not json")
        for i in (1, 2):
            await bus.publish(req.stream_subject, chunk(req, "w-live", i, i, [i], "stop" if i == 2 else None))

    async with Scripted(["w-live"], {"w-live": interrupted}) as t:
        outs = await t.run()
        assert "".join(o.text for o in outs) == "all of it" and outs[-1].finish_reason == "stop"
        assert t.backend.resumes == 0


async def test_two_copies_of_one_attempt_never_drift():
    """The same attempt streamed by two workers (a hand-off that got no answer, yet arrived) with
    chunks cut at different tokens: the gateway takes a chunk only where it continues the text
    the client has, resumes, and the text is exact — not "all of itit"."""
    async def two_copies(bus: Bus, req: GenerateRequest) -> None:
        if req.resume:   # the resume (routed here again: no worker was lost) continues from the client's text
            return await ending(bus, req)
        await bus.publish(req.stream_subject, chunk(req, "w-a", 0, 0, [0]))
        await bus.publish(req.stream_subject, chunk(req, "w-b", 1, 1, [1, 2]))   # the copy that merged two steps
        await bus.publish(req.stream_subject, chunk(req, "w-a", 2, 2, [2], "stop"))

    async def ending(bus: Bus, req: GenerateRequest) -> None:   # the resume: the client has every word
        assert req.resume.output_token_ids == [0, 1, 2] and req.resume.emitted_chars == len("all of it")
        await bus.publish(req.stream_subject, chunk(req, "w-live", req.resume.next_seq, 3, [], "stop"))

    async with Scripted(["w-a"], {"w-a": two_copies}) as t:
        outs = await t.run()
        assert "".join(o.text for o in outs) == "all of it" and outs[-1].finish_reason == "stop"
        assert t.backend.resumes == 1


@pytest.mark.parametrize("refused", [None, "full", "draining"])
async def test_a_decode_worker_the_prefill_could_not_reach_is_left_out_of_the_resume(refused, caplog):
    """The router plans prefill "p" -> decode "d-c" while d-c is dead (its heartbeats not yet
    missed): p's KV hand-off finds d-c's data plane refusing connections. The prefill's stream
    error names d-c as lost (the real PrefillWorker.hand_off, KVConnector.hand_off and TCP sender,
    EngineWorker.stream_outputs; no engine): the resume is routed without d-c, not without p (the
    bench of N hosts saw a router name d-c again for that resume). ``refused``: d-c is alive and
    answers the hand-off with an error ("overloaded"): nobody is gone, the resume excludes nobody
    (it used to exclude p, the prefill, which had done nothing wrong), and refusals for room are
    no losses: two of them under TANDEM_RESUME_ATTEMPTS=1 (two choices of one request planned
    onto one ring: the second's hand-offs refused until the first ends) still end exact. A decode
    worker that refuses because it is stopping (``draining``) names itself: the request is routed
    again without it, still no loss."""
    import socket

    from shared.bus import RemoteError

    from services.prefill import PrefillWorker
    from shared.engine.kv_cache import KVBlobHeader, KVLayout
    from shared.engine.sampling import RequestOutput
    from shared.kv_connector import KVConnector
    from shared.schemas import PrefillRequest
    from shared.settings import DataPlaneSettings
    from shared.transfer import make_transport

    with socket.socket() as s:   # a port nothing listens on: connections to it are refused
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    server = EmbeddedNats()
    st = Settings(nats=NatsSettings(url=server.start(), request_timeout=2.0))
    buses = {n: await Bus.connect(st, name=n) for n in ("gw", "router", "p", "d-b")}
    routed: list[RouteRequest] = []

    async def route(req: RouteRequest) -> RoutePlan:
        routed.append(req)
        if len(routed) <= (2 if refused else 1):   # prefill on p (unless p is excluded), the KV to d-c; then d-b
            return RoutePlan(request_id=req.request_id, prefill_worker=None if "p" in req.exclude else "p",
                             decode_worker="d-c", decode_role=subjects.CPU_DECODE, reason="to d-c",
                             decode_data_host="127.0.0.1", decode_data_port=closed_port)
        return RoutePlan(request_id=req.request_id, prefill_worker=None, decode_worker="d-b",
                         decode_role=subjects.CPU_DECODE, reason="to d-b")

    class Engine:   # what hand_off asks of the engine: the exported KV (a header, no blocks)
        async def export_kv(self, rid: str, written_back: bool = False) -> bytes:
            return KVBlobHeader(layout=KVLayout(1, 1, 8).to_dict(), model="m", request_id=rid, token_ids=[1, 2, 3, 0], num_prompt_tokens=3,
                                num_computed=3, num_cached_tokens=0, params={}, priority=0, kv_blocks=0).pack(b"")

        async def abort(self, rid: str) -> bool:
            return True

    kv = KVConnector.__new__(KVConnector)   # its sending half only: the bus, the TCP sender
    kv.bus, kv.worker_id = buses["p"], "p"
    kv.sender = make_transport(DataPlaneSettings(shm=False, key="k")).sender()
    kv.store_later, kv.pool = (lambda *a: None), None
    if refused:
        async def hand_off(*a, **kw):   # d-c's answer on its decode subject (KVConnector.hand_off)
            if refused == "draining":   # what EngineWorker.refuse_if_draining answers, through the bus
                raise RemoteError.from_reply(error_reply_for(BusError(
                    "overloaded", "d-c is stopping (draining): the KV of r-1 goes to another worker", lost="d-c")))
            raise RemoteError("overloaded", "d-c: the engine is full")
        kv.hand_off = hand_off
    prefill = PrefillWorker.__new__(PrefillWorker)
    prefill.bus, prefill.worker_id, prefill.requests, prefill.engine, prefill.kv, prefill.tpot = \
        buses["p"], "p", {}, Engine(), kv, 0.0

    async def on_prefill(req: PrefillRequest) -> Ack:   # the next word, then the hand-off (services/prefill.py)
        start, seq = (len(req.resume.output_token_ids), req.resume.next_seq) if req.resume else (0, 0)
        attempt = req.resume.attempt if req.resume else 0

        async def outputs():
            yield RequestOutput(req.request_id, [start], WORDS[start], True, "prefilled")

        async def parked(out) -> None:
            await prefill.hand_off(req, seq + 1, attempt)
        asyncio.get_running_loop().create_task(prefill.stream_outputs(
            req.request_id, req.stream_subject, outputs(), seq, parked, attempt, offset=start))
        return Ack(worker="p")

    async def on_generate(req: GenerateRequest) -> Ack:
        asyncio.get_running_loop().create_task(finishing(buses["d-b"], req))
        return Ack(worker="d-b")

    await buses["router"].serve(subjects.ROUTE, route, expected=RouteRequest)
    await buses["p"].serve(subjects.worker_prefill("p"), on_prefill, expected=PrefillRequest)
    await buses["d-b"].serve(subjects.worker_generate("d-b"), on_generate, expected=GenerateRequest)
    backend = NatsBackend(buses["gw"], "m", 1024, tokenizer=None,
                          settings=GatewaySettings(liveness_check_s=0.2, resume_wait_s=5.0, resume_attempts=1))
    await backend.start()
    try:
        req = GenerationRequest("r-1", "m", [1, 2, 3], SamplingParams(max_tokens=8), "standard", None)
        outs = await asyncio.wait_for(_collect(backend, req), 30)
        assert "".join(o.text for o in outs) == "all of it" and outs[-1].finish_reason == "stop"
        # a failed hand-off is routine (the gateway goes on elsewhere): a warning, not an error with a traceback
        assert not [r for r in caplog.records if r.name == "tandem.worker" and r.levelno >= logging.ERROR]
        assert [r for r in caplog.records if r.name == "tandem.worker" and "hand-off to d-c" in r.getMessage()]
        if refused == "full":
            assert [r.exclude for r in routed] == [[]] * 3 and backend.resumes == 2
        elif refused == "draining":
            assert [r.exclude for r in routed] == [[], ["d-c"], ["d-c"]] and backend.resumes == 2
        else:
            assert [r.exclude for r in routed] == [[], ["d-c"]] and backend.resumes == 1
    finally:
        await backend.close()
        await kv.sender.close()
        for b in buses.values():
            await b.close()
        server.stop()


@pytest.mark.parametrize("field, params, want", [("max_tokens", ("messages", "max_completion_tokens"),
                                                  "max_completion_tokens"),
                                                 ("prompt", ("input", "max_output_tokens"), "input"),
                                                 ("max_tokens", ("prompt", "max_tokens"), "max_tokens")])
async def test_a_context_error_names_the_endpoint_s_own_field(field, params, want):
    """The router's prompt_too_long names the field at fault ("prompt" or "max_tokens"; it was
    always param: null): it crosses the bus (ErrorReply.param) and the client's 400 names it as its
    endpoint calls it (GenerationRequest.params: chat messages / max_completion_tokens, Responses
    input / max_output_tokens, completions prompt / max_tokens)."""
    from services.gateway.backend import BackendError

    server = EmbeddedNats()
    s = Settings(nats=NatsSettings(url=server.start(), request_timeout=2.0))
    gw_bus, router = [await Bus.connect(s, name=n) for n in ("gw", "router")]

    async def route(req: RouteRequest) -> RoutePlan:
        raise BusError("prompt_too_long", "a prompt of 3 tokens does not fit", param=field)

    await router.serve(subjects.ROUTE, route, expected=RouteRequest)
    backend = NatsBackend(gw_bus, "m", 1024, tokenizer=None, settings=GatewaySettings(resume_wait_s=1.0))
    await backend.start()
    try:
        req = GenerationRequest("r-1", "m", [1, 2, 3], SamplingParams(max_tokens=8), "standard", None, params=params)
        with pytest.raises(BackendError) as e:
            await asyncio.wait_for(_collect(backend, req), 30)
        assert (e.value.code, e.value.status, e.value.param) == ("context_length_exceeded", 400, want)
    finally:
        await backend.close()
        for b in (gw_bus, router):
            await b.close()
        server.stop()


async def _collect(backend: NatsBackend, req: GenerationRequest) -> list:
    return [o async for o in backend.generate(req)]


def test_a_failed_hand_off_names_the_worker_not_reached():
    """ErrorReply.lost of a prefill's failed hand-off: the decode worker when it was not reached, a
    ring member that stopped answering, nobody when the decode worker answered (it is there)."""
    from services.prefill import lost_in_hand_off
    from shared.bus import RemoteError
    from shared.ring import RingCapacityError, RingMemberLost
    from shared.transfer.base import PeerUnavailable, TransferError

    assert lost_in_hand_off(PeerUnavailable("cannot connect to 10.0.0.3:1: Connect call failed"), "d-c") == "d-c"
    assert lost_in_hand_off(TransferError("connection lost"), "d-c") == "d-c"
    assert lost_in_hand_off(BusError("unavailable", "no responders"), "d-c") == "d-c"
    assert lost_in_hand_off(RingMemberLost("d-e", "link broke"), "d-c") == "d-e"
    assert lost_in_hand_off(RemoteError("overloaded", "full"), "d-c") == ""
    assert lost_in_hand_off(RingCapacityError("no room"), "d-c") == ""
