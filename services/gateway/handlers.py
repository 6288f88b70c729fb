"""The gateway's endpoints, one module-level handler each, and the request plumbing they share.

Life of a generation request:
1. authenticate (401), count the request against its key's streams (429 ``too_many_streams``,
   limits.py), read + parse the JSON body (413 past the size limit, chunked uploads included:
   limits.py), validate it (400 naming the parameter), check the model (404);
2. resolve SLA tier, session and tenant (body ``sla``/``tier``/``session_id`` over the
   ``X-Tandem-SLA``/``X-Tandem-Session`` headers over the API key's default tier; the key's
   tier is also a ceiling; the key and ``cache_salt`` give the tenant whose cached KV the request
   may reuse, docs/security.md);
3. tokenize (chat template for chat; a large request is parsed, validated, templated and
   tokenized in a bounded thread pool, so the event loop and every other stream keep going),
   check prompt + max_tokens against the context (400 ``context_length_exceeded``), build
   ``SamplingParams`` and a ``GenerationRequest``;
4. ``streaming.run``: one response, or SSE chunks; a client gone -> the request is aborted.

Each handler finds the gateway's state (backend, settings, ...) as ``request.app.state.gw``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import re
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from jinja2 import TemplateError

from kvpool.keys import PUBLIC_OWNER
from shared import metrics, tracing
from shared.settings import GatewaySettings
from shared.tier import TIERS, Tier

from . import streaming, tools
from .backend import Backend, GenerationRequest
from .limits import StreamCap, TokenizePool
from .openai_api import (
    SESSION_HEADER, SESSION_RE, SLA_HEADER, APIError, ChatCompletionRequest, ChatFormat, CompletionFormat,
    CompletionRequest, TokenStrings, bad_param, chat_messages, check_one_tier, check_unsupported, completion_prompt,
    ignored_fields, json_response, model_card, models_list, parse_json, resolve_retention, resolve_session,
    resolve_tier,
    sampling_params, validate_model,
)

log = logging.getLogger("tandem.gateway")

MAX_CACHE_SALT = 1024     # characters of a request's cache_salt at most

router = APIRouter()


@dataclass
class GatewayState:
    """What every handler needs; one per app (``app.state.gw``)."""
    backend: Backend
    settings: GatewaySettings
    started: int = field(default_factory=lambda: int(time.time()))
    token_str: TokenStrings = field(init=False)
    key_tiers: dict[str, str] = field(init=False)   # accepted bearer tokens -> their default tier
    tool_parser: object = field(init=False)         # tools.PARSERS entry for this model family
    native_tools: bool = field(init=False)          # the chat template renders ``tools`` itself
    _grammar: object = None                         # GrammarCompiler, built with the first guide
    responses: Any = None                           # stored Responses (responses.ResponseStore), made at first use
    streams: StreamCap = field(init=False)          # generation requests in flight per API key
    pool: TokenizePool = field(init=False)          # parse / template / tokenize large requests off the loop
    # set when the drain time at shutdown ran out: a stream still going ends with an error event
    # at its next chunk (it was cut with no error and no [DONE] before), and every request waiting
    # on its next output (``live``) is woken to end so (streaming.Choices.interrupt)
    closing: bool = False
    live: weakref.WeakSet = field(default_factory=weakref.WeakSet)   # streaming.Choices of requests running

    def close(self) -> None:
        """The drain time ran out: every request still running ends with ``unavailable`` now —
        a stream with an error event, one not yet answered with a 503 — whether or not an output
        is on its way (one waiting on a backend that said nothing — a prefill, a bus gone — was
        cut by uvicorn with no answer at all)."""
        self.closing = True
        for c in list(self.live):
            c.interrupt()

    def __post_init__(self) -> None:
        self.token_str = TokenStrings(self.backend.tokenizer)
        self.key_tiers = self.settings.key_tiers()
        self.defaults = self.settings.defaults()
        self.tool_parser = tools.choose_parser(self.backend.tokenizer, self.settings.tool_parser)
        self.native_tools = tools.template_takes_tools(getattr(self.backend.tokenizer, "chat_template", None))
        self.streams = StreamCap(self.settings.max_streams_per_key)
        _CAPS.add(self.streams)
        self.pool = TokenizePool(self.settings.tokenize_threads)

    def check_guide(self, guide: dict | None, param: str) -> None:
        """400 naming ``param`` when the guide does not compile (the engine would refuse it)."""
        if guide is None:
            return
        if self._grammar is None:
            from shared.engine.grammar import GrammarCompiler
            self._grammar = GrammarCompiler(self.backend.tokenizer)
        try:
            self._grammar.compile(guide)
        except ValueError as e:
            raise bad_param(param, str(e), code="invalid_schema") from None


def state(request: Request) -> GatewayState:
    return request.app.state.gw


# ---- request plumbing -----------------------------------------------------------------------

PUBLIC = PUBLIC_OWNER   # the tenant of every request when no API keys are configured

# every gateway app's stream counts (one in a served process; tests make several)
_CAPS: weakref.WeakSet = weakref.WeakSet()
metrics.GATEWAY_IN_FLIGHT.set_function(lambda: sum(c.in_flight() for c in list(_CAPS)))


def key_tenant(key: str) -> str:
    """The tenant id of an API key (never the key itself: it travels on the bus and is stored)."""
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def scoped_session(session: str | None, tenant: str) -> str | None:
    """A client's session id as the rest of the stack knows it: in the key's own namespace
    (``<tenant>/<id>``) when there are keys, so two keys' ``agent-1`` are two sessions — a
    session belonged to the first key that named it, and another key could claim an id before
    its owner did (then the owner could never change its tier). Without keys: as given."""
    return session if session is None or tenant == PUBLIC else f"{tenant}/{session}"


def check_auth(request: Request) -> None:
    """401 unless a configured bearer token is sent; remembers that key's default tier, the best
    tier it may ask for (a ``TANDEM_API_KEYS`` key's own; any without keys or with
    ``TANDEM_API_KEY``) and its tenant (what it stores, e.g. Responses and sessions, only that key
    reads; whose cached KV it reuses: ``public`` without keys)."""
    gw = state(request)
    request.state.key_tier = gw.settings.default_tier
    request.state.tier_cap = Tier.INTERACTIVE.value
    request.state.tenant = PUBLIC
    if not gw.key_tiers:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""   # (a scheme is case-insensitive)
    for key, tier in gw.key_tiers.items():
        if hmac.compare_digest(given, key.encode()):
            request.state.key_tier = tier
            if key != gw.settings.api_key:
                request.state.tier_cap = tier
            request.state.tenant = key_tenant(key)
            return
    raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")


async def generation_body(request: Request) -> dict:
    """Authenticate a generation request, read its body (``read_body``), then count it against its
    key's streams (429 past ``TANDEM_MAX_STREAMS_PER_KEY``) until the app is done with it — from
    the body on: an upload still coming holds no slot (limits.py)."""
    check_auth(request)
    body = await read_body(request)
    state(request).streams.hold(request, request.state.tenant)
    return body


async def read_body(request: Request) -> dict:
    """The JSON object in the body (in the pool when large). Its size is bounded as it arrives:
    413 ``body_too_large`` past ``TANDEM_MAX_BODY_BYTES`` (limits.Limits)."""
    raw = await request.body()
    request.state.body_bytes = len(raw)
    return await state(request).pool.run(request, parse_json, raw)


async def validated(request: Request, model_cls, body: dict):
    """``validate_model`` (in the pool when the request is large)."""
    return await state(request).pool.run(request, validate_model, model_cls, body)


def check_model(request: Request, model: str) -> None:
    backend = state(request).backend
    if model != backend.model_name:
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{backend.model_name}`.",
                       param="model", code="model_not_found")


def check_context(request: Request, n_prompt: int, max_tokens: int | None, prompt_param: str,
                  max_param: str) -> int:
    """The request's max_tokens (when not given: TANDEM_GENERATION_DEFAULTS' max_tokens, at most
    the rest of the context), or a 400."""
    ctx = state(request).backend.max_context
    if n_prompt >= ctx or (max_tokens is not None and n_prompt + max_tokens > ctx):
        asked = n_prompt + (max_tokens or 0)
        raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                            f"{asked} tokens ({n_prompt} in the {prompt_param}, {max_tokens or 0} in the "
                            f"completion). Please reduce the length of the {prompt_param} or completion.",
                       param=prompt_param if n_prompt >= ctx else max_param, code="context_length_exceeded")
    if max_tokens is None:
        cap = state(request).defaults.get("max_tokens")
        return ctx - n_prompt if cap is None else min(cap, ctx - n_prompt)
    return max_tokens


def cache_tenant(owner: str, cache_salt: str | None) -> str:
    """The tenant whose cached KV a request may reuse: its API key's (``owner``), split further by
    the request's ``cache_salt`` (``<owner>:<hash>``: kvpool.keys.tenant_owner reads the owner
    back); "" (the public tenant, shared by all) without either."""
    if cache_salt is None:
        return "" if owner == PUBLIC else owner
    return f"{owner}:{hashlib.sha256(cache_salt.encode()).hexdigest()[:32]}"


def common(request: Request, req, rid: str) -> dict:
    """Trace context, model, unsupported fields; the tier, session, tenant and owner of a
    generation request (``GenerationRequest`` fields)."""
    tracing.start(rid, request.headers.get(tracing.TRACEPARENT))
    check_model(request, req.model)
    check_unsupported(req)
    extra = ignored_fields(req)
    if extra:
        log.info("%s ignoring unsupported fields: %s", rid, ", ".join(extra))
    tier = resolve_tier(req, request.headers.get(SLA_HEADER), request.state.key_tier, request.state.tier_cap)
    session = scoped_session(resolve_session(req, request.headers.get(SESSION_HEADER)), request.state.tenant)
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= MAX_CACHE_SALT:
        raise bad_param("cache_salt", f"cache_salt must be 1-{MAX_CACHE_SALT} characters", code="invalid_cache_salt")
    request.state.tier = tier
    return {"tier": tier, "session_id": session, "tenant": cache_tenant(request.state.tenant, req.cache_salt),
            "owner": request.state.tenant, "cache_retention": resolve_retention(req.prompt_cache_retention)}


def too_long_to_encode(gw: GatewayState, text: str, param: str) -> None:
    """400 ``context_length_exceeded`` for a prompt text that cannot fit the context whatever its
    tokens (``Tokenizer.min_tokens``), before it is encoded: a 30 MiB text under the body limit
    took the gateway 2-3 minutes of CPU and ~2 GiB each to tokenize, for the same 400."""
    least = getattr(gw.backend.tokenizer, "min_tokens", lambda _: 0)(text)
    if least and least >= (ctx := gw.backend.max_context):
        raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, your {param} "
                            f"come to at least {least} tokens ({len(text)} characters). Please reduce the length "
                            f"of the {param}.", param=param, code="context_length_exceeded")


def chat_prompt(gw: GatewayState, req: ChatCompletionRequest, plan) -> list[int]:
    """The prompt's token ids: messages (+ tools) rendered by the chat template, then tokenized
    (each assistant reply on its own: ``encode_turns``)."""
    messages, extra = tools.render_messages(chat_messages(req.messages), plan, gw.tool_parser, gw.native_tools)
    tok = gw.backend.tokenizer
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, **(extra or {}))
        # the same conversation with each reply a placeholder: where the template puts the replies
        marks = [f"\x00tandem-reply-{i}\x00" for i in range(len(messages))]
        replies = {i: m["content"] for i, m in enumerate(messages)
                   if m.get("role") == "assistant" and isinstance(m.get("content"), str) and m["content"]}
        marked = tok.apply_chat_template([dict(m, content=marks[i]) if i in replies else m
                                          for i, m in enumerate(messages)], add_generation_prompt=True,
                                         **(extra or {})) if replies else text
    except (ValueError, TemplateError) as e:  # the template's raise_exception, or no template
        raise bad_param("messages", f"could not apply the chat template: {e}") from None
    too_long_to_encode(gw, text, "messages")
    # the template already holds BOS where the model wants one (as transformers tokenizes it)
    return encode_turns(tok, text, marked, {marks[i]: r for i, r in replies.items()})


_MARK = re.compile("(\x00tandem-reply-[0-9]+\x00)")


def encode_turns(tokenizer, text: str, marked: str, replies: dict[str, str]) -> list[int]:
    """``text`` (a rendered conversation) as token ids, each assistant reply encoded on its own:
    the tokens before a reply are those its turn's prompt ended with (the template's
    ``<|im_start|>assistant\n``...), and the reply's are those the model generated — not merged
    with them by the BPE (a reply that starts with whitespace would merge with the prompt's last
    newline: the next turn's prompt would differ from the last one at its last token, and the
    reply's KV, still in the worker's prefix cache, would not match). So the next turn's prompt
    starts with exactly the last turn's prompt and reply tokens, and the engine reuses their KV.
    ``marked`` is the same rendering with each reply a placeholder (the keys of ``replies``); a
    template that changes a reply (trims it, escapes it) does not render ``text`` from it: then
    the whole text is encoded at once, and the reply's KV is reused up to its first changed token."""
    parts = _MARK.split(marked) if replies else [text]
    if "".join(replies.get(p, p) for p in parts) != text:
        parts = [text]
    ids: list[int] = []
    for p in parts:
        if p:
            ids += tokenizer.encode(replies.get(p, p), add_special_tokens=False)
    return ids


