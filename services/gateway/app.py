"""The gateway's HTTP layer: an OpenAI-compatible REST API in front of a ``Backend``.

Life of a request:
1. read + parse the JSON body, validate it (400 naming the parameter), check the model (404);
2. resolve SLA tier and session (body ``sla``/``tier``/``session_id`` over the
   ``X-Tandem-SLA``/``X-Tandem-Session`` headers over the default tier);
3. tokenize (chat template for chat), check prompt + max_tokens against the context (400
   ``context_length_exceeded``), build ``SamplingParams`` and a ``GenerationRequest``;
4. iterate ``backend.generate``: collected into one response, or streamed as SSE chunks
   (the first output is awaited before the 200 goes out, so admission errors keep their status);
5. a client that goes away before the request finished -> ``backend.abort(request_id)``.

Every log line about a request starts with its id (``chatcmpl-<hex>`` / ``cmpl-<hex>``), and
the request's trace context (the client's ``traceparent`` header, or a new trace) goes with every
bus message it causes (shared/tracing.py). ``GET /metrics``: Prometheus series (shared/metrics.py).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import math
import time
import uuid
from typing import AsyncIterator

import anyio
import orjson
from fastapi import FastAPI, Request
from jinja2 import TemplateError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared import metrics, tracing
from shared.settings import GatewaySettings

from .backend import TIERS, Backend, BackendError, GenerationRequest
from .openai_api import (
    SESSION_HEADER, SESSION_RE, SLA_HEADER, SSE_DONE, Accumulator, APIError, ChatCompletionRequest, ChatFormat,
    CompletionFormat, CompletionRequest, TokenStrings, _Format, bad_param, chat_messages, check_unsupported,
    completion_prompt, ignored_fields, model_card, models_list, parse_json, resolve_session, resolve_tier,
    sampling_params, sse, validate_model,
)

log = logging.getLogger("tandem.gateway")

ABORT_TIMEOUT_S = 5.0     # a backend.abort that takes longer is logged and given up on
OFFLOAD_CHARS = 16384     # prompts longer than this are templated + tokenized in a worker thread


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's command-line flags; each defaults to its environment variable."""
    parser.add_argument("--host", default=None, help="interface to listen on (TANDEM_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="HTTP port (TANDEM_PORT, default 8000)")
    parser.add_argument("--api-key", default=None, help="require this bearer token on /v1/* (TANDEM_API_KEY)")
    parser.add_argument("--default-sla", dest="default_tier", choices=TIERS, default=None,
                        help="tier of requests that name none (TANDEM_DEFAULT_TIER, default standard)")


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    return GatewaySettings.from_env(host=args.host, port=args.port, api_key=args.api_key,
                                    default_tier=args.default_tier)


# ---- helpers --------------------------------------------------------------------------------

def _json(obj: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(content=orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


class _ClientGone(Exception):
    """The client closed the connection before the response was complete."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, aw):
    """Await ``aw``; if the client disconnects first, cancel it and raise _ClientGone."""
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
        raise _ClientGone()
    return task.result()


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so the generator's ``finally``
    (which aborts an unfinished request) runs when the client goes away between two chunks."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


# ---- the app --------------------------------------------------------------------------------

def create_app(backend: Backend, settings: GatewaySettings | None = None) -> FastAPI:
    """The gateway's FastAPI app for one backend."""
    settings = settings or GatewaySettings()
    started = int(time.time())
    token_str = TokenStrings(backend.tokenizer)
    app = FastAPI(title="Tandem", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend = backend
    app.state.settings = settings

    # -- errors, all in OpenAI's shape --

    def _error(request: Request, err: APIError) -> Response:
        rid = getattr(request.state, "request_id", "-")
        level = logging.WARNING if err.status >= 500 else logging.INFO
        metrics.observe_request("gateway", getattr(request.state, "tier", "-"), outcome="error")
        log.log(level, "%s rejected %d %s param=%s: %s", rid, err.status, err.code, err.param, err.message)
        headers = {"X-Request-Id": rid} if rid != "-" else {}
        if err.retry_after > 0:
            headers["Retry-After"] = str(max(1, math.ceil(err.retry_after)))
        return _json(err.body(), err.status, headers=headers or None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return _error(request, exc)

    @app.exception_handler(BackendError)
    async def _backend_error(request: Request, exc: BackendError) -> Response:
        return _error(request, APIError.from_backend(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error(request, APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        rid = getattr(request.state, "request_id", "-")
        log.exception("%s internal error", rid)
        return _json(APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").body(), 500)

    # -- request plumbing --

    key_tiers = settings.key_tiers()

    def _check_auth(request: Request) -> None:
        """401 unless a configured bearer token is sent; remembers that key's default tier."""
        request.state.key_tier = settings.default_tier
        if not key_tiers:
            return
        auth = request.headers.get("authorization", "").encode()
        for key, tier in key_tiers.items():
            if hmac.compare_digest(auth, f"Bearer {key}".encode()):
                request.state.key_tier = tier
                return
        raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")

    async def _read_body(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            raise APIError(413, f"request body larger than {settings.max_body_bytes} bytes", code="body_too_large")
        raw = await request.body()
        if len(raw) > settings.max_body_bytes:
            raise APIError(413, f"request body larger than {settings.max_body_bytes} bytes", code="body_too_large")
        return parse_json(raw)

    def _check_model(model: str) -> None:
        if model != backend.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{backend.model_name}`.",
                           param="model", code="model_not_found")

    def _check_context(n_prompt: int, max_tokens: int | None, prompt_param: str,
                       max_param: str) -> int:
        """The request's max_tokens (the rest of the context when not given), or a 400."""
        ctx = backend.max_context
        if n_prompt >= ctx or (max_tokens is not None and n_prompt + max_tokens > ctx):
            asked = n_prompt + (max_tokens or 0)
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                f"{asked} tokens ({n_prompt} in the {prompt_param}, {max_tokens or 0} in the "
                                f"completion). Please reduce the length of the {prompt_param} or completion.",
                           param=prompt_param if n_prompt >= ctx else max_param, code="context_length_exceeded")
        return ctx - n_prompt if max_tokens is None else max_tokens

    def _common(request: Request, req, rid: str) -> tuple[str, str | None]:
        tracing.start(rid, request.headers.get(tracing.TRACEPARENT))
        _check_model(req.model)
        check_unsupported(req)
        extra = ignored_fields(req)
        if extra:
            log.info("%s ignoring unsupported fields: %s", rid, ", ".join(extra))
        tier = resolve_tier(req, request.headers.get(SLA_HEADER), request.state.key_tier)
        session = resolve_session(req, request.headers.get(SESSION_HEADER))
        request.state.tier = tier
        return tier, session

    def _chat_prompt(messages: list[dict]) -> list[int]:
        try:
            text = backend.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except (ValueError, TemplateError) as e:  # the template's raise_exception, or no template
            raise bad_param("messages", f"could not apply the chat template: {e}") from None
        # the template already holds BOS where the model wants one (as transformers tokenizes it)
        return backend.tokenizer.encode(text, add_special_tokens=False)

    def _max_tokens_param(value, name: str) -> int | None:
        if value is not None and value < 1:
            raise bad_param(name, f"invalid parameter {name}={value}: must be an integer >= 1")
        return value

    # -- endpoints --

    @app.get("/health")
    async def health() -> Response:
        try:
            ready, details = backend.health()
        except Exception as e:  # a broken health check is "not ready", with the reason
            log.exception("health check failed")
            ready, details = False, {"error": f"{type(e).__name__}: {e}"}
        body = {"status": "ready" if ready else "unavailable", "model": backend.model_name, "details": details}
        return _json(body, 200 if ready else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        _check_auth(request)
        return _json(models_list(backend.model_name, backend.max_context, started))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> Response:
        _check_auth(request)
        _check_model(model_id)
        return _json(model_card(backend.model_name, backend.max_context, started))

    @app.post("/v1/sessions/{session_id:path}")
    async def update_session(session_id: str, request: Request) -> Response:
        """Change an agent session's tier: its running requests move between GPU and CPU decode
        (their streams go on), its next turns run at the new tier."""
        _check_auth(request)
        body = await _read_body(request)  # a JSON object, or 400
        for extra in sorted(set(body) - {"tier", "sla"}):
            raise bad_param(extra, f"unknown field {extra!r}: the body is {{\"tier\": \"interactive\" | "
                                   f"\"standard\" | \"batch\"}}")
        tier = body.get("tier", body.get("sla"))
        if not isinstance(tier, str) or tier.strip().lower() not in TIERS:
            raise bad_param("tier", f"invalid SLA tier {tier!r}: expected one of {', '.join(TIERS)}",
                            code="invalid_tier")
        if not SESSION_RE.match(session_id):
            raise bad_param("session_id", "invalid session id: 1-256 visible ASCII characters, no spaces",
                            code="invalid_session")
        state = await backend.update_session(session_id, tier.strip().lower())
        log.info("session %s -> %s: moved %d request(s)", session_id, state["tier"], len(state["moved"]))
        return _json(state)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        rid = request.state.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        _check_auth(request)
        req = validate_model(ChatCompletionRequest, await _read_body(request))
        tier, session = _common(request, req, rid)
        messages = chat_messages(req.messages)
        if sum(len(m["content"]) for m in messages) > OFFLOAD_CHARS:  # long: keep the event loop free
            prompt = await anyio.to_thread.run_sync(_chat_prompt, messages)
        else:
            prompt = _chat_prompt(messages)
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        asked = _max_tokens_param(req.max_completion_tokens if req.max_completion_tokens is not None
                                  else req.max_tokens, max_param)
        max_tokens = _check_context(len(prompt), asked, "messages", max_param)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise bad_param("top_logprobs", f"invalid parameter top_logprobs={req.top_logprobs}: must be in [0, 20]")
        want_lp = bool(req.logprobs)
        sampling = sampling_params(req, max_tokens, logprobs=want_lp, top_logprobs=req.top_logprobs or 0)
        fmt = ChatFormat(rid, req.model, token_str, (req.top_logprobs or 0) if want_lp else None)
        return await _run(request, GenerationRequest(rid, req.model, prompt, sampling, tier, session),
                          fmt, req.stream, req.user)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        rid = request.state.request_id = f"cmpl-{uuid.uuid4().hex}"
        _check_auth(request)
        req = validate_model(CompletionRequest, await _read_body(request))
        tier, session = _common(request, req, rid)
        if isinstance(req.prompt, str) and len(req.prompt) > OFFLOAD_CHARS:
            prompt = await anyio.to_thread.run_sync(completion_prompt, req.prompt, backend.tokenizer)
        else:
            prompt = completion_prompt(req.prompt, backend.tokenizer)
        asked = _max_tokens_param(req.max_tokens if req.max_tokens is not None else 16, "max_tokens")
        max_tokens = _check_context(len(prompt), asked, "prompt", "max_tokens")
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise bad_param("logprobs", f"invalid parameter logprobs={req.logprobs}: must be in [0, 20]")
        want_lp = req.logprobs is not None
        sampling = sampling_params(req, max_tokens, logprobs=want_lp, top_logprobs=req.logprobs or 0)
        fmt = CompletionFormat(rid, req.model, token_str, req.logprobs if want_lp else None)
        return await _run(request, GenerationRequest(rid, req.model, prompt, sampling, tier, session),
                          fmt, req.stream, req.user)

    # -- running a request --

    async def _abort(rid: str, why: str) -> None:
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
                 acc.finish_reason, acc.prompt_tokens, acc.completion_tokens, acc.cached_tokens, ttft,
                 now - t0)

    async def _run(request: Request, g: GenerationRequest, fmt: _Format, stream: bool, user: str | None) -> Response:
        rid = g.request_id
        log.info("%s start model=%s tier=%s session=%s user=%s prompt=%d max_tokens=%d stream=%s", rid, g.model,
                 g.tier, g.session_id, user, len(g.prompt_token_ids), g.sampling.max_tokens, stream)
        headers = {"X-Request-Id": rid, "X-Tandem-SLA": g.tier}
        t0 = time.monotonic()
        acc = Accumulator(prompt_tokens=len(g.prompt_token_ids))
        it = backend.generate(g).__aiter__()

        if not stream:
            async def collect() -> None:
                while True:
                    try:
                        out = await it.__anext__()
                    except StopAsyncIteration:
                        raise BackendError("internal_error", "the backend ended the stream without finishing",
                                           502) from None
                    acc.add(out)
                    if out.finished:
                        return
            try:
                await _unless_disconnected(request, collect())
            except _ClientGone:
                await _abort(rid, "client disconnected")
                return Response(status_code=499)
            except BackendError:
                raise  # the backend ended the request itself
            except BaseException as e:
                await _abort(rid, f"request failed ({type(e).__name__})")
                raise
            finally:
                await _close(it)
            _done(g, acc, t0)
            return _json(fmt.response(acc), headers=headers)

        # streaming: wait for the first output so that admission errors keep their HTTP status
        try:
            first = await _unless_disconnected(request, it.__anext__())
        except _ClientGone:
            await _abort(rid, "client disconnected")
            await _close(it)
            return Response(status_code=499)
        except StopAsyncIteration:
            await _close(it)
            raise BackendError("internal_error", "the backend ended the stream without output", 502) from None
        except BackendError:
            await _close(it)
            raise
        except BaseException as e:
            await _abort(rid, f"request failed ({type(e).__name__})")
            await _close(it)
            raise

        async def events() -> AsyncIterator[bytes]:
            finished = False
            try:
                for chunk in fmt.first_chunks():
                    yield sse(chunk)
                out = first
                while True:
                    acc.add(out)
                    chunk = fmt.delta_chunk(out)
                    if chunk is not None:
                        yield sse(chunk)
                    if out.finished:
                        finished = True
                        break
                    try:
                        out = await it.__anext__()
                    except StopAsyncIteration:
                        raise BackendError("internal_error", "the backend ended the stream without finishing",
                                           502) from None
                yield sse(fmt.final_chunk(acc))
                yield sse(fmt.usage_chunk(acc))
                yield SSE_DONE
                _done(g, acc, t0)
            except BackendError as e:  # mid-stream: the status is sent already; an error event instead
                finished = True
                metrics.observe_request("gateway", g.tier, outcome="error")
                log.warning("%s failed mid-stream %d %s: %s", rid, e.status, e.code, e.message)
                yield sse(APIError.from_backend(e).body())
                yield SSE_DONE
            except Exception as e:  # a bug: tell the client, abort (in finally), keep serving
                log.exception("%s internal error mid-stream", rid)
                yield sse(APIError(500, f"internal error: {type(e).__name__}", code="internal_error").body())
                yield SSE_DONE
            finally:
                if not finished:
                    await _abort(rid, "client disconnected mid-stream")
                await _close(it)

        return _SSEResponse(events(), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


# ---- serving --------------------------------------------------------------------------------

async def serve(backend: Backend, settings: GatewaySettings, log_level: str = "info") -> None:
    """Serve the gateway with uvicorn until SIGINT/SIGTERM; in-flight requests get ``drain_s``."""
    import uvicorn

    config = uvicorn.Config(create_app(backend, settings), host=settings.host, port=settings.port,
                            log_level=log_level, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=settings.drain_s)
    log.info("gateway on http://%s:%d serving %s (context %d)", settings.host, settings.port,
             backend.model_name, backend.max_context)
    await uvicorn.Server(config).serve()
