"""The gateway's one seam to the rest of Tandem: a ``Backend`` that runs a tokenized request.

The HTTP layer (``app.py``) parses and validates an OpenAI request, tokenizes it with
``backend.tokenizer``, builds a ``GenerationRequest`` and iterates ``backend.generate(req)``.
Everything behind that call (routing, prefill, decode, the bus) belongs to the backend.

Two implementations:
- ``InProcessBackend``: the engine's asyncio wrapper in this process (``tandem`` without a bus,
  benchmarks' baseline).
- the NATS backend (router -> prefill -> decode over the bus), plugged in by ``services.gateway``'s
  caller; it implements the same ``Backend`` protocol.

Contract of ``Backend.generate``:
- yields ``RequestOutput`` deltas (``token_ids`` / ``text`` new in that step) until one with
  ``finished=True``; the last one carries ``finish_reason`` and the counts;
- raises ``BackendError`` for anything the client should see as an error: before the first
  output (the gateway then answers with ``status``), or mid-stream (the gateway sends an SSE
  error event). Admission failures should raise on the first ``__anext__``, not later;
- when the gateway stops iterating before ``finished`` (client gone), it calls
  ``await backend.abort(request_id)`` once and closes the iterator; ``abort`` of an unknown or
  finished request is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Protocol, runtime_checkable

from shared.engine.sampling import RequestOutput, SamplingParams
from shared.tier import Tier


# Error codes a backend raises (BackendError.code) and the HTTP status the gateway answers with.
OVERLOADED = "overloaded"                    # 429: admission control said no; retry later
NO_WORKERS = "no_workers"                    # 503: no ready worker for a role the request needs
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # 400: prompt + max_tokens > context
INVALID_REQUEST = "invalid_request"          # 400: the backend rejected a parameter
WORKER_LOST = "worker_lost"                  # 502: the worker holding the request went away
TIMEOUT = "timeout"                          # 504: no progress within the backend's deadline
INTERNAL = "internal_error"                  # 500: a bug


class BackendError(Exception):
    """An error the client should see, with the HTTP status it maps to."""

    def __init__(self, code: str, message: str, status: int = 500, param: str | None = None,
                 retry_after: float = 0.0):
        super().__init__(message)
        self.code = code          # machine-readable, e.g. "overloaded" (OpenAI error.code)
        self.message = message    # human-readable (OpenAI error.message)
        self.status = status      # HTTP status: 400, 429, 503, ...
        self.param = param        # the request parameter at fault, when there is one
        self.retry_after = retry_after  # 429/503: seconds the client should wait (Retry-After)

    def __repr__(self) -> str:
        return f"BackendError({self.code!r}, {self.message!r}, status={self.status})"


@dataclass
class GenerationRequest:
    request_id: str                  # "chatcmpl-<hex>" / "cmpl-<hex>"; a valid NATS subject token
    model: str                       # the served model name the client asked for
    prompt_token_ids: list[int]      # the whole prompt, chat template applied
    sampling: SamplingParams         # validated
    tier: str                        # "interactive" | "standard" | "batch"
    session_id: str | None           # agent session (X-Tandem-Session), None when not given
    tenant: str = ""                 # whose cached KV it may reuse (handlers.cache_tenant; "" = public)
    owner: str = "public"            # the API key's tenant: sessions belong to it
    cache_retention: str = ""        # prompt_cache_retention: "" | in_memory | 24h (its session's KV)
    params: tuple[str, str] = ("prompt", "max_tokens")  # its endpoint's names of the prompt and of the
                                                        # output budget: a context error's param


class Tokenizer(Protocol):
    """What the gateway uses of ``shared.engine.tokenizer.Tokenizer``."""

    vocab_size: int                  # ids must be in [0, vocab_size)
    eos_token_ids: set[int]          # every token that ends generation

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


@runtime_checkable
class Backend(Protocol):
    model_name: str                  # the one model served; requests must name it
    max_context: int                 # prompt + max_tokens may not exceed this
    tokenizer: Tokenizer

    def health(self) -> tuple[bool, dict]:
        """(ready, details per role): ready only when every role the request path needs has a
        ready worker. Cheap and non-blocking (answer from cached heartbeats)."""
        ...

    def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; raises BackendError (see the module docstring)."""
        ...

    async def abort(self, request_id: str) -> None:
        """Drop the request everywhere it is held. Idempotent."""
        ...

    async def update_session(self, session_id: str, tier: str, owner: str = "public") -> dict:
        """Set the tier of an agent session of ``owner`` (an API key's tenant); returns {"id",
        "object": "session", "tier", "worker", "running": [request ids], "moved": [one dict per
        request moved now]}. Raises BackendError "not_found" (404) for another owner's session."""
        ...


class InProcessBackend:
    """The engine's asyncio wrapper (``shared.engine.async_engine.AsyncEngine``) in this process.

    Uses of the engine: ``engine.generate(request_id, prompt_token_ids, params, priority=...)``
    (an async iterator of ``RequestOutput``), ``await engine.abort(request_id)``,
    ``engine.tokenizer`` and ``engine.max_context``. ``model_name`` defaults to the loaded
    model's name (``engine.engine.model_config.name``).
    """

    def __init__(self, engine, model_name: str | None = None):
        self.engine = engine
        self.model_name = model_name or engine.engine.model_config.name
        self.tokenizer = engine.tokenizer
        self.max_context = int(engine.max_context)
        self.session_tiers: dict[str, str] = {}   # session -> tier set by update_session
        self.session_owners: dict[str, str] = {}  # session -> the owner that created it
        self.running: dict[str, str | None] = {}   # request id -> its session

    def health(self) -> tuple[bool, dict]:
        return True, {"engine": {"ready": True, "where": "in-process"}}

    async def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        try:
            priority = Tier.parse(req.tier).priority
        except ValueError as e:
            raise BackendError(INVALID_REQUEST, str(e), 400, "sla") from None
        session = req.session_id if self._owns(req.session_id, req.owner) else None  # another key's id: none
        if session in self.session_tiers:  # one engine: a session's tier only raises priority
            priority = min(priority, Tier(self.session_tiers[session]).priority)
        self.running[req.request_id] = session
        if session:   # its KV stays resident between turns (shared/engine/retention.py)
            self.engine.tag_session(req.request_id, session, req.cache_retention)
        try:
            stream = self.engine.generate(req.request_id, req.prompt_token_ids, req.sampling, priority=priority,
                                          tenant=req.tenant)
            async for out in stream:
                yield out
        except ValueError as e:  # the engine validates too (e.g. a prompt longer than its KV)
            raise BackendError(INVALID_REQUEST, str(e), 400) from e
        finally:
            self.running.pop(req.request_id, None)

    def _owns(self, session_id: str | None, owner: str) -> bool:
        return session_id is not None and self.session_owners.setdefault(session_id, owner) == owner

    async def update_session(self, session_id: str, tier: str, owner: str = "public") -> dict:
        """One engine, nowhere to move to: the tier applies to the session's next requests."""
        if not self._owns(session_id, owner):
            raise BackendError("not_found", f"no session {session_id!r} for this API key", 404, "session_id")
        self.session_tiers[session_id] = tier
        return {"id": session_id, "object": "session", "tier": tier, "worker": "in-process",
                "running": [r for r, s in self.running.items() if s == session_id], "moved": []}

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)
