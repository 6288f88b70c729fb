"""OpenAI's Responses API (``/v1/responses``) on the chat-completions request path.

A Responses request is translated into a ``ChatCompletionRequest`` — ``input`` items become chat
messages (``function_call`` → an assistant ``tool_calls`` entry, ``function_call_output`` → a
``tool`` message), ``instructions`` the system message, function ``tools`` / ``tool_choice`` /
``text.format`` their chat spellings — and runs through ``handlers.prepare_chat`` and
``streaming.run`` like any chat request: same auth, limits, tiers, metrics, traces, cancellation.
``ResponsesFormat`` turns the chat deltas into the Responses event sequence and the final chat
message into ``output`` items.

Stored responses (``store``, default true) keep the response, its input items and the whole
conversation as chat messages, per tenant (the API key): ``previous_response_id`` continues that
conversation, and since the prompt is the same conversation rendered by the same template, the
workers' prefix caches and the KV pool hold its prefix (``cached_tokens``). The conversation's
session id (``prompt_cache_key``, else the first response's id) steers the router to the worker
holding it. Where they are kept, and their caps per tenant: ``response_store.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
import uuid
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from . import streaming
from .handlers import check_auth, generation_body, prepare_chat, state, validated
from .response_store import ResponseStore, StoredResponse, StoreUnavailable
from .tools import ToolTurns
from .openai_api import (
    _STRICT, Accumulator, APIError, ChatCompletionRequest, ChatFormat, _Format, bad_param, json_response,
    resolve_retention, session_of,
)

log = logging.getLogger("tandem.gateway")

router = APIRouter()


class ResponsesRequest(BaseModel):
    model_config = _STRICT
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    include: list[str] | None = None           # accepted; nothing to include beyond the defaults
    store: bool | None = None                   # None: true, OpenAI's default
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None   # in_memory | 24h (docs/api.md)
    truncation: str | None = None               # "disabled" (default) or "auto": accepted, never truncates
    reasoning: dict[str, Any] | None = None     # accepted; the model has no reasoning mode
    stream: bool | None = None
    # Tandem extensions, as on the chat endpoint
    sla: str | None = None
    tier: str | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    ignore_eos: bool | None = None
    # sampling extensions, as on the chat endpoint (vLLM's names); unset: TANDEM_GENERATION_DEFAULTS
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


# fields of OpenAI's Responses API this server refuses rather than ignores (they change the contract)
UNSUPPORTED = {"background": "responses run in the foreground (the request waits for its answer)",
               "conversation": "continue a conversation with previous_response_id",
               "prompt": "no prompt templates are stored here: send the instructions and input",
               "top_logprobs": "log probabilities are on /v1/chat/completions (logprobs, top_logprobs)"}
# OpenAI's ``include`` values: what they add is output of hosted tools, images or reasoning, none
# of which this server makes (nothing to add), or logprobs (refused as top_logprobs)
INCLUDE = {"web_search_call.action.sources", "web_search_call.results", "code_interpreter_call.outputs",
           "computer_call_output.output.image_url", "file_search_call.results", "message.input_image.image_url",
           "reasoning.encrypted_content"}
# a chat parameter an error names -> the Responses parameter it came from
PARAMS = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512   # OpenAI's bounds on ``metadata``


def check_metadata(metadata: dict | None) -> None:
    """``metadata`` as OpenAI takes it: up to 16 pairs, string keys of up to 64 characters, string
    values of up to 512 (it is echoed and stored with the response), else 400 before any work."""
    if not metadata:
        return
    if len(metadata) > METADATA_PAIRS:
        raise bad_param("metadata", f"metadata holds at most {METADATA_PAIRS} key-value pairs, got {len(metadata)}")
    for k, v in metadata.items():
        if len(k) > METADATA_KEY:
            raise bad_param("metadata", f"a metadata key is at most {METADATA_KEY} characters, got {len(k)}")
        if not isinstance(v, str) or len(v) > METADATA_VALUE:
            raise bad_param(f"metadata.{k}", f"a metadata value is a string of at most {METADATA_VALUE} characters")


# ---- request translation -----------------------------------------------------------------------

_TEXT_PARTS = {"input_text", "output_text", "text"}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_param(where, "content must be a string or a list of content parts")
    parts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in _TEXT_PARTS:
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise bad_param(f"{where}[{j}]", f"unsupported content part {kind!r}: only input_text and "
                                             f"output_text are supported", code="unsupported_parameter")
        if not isinstance(p.get("text"), str):
            raise bad_param(f"{where}[{j}].text", f"a {p['type']} part needs its text, a string")
        parts.append(p["text"])
    return "\n".join(parts)


def input_messages(items: str | list[dict], history: list[dict] = ()) -> list[dict]:
    """Responses ``input`` -> chat messages (OpenAI chat shape). ``reasoning`` items are dropped
    (the model has no reasoning mode; their text is not the model's to see again). A
    ``function_call_output`` answers a call of ``history`` (the previous response's conversation)
    or of an earlier item, once, and every call is answered — the previous response's calls and
    the items' own (``ToolTurns``) — else 400, as OpenAI's ("No tool call found ...", "No tool
    output found ...")."""
    turns = ToolTurns()
    for m in history:   # (the stored conversation: as it was taken)
        for c in m.get("tool_calls") or []:
            turns.call(c.get("id"))
        if m.get("role") == "tool":
            turns.answer(m.get("tool_call_id"))
    if isinstance(items, str):
        _all_answered(turns)
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, it in enumerate(items):
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_param(f"input[{i}].role", f"unsupported role {role!r}: expected user, system, "
                                                    f"developer or assistant")
            out.append({"role": role, "content": _text(it.get("content", ""), f"input[{i}].content")})
        elif kind == "function_call":
            if not isinstance(it.get("call_id"), str) or not it["call_id"]:
                raise bad_param(f"input[{i}].call_id", "a function_call item needs its call_id (the id its "
                                                       "function_call_output answers)")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it.get("name", ""), "arguments": it.get("arguments", "")}}
            turns.call(call["id"])
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)   # parallel calls of one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            for field in ("call_id", "output"):
                if field not in it:
                    raise bad_param(f"input[{i}].{field}", f"a function_call_output item needs its {field}")
            if (wrong := turns.answer(it["call_id"])) is not None:
                raise bad_param(f"input[{i}].call_id", wrong)
            output = it["output"]
            out.append({"role": "tool", "tool_call_id": it.get("call_id", ""),
                        "content": output if isinstance(output, str) else _text(output, f"input[{i}].output")})
        elif kind == "reasoning":
            continue
        else:
            raise bad_param(f"input[{i}].type", f"unsupported input item type {kind!r}: expected message, "
                                                f"function_call, function_call_output or reasoning",
                            code="unsupported_parameter")
    _all_answered(turns)
    return out


