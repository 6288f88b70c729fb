"""The gateway service's app: an OpenAI-compatible REST API in front of a ``Backend``.

``create_app`` puts the endpoints (``handlers.py``), the error handlers (every error in
OpenAI's shape, a bug included) and the limits (``limits.py``: body size, streams per key) on a
FastAPI app; ``serve`` runs it with uvicorn. How a request runs: ``handlers.py`` (parse,
validate, tokenize) then ``streaming.py`` (collect or stream, abort on disconnect). Every log
line about a request starts with its id (``chatcmpl-<hex>`` / ``cmpl-<hex>``), and the
request's trace context (the client's ``traceparent`` header, or a new trace) goes with every
bus message it causes (shared/tracing.py). ``GET /metrics``: Prometheus.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from shared import metrics
from shared.settings import GatewaySettings
from shared.tier import TIERS

from .backend import Backend, BackendError
from .handlers import GatewayState, router
from .limits import Limits, deadline_protocol
from . import streaming
from .responses import router as responses_router
from .openai_api import APIError, json_response

log = logging.getLogger("tandem.gateway")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's command-line flags (`tandem serve gateway`); each defaults to its environment
    variable. API keys have none: a key on a command line is in every user's `ps`."""
    parser.add_argument("--host", default=None, help="gateway: interface to listen on (TANDEM_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="gateway: HTTP port (TANDEM_PORT, default 8000)")
    parser.add_argument("--default-tier", dest="default_tier", choices=[t.value for t in TIERS], default=None,
                        help="gateway: tier of requests that name none (TANDEM_DEFAULT_TIER, default standard)")
    parser.add_argument("--served-model-name", dest="served_model_name", default=None,
                        help="gateway: the model id clients send (TANDEM_SERVED_MODEL_NAME; default the model "
                             "file's stem)")


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    return GatewaySettings.from_env(host=args.host, port=args.port, default_tier=args.default_tier,
                                    served_model_name=args.served_model_name)


CLOSE_GRACE_S = 3.0   # after the drain time, for each stream still going to send its error event

# ---- errors, all in OpenAI's shape ----------------------------------------------------------

def _error(request: Request, err: APIError, extra: dict | None = None) -> Response:
    """``err`` as OpenAI's error body; ``extra``: headers the status needs (405: ``Allow``)."""
    rid = getattr(request.state, "request_id", "-")
    level = logging.WARNING if err.status >= 500 else logging.INFO
    # the server's failures are errors; load shed is "overloaded"; the rest is the client's own
    # (a bad body, no key, a path that does not exist: a scanner must not move the error rate)
    outcome = "error" if err.status >= 500 else "overloaded" if err.status == 429 else "rejected"
    metrics.observe_request("gateway", getattr(request.state, "tier", None) or "none", outcome=outcome)
    log.log(level, "%s rejected %d %s param=%s: %s (%s %s)", rid, err.status, err.code, err.param, err.message,
            request.method, request.url.path[:200])
    headers = {"X-Request-Id": rid} if rid != "-" else {}
    if err.retry_after > 0:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after)))
    if err.code in ("body_too_large", "request_timeout"):  # the rest of the upload is never read
        headers["Connection"] = "close"
    headers.update(extra or {})
    return json_response(err.body(), err.status, headers=headers or None)


async def _api_error(request: Request, exc: APIError) -> Response:
    return _error(request, exc)


async def _backend_error(request: Request, exc: BackendError) -> Response:
    return _error(request, APIError.from_backend(exc))


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    allow = {k: v for k, v in (exc.headers or {}).items() if k.lower() == "allow"}   # RFC 9110: a 405 has one
    return _error(request, APIError(exc.status_code, str(exc.detail), code=code), allow)


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    """The client went away while its body was being read: nothing to answer, nothing to log as a bug."""
    log.info("%s client disconnected before its request was read", getattr(request.state, "request_id", "-"))
    return Response(status_code=499)


class Internal:
    """ASGI middleware: an unexpected exception before the response started becomes a 500 in
    OpenAI's shape, logged with its traceback, and the request ends there. (An exception handler
    for ``Exception`` would answer the same, but Starlette re-raises after it, and uvicorn then
    closes the connection: the client's next request on that keep-alive connection was lost.)
    One raised after the response started still goes up: that response is broken, and closing
    the connection is how its client learns it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as exc:
            if started:
                raise
            request = Request(scope)
            log.error("%s internal error", getattr(request.state, "request_id", "-"), exc_info=exc)
            err = APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")
            await _error(request, err)(scope, receive, send)


# ---- the app --------------------------------------------------------------------------------

def create_app(backend: Backend, settings: GatewaySettings | None = None) -> FastAPI:
    """The gateway's FastAPI app for one backend."""
    settings = settings or GatewaySettings()
    app = FastAPI(title="Tandem", version="0.1.0", docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  description="OpenAI-compatible API of Tandem's gateway (docs/api.md)")
    app.state.gw = GatewayState(backend, settings)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(BackendError, _backend_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_middleware(Limits, max_body_bytes=settings.max_body_bytes, read_timeout_s=settings.read_timeout_s,
                       write_timeout_s=settings.write_timeout_s)
    app.add_middleware(Internal)    # outside Limits: what a request held is released first
    app.include_router(router)
    app.include_router(responses_router)
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema of the routes, plus the request bodies (the handlers read the body
    themselves, to answer errors in OpenAI's shape, so FastAPI cannot see the models)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi
        from pydantic.json_schema import models_json_schema

        from .openai_api import ChatCompletionRequest, CompletionRequest
        spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        bodies = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
        _, defs = models_json_schema([(m, "validation") for m in bodies.values()],
                                     ref_template="#/components/schemas/{model}")
        spec.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        for path, model in bodies.items():
            spec["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = spec
    return app.openapi_schema


async def serve(backend: Backend, settings: GatewaySettings, log_level: str = "info") -> None:
    """Serve the gateway with uvicorn until SIGINT/SIGTERM; in-flight requests get ``drain_s``."""
    await streaming.warm_up()
    app = create_app(backend, settings)
    server = draining_server(app, settings, log_level=log_level)
    log.info("gateway on http://%s:%d serving %s (context %d)", settings.host, settings.port,
             backend.model_name, backend.max_context)
    try:
        await server.serve()
    finally:
        if app.state.gw.responses is not None:     # stored responses the bus has not taken yet
            await app.state.gw.responses.close()


def draining_server(app: FastAPI, settings: GatewaySettings, **config):
    """A uvicorn server of ``app`` whose shutdown (SIGINT / SIGTERM) drains: no new connection,
    in-flight requests go on for ``drain_s``; then each stream still going ends with an error event
    at its next chunk (``GatewayState.closing``), and uvicorn cancels what is left
    ``CLOSE_GRACE_S`` later."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn raises the signal it stopped for again once it has shut down: the process
            then dies of SIGTERM (exit 143 in a container) after a clean drain — every rolling
            update would look like a failure. Drained: it exits 0, as every other service does."""
            with super().capture_signals():
                yield
                self._captured_signals.clear()

        async def shutdown(self, sockets=None) -> None:
            def close() -> None:
                log.warning("drain time (TANDEM_DRAIN_S=%.0f s) over: ending the streams still going with an "
                            "error event", settings.drain_s)
                app.state.gw.close()
            timer = asyncio.get_running_loop().call_later(settings.drain_s, close)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server(uvicorn.Config(app, host=settings.host, port=settings.port, access_log=False, lifespan="off",
                                 http=deadline_protocol(settings.read_timeout_s),
                                 timeout_graceful_shutdown=settings.drain_s + CLOSE_GRACE_S, **config))
