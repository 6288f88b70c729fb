"""Running one tokenized request against the backend: collected into one response, or streamed
as server-sent events; a client that goes away aborts the request everywhere.

``run`` is the one place a request meets ``Backend.generate``:
- not streamed: outputs are collected (cancelled if the client disconnects) into ``fmt.response``;
- streamed: the first output is awaited before the 200 goes out, so admission errors keep their
  HTTP status; later errors become an SSE error event, the stream's last (never ``[DONE]`` after
  a partial text: ``[DONE]`` says the answer is complete);
- an answer is exact or an error: an output that ends with a finish reason outside OpenAI's (a
  backend that dropped the request: "abort") is the error ``worker_lost`` (``Choices``);
- in every path an unfinished request is aborted (``backend.abort``) and the backend's iterator
  is closed, also when the client disconnects between two chunks (``SSEResponse``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from shared import metrics

from .backend import Backend, BackendError, GenerationRequest
from .openai_api import Accumulator, APIError, _Format, json_response

log = logging.getLogger("tandem.gateway")

ABORT_TIMEOUT_S = 5.0     # a backend.abort that takes longer is logged and given up on
FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter", "function_call"}  # OpenAI's


def checked(out):
    """``out``, unless it ends its generation with a finish reason no OpenAI client knows: a
    request dropped behind the gateway's back is an error, never a short answer."""
    if out.finished and out.finish_reason is not None and out.finish_reason not in FINISH_REASONS:
        raise BackendError("worker_lost", f"the request was dropped before it finished "
                                          f"(finish_reason {out.finish_reason!r})", 502)
    return out


class ClientGone(Exception):
    """The client closed the connection before the response was complete."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, aw):
    """Await ``aw``; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so the generator's ``finally``
    (which aborts an unfinished request) runs when the client goes away between two chunks."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def warm_up() -> None:
    """One SSE response through Starlette in this process, before serving: anyio imports its stream
    and socket modules on first use, which cost the first streamed request ~0.1 s (measured in a
    fresh stack: 151 ms gateway TTFT vs 29 ms on the worker, then 32 ms)."""
    import httpx
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/")
    async def one():
        async def body():
            yield b"data: warm\n\n"
        return SSEResponse(body(), media_type="text/event-stream")

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://warm-up") as client:
        (await client.get("/")).raise_for_status()


async def abort(backend: Backend, rids: list[str], why: str) -> None:
    for rid in rids:
        log.info("%s %s; aborting", rid, why)
        with anyio.CancelScope(shield=True):
            try:
                with anyio.fail_after(ABORT_TIMEOUT_S):
                    await backend.abort(rid)
            except Exception:
                log.exception("%s abort failed", rid)


class ShuttingDown(BackendError):
    """The gateway ended the request (its drain time ran out), not the backend: it is aborted."""


def shutting_down() -> BackendError:
    return ShuttingDown("unavailable", "the gateway is shutting down and its drain time ran out before this answer "
                                       "was complete: send the request again", 503)


