"""The agent API against the real stack (`tandem up --prefill 0`: gpu-decode and cpu-decode prefill
themselves), with the official openai client: tool calls (named, required, auto, streamed, a
turn with a tool result), response_format json_schema / json_object, n=2, and a constrained
request migrated mid-stream (POST /v1/sessions/{id}) that still validates and equals the
unmigrated output. One stack for the module."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import jsonschema
import openai
import pytest

from shared import subjects
from shared.bus import Bus
from shared.schemas import RoutePlan
from tests.e2e.test_ring import _collect
from tests.e2e.test_stack import running_stack

# a stack of its own, 13 s for the whole module with the weight cache: in the default run
pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
RECIPE = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 60},
    "steps": {"type": "array", "items": {"type": "string", "maxLength": 80}, "minItems": 3, "maxItems": 4}},
    "required": ["title", "steps"], "additionalProperties": False}


@pytest.fixture(scope="module")
def stack(nats_server):
    with running_stack(nats_server, ["--prefill", "0"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    (m,) = client.models.list().data
    assert m.id == "SmolLM2-135M-Instruct"  # the typeable id the docs use
    return m.id


def check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, TOOLS[call.function.name])
    return args


def test_named_tool_choice_gives_a_valid_call(client, model):
    # seeded: unseeded, a draw at temperature 1 once spent its 60 tokens inside an argument string
    # (finish "length": a valid prefix, not a call)
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, seed=1,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_call(call)


def test_a_forced_call_whose_schema_leaves_objects_open_still_ends(client, model):
    """No additionalProperties in the tool's schema (JSON Schema then allows any other key): the
    135M model, forced to call, wrote {"q": "...", "type": {"type": {...}}} until the token cap
    and no call came out. The gateway closes such objects for forced calls, as OpenAI's strict
    mode and vLLM do: one call with the declared keys."""
    lookup = {"type": "function", "function": {"name": "lookup", "description": "look up a fact", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 16}}, "required": ["q"]}}}
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Look up fact 1."}],
                                       tools=[lookup], tool_choice={"type": "function", "function": {"name": "lookup"}},
                                       max_tokens=64, temperature=0)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, r.usage)
    (call,) = choice.message.tool_calls
    assert set(json.loads(call.function.arguments)) == {"q"}


def test_required_tool_choice_gives_valid_calls(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=0.7, seed=1)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls  # parallel_tool_calls=false: exactly one
    check_call(call)


def test_auto_gives_a_valid_call_or_text(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0)
    msg = r.choices[0].message
    if msg.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        for call in msg.tool_calls:
            check_call(call)
    else:
        assert msg.content and r.choices[0].finish_reason in ("stop", "length")


NAMED = {"type": "function", "function": {"name": "get_time"}}
# every tool_choice mode, and forced calls cut by the token cap (the complete calls stay, the cut one goes)
MODES = [("none", "none", None, 40), ("auto", "auto", None, 40), ("named", NAMED, None, 40),
         ("required", "required", None, 60), ("required-one", "required", False, 60),
         ("required-cut", "required", None, 12), ("named-cut", NAMED, None, 4)]
BOTH = [{"role": "user", "content": "What are the weather and the local time in Paris and in Rome?"}]


def chat_streamed(stream) -> tuple[str, list[tuple[str, str]], str | None]:
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:  # id and name first, then argument fragments
                    assert c["id"] is None and not c["arguments"]
                    c["id"], c["name"] = d.id, d.function.name
                c["arguments"] += d.function.arguments or ""
    assert all(c["id"] for c in calls.values())
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], finish


def responses_streamed(events) -> tuple[str, list[tuple[str, str]], str]:
    text, done, status, args, call_ids = "", [], None, {}, {}
    for e in events:
        if e.type == "response.output_text.delta":
            text += e.delta
        elif e.type == "response.output_item.added" and e.item.type == "function_call":
            call_ids[e.item.id] = e.item.call_id
        elif e.type == "response.function_call_arguments.delta":
            args[e.item_id] = args.get(e.item_id, "") + e.delta
        elif e.type == "response.output_item.done" and e.item.type == "function_call":
            assert args.get(e.item.id, "") == e.item.arguments  # the deltas assemble to the item
            assert e.item.call_id == call_ids[e.item.id]         # one call, one call_id (openai's stream helper checks)
            done.append((e.item.name, e.item.arguments))
        elif e.type in ("response.completed", "response.incomplete"):
            status = e.response.status
            assert [(i.name, i.arguments) for i in e.response.output if i.type == "function_call"] == done
            assert {i.id: i.call_id for i in e.response.output if i.type == "function_call"} == call_ids
    return text, done, status


@pytest.mark.parametrize("mode,choice,parallel,cap", MODES, ids=[m[0] for m in MODES])
def test_streamed_tool_calls_equal_the_non_streamed_ones(client, model, mode, choice, parallel, cap):
    """Chat and Responses, each tool_choice mode, greedy: the streamed calls assemble to exactly
    the non-streamed ones (names, arguments, order); every argument string validates; a forced
    call is never text, and a cut one is dropped (finish_reason length / status incomplete)."""
    kw = {"parallel_tool_calls": parallel} if parallel is not None else {}
    chat = dict(model=model, messages=BOTH, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=cap,
                temperature=0, **kw)
    r = client.chat.completions.create(**chat)
    (c,) = r.choices
    want = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    assert chat_streamed(client.chat.completions.create(**chat, stream=True)) == (c.message.content or "", want,
                                                                                   c.finish_reason)
    for name, args in want:
        jsonschema.validate(json.loads(args), TOOLS[name])
    forced = mode.startswith(("named", "required"))
    if forced:
        assert c.message.content is None  # the grammar's JSON is never content
        assert c.finish_reason == ("length" if mode.endswith("cut") else "tool_calls")
        assert want or mode.endswith("cut")
    if mode == "required-one" or mode == "named":
        assert len(want) == 1
    if mode.endswith("cut"):
        assert want == []  # the cap cannot hold one complete call: no call (and no text)
    if mode == "none":
        assert want == [] and c.message.content

    rtool = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
    rchoice = {"type": "function", "name": choice["function"]["name"]} if isinstance(choice, dict) else choice
    resp = dict(model=model, input=BOTH[0]["content"], tools=rtool, tool_choice=rchoice, max_output_tokens=cap,
                temperature=0, store=False, **kw)
    r2 = client.responses.create(**resp)
    got = [(i.name, i.arguments) for i in r2.output if i.type == "function_call"]
    assert got == want  # the same request through the Responses API: the same calls
    assert responses_streamed(client.responses.create(**resp, stream=True)) == (r2.output_text, got, r2.status)
    if forced:
        assert r2.output_text == "" and r2.status == ("incomplete" if mode.endswith("cut") else "completed")


def test_required_calls_cut_by_the_cap_keep_the_complete_ones(client, model):
    """``required`` with parallel calls, cut inside its last call: the complete calls come back as
    tool_calls (finish_reason length), streamed or not, chat and Responses; the cut one is dropped.
    Sampled with a seed (greedy, this model writes one call): the first seed whose uncapped
    output has two or more calls, then the same request capped two tokens short of it."""
    ask = [{"role": "user", "content": "Get the local time in Paris, in Rome, in Oslo and in Berlin."}]
    base = dict(model=model, messages=ask, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0)
    for seed in range(16):
        full = client.chat.completions.create(**base, seed=seed, max_tokens=160)
        if full.choices[0].finish_reason == "tool_calls" and len(full.choices[0].message.tool_calls) >= 2:
            break
    else:
        pytest.fail("no seed in 16 gave parallel calls")
    calls = [(t.function.name, t.function.arguments) for t in full.choices[0].message.tool_calls]
    cut = dict(base, seed=seed, max_tokens=full.usage.completion_tokens - 2)
    r = client.chat.completions.create(**cut)
    (c,) = r.choices
    assert c.finish_reason == "length" and c.message.content is None
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == calls[:-1]
    assert chat_streamed(client.chat.completions.create(**cut, stream=True)) == ("", calls[:-1], "length")
    rtool = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
    resp = dict(model=model, input=ask[0]["content"], tools=rtool, tool_choice="required", temperature=1.0,
                max_output_tokens=cut["max_tokens"], store=False, extra_body={"seed": seed})
    r2 = client.responses.create(**resp)
    assert r2.status == "incomplete" and r2.incomplete_details.reason == "max_output_tokens"
    assert [(i.name, i.arguments) for i in r2.output] == calls[:-1]   # function_call items only, no text
    assert responses_streamed(client.responses.create(**resp, stream=True)) == ("", calls[:-1], "incomplete")


def test_a_turn_with_a_tool_message_is_served(client, model):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    r = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], max_tokens=40,
                                       temperature=0)
    msg = r.choices[0].message
    assert msg.content or msg.tool_calls
    assert r.usage.prompt_tokens > 100  # the tools block, the call and its result were all in the prompt


def test_json_schema_output_validates(client, model):
    # sampled at temperature 1, seeded: unseeded, a draw once spent 200 tokens inside the schema's bounds
    # (a title of up to 60 characters, 3-4 steps of up to 80: ~420 characters of JSON at most) and
    # ended 'length'; 400 tokens hold it
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give me a short pancake recipe."}], max_tokens=400,
        response_format={"type": "json_schema", "json_schema": {"name": "recipe", "schema": RECIPE, "strict": True}},
        extra_body={"seed": 3})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), RECIPE)


def test_json_object_parses(client, model):
    r = client.chat.completions.create(
        model=model, max_tokens=120, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Return a JSON object with the keys name and age for a cat."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_bad_schema_is_a_400(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": 7}}}}})
    assert e.value.body["param"] == "response_format"


def test_n_2_gives_two_choices(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, n=2, max_tokens=12, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1] and all(c.message.content for c in r.choices)
    assert r.usage.completion_tokens >= 2  # both choices counted


async def test_constrained_request_migrated_mid_stream_equals_unmigrated(stack, model, nats_server):
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Give me a recipe for tomato soup."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "recipe", "schema": RECIPE, "strict": True}}

    async def run(session: str | None, on_chunk=None) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=200, temperature=0, response_format=fmt, stream=True,
            extra_headers={"X-Tandem-Session": session} if session else None)
        text, finish, n = "", None, 0
        async for ch in stream:
            ids.add(ch.id)
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
                n += 1
                if on_chunk is not None:
                    await on_chunk(n)
        return text, finish

    ids: set[str] = set()
    want, want_finish = await run(None)
    jsonschema.validate(json.loads(want), RECIPE)
    session, moves = f"agent-{uuid.uuid4().hex[:8]}", []
    bus = await Bus.connect(url=nats_server, name="e2e-agent-move")
    plans: list[RoutePlan] = []
    sub = await bus.subscribe(subjects.ROUTER_DECISION, RoutePlan, skip_invalid=True)
    noting = asyncio.create_task(_collect(sub, plans))
    ids.clear()

    async def promote(n: int) -> None:
        if n == 4:  # mid-stream: standard (cpu-decode) -> interactive (gpu-decode)
            async with httpx.AsyncClient() as h:
                r = await h.post(f"{stack.url}/v1/sessions/{session}", json={"tier": "interactive"}, timeout=30)
            assert r.status_code == 200, r.text
            moves.extend(r.json()["moved"])
    try:
        got, finish = await run(session, promote)
        await asyncio.sleep(0.2)
    finally:
        noting.cancel()
        await bus.close()
    # it did move, once, to gpu-decode: at once (the POST's reply lists it) or at the router's next
    # tick (on a loaded machine its view of the worker's requests can lag a heartbeat)
    moved = [p for p in plans if p.request_id in ids and p.moved_from]
    assert [p.decode_role for p in moved] == ["gpu-decode"], (moves, plans)
    assert all(m["target"] == moved[0].decode_worker for m in moves), moves
    assert got == want and finish == want_finish == "stop"
    jsonschema.validate(json.loads(got), RECIPE)


@pytest.mark.parametrize("api,settings", [("chat", {"temperature": 0}), ("chat", {"seed": 3}),
                                          ("responses", {"temperature": 0})],
                         ids=["chat-greedy", "chat-sampled", "responses-greedy"])
async def test_pydantic_ai_agent_gets_a_validated_output_object(stack, model, api, settings):
    """pydantic-ai's ``Agent(model, output_type=...)`` (``tool_choice: required`` with its output
    tool, 80 output tokens; its chat and its Responses model), streamed and not: a validated
    object, the same one. (Its Responses model sends no seed: sampled, it is another draw each run.)"""
    pytest.importorskip("pydantic_ai", reason="pydantic-ai-slim[openai] is in the test extras")
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Person(BaseModel):
        name: str
        age: int

    provider = OpenAIProvider(base_url=stack.url + "/v1", api_key="none")
    kind = OpenAIChatModel if api == "chat" else OpenAIResponsesModel
    agent = Agent(kind(model, provider=provider), output_type=Person)
    ask, ms = "Ada Lovelace was 36 years old. Extract the person.", {"max_tokens": 80, **settings}
    whole = (await agent.run(ask, model_settings=ms)).output
    async with agent.run_stream(ask, model_settings=ms) as run:
        streamed = await run.get_output()
    assert isinstance(whole, Person) and streamed == whole