_SEED_STEP = 0x9E3779B97F4A7C15   # golden-ratio stride: choice i of seed s draws from seed s + i*step


def choices(g: GenerationRequest, n: int) -> list[GenerationRequest]:
    """One generation per choice: choice 0 is the request itself (so n=1 and the first of n
    draw the same tokens), choice i runs as ``<id>-<i>`` with its own seed stream. The prompt's
    KV blocks are computed once and shared through the engines' prefix cache."""
    out = [g]
    for i in range(1, n):
        seed = g.sampling.seed
        sp = g.sampling if seed is None else dataclasses.replace(g.sampling, seed=(seed + i * _SEED_STEP) % (1 << 63))
        out.append(dataclasses.replace(g, request_id=f"{g.request_id}-{i}", sampling=sp))
    return out


def max_tokens_param(value, name: str) -> int | None:
    if value is not None and value < 1:
        raise bad_param(name, f"invalid parameter {name}={value}: must be an integer >= 1")
    return value


# ---- endpoints ------------------------------------------------------------------------------

@router.get("/health")
async def health(request: Request) -> Response:
    backend = state(request).backend
    try:
        ready, details = backend.health()
    except Exception as e:  # a broken health check is "not ready", with the reason
        log.exception("health check failed")
        ready, details = False, {"error": f"{type(e).__name__}: {e}"}
    body = {"status": "ready" if ready else "unavailable", "model": backend.model_name, "details": details}
    return json_response(body, 200 if ready else 503)


