"""The gateway's limits: what one client can make it hold, per request and per API key.

- **Body size** (``TANDEM_MAX_BODY_BYTES``): ``Limits`` is ASGI middleware around the app. It
  counts a request's body bytes as they arrive, whatever the framing (Content-Length or chunked),
  and the receive call that passes the limit raises ``APIError`` 413 ``body_too_large`` — so the
  handler reading the body ends with the 413 (in OpenAI's shape) having held at most the limit;
  a declared Content-Length over it fails before any byte is read. The 413 closes the
  connection, so the rest of an upload is never read.
- **Read deadlines** (``TANDEM_READ_TIMEOUT_S``): a request's whole body must arrive within it
  of the request's start (``Limits`` again: 408 ``request_timeout``, the connection closed), and
  a connection must send a request's headers within it (``deadline_protocol``: uvicorn's own
  timer runs only after a response, and any byte stops it) — else idle connections, headers
  sent a byte at a time and bodies that never end were held for good.
- **Streams per key** (``TANDEM_MAX_STREAMS_PER_KEY``): ``StreamCap`` counts each API key's
  generation requests in flight (streamed or not; all keyless clients are one key), from the
  moment the body is read — an upload is not a stream: 256 stalled uploads took every slot of
  the keyless tenant. One over the cap is a 429 ``too_many_streams``. A request's hold is released when the app is done with
  it — its response ended, its stream finished or broke off, its client went away, or an
  error — by the same middleware, so no path can leak one.
- **Tokenization off the event loop** (``TANDEM_TOKENIZE_THREADS``): ``off_loop`` runs a
  function (parse, validate, chat template, tokenize) in a bounded thread pool when the request
  body is large, so every other stream goes on meanwhile; small requests stay inline (a thread
  hop costs more than they do).
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from fastapi import Request

from .openai_api import APIError, json_response

log = logging.getLogger("tandem.gateway")

OFFLOAD_BYTES = 16384      # request bodies larger than this are parsed, templated and tokenized in the pool
RELEASES = "tandem.releases"   # scope key: what to release when the app is done with the request


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"request body larger than {limit} bytes", code="body_too_large")


def body_too_slow(seconds: float) -> APIError:
    return APIError(408, f"request body not received within {seconds:g} s (TANDEM_READ_TIMEOUT_S)",
                    code="request_timeout")


def deadline_protocol(seconds: float) -> type:
    """uvicorn's HTTP protocol class, closing a connection that has no request in progress and
    starts none for ``seconds`` (checked every ``seconds``: closed within twice that): connected
    and silent, or sending its headers too slowly."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class DeadlineProtocol(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._looked_at = None   # the request cycle seen at the last check
            self._check = self.loop.call_later(seconds, self._headers_due)

        def _headers_due(self) -> None:
            cycle = self.cycle
            if cycle is not None and (cycle is not self._looked_at or not cycle.response_complete):
                self._looked_at = cycle    # a request came since, or is in progress (its body: Limits)
                self._check = self.loop.call_later(seconds, self._headers_due)
            elif not self.transport.is_closing():
                log.info("closing a connection that sent no complete request in %g s (TANDEM_READ_TIMEOUT_S)",
                         seconds)
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self._check.cancel()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """A request the HTTP parser refuses (a bad chunk size, an HTTP/0.9 line, headers too
            large): OpenAI's error shape, as every other 400 here (uvicorn's is plain text)."""
            body = json.dumps({"error": {
                "message": f"malformed HTTP request: {msg.rstrip('.')} (bad framing, a bad request line or "
                           "headers too large)", "type": "invalid_request_error", "param": None,
                "code": "invalid_request"}}).encode()
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
            self.transport.close()

    return DeadlineProtocol


class Limits:
    """ASGI middleware: the body-size limit, and the release of what a request held (module doc)."""

    def __init__(self, app, max_body_bytes: int, read_timeout_s: float = 60.0, write_timeout_s: float = 60.0):
        self.app = app
        self.limit = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, seen, body_done = self.limit, 0, False
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and any(k == b"transfer-encoding" for k, _ in scope["headers"]):
            # both framings (RFC 9112 §6.1: an error, and the connection closed): a proxy in front
            # that reads the other one would take the rest of this body for a request of its own
            err = APIError(400, "a request with both Content-Length and Transfer-Encoding is refused",
                           code="invalid_request")
            await json_response(err.body(), 400, headers={"Connection": "close"})(scope, receive, send)
            return
        due = asyncio.get_running_loop().time() + self.read_timeout_s

        async def counted_receive():
            nonlocal seen, body_done
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise body_too_large(limit)
            if body_done:      # what comes now is the client's disconnect: no deadline on that
                return await receive()
            try:
                async with asyncio.timeout_at(due):
                    message = await receive()
            except TimeoutError:
                raise body_too_slow(self.read_timeout_s) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise body_too_large(limit)
                body_done = not message.get("more_body", False)
            return message

        async def timed_send(message) -> None:
            """A response's bytes wait for the client to read at most ``write_timeout_s`` (the
            server's send blocks only while the connection's buffers are full)."""
            if message["type"] != "http.response.body":
                return await send(message)
            try:
                async with asyncio.timeout(self.write_timeout_s):
                    await send(message)
            except TimeoutError:
                raise ClientNotReading() from None

        releases: list[Callable[[], None]] = []
        scope[RELEASES] = releases
        try:
            await self.app(scope, counted_receive, timed_send)
        except ClientNotReading:
            # a client that stopped reading held its stream slot and its unsent output for as long as
            # it kept the connection open: the request is aborted (SSEResponse closes its generator),
            # the slot freed here, and uvicorn closes the connection
            log.warning("%s %s: the client read nothing for %.0f s (TANDEM_WRITE_TIMEOUT_S): response abandoned, "
                        "connection closed", scope.get("method", ""), scope.get("path", ""), self.write_timeout_s)
        finally:
            for release in releases:
                release()


class ClientNotReading(Exception):
    """A response's send waited past the write timeout: its client stopped reading."""


class StreamCap:
    """Generation requests in flight per API key, at most ``cap`` each (0: no cap)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.held: dict[str, int] = {}   # key's tenant -> requests in flight

    def hold(self, request: Request, key: str) -> None:
        """Count one more request of ``key`` until the app is done with ``request``; 429 past the cap."""
        n = self.held.get(key, 0)
        if self.cap and n >= self.cap:
            raise APIError(429, f"this API key already has {n} requests in flight, the most allowed "
                                f"(TANDEM_MAX_STREAMS_PER_KEY={self.cap}); wait for one to end",
                           code="too_many_streams", retry_after=1.0)
        self.held[key] = n + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                left = self.held[key] - 1
                if left:
                    self.held[key] = left
                else:
                    del self.held[key]
        request.scope[RELEASES].append(release)

    def in_flight(self) -> int:
        return sum(self.held.values())


class TokenizePool:
    """A bounded thread pool for the CPU-heavy steps of large requests."""

    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tandem-tokenize")

    async def run(self, request: Request, fn: Callable[..., Any], *args) -> Any:
        """``fn(*args)``: in the pool when the request's body is large (``OFFLOAD_BYTES``), else inline."""
        if getattr(request.state, "body_bytes", 0) <= OFFLOAD_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