def _all_answered(turns: ToolTurns) -> None:
    if (missing := turns.missing()) is not None:   # the model would see a call without its result
        raise bad_param("input", f"No tool output found for function call {str(missing)[:64]}: give it a "
                                 "function_call_output item")


def chat_tools(tools: list[dict] | None) -> tuple[list[dict] | None, list[str]]:
    """Function tools in the chat shape, and the kinds left out (hosted tools the server cannot
    run: web_search, file_search, mcp, image_generation, code_interpreter, namespace groups...)."""
    kept, dropped = [], []
    for i, t in enumerate(tools or []):
        if t.get("type") == "function" and not isinstance(t.get("name"), str):
            raise bad_param(f"tools[{i}].name", "a function tool needs its name")
        if t.get("type") == "function":
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
            kept.append({"type": "function", "function": fn})
        else:
            dropped.append(str(t.get("type")))
    return kept or None, dropped


def chat_tool_choice(choice: Any) -> Any:
    """Responses' ``tool_choice`` in the chat shape. ``allowed_tools`` keeps its functions (the
    hosted tools it lists are not run here: with none left, the model chooses); a hosted tool's
    type: the model chooses."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        listed = choice.get("tools")
        if not isinstance(listed, list):
            raise bad_param("tool_choice.tools", "allowed_tools lists its tools: [{\"type\": \"function\", "
                                                 "\"name\": ...}, ...]")
        fns = [{"type": "function", "function": {"name": t.get("name")}} for t in listed
               if isinstance(t, dict) and t.get("type") == "function"]
        if not fns:
            return "auto"
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": fns}}
    if isinstance(choice, dict):  # a hosted tool type: let the model choose
        return "auto"
    return choice


def chat_response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("name"), str):
            raise bad_param("text.format.name", "a json_schema format needs its name, a string")
        if not isinstance(fmt.get("schema", {}), dict):
            raise bad_param("text.format.schema", "a json_schema format's schema is a JSON schema object")
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}


def item_of(m: dict) -> dict:
    """A chat message of this request's input as a Responses input item (``input_items``)."""
    if m.get("tool_calls"):
        tc = m["tool_calls"][0]
        return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": tc["id"],
                "name": tc["function"]["name"], "arguments": tc["function"]["arguments"], "status": "completed"}
    if m["role"] == "tool":
        return {"id": f"fco_{uuid.uuid4().hex}", "type": "function_call_output", "call_id": m["tool_call_id"],
                "output": m["content"], "status": "completed"}
    part = "output_text" if m["role"] == "assistant" else "input_text"
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": m["role"], "status": "completed",
            "content": [{"type": part, "text": m.get("content") or ""}]}


