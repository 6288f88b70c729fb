"""OpenAI's wire format: request models and their validation, response and chunk shapes, SSE
framing, and errors in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Pure functions and data; no I/O. ``handlers.py`` and ``streaming.py`` string these together per request.
"""

from __future__ import annotations

import codecs
import hashlib
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.engine.sampling import RequestOutput, SamplingParams
from shared.tier import TIERS, Tier

from .backend import Tokenizer
from .errors import APIError, bad_param
from .tools import ChoiceTools, ToolPlan, ToolTurns

# ---- request parsing ------------------------------------------------------------------------

MAX_DEPTH = 128   # a request body's nesting: what it carries must encode again (orjson stops at 255
                  # levels; a stored response echoes fields inside its own, the bus wraps a request)


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object nested at most ``MAX_DEPTH`` levels, or APIError 400
    (deeper, a schema or metadata passed here and failed later: a 500 after the generation)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise APIError(400, _unparsable(raw, e), code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    if too_deep(data, MAX_DEPTH):
        raise APIError(400, f"the request body is nested deeper than {MAX_DEPTH} levels", code="invalid_json")
    return data


def _unparsable(raw: bytes, e: Exception) -> str:
    """Why a body is not JSON, in the client's terms (orjson says "surrogates not allowed" for any
    body that is not UTF-8)."""
    if raw[:2] == b"\x1f\x8b":
        return "the request body is gzip-compressed: send it uncompressed (no Content-Encoding is accepted)"
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as u:
        return (f"the request body is not UTF-8 text (byte {u.start}: {raw[u.start:u.start + 1]!r}); JSON bodies "
                "must be UTF-8, uncompressed")
    return f"could not parse the JSON body of the request: {e}"


def too_deep(data: Any, limit: int) -> bool:
    """Is ``data`` (parsed JSON) nested more than ``limit`` objects / arrays deep? (No recursion.)"""
    stack = [(data, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return True
        for x in (v.values() if isinstance(v, dict) else v):
            if isinstance(x, (dict, list)):
                stack.append((x, d + 1))
    return False


def _loc_to_param(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validate_model(model_cls: type[BaseModel], data: dict) -> BaseModel:
    """Build a request model; a type error becomes APIError 400 naming the parameter."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        # pydantic appends a union member's type to loc ("stop", "str"); keep the field path only
        loc = tuple(p for p in err["loc"] if isinstance(p, int) or p in _FIELD_NAMES or p in model_cls.model_fields)
        param = _loc_to_param(loc) or None
        raise bad_param(param, f"invalid parameter {param}: {err['msg']}") from None


# Unknown fields are accepted and logged (as vLLM does); known-unsupported ones are rejected. The
# types are strict, as OpenAI's: "5" is no integer, "yes" no boolean (an int stands for a float).
_STRICT = ConfigDict(extra="allow", strict=True)


class _Request(BaseModel):
    model_config = _STRICT


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = None     # Tandem always sends the usage chunk


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None   # an assistant turn that called tools
    tool_call_id: str | None = None                  # a "tool" turn: the call it answers


class _Sampling(_Request):
    """Parameters shared by both endpoints (None = not given)."""
    model: str
    stream: bool | None = None            # None: false (clients send null for "not set")
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None               # vLLM extension
    min_p: float | None = None             # vLLM extension
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool | None = None           # vLLM extension
    n: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # Tandem extensions (also as headers X-Tandem-SLA / X-Tandem-Session)
    sla: str | None = None
    tier: str | None = None
    session_id: str | None = None
    cache_salt: str | None = None            # vLLM's: only requests with the same salt share cached KV
    # OpenAI's prompt caching: the key names the conversation (a session), the retention how long
    # its KV is kept (docs/api.md, "A session's KV survives its tool pauses")
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None   # in_memory | 24h


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


_FIELD_NAMES = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields) | \
    set(ChatMessage.model_fields) | set(StreamOptions.model_fields)


MAX_N = 8   # choices per request at most


def check_unsupported(req: _Sampling) -> None:
    """Reject parameters Tandem does not implement instead of silently ignoring them."""
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise bad_param("n", f"invalid parameter n={req.n}: must be in [1, {MAX_N}]")
    if req.logit_bias:
        raise bad_param("logit_bias", "logit_bias is not supported", code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise bad_param("stream_options", "stream_options is only allowed when stream is true")
    if isinstance(req, ChatCompletionRequest):
        if req.functions or req.function_call not in (None, "none"):
            raise bad_param("functions" if req.functions else "function_call",
                            "the deprecated functions / function_call are not supported: use tools / tool_choice",
                            code="unsupported_parameter")
        if req.top_logprobs and not req.logprobs:
            raise bad_param("top_logprobs", "top_logprobs requires logprobs=true")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise bad_param("echo", "echo is not supported", code="unsupported_parameter")
        if req.suffix:
            raise bad_param("suffix", "suffix is not supported", code="unsupported_parameter")
        if req.best_of not in (None, 1):
            raise bad_param("best_of", "only best_of=1 is supported", code="unsupported_parameter")


def ignored_fields(req: BaseModel) -> list[str]:
    return sorted(req.model_extra or {})


# ---- tier and session -----------------------------------------------------------------------

SLA_HEADER = "x-tandem-sla"
SESSION_HEADER = "x-tandem-session"
SESSION_RE = re.compile(r"^[\x21-\x7e]{1,256}$")  # visible ASCII, no spaces, at most 256


def check_one_tier(sla: Any, tier: Any) -> None:
    """``sla`` and ``tier`` name one setting: both given, they must name the same tier (case
    aside, as every tier value), else 400 ``invalid_tier``."""
    if sla is not None and tier is not None and (str(sla).strip().lower() != str(tier).strip().lower()):
        raise bad_param("sla", f"sla={sla!r} and tier={tier!r} disagree; send one", code="invalid_tier")


def resolve_tier(req: _Sampling, header: str | None, default: str, cap: str = "interactive") -> str:
    """Body ``sla`` / ``tier`` over header ``X-Tandem-SLA`` over the default, never better than
    ``cap`` (the API key's tier)."""
    check_one_tier(req.sla, req.tier)
    for param, value in (("sla", req.sla), ("tier", req.tier), ("X-Tandem-SLA", header)):
        if value is not None:
            v = value.strip().lower()
            if v not in TIERS:
                raise bad_param(param, f"invalid SLA tier {value!r}: expected one of {', '.join(TIERS)}",
                                code="invalid_tier")
            default = v
            break
    return max(default, cap, key=lambda t: Tier(t).priority)


def resolve_session(req: _Sampling, header: str | None) -> str | None:
    """Body ``session_id`` over header ``X-Tandem-Session`` over ``prompt_cache_key``."""
    for param, value in (("session_id", req.session_id), ("X-Tandem-Session", header)):
        if value is not None:
            if not SESSION_RE.match(value):
                raise bad_param(param, "invalid session id: 1-256 visible ASCII characters, no spaces",
                                code="invalid_session")
            return value
    return session_of(req.prompt_cache_key) if req.prompt_cache_key else None


def session_of(key: str) -> str:
    """A prompt_cache_key as a session id (any string; hashed when it is not a valid id)."""
    if SESSION_RE.match(key):
        return key
    return "pck-" + hashlib.sha256(key.encode()).hexdigest()[:32]


CACHE_RETENTIONS = ("in_memory", "24h")


def resolve_retention(value: str | None) -> str:
    """``prompt_cache_retention`` (OpenAI's values; "" when not given); 400 for another value."""
    if value is None:
        return ""
    if value not in CACHE_RETENTIONS:
        raise bad_param("prompt_cache_retention", f"invalid prompt_cache_retention {value!r}: expected one of "
                        f"{', '.join(CACHE_RETENTIONS)}")
    return value


# ---- prompts --------------------------------------------------------------------------------

_ROLES = {"system", "developer", "user", "assistant", "tool"}


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> the ``[{"role", "content"}]`` a chat template takes (text only), plus
    ``tool_calls`` of assistant turns and ``tool_call_id`` of tool turns (each answering a call of
    an earlier assistant turn, once, and every call answered: ``ToolTurns``, as OpenAI checks)."""
    out, turns = [], ToolTurns()
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise bad_param(f"messages[{i}].role", f"unsupported role {m.role!r}: expected one of "
                            f"{', '.join(sorted(_ROLES))}")
        if isinstance(m.content, list):
            parts = []
            for j, p in enumerate(m.content):
                kind = "refusal" if p.get("type") == "refusal" and m.role == "assistant" else "text"
                if p.get("type") != kind or not isinstance(p.get(kind), str):
                    raise bad_param(f"messages[{i}].content[{j}]", "only text content parts are supported (and an "
                                    "assistant's refusal)", code="unsupported_parameter")
                parts.append(p[kind])
            content = "\n".join(parts)
        elif m.content is None and m.role != "assistant":    # (an assistant's turn may be only calls)
            raise bad_param(f"messages[{i}].content", f"a {m.role} message needs its content")
        else:
            content = m.content or ""
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_param(f"messages[{i}].tool_calls", "only assistant messages carry tool_calls")
            for j, c in enumerate(m.tool_calls):
                fn = c.get("function")
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_param(f"messages[{i}].tool_calls[{j}]", "a tool call is {\"id\", \"type\": "
                                    "\"function\", \"function\": {\"name\", \"arguments\"}}")
                turns.call(c.get("id"))
            msg["tool_calls"] = m.tool_calls
        if m.role == "tool":
            if not m.tool_call_id:
                raise bad_param(f"messages[{i}].tool_call_id", "a tool message needs the tool_call_id it answers")
            if (wrong := turns.answer(m.tool_call_id)) is not None:
                raise bad_param(f"messages[{i}].tool_call_id", f"{wrong} (a tool message answers a call of an "
                                "earlier assistant message's tool_calls)")
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    if (missing := turns.missing()) is not None:
        raise bad_param("messages", f"an assistant message's tool_calls must each be answered by a tool message: "
                                    f"the call {str(missing)[:64]!r} has none")
    return out


def completion_prompt(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    """``prompt`` as a string or token ids (one prompt only) -> token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_param("prompt", "prompt must not be empty")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        vocab = getattr(tokenizer, "vocab_size", None)
        for t in prompt:
            if t < 0 or (vocab is not None and t >= vocab):
                raise bad_param("prompt", f"token id {t} is out of range [0, {vocab})")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad_param("prompt", "only one prompt per request is supported", code="unsupported_parameter")
    raise bad_param("prompt", "prompt must be a non-empty string or list of token ids")


# ---- sampling -------------------------------------------------------------------------------

_BAD_FIELD = re.compile(r"invalid sampling parameter (\w+)=")


def sampling_params(req: _Sampling, max_tokens: int, *, logprobs: bool, top_logprobs: int,
                    guide: dict | None = None, defaults: dict | None = None) -> SamplingParams:
    """The request's SamplingParams, validated (APIError 400 naming the parameter); what the
    request leaves out comes from ``defaults`` (TANDEM_GENERATION_DEFAULTS), then OpenAI's."""
    def given(v, default, name=None):
        return (defaults or {}).get(name, default) if v is None else v

    if req.top_k is not None and req.top_k < -1:
        raise bad_param("top_k", f"invalid parameter top_k={req.top_k}: must be >= 0 (or -1 for off)")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    sp = SamplingParams(
        max_tokens=max_tokens,
        temperature=given(req.temperature, 1.0, "temperature"),
        top_p=given(req.top_p, 1.0, "top_p"),
        top_k=max(0, given(req.top_k, 0, "top_k")),  # vLLM spells "off" as -1
        min_p=given(req.min_p, 0.0, "min_p"),
        seed=req.seed,
        presence_penalty=given(req.presence_penalty, 0.0, "presence_penalty"),
        frequency_penalty=given(req.frequency_penalty, 0.0, "frequency_penalty"),
        repetition_penalty=given(req.repetition_penalty, 1.0, "repetition_penalty"),
        # an output a guide constrains (a forced call, response_format) ends where its grammar does:
        # a stop string inside it cut a call away or left invalid JSON under finish_reason "stop"
        stop=[] if guide is not None else [s for s in stop if s != ""],
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        guide=guide,
    )
    try:
        return sp.validate()
    except ValueError as e:
        m = _BAD_FIELD.search(str(e))
        raise bad_param(m.group(1) if m else None, str(e)) from None


# ---- responses ------------------------------------------------------------------------------

def json_response(obj: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(content=orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


def sse(obj: dict) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else -9999.0


class TokenStrings:
    """Token id -> (its text, its bytes) for logprobs, cached. A token that is part of a
    character spelled by several tokens is no text on its own: OpenAI's ``"bytes:\\xf0\\x9f"``
    spelling, and its own bytes (a decoded ``U+FFFD`` lost them: joined, they must give the text).
    Special tokens are spelled out."""

    def __init__(self, tokenizer: Tokenizer, limit: int = 65536):
        self.tokenizer = tokenizer
        self.limit = limit
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> str:
        return self.both(token_id)[0]

    def both(self, token_id: int) -> tuple[str, bytes]:
        got = self._cache.get(token_id)
        if got is None:
            b = self.tokenizer.token_bytes(token_id)
            try:
                got = (b.decode("utf-8"), b)
            except UnicodeDecodeError:
                got = ("bytes:" + "".join(f"\\x{x:02x}" for x in b), b)
            if len(self._cache) < self.limit:
                self._cache[token_id] = got
        return got


@dataclass
class Accumulator:
    """Everything one request produced so far, from its RequestOutput deltas."""
    prompt_tokens: int                        # len(prompt_token_ids) sent to the backend
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)   # TokenLogprob, one per token
    finish_reason: str | None = None
    cached_tokens: int = 0
    engine_output_tokens: int = 0             # the engine's count (includes a stop token it dropped)
    first_token_at: float | None = None
    resumes: int = 0                          # times the request went on elsewhere after losing its worker
    reused_tokens: int = 0                    # ... tokens of KV those resumes found cached
    recomputed_tokens: int = 0                # ... and computed again
    tier: str = ""                            # the tier it ran at, where the backend said (RequestOutput.tier)

    def add(self, out: RequestOutput) -> None:
        self.tier = self.tier or out.tier
        if out.reused_tokens >= 0:
            self.resumes += 1
            self.reused_tokens += out.reused_tokens
            self.recomputed_tokens += out.recomputed_tokens
        if out.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens)
        self.engine_output_tokens = max(self.engine_output_tokens, out.num_output_tokens)
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"

    @property
    def completion_tokens(self) -> int:
        return max(self.engine_output_tokens, len(self.token_ids))

    def usage(self) -> dict:
        u = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.resumes:  # Tandem's extension: the request survived the loss of its worker
            u["tandem"] = {"resumes": self.resumes, "reused_tokens": self.reused_tokens,
                           "recomputed_tokens": self.recomputed_tokens}
        return u


def usage(accs: list[Accumulator]) -> dict:
    """One response's usage over its choices (the prompt counted once, as OpenAI does)."""
    if len(accs) == 1:
        return accs[0].usage()
    u = Accumulator(accs[0].prompt_tokens, engine_output_tokens=sum(a.completion_tokens for a in accs),
                    cached_tokens=max(a.cached_tokens for a in accs), resumes=sum(a.resumes for a in accs),
                    reused_tokens=sum(a.reused_tokens for a in accs),
                    recomputed_tokens=sum(a.recomputed_tokens for a in accs))
    return u.usage()


class _Format:
    """Shared state of one response: id, created time, model, logprob spelling, choices; how its
    stream is framed. ``streaming.run`` sends ``first_chunks``, ``delta_chunks`` per output,
    ``final_chunks`` per finished choice, then (after the async ``finish`` hook, once every choice
    ended) ``end_chunks``; or, not streamed, ``finish`` and ``response``. A failure mid-stream sends
    ``error_chunks``. Each chunk goes out through ``frame``; the stream ends with ``done``."""
    object_full: str
    object_chunk: str
    done: bytes | None = SSE_DONE       # the stream's last event (chat, completions: [DONE])

    @staticmethod
    def frame(chunk: dict) -> bytes:
        return sse(chunk)

    def delta_chunks(self, index: int, out: RequestOutput) -> list[dict]:
        chunk = self.delta_chunk(index, out)
        return [] if chunk is None else [chunk]

    def end_chunks(self, accs: list[Accumulator]) -> list[dict]:
        return [self.usage_chunk(accs)]

    @staticmethod
    def error_chunks(error: APIError) -> list[dict]:
        return [error.body()]

    async def finish(self, accs: list[Accumulator]) -> None:
        """Hook once every choice is complete (the Responses API stores the response here)."""

    def __init__(self, request_id: str, model: str, token_str: TokenStrings, top_logprobs: int | None, n: int = 1):
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.token_str = token_str
        self.top_logprobs = top_logprobs      # None = no logprobs asked for
        self.n = n                            # choices

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage_chunk(self, accs: list[Accumulator]) -> dict:
        return {**self._head(self.object_chunk), "choices": [], "usage": usage(accs)}


class ChatFormat(_Format):
    """Chat responses; with a tool plan (``tools.ToolPlan``) each choice's text goes through a
    ``tools.ChoiceTools`` that turns calls into ``tool_calls``."""
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, *args, plan=None, parser=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._tools = lambda: ChoiceTools(plan or ToolPlan("none", []), parser)
        self._streams = [self._tools() for _ in range(self.n)]

    def _entry(self, tid: int, lp: float) -> dict:
        s, b = self.token_str.both(tid)
        return {"token": s, "logprob": _finite(lp), "bytes": list(b)}

    def logprobs(self, lps: list) -> dict | None:
        if self.top_logprobs is None:
            return None
        content = []
        for tl in lps:
            e = self._entry(tl.token_id, tl.logprob)
            e["top_logprobs"] = [self._entry(t, lp) for t, lp in tl.top[: self.top_logprobs]]
            content.append(e)
        return {"content": content, "refusal": None}

    def _chunk(self, index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        return {**self._head(self.object_chunk),
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}

    @staticmethod
    def _delta(content: str, calls: list[dict]) -> dict:
        d = {"content": content} if content or not calls else {}
        if calls:
            d["tool_calls"] = calls
        return d

    def first_chunks(self) -> list[dict]:
        return [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(self.n)]

    def delta_chunk(self, index: int, out: RequestOutput) -> dict | None:
        content, calls = self._streams[index].feed(out.text)
        if not content and not calls and not out.logprobs:
            return None
        return self._chunk(index, self._delta(content, calls), logprobs=self.logprobs(out.logprobs or []))

    @staticmethod
    def _finish_reason(acc: Accumulator, tools) -> str:
        return "tool_calls" if tools.calls and acc.finish_reason == "stop" else acc.finish_reason

    def final_chunks(self, index: int, acc: Accumulator) -> list[dict]:
        st = self._streams[index]
        content, calls = st.finish()
        out = [self._chunk(index, self._delta(content, calls))] if content or calls else []
        return out + [self._chunk(index, {}, finish_reason=self._finish_reason(acc, st))]

    def response(self, accs: list[Accumulator]) -> dict:
        choices = []
        for i, acc in enumerate(accs):
            st = self._tools()
            st.feed("".join(acc.text))
            st.finish()
            # a forced call's JSON is never content: no calls (cut by max_tokens) is no content either
            msg = {"role": "assistant", "content": st.content if st.content or not (st.calls or st.forced) else None}
            if st.calls:
                msg["tool_calls"] = [c.to_dict() for c in st.calls]
            choices.append({"index": i, "message": msg, "logprobs": self.logprobs(acc.logprobs),
                            "finish_reason": self._finish_reason(acc, st)})
        return {**self._head(self.object_full), "choices": choices, "usage": usage(accs)}


class CompletionFormat(_Format):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._reset()

    def _reset(self) -> None:
        # text_offset of each choice's next token, relative to its text: the characters its tokens'
        # bytes completed so far (a token inside a character starts where that character does)
        self._offset = [0] * self.n
        self._utf8 = [codecs.getincrementaldecoder("utf-8")("replace") for _ in range(self.n)]

    def logprobs(self, lps: list, index: int = 0) -> dict | None:
        if self.top_logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for tl in lps:
            s, b = self.token_str.both(tl.token_id)
            tokens.append(s)
            token_lps.append(_finite(tl.logprob))
            # OpenAI: "the API will always return the logprob of the sampled token, so there may be
            # up to logprobs+1 elements"
            top = {self.token_str(t): _finite(lp) for t, lp in tl.top[: self.top_logprobs]}
            top.setdefault(s, _finite(tl.logprob))
            tops.append(top)
            offsets.append(self._offset[index])
            self._offset[index] += len(self._utf8[index].decode(b))
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chunk(self, index: int, text: str, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        return {**self._head(self.object_chunk),
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def first_chunks(self) -> list[dict]:
        return []

    def delta_chunk(self, index: int, out: RequestOutput) -> dict | None:
        if not out.text and not out.logprobs:
            return None
        return self._chunk(index, out.text, logprobs=self.logprobs(out.logprobs or [], index))

    def final_chunks(self, index: int, acc: Accumulator) -> list[dict]:
        return [self._chunk(index, "", finish_reason=acc.finish_reason)]

    def response(self, accs: list[Accumulator]) -> dict:
        self._reset()
        return {**self._head(self.object_full),
                "choices": [{"index": i, "text": "".join(acc.text), "logprobs": self.logprobs(acc.logprobs, i),
                             "finish_reason": acc.finish_reason} for i, acc in enumerate(accs)],
                "usage": usage(accs)}


def models_list(model_name: str, max_context: int, created: int) -> dict:
    return {"object": "list", "data": [model_card(model_name, max_context, created)]}


def model_card(model_name: str, max_context: int, created: int) -> dict:
    return {"id": model_name, "object": "model", "created": created, "owned_by": "tandem",
            "root": model_name, "max_model_len": max_context}
