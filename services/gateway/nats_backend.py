"""The gateway's backend over the bus: router → prefill → decode, tokens back on a stream subject.

Per request (docs/architecture.md numbers these steps):
1. subscribe to ``tandem.stream.<request_id>`` (before anything can be published there);
2. ask the router for a plan (``tandem.router.route``);
3. send the prompt to the planned prefill worker (or, with no prefill worker, to the decode
   worker's generate subject); the worker acks once its engine took the request;
4. yield the StreamChunks in ``seq`` order (prefill sends seq 0, decode continues from 1);
5. if the client goes away first, broadcast ``tandem.abort`` so every service drops it.
Health comes from heartbeats: ready when a router and a decode worker are live.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from shared import subjects, tracing
from shared.bus import Bus, BusError, RemoteError
from shared.engine.sampling import RequestOutput, TokenLogprob
from shared.schemas import (Abort, ErrorReply, GenerateRequest, Heartbeat, PrefillRequest, RoutePlan,
                            RouteRequest, SessionState, SessionUpdate, StreamChunk)
from services.gateway.backend import BackendError, GenerationRequest

log = logging.getLogger("tandem.gateway")

CODE_MAP = {  # bus error code -> (gateway code, HTTP status)
    "bad_request": ("invalid_request", 400), "prompt_too_long": ("context_length_exceeded", 400),
    "not_found": ("not_found", 404), "overloaded": ("overloaded", 429), "unavailable": ("no_workers", 503),
    "timeout": ("timeout", 504), "internal": ("internal_error", 500),
}


def backend_error(code: str, message: str, retry_after: float = 0.0) -> BackendError:
    gw_code, status = CODE_MAP.get(code, ("internal_error", 500))
    return BackendError(gw_code, message, status, retry_after=retry_after)


class NatsBackend:
    def __init__(self, bus: Bus, model_name: str, max_context: int, tokenizer,
                 stall_timeout: float = 120.0):
        self.bus = bus
        self.model_name = model_name
        self.max_context = max_context
        self.tokenizer = tokenizer
        self.stall_timeout = stall_timeout   # no chunk for this long: the worker is gone
        self.beats: dict[str, tuple[Heartbeat, float]] = {}
        self._watch_task: asyncio.Task | None = None

    async def start(self) -> None:
        sub = await self.bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, skip_invalid=True)

        async def watch() -> None:
            async for beat in sub:
                self.beats[beat.worker_id] = (beat, time.monotonic())

        self._watch_task = asyncio.create_task(watch(), name="gateway-heartbeats")

    def health(self) -> tuple[bool, dict]:
        now = time.monotonic()
        roles: dict[str, list[str]] = {}
        for beat, seen in self.beats.values():
            if beat.ready and now - seen <= 3 * beat.interval:
                roles.setdefault(beat.role, []).append(beat.worker_id)
        decode = roles.get(subjects.GPU_DECODE, []) + roles.get(subjects.CPU_DECODE, [])
        ready = bool(roles.get(subjects.ROUTER)) and bool(decode)
        details = {r: {"ready": bool(roles.get(r)), "workers": sorted(roles.get(r, []))}
                   for r in (subjects.ROUTER, subjects.PREFILL, subjects.GPU_DECODE, subjects.CPU_DECODE)}
        return ready, details

    async def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        rid = req.request_id
        stream_subject = subjects.stream(rid)
        sub = await self.bus.subscribe(stream_subject)
        finished = False
        try:
            with tracing.span("gateway.dispatch", tier=req.tier):  # parent of the router's and workers' spans
                plan = await self._call(subjects.ROUTE, RouteRequest(
                    request_id=rid, model=req.model, tier=req.tier, session_id=req.session_id,
                    num_prompt_tokens=len(req.prompt_token_ids), max_tokens=req.sampling.max_tokens,
                    prompt_token_ids=req.prompt_token_ids), RoutePlan)
                sampling = req.sampling.to_dict()
                if plan.prefill_worker:  # the plan's tier: a session's may raise it, fifo flattens it
                    await self._call(subjects.worker_prefill(plan.prefill_worker), PrefillRequest(
                        request_id=rid, prompt_token_ids=req.prompt_token_ids, sampling=sampling, tier=plan.tier,
                        decode_worker=plan.decode_worker, decode_subject=subjects.worker_decode(plan.decode_worker),
                        stream_subject=stream_subject, decode_data_host=plan.decode_data_host,
                        decode_data_port=plan.decode_data_port, session_id=req.session_id))
                else:
                    await self._call(subjects.worker_generate(plan.decode_worker), GenerateRequest(
                        request_id=rid, prompt_token_ids=req.prompt_token_ids, sampling=sampling, tier=plan.tier,
                        stream_subject=stream_subject, session_id=req.session_id))
            log.info("%s: %s", rid, plan.reason)
            next_seq, held = 0, {}
            while not finished:
                try:
                    msg = await sub.next(timeout=self.stall_timeout)
                except BusError:
                    raise BackendError("worker_lost", f"no progress for {self.stall_timeout:.0f}s", 502) from None
                if isinstance(msg, ErrorReply):
                    raise backend_error(msg.code, msg.message, msg.retry_after)
                if not isinstance(msg, StreamChunk):
                    continue
                held[msg.seq] = msg
                while next_seq in held:  # prefill and decode publish from different connections
                    chunk = held.pop(next_seq)
                    next_seq += 1
                    finished = chunk.finish_reason is not None
                    yield to_output(chunk)
                    if finished:
                        break
        finally:
            await sub.unsubscribe()
            if not finished:
                await self.abort(rid)

    async def update_session(self, session_id: str, tier: str) -> dict:
        """Set a session's tier (the router moves its running requests); the new state."""
        state = await self._call(subjects.ROUTER_SESSION, SessionUpdate(session_id=session_id, tier=tier),
                                 SessionState)
        return {"id": state.session_id, "object": "session", "tier": state.tier, "worker": state.worker,
                "running": state.running, "moved": state.moved}

    async def _call(self, subject: str, msg, expected=None):
        try:
            return await self.bus.request(subject, msg, expected=expected)
        except RemoteError as e:
            raise backend_error(e.code, e.message, e.retry_after) from None
        except BusError as e:
            raise backend_error(e.code, str(e), e.retry_after) from None

    async def abort(self, request_id: str) -> None:
        try:
            await self.bus.publish(subjects.ABORT, Abort(request_id=request_id, reason="client gone"))
        except Exception:  # the bus is gone: the workers' stall timeouts will clean up
            log.warning("%s: could not broadcast abort", request_id, exc_info=True)

    async def close(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()


def to_output(c: StreamChunk) -> RequestOutput:
    lps = None
    if c.logprobs is not None:
        lps = [TokenLogprob(d["token_id"], d["logprob"], [tuple(t) for t in d["top"]]) for d in c.logprobs]
    u = c.usage or {}
    return RequestOutput(request_id=c.request_id, token_ids=c.token_ids, text=c.text,
                         finished=c.finish_reason is not None, finish_reason=c.finish_reason, logprobs=lps,
                         num_prompt_tokens=u.get("prompt_tokens", 0), num_cached_tokens=u.get("cached_tokens", 0),
                         num_output_tokens=u.get("completion_tokens", 0))