# ---- the stored conversation ----------------------------------------------------------------------

def store_of(request: Request) -> ResponseStore:
    gw = state(request)
    if gw.responses is None:
        gw.responses = ResponseStore(getattr(gw.backend, "bus", None), gw.settings.responses_retention_s,
                                     gw.settings.responses_max_per_tenant, gw.settings.responses_max_bytes_per_tenant)
    return gw.responses


# what this server's ids look like (resp_ and 32 hex digits; a few more characters allowed): nothing a
# NATS KV key gives a meaning to (".", "*", ">"), which the bucket refuses with an error of its own
_RID_RE = re.compile(r"resp_[A-Za-z0-9_-]{1,200}")


def check_id(rid: str, param: str = "response_id") -> None:
    if not _RID_RE.fullmatch(rid):
        raise APIError(404, f"No response found with id '{rid[:300]}'.", param=param, code="not_found")


async def unless_unavailable(op):
    """``await op``; a 503 ``unavailable`` (retry) when the bus cannot read or write stored responses."""
    try:
        return await op
    except StoreUnavailable as e:
        raise APIError(503, f"stored responses are unavailable now ({e}); try again shortly",
                       code="unavailable", retry_after=5) from None


async def load(request: Request, rid: str, param: str = "response_id") -> StoredResponse:
    check_id(rid, param)
    record = await unless_unavailable(store_of(request).get(request.state.tenant, rid))
    if record is None:   # (an answer says "store": false where the bus could not store it)
        raise APIError(404, f"No response found with id '{rid}'. Only a response answered with \"store\": true "
                            "is kept: one answered with \"store\": false was not stored.", param=param, code="not_found")
    return StoredResponse.from_dict(record)


# ---- the response object and its events -----------------------------------------------------------