@router.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    try:   # the gateway's tandem_ready: what /health says, as of this scrape
        ready = state(request).backend.health()[0]
    except Exception:
        ready = False
    metrics.set_ready("gateway", ready)
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    check_auth(request)
    gw = state(request)
    return json_response(models_list(gw.backend.model_name, gw.backend.max_context, gw.started))


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> Response:
    check_auth(request)
    check_model(request, model_id)
    gw = state(request)
    return json_response(model_card(gw.backend.model_name, gw.backend.max_context, gw.started))


@router.post("/v1/sessions/{session_id:path}")
async def update_session(session_id: str, request: Request) -> Response:
    """Change an agent session's tier: its running requests move between GPU and CPU decode
    (their streams go on), its next turns run at the new tier."""
    check_auth(request)
    body = await read_body(request)  # a JSON object, or 400
    for extra in sorted(set(body) - {"tier", "sla"}):
        raise bad_param(extra, f"unknown field {extra!r}: the body is {{\"tier\": \"interactive\" | "
                               f"\"standard\" | \"batch\"}}")
    check_one_tier(body.get("sla"), body.get("tier"))
    tier = body.get("tier", body.get("sla"))
    if not isinstance(tier, str) or tier.strip().lower() not in TIERS:
        raise bad_param("tier", f"invalid SLA tier {tier!r}: expected one of {', '.join(TIERS)}",
                        code="invalid_tier")
    if not SESSION_RE.match(session_id):
        raise bad_param("session_id", "invalid session id: 1-256 visible ASCII characters, no spaces",
                        code="invalid_session")
    # never above the key's own tier (docs/security.md): a session asked for better runs at the cap
    tier = max(tier.strip().lower(), request.state.tier_cap, key=lambda t: Tier(t).priority)
    state_ = await state(request).backend.update_session(scoped_session(session_id, request.state.tenant), tier,
                                                         request.state.tenant)
    log.info("session %s -> %s: moved %d request(s)", session_id, state_["tier"], len(state_["moved"]))
    return json_response({**state_, "id": session_id})