class Choices:
    """The outputs of one request's generations (one per choice, ``n``) as ``(index, output)``
    in arrival order; ``__anext__`` raises StopAsyncIteration when a generation ends unfinished
    or every one has finished."""

    def __init__(self, backend: Backend, gens: list[GenerationRequest], live=None):
        """``live``: a set the gateway keeps of its running requests (``GatewayState.close``)."""
        self.its = [backend.generate(g).__aiter__() for g in gens]
        self.pending: dict[int, asyncio.Future] = {}
        self.finished: set[int] = set()
        self.waiting: asyncio.Task | None = None    # the task awaiting the next output, while it does
        self.interrupted = False
        if live is not None:
            live.add(self)

    def __aiter__(self):
        return self

    def interrupt(self) -> None:
        """The gateway's drain ran out: the wait for the next output (now or later) raises
        ``unavailable`` (BackendError 503)."""
        self.interrupted = True
        if self.waiting is not None:
            self.waiting.cancel()

    async def __anext__(self) -> tuple[int, object]:
        if self.interrupted:
            raise shutting_down()
        self.waiting = asyncio.current_task()
        try:
            return await self._next()
        except asyncio.CancelledError:
            if not self.interrupted:
                raise
            self.waiting.uncancel()
            raise shutting_down() from None
        finally:
            self.waiting = None

    async def _next(self) -> tuple[int, object]:
        if len(self.its) == 1:
            out = await self.its[0].__anext__()
            return 0, checked(out)
        for i, it in enumerate(self.its):
            if i not in self.finished and i not in self.pending:
                self.pending[i] = asyncio.ensure_future(it.__anext__())
        if not self.pending:
            raise StopAsyncIteration
        await asyncio.wait(self.pending.values(), return_when=asyncio.FIRST_COMPLETED)
        i = min(i for i, t in self.pending.items() if t.done())
        out = checked(self.pending.pop(i).result())
        if out.finished:
            self.finished.add(i)
        return i, out

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            for t in self.pending.values():
                t.cancel()
            await asyncio.gather(*self.pending.values(), return_exceptions=True)
            self.pending.clear()
            for it in self.its:
                aclose = getattr(it, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except Exception:
                        log.exception("closing the backend stream failed")


def _first_token(accs: list[Accumulator], t0: float) -> float | None:
    """TTFT of a request that ended before its last token (the client left, an error mid-stream):
    its first token reached the client all the same, and counts (None: none did)."""
    firsts = [a.first_token_at for a in accs if a.first_token_at is not None]
    return min(firsts) - t0 if firsts else None


def _done(g: GenerationRequest, accs: list[Accumulator], t0: float) -> None:
    now = time.monotonic()
    tier = accs[0].tier or g.tier   # the tier it ran at (a session's tier change overrides the request's)
    if g.session_id:  # an agent's turn: how much of its prompt (the conversation so far) was reused
        metrics.observe_session_turn(tier, accs[0].prompt_tokens, max(a.cached_tokens for a in accs))
    for acc in accs:
        ttft = (acc.first_token_at - t0) if acc.first_token_at else float("nan")
        tpot = (now - acc.first_token_at) / (acc.completion_tokens - 1) \
            if acc.first_token_at is not None and acc.completion_tokens > 1 else None
        metrics.observe_request("gateway", tier, ttft=ttft if acc.first_token_at else None, tpot=tpot,
                                tokens=acc.completion_tokens, outcome="ok")
        log.info("%s done finish=%s prompt=%d completion=%d cached=%d ttft=%.3fs total=%.3fs", g.request_id,
                 acc.finish_reason, acc.prompt_tokens, acc.completion_tokens, acc.cached_tokens, ttft, now - t0)


async def run(request: Request, backend: Backend, gens: list[GenerationRequest], fmt: _Format, stream: bool,
              user: str | None) -> Response:
    """Run ``gens`` (one per choice) and answer: one JSON response, or an SSE stream (see the
    module doc)."""
    g = gens[0]
    rid, rids = g.request_id, [x.request_id for x in gens]
    log.info("%s start model=%s tier=%s session=%s user=%s prompt=%d max_tokens=%d n=%d stream=%s", rid, g.model,
             g.tier, g.session_id, user, len(g.prompt_token_ids), g.sampling.max_tokens, len(gens), stream)
    headers = {"X-Request-Id": rid, "X-Tandem-SLA": g.tier}
    t0 = time.monotonic()
    accs = [Accumulator(prompt_tokens=len(g.prompt_token_ids)) for _ in gens]
    it = Choices(backend, gens, request.app.state.gw.live)
    if not stream:
        return await _collect(request, backend, gens, it, accs, fmt, headers, t0)

    # streaming: wait for the first output so that admission errors keep their HTTP status
    try:
        first = await unless_disconnected(request, it.__anext__())
    except ClientGone:
        metrics.observe_request("gateway", g.tier, outcome="aborted")
        await abort(backend, rids, "client disconnected")
        await it.aclose()
        return Response(status_code=499)
    except StopAsyncIteration:
        await it.aclose()
        raise BackendError("internal_error", "the backend ended the stream without output", 502) from None
    except BackendError as e:   # the backend ended it (one of several choices: the others go too)
        await abort(backend, rids if len(rids) > 1 or isinstance(e, ShuttingDown) else [], e.code)
        await it.aclose()
        raise
    except BaseException as e:
        await abort(backend, rids, f"request failed ({type(e).__name__})")
        await it.aclose()
        raise
    headers["X-Tandem-SLA"] = first[1].tier or g.tier   # the tier it runs at, where the router said
    return SSEResponse(_events(backend, gens, it, first, accs, fmt, t0, request.app.state.gw),
                       media_type="text/event-stream",
                       headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _collect(request: Request, backend: Backend, gens: list[GenerationRequest], it: Choices,
                   accs: list[Accumulator], fmt: _Format, headers: dict, t0: float) -> Response:
    rids = [g.request_id for g in gens]

    async def collect() -> None:
        left = len(accs)
        while left:
            try:
                i, out = await it.__anext__()
            except StopAsyncIteration:
                raise BackendError("internal_error", "the backend ended the stream without finishing", 502) from None
            accs[i].add(out)
            left -= out.finished
    try:
        await unless_disconnected(request, collect())
    except ClientGone:
        metrics.observe_request("gateway", gens[0].tier, outcome="aborted")
        await abort(backend, rids, "client disconnected")
        return Response(status_code=499)
    except BackendError as e:
        if len(rids) > 1 or isinstance(e, ShuttingDown):  # the backend ended this choice itself; the others go
            await abort(backend, rids, e.code)
        raise
    except BaseException as e:
        await abort(backend, rids, f"request failed ({type(e).__name__})")
        raise
    finally:
        await it.aclose()
    _done(gens[0], accs, t0)
    await fmt.finish(accs)
    headers["X-Tandem-SLA"] = accs[0].tier or gens[0].tier
    return json_response(fmt.response(accs), headers=headers)


async def _events(backend: Backend, gens: list[GenerationRequest], it: Choices, first, accs: list[Accumulator],
                  fmt: _Format, t0: float, gw) -> AsyncIterator[bytes]:
    rid, rids = gens[0].request_id, [g.request_id for g in gens]
    finished = False
    try:
        for chunk in fmt.first_chunks():
            yield fmt.frame(chunk)
        i, out = first
        left = len(accs)
        while True:
            accs[i].add(out)
            for chunk in fmt.delta_chunks(i, out):
                yield fmt.frame(chunk)
            if out.finished:
                for chunk in fmt.final_chunks(i, accs[i]):
                    yield fmt.frame(chunk)
                left -= 1
                if not left:
                    finished = True
                    break
            if gw.closing:   # the gateway's drain time at shutdown ran out (app.serve)
                raise shutting_down()
            try:
                i, out = await it.__anext__()
            except StopAsyncIteration:
                raise BackendError("internal_error", "the backend ended the stream without finishing", 502) from None
        await fmt.finish(accs)
        for chunk in fmt.end_chunks(accs):
            yield fmt.frame(chunk)
        if fmt.done:
            yield fmt.done
        _done(gens[0], accs, t0)
    except BackendError as e:  # mid-stream: the status is sent already; an error event instead (no [DONE])
        finished = None          # None: ended, not finished, and counted here
        metrics.observe_request("gateway", gens[0].tier, ttft=_first_token(accs, t0), outcome="error")
        log.warning("%s failed mid-stream %d %s: %s", rid, e.status, e.code, e.message)
        for chunk in fmt.error_chunks(APIError.from_backend(e)):
            yield fmt.frame(chunk)
    except Exception as e:  # a bug: tell the client, abort (in finally), keep serving
        finished = None
        metrics.observe_request("gateway", gens[0].tier, ttft=_first_token(accs, t0), outcome="error")
        log.exception("%s internal error mid-stream", rid)
        for chunk in fmt.error_chunks(APIError(500, f"internal error: {type(e).__name__}", code="internal_error")):
            yield fmt.frame(chunk)
    finally:
        if finished is False:   # the client left (the generator closed or cancelled mid-stream)
            metrics.observe_request("gateway", gens[0].tier, ttft=_first_token(accs, t0), outcome="aborted")
        if not finished:
            await abort(backend, [r for r, a in zip(rids, accs) if a.finish_reason is None], "stream ended early")
        await it.aclose()