class ResponsesFormat(_Format):
    """The Responses shape of one chat request: ``output`` items from the chat message, events
    from the chat deltas (each with a ``sequence_number``)."""
    done = None   # the stream ends with response.completed / incomplete / failed, no [DONE]

    def __init__(self, chat: ChatFormat, rid: str, req: ResponsesRequest, echo: dict, on_finish):
        super().__init__(rid, chat.model, chat.token_str, None)
        self.chat, self.req, self.echo, self.on_finish = chat, req, echo, on_finish
        self.created_at = int(time.time())
        self.seq = 0
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.items: list[dict] = []            # output items opened so far, in order
        self.text_item: dict | None = None     # the open message item
        self.calls: dict[int, dict] = {}       # chat tool-call index -> its function_call item
        self.final: dict | None = None

    @staticmethod
    def frame(chunk: dict) -> bytes:
        return b"event: " + chunk["type"].encode() + b"\ndata: " + orjson.dumps(chunk) + b"\n\n"

    def _event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def _object(self, status: str, output: list[dict], usage: dict | None = None, error: dict | None = None,
                incomplete: str | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                **({"completed_at": int(time.time())} if status == "completed" else {}),
                "model": self.model, "output": output, "usage": usage, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None, **self.echo}

    # -- streaming
    def first_chunks(self) -> list[dict]:
        obj = self._object("in_progress", [])
        return [self._event("response.created", response=obj), self._event("response.in_progress", response=obj)]

    def delta_chunks(self, index: int, out) -> list[dict]:
        chunk = self.chat.delta_chunk(index, out)
        return [] if chunk is None else self._translate(chunk)

    def final_chunks(self, index: int, acc: Accumulator) -> list[dict]:
        """What the chat format still held back (a tool call parsed at the end), as events."""
        return [ev for chunk in self.chat.final_chunks(index, acc) for ev in self._translate(chunk)]

    def _translate(self, chunk: dict) -> list[dict]:
        """One chat chunk's delta -> Responses events (opening items as they start)."""
        delta = chunk["choices"][0]["delta"]
        events = []
        if delta.get("content"):
            if self.text_item is None:
                self.text_item = {"type": "message", "id": self.msg_id, "status": "in_progress",
                                  "role": "assistant", "content": []}
                self.items.append(self.text_item)
                idx = len(self.items) - 1
                events += [self._event("response.output_item.added", output_index=idx, item=dict(self.text_item)),
                           self._event("response.content_part.added", item_id=self.msg_id, output_index=idx,
                                       content_index=0, part={"type": "output_text", "text": "",
                                                              "annotations": []})]
            events.append(self._event("response.output_text.delta", item_id=self.msg_id,
                                      output_index=self.items.index(self.text_item), content_index=0,
                                      delta=delta["content"], logprobs=[]))
        for tc in delta.get("tool_calls") or []:
            item = self.calls.get(tc.get("index", 0))
            fn = tc.get("function") or {}
            if item is None:
                item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                        "call_id": tc.get("id") or f"call_{uuid.uuid4().hex[:24]}", "name": fn.get("name", ""),
                        "arguments": "", "status": "in_progress"}
                self.calls[tc.get("index", 0)] = item
                self.items.append(item)
                events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                          item=dict(item)))
            if fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self.items.index(item), delta=fn["arguments"]))
        return events

    async def finish(self, accs: list[Accumulator]) -> None:
        self.final, message = self._full(accs)
        await self.on_finish(self.final, message)

    def end_chunks(self, accs: list[Accumulator]) -> list[dict]:
        final = self.final or self.response(accs)
        events = []
        for idx, item in enumerate(self.items):
            done = final["output"][idx] if idx < len(final["output"]) else item
            if item["type"] == "message":
                text = done["content"][0]["text"] if done.get("content") else ""
                events += [self._event("response.output_text.done", item_id=item["id"], output_index=idx,
                                       content_index=0, text=text, logprobs=[]),
                           self._event("response.content_part.done", item_id=item["id"], output_index=idx,
                                       content_index=0, part=done["content"][0])]
            else:
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=idx, arguments=done["arguments"]))
            events.append(self._event("response.output_item.done", output_index=idx, item=done))
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return events + [self._event(kind, response=final)]

    def error_chunks(self, error: APIError) -> list[dict]:
        err = {"code": error.code or "server_error", "message": error.message}
        return [self._event("response.failed", response=self._object("failed", [], error=err)),
                self._event("error", code=err["code"], message=error.message, param=error.param)]

    # -- the whole response
    def output_items(self, message: dict, cut: bool = False) -> list[dict]:
        """The chat message as output items, with the ids the stream used: a call's ``call_id`` is
        the one its ``output_item.added`` said, and the message (what a next turn continues) gets
        it too, so a ``function_call_output`` answering the streamed id matches. ``cut``: the
        output ended at max_output_tokens (the text item is incomplete then)."""
        items = []
        text = message.get("content")
        if text:
            items.append({"type": "message", "id": self.msg_id, "status": "incomplete" if cut else "completed",
                          "role": "assistant",
                          "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
        streamed = list(self.calls.values())
        for i, tc in enumerate(message.get("tool_calls") or []):
            fn = tc.get("function") or {}
            known = streamed[i] if i < len(streamed) else {}
            tc["id"] = known.get("call_id") or tc.get("id") or f"call_{uuid.uuid4().hex[:24]}"
            items.append({"type": "function_call", "id": known.get("id") or f"fc_{uuid.uuid4().hex}",
                          "call_id": tc["id"], "name": fn.get("name", ""), "arguments": fn.get("arguments", ""),
                          "status": "completed"})
        if self.items and [it["type"] for it in self.items] != [it["type"] for it in items]:
            # keep the streamed order (text first or calls first) for output_index consistency
            by_type = {t: [it for it in items if it["type"] == t] for t in ("message", "function_call")}
            items = [by_type[it["type"]].pop(0) for it in self.items if by_type[it["type"]]] + \
                [it for t in by_type.values() for it in t]
        return items

    def response(self, accs: list[Accumulator]) -> dict:
        return self.final or self._full(accs)[0]

    def _full(self, accs: list[Accumulator]) -> tuple[dict, dict]:
        """The response object, and the assistant turn as a chat message (stored, never sent)."""
        chat = self.chat.response(accs)
        choice = chat["choices"][0]
        u = chat["usage"]
        usage = {"input_tokens": u["prompt_tokens"],
                 # cache_write_tokens: the openai SDK's types require it; a prompt's KV is kept
                 # by the workers' prefix caches and the pool as a side effect, never billed apart
                 "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                          "cache_write_tokens": 0},
                 "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": u["total_tokens"]}
        if "tandem" in u:
            usage["tandem"] = u["tandem"]
        incomplete = "max_output_tokens" if choice["finish_reason"] == "length" else None
        obj = self._object("incomplete" if incomplete else "completed",
                           self.output_items(choice["message"], cut=bool(incomplete)), usage=usage, incomplete=incomplete)
        return obj, choice["message"]


# ---- endpoints ------------------------------------------------------------------------------------

@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    rid = request.state.request_id = f"resp_{uuid.uuid4().hex}"
    req = await validated(request, ResponsesRequest, await generation_body(request))
    if req.truncation not in (None, "disabled", "auto"):
        raise bad_param("truncation", "truncation must be 'disabled' or 'auto'")
    for field, why in UNSUPPORTED.items():
        if (req.model_extra or {}).get(field):
            raise bad_param(field, f"{field} is not supported: {why}", code="unsupported_parameter")
    for j, what in enumerate(req.include or []):
        if what == "message.output_text.logprobs":
            raise bad_param(f"include[{j}]", f"{what} is not supported: {UNSUPPORTED['top_logprobs']}",
                            code="unsupported_parameter")
        if what not in INCLUDE:
            raise bad_param(f"include[{j}]", f"unknown include value {what[:80]!r}: one of "
                                             f"{', '.join(sorted(INCLUDE | {'message.output_text.logprobs'}))}")
    check_metadata(req.metadata)
    store_it = req.store is not False
    previous = await load(request, req.previous_response_id, "previous_response_id") \
        if req.previous_response_id else None
    history = list(previous.messages) if previous else []
    new_messages = input_messages(req.input, history)
    conversation = history + new_messages            # what is stored and continued next turn
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    if not messages:
        raise bad_param("input", "input must not be empty")
    tools, dropped = chat_tools(req.tools)
    if dropped:
        log.info("%s leaving out tools the server cannot run: %s", rid, ", ".join(dropped))
    choice = chat_tool_choice(req.tool_choice)
    if choice == "required" and not tools and dropped:   # only hosted tools: none to call here (never a 400 that stops
        log.info("%s: tool_choice 'required' over tools the server cannot run: answered as 'auto'", rid)
        choice = "auto"                      # an agent: Codex sends web_search)
    # the conversation's session: its turns go to the worker holding its prefix
    session = req.session_id or (session_of(req.prompt_cache_key) if req.prompt_cache_key else None) \
        or (previous.session if previous else None) or (rid if store_it else None)
    chat_body = {
        "model": req.model, "messages": messages, "stream": req.stream, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "user": req.user,
        "sla": req.sla, "tier": req.tier, "session_id": session, "cache_salt": req.cache_salt,
        "prompt_cache_retention": resolve_retention(req.prompt_cache_retention) or None,
        "ignore_eos": req.ignore_eos,
        "tools": tools, "tool_choice": choice,
        "response_format": chat_response_format(req.text), "top_k": req.top_k, "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty, "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
    }
    if req.parallel_tool_calls is not None and tools:
        chat_body["parallel_tool_calls"] = req.parallel_tool_calls
    try:   # an error names the Responses parameter, not the chat one it became
        chat_req = await validated(request, ChatCompletionRequest, {k: v for k, v in chat_body.items() if v is not None})
        gens, chat_fmt = await prepare_chat(request, chat_req, rid)
    except APIError as e:
        if e.param:
            head, dot, rest = e.param.partition(".")
            e.param = PARAMS.get(head, head) + dot + rest
            e.param = e.param.replace("tool_choice.allowed_tools.", "tool_choice.")
        for chat in ("max_completion_tokens", "response_format"):   # (not "messages": a plain word too)
            e.message = e.message.replace(chat, PARAMS[chat])
        raise
    gens = [dataclasses.replace(g, params=("input", "max_output_tokens")) for g in gens]   # a context error's param
    echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": gens[0].sampling.temperature,
            "top_p": req.top_p if req.top_p is not None else 1.0, "tools": req.tools or [],
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "previous_response_id": req.previous_response_id, "store": store_it, "metadata": req.metadata or {},
            "text": req.text or {"format": {"type": "text"}}, "truncation": req.truncation or "disabled",
            "user": req.user, "reasoning": {"effort": None, "summary": None}, "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention}
    tenant, store = request.state.tenant, store_of(request)
    input_items = [item_of(m) for m in new_messages]

    async def on_finish(final: dict, message: dict) -> None:
        if not store_it:
            return
        turn = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            turn["tool_calls"] = message["tool_calls"]
        record = StoredResponse(final, input_items, conversation + [turn], session)
        try:
            await store.put(tenant, rid, record.to_dict())
        except Exception as e:  # the answer still goes out, saying it was not stored (a later
            final["store"] = False   # previous_response_id would get a 404)
            if isinstance(e, (StoreUnavailable, ValueError)):
                log.warning("%s could not be stored: %s; answered with \"store\": false", rid, e)
            else:
                log.exception("%s could not be stored; answered with \"store\": false", rid)

    fmt = ResponsesFormat(chat_fmt, rid, req, echo, on_finish)
    return await streaming.run(request, state(request).backend, gens, fmt, req.stream, req.user)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    check_auth(request)
    return json_response((await load(request, response_id)).response)


@router.get("/v1/responses/{response_id}/input_items")
async def get_input_items(response_id: str, request: Request) -> Response:
    """The turn's input items, a page at a time as OpenAI's: ``limit`` (1-100, default 20),
    ``order`` (``desc``, the default: newest first, or ``asc``), ``after`` (an item id: the page
    starts past it)."""
    check_auth(request)
    q = request.query_params
    limit = q.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise bad_param("limit", f"limit must be an integer in [1, 100], got {limit!r}")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_param("order", f"order must be 'asc' or 'desc', got {order!r}")
    items = (await load(request, response_id)).input_items
    items = items[::-1] if order == "desc" else items
    after = q.get("after")
    if after is not None:
        at = next((k for k, it in enumerate(items) if it.get("id") == after), None)
        if at is None:
            raise bad_param("after", f"no input item {after[:100]!r} in this response")
        items = items[at + 1:]
    page = items[:int(limit)]
    return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    check_auth(request)
    check_id(response_id)
    if not await unless_unavailable(store_of(request).delete(request.state.tenant, response_id)):
        raise APIError(404, f"No response found with id '{response_id}'.", param="response_id", code="not_found")
    return json_response({"id": response_id, "object": "response", "deleted": True})