async def prepare_chat(request: Request, req: ChatCompletionRequest,
                       rid: str) -> tuple[list[GenerationRequest], ChatFormat]:
    """A validated chat request -> the backend requests (one per choice) and the response format (the Responses
    API comes through here too: one request path)."""
    gw = state(request)
    route = common(request, req, rid)
    plan = tools.tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    guide, param = tools.turn_guide(plan, req.response_format)
    await gw.pool.run(request, gw.check_guide, guide, param)
    prompt = await gw.pool.run(request, chat_prompt, gw, req, plan)
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    asked = max_tokens_param(req.max_completion_tokens if req.max_completion_tokens is not None
                             else req.max_tokens, max_param)
    max_tokens = check_context(request, len(prompt), asked, "messages", max_param)
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise bad_param("top_logprobs", f"invalid parameter top_logprobs={req.top_logprobs}: must be in [0, 20]")
    want_lp = bool(req.logprobs)
    sampling = sampling_params(req, max_tokens, logprobs=want_lp, top_logprobs=req.top_logprobs or 0, guide=guide,
                               defaults=gw.defaults)
    fmt = ChatFormat(rid, req.model, gw.token_str, (req.top_logprobs or 0) if want_lp else None, n=req.n or 1,
                     plan=plan, parser=gw.tool_parser)
    return choices(GenerationRequest(rid, req.model, prompt, sampling, **route, params=("messages", max_param)),
                   req.n or 1), fmt


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    rid = request.state.request_id = f"chatcmpl-{uuid.uuid4().hex}"
    req = await validated(request, ChatCompletionRequest, await generation_body(request))
    gens, fmt = await prepare_chat(request, req, rid)
    return await streaming.run(request, state(request).backend, gens, fmt, req.stream, req.user)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    rid = request.state.request_id = f"cmpl-{uuid.uuid4().hex}"
    gw = state(request)
    req = await validated(request, CompletionRequest, await generation_body(request))
    route = common(request, req, rid)
    text = req.prompt[0] if isinstance(req.prompt, list) and len(req.prompt) == 1 else req.prompt
    if isinstance(text, str):
        too_long_to_encode(gw, text, "prompt")
    prompt = await gw.pool.run(request, completion_prompt, req.prompt, gw.backend.tokenizer)
    asked = max_tokens_param(req.max_tokens if req.max_tokens is not None else gw.defaults.get("max_tokens", 16),
                             "max_tokens")
    max_tokens = check_context(request, len(prompt), asked, "prompt", "max_tokens")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise bad_param("logprobs", f"invalid parameter logprobs={req.logprobs}: must be in [0, 20]")
    want_lp = req.logprobs is not None
    sampling = sampling_params(req, max_tokens, logprobs=want_lp, top_logprobs=req.logprobs or 0,
                               defaults=gw.defaults)
    fmt = CompletionFormat(rid, req.model, gw.token_str, req.logprobs if want_lp else None, n=req.n or 1)
    return await streaming.run(request, gw.backend, choices(GenerationRequest(rid, req.model, prompt, sampling, **route),
                                                            req.n or 1), fmt, req.stream, req.user)
