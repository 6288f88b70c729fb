"""Running one tokenized request against the backend: collected into one response, or streamed
as server-sent events; a client that goes away aborts the request everywhere.

``run`` is the one place a request meets ``Backend.generate``:
- not streamed: outputs are collected (cancelled if the client disconnects) into ``fmt.response``;
- streamed: the first output is awaited before the 200 goes out, so admission errors keep their
  HTTP status; later errors become an SSE error event followed by ``[DONE]``;
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


async def abort(backend: Backend, rid: str, why: str) -> None:
    log.info("%s %s; aborting", rid, why)
    with anyio.CancelScope(shield=True):
        try:
            with anyio.fail_after(ABORT_TIMEOUT_S):
                await backend.abort(rid)
        except Exception:
            log.exception("%s abort failed", rid)


async def _close(it) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            try:
                await aclose()
            except Exception:
                log.exception("closing the backend stream failed")


def _done(g: GenerationRequest, acc: Accumulator, t0: float) -> None:
    now = time.monotonic()
    ttft = (acc.first_token_at - t0) if acc.first_token_at else float("nan")
    tpot = (now - acc.first_token_at) / (acc.completion_tokens - 1) if acc.completion_tokens > 1 else None
    metrics.observe_request("gateway", g.tier, ttft=ttft if acc.first_token_at else None, tpot=tpot,
                            tokens=acc.completion_tokens, outcome="ok")
    log.info("%s done finish=%s prompt=%d completion=%d cached=%d ttft=%.3fs total=%.3fs", g.request_id,
             acc.finish_reason, acc.prompt_tokens, acc.completion_tokens, acc.cached_tokens, ttft, now - t0)


async def run(request: Request, backend: Backend, g: GenerationRequest, fmt: _Format, stream: bool,
              user: str | None) -> Response:
    """Run ``g`` and answer: one JSON response, or an SSE stream (see the module doc)."""
    rid = g.request_id
    log.info("%s start model=%s tier=%s session=%s user=%s prompt=%d max_tokens=%d stream=%s", rid, g.model,
             g.tier, g.session_id, user, len(g.prompt_token_ids), g.sampling.max_tokens, stream)
    headers = {"X-Request-Id": rid, "X-Tandem-SLA": g.tier}
    t0 = time.monotonic()
    acc = Accumulator(prompt_tokens=len(g.prompt_token_ids))
    it = backend.generate(g).__aiter__()
    if not stream:
        return await _collect(request, backend, g, it, acc, fmt, headers, t0)

    # streaming: wait for the first output so that admission errors keep their HTTP status
    try:
        first = await unless_disconnected(request, it.__anext__())
    except ClientGone:
        await abort(backend, rid, "client disconnected")
        await _close(it)
        return Response(status_code=499)
    except StopAsyncIteration:
        await _close(it)
        raise BackendError("internal_error", "the backend ended the stream without output", 502) from None
    except BackendError:
        await _close(it)
        raise
    except BaseException as e:
        await abort(backend, rid, f"request failed ({type(e).__name__})")
        await _close(it)
        raise
    return SSEResponse(_events(backend, g, it, first, acc, fmt, t0), media_type="text/event-stream",
                       headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _collect(request: Request, backend: Backend, g: GenerationRequest, it, acc: Accumulator, fmt: _Format,
                   headers: dict, t0: float) -> Response:
    async def collect() -> None:
        while True:
            try:
                out = await it.__anext__()
            except StopAsyncIteration:
                raise BackendError("internal_error", "the backend ended the stream without finishing", 502) from None
            acc.add(out)
            if out.finished:
                return
    try:
        await unless_disconnected(request, collect())
    except ClientGone:
        await abort(backend, g.request_id, "client disconnected")
        return Response(status_code=499)
    except BackendError:
        raise  # the backend ended the request itself
    except BaseException as e:
        await abort(backend, g.request_id, f"request failed ({type(e).__name__})")
        raise
    finally:
        await _close(it)
    _done(g, acc, t0)
    await fmt.finish(acc)
    return json_response(fmt.response(acc), headers=headers)


async def _events(backend: Backend, g: GenerationRequest, it, first, acc: Accumulator, fmt: _Format,
                  t0: float) -> AsyncIterator[bytes]:
    rid = g.request_id
    finished = False
    try:
        for chunk in fmt.first_chunks():
            yield fmt.frame(chunk)
        out = first
        while True:
            acc.add(out)
            for chunk in fmt.delta_chunks(out):
                yield fmt.frame(chunk)
            if out.finished:
                finished = True
                break
            try:
                out = await it.__anext__()
            except StopAsyncIteration:
                raise BackendError("internal_error", "the backend ended the stream without finishing", 502) from None
        await fmt.finish(acc)
        for chunk in fmt.final_chunks(acc):
            yield fmt.frame(chunk)
        if fmt.done:
            yield fmt.done
        _done(g, acc, t0)
    except BackendError as e:  # mid-stream: the status is sent already; an error event instead
        finished = True
        metrics.observe_request("gateway", g.tier, outcome="error")
        log.warning("%s failed mid-stream %d %s: %s", rid, e.status, e.code, e.message)
        for chunk in fmt.error_chunks(APIError.from_backend(e)):
            yield fmt.frame(chunk)
        if fmt.done:
            yield fmt.done
    except Exception as e:  # a bug: tell the client, abort (in finally), keep serving
        log.exception("%s internal error mid-stream", rid)
        for chunk in fmt.error_chunks(APIError(500, f"internal error: {type(e).__name__}", code="internal_error")):
            yield fmt.frame(chunk)
        if fmt.done:
            yield fmt.done
    finally:
        if not finished:
            await abort(backend, rid, "client disconnected mid-stream")
        await _close(it)
