"""Tool calling pieces without a model: parsers per family, tool_choice plans and their guides,
prompt rendering, the per-choice stream of content and tool_call deltas; served model ids."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.gateway import tools
from services.gateway.openai_api import APIError
from services.gateway.tools import (
    ChoiceTools, HermesParser, Llama3JsonParser, MistralParser, choose_parser, closed, render_messages,
    response_format_guide, template_takes_tools, tool_plan,
)
from shared.engine.grammar import check_guide
from shared.engine.model_files import served_model_name

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather at a place",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def assemble(deltas: list[dict]) -> list[dict]:
    """OpenAI's client-side assembly of streamed tool_call deltas."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in d:
            assert c["id"] is None and c["arguments"] == "", "id and name come first"
            c["id"], c["name"] = d["id"], d["function"]["name"]
        c["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def run_stream(ct: ChoiceTools, pieces: list[str]) -> tuple[str, list[dict]]:
    content, deltas = "", []
    for p in pieces + [None]:
        c, d = ct.finish() if p is None else ct.feed(p)
        content += c
        deltas += d
    return content, assemble(deltas)


def test_hermes_parser_finds_calls_and_keeps_other_text():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = HermesParser().parse(text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    bad = "<tool_call>{not json}</tool_call> hello"
    assert HermesParser().parse(bad) == (bad.strip(), [])  # unknown text stays content


def test_llama3_and_mistral_parsers():
    content, calls = Llama3JsonParser().parse('{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
                                              '"parameters": {"city": "Rome"}}')
    assert content == "" and [c.name for c in calls] == ["get_time", "get_weather"]
    assert Llama3JsonParser().parse("Plain answer {x}")[1] == []
    content, calls = MistralParser().parse('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    assert content == "" and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert MistralParser().parse("[1, 2]")[1] == []


def test_parser_choice():
    class Vocab:
        def __init__(self, *toks):
            self.toks = toks

        def token_to_id(self, t):
            return 5 if t in self.toks else None
    assert choose_parser(Vocab()).name == "hermes"
    assert choose_parser(Vocab("[TOOL_CALLS]")).name == "mistral"
    assert choose_parser(Vocab("<|python_tag|>")).name == "llama3_json"
    assert choose_parser(Vocab("[TOOL_CALLS]"), "hermes").name == "hermes"
    with pytest.raises(ValueError):
        choose_parser(Vocab(), "xml")


def test_plans_and_their_guides():
    assert tool_plan(None, None, None).mode == "none"
    assert tool_plan([WEATHER], "none", None).mode == "none"
    assert tool_plan([WEATHER], None, None).guide() is None  # auto: free text
    named = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.guide() == {"kind": "json_schema", "value": closed(WEATHER["function"]["parameters"])}
    req = tool_plan([WEATHER, TIME], "required", False).guide()
    check_guide(req)
    schema = req["value"]
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {"town": "x"}}], [{"name": "nope", "arguments": {}}],
                [{"name": "get_time", "arguments": {}}] * 2):  # parallel_tool_calls false: one call
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    for tools, choice in (([WEATHER], {"type": "function", "function": {"name": "x"}}), ([WEATHER], "sometimes"),
                          (None, "required"), ([{"type": "function", "function": {}}], None),
                          # a choice's "function" that is no object; names OpenAI refuses; two alike
                          ([WEATHER], {"type": "function", "function": "get_weather"}),
                          ([WEATHER], {"type": "function", "function": None}), ([WEATHER], ["get_weather"]),
                          ([{"type": "function", "function": {"name": 'a b/c"d'}}], None),
                          ([{"type": "function", "function": {"name": "f" * 65}}], None),
                          ([WEATHER, WEATHER], None),
                          # parameters of another type than object: every output would be discarded
                          ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None)):
        with pytest.raises(APIError) as e:
            tool_plan(tools, choice, None)
        assert e.value.status == 400 and e.value.param.startswith(("tools", "tool_choice"))
    assert tool_plan([{"type": "function", "function": {"name": "mcp__fs-read_2"}}], "required", None).mode == "required"


def test_a_function_without_parameters_takes_none():
    """OpenAI: "Omitting parameters defines a function with an empty parameter list": a forced
    call's arguments are {} (an open object let the 135M model nest keys until the token cap)."""
    for fn in ({"name": "ping"}, {"name": "ping", "parameters": {}}):
        for choice in ({"type": "function", "function": {"name": "ping"}}, "required"):
            schema = tool_plan([{"type": "function", "function": fn}], choice, None).guide()["value"]
            args = schema if choice != "required" else schema["items"]["anyOf"][0]["properties"]["arguments"]
            jsonschema.validate({}, args)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate({"function_name": {}}, args)


def test_a_forced_call_s_objects_are_closed_unless_the_schema_opens_them():
    """A parameters schema without additionalProperties allows any other key: the 135M model
    wrote {"q": "...", "type": {"type": {...}}} to the token cap and the call was lost. Forced
    calls close such objects (OpenAI's strict mode, vLLM's xgrammar default), nested ones too; a
    schema that says additionalProperties (or patternProperties) keeps it; the caller's schema is
    left as it was."""
    params = {"type": "object", "properties": {
        "q": {"type": "string", "maxLength": 16},
        "opts": {"type": "object", "properties": {"deep": {"type": "boolean"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "meta": {"type": "object", "additionalProperties": {"type": "string"}},
        "any": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "null"}]}},
        "required": ["q"]}
    before = json.dumps(params, sort_keys=True)
    fn = {"type": "function", "function": {"name": "search", "parameters": params}}
    for choice in ({"type": "function", "function": {"name": "search"}}, "required"):
        schema = tool_plan([fn], choice, None).guide()["value"]
        args = schema if choice != "required" else schema["items"]["anyOf"][0]["properties"]["arguments"]
        ok = {"q": "x", "opts": {"deep": True}, "tags": [{"k": "v"}], "meta": {"free": "form"}, "any": {"a": 1}}
        jsonschema.validate(ok, args)
        for extra in ({"q": "x", "type": {}}, {"q": "x", "opts": {"deep": True, "x": 1}}, {"q": "x", "tags": [{"z": 1}]},
                      {"q": "x", "any": {"a": 1, "b": 2}}):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(extra, args)
    assert json.dumps(params, sort_keys=True) == before
    assert closed({"type": "object", "patternProperties": {"^x": {}}}) == {"type": "object", "patternProperties": {"^x": {}}}
    assert closed({"type": "object", "additionalProperties": True})["additionalProperties"] is True


def test_a_forced_call_s_integers_end():
    """An integer without bounds gets JSON's safe ones: the 135M model at temperature 0 wrote
    1000000… to the token cap (a probe, 2026-11-30) and the call was lost; the grammar now ends
    the number by the 16th digit. Bounds the schema gives are kept."""
    from shared.engine.grammar import GrammarCompiler
    from shared.engine.model_files import load_tokenizer
    params = {"type": "object", "properties": {"n": {"type": "integer"}, "m": {"type": ["integer", "null"]},
                                               "k": {"type": "integer", "minimum": 0}}, "required": ["n"]}
    schema = tool_plan([{"type": "function", "function": {"name": "f", "parameters": params}}],
                       {"type": "function", "function": {"name": "f"}}, None).guide()
    props = schema["value"]["properties"]
    assert (props["n"]["minimum"], props["n"]["maximum"]) == (-(2 ** 53 - 1), 2 ** 53 - 1)
    assert props["m"]["maximum"] == 2 ** 53 - 1 and props["k"] == {"type": "integer", "minimum": 0}
    tok, _ = load_tokenizer()
    compiler = GrammarCompiler(tok)
    for digits, fits in ((16, True), (17, False), (40, False)):
        m = compiler.matcher(schema)
        assert all(m.accept(t) for t in tok.encode('{"n":1' + "2" * (digits - 1) + "}")) is fits, digits


def test_response_format_guides():
    assert response_format_guide(None) is None and response_format_guide({"type": "text"}) is None
    assert response_format_guide({"type": "json_object"})["kind"] == "json_object"
    g = response_format_guide({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}, "strict": True}})
    assert g == {"kind": "json_schema", "value": {"type": "array"}}
    with pytest.raises(APIError):
        response_format_guide({"type": "json_schema", "json_schema": "nope"})


def test_default_rendering_puts_tools_and_history_in_text():
    plan = tool_plan([WEATHER], "auto", None)
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'}]
    msgs, extra = render_messages(history, plan, HermesParser(), native=False)
    assert extra == {} and msgs[0]["role"] == "system" and '"get_weather"' in msgs[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' == msgs[2]["content"]
    assert msgs[3] == {"role": "user", "content": '<tool_response>\n{"temp": 3}\n</tool_response>'}
    msgs, extra = render_messages(history, plan, HermesParser(), native=True)
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert template_takes_tools("{% for t in tools %}{{ t }}{% endfor %}") and not template_takes_tools("{{ messages }}")


def test_streams_per_mode():
    hermes = HermesParser()
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]  # the marker split across deltas
    ct = ChoiceTools(tool_plan([WEATHER], "auto", None), hermes)
    content, calls = run_stream(ct, pieces)
    assert content == "Sure. " and [c["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"} and ct.calls[0].id == calls[0]["id"]
    content, calls = run_stream(ChoiceTools(tool_plan([WEATHER], "auto", None), hermes), ["Just ", "<tool", " text"])
    assert content == "Just <tool text" and calls == []

    named = tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    content, calls = run_stream(ChoiceTools(named, hermes), ['{"city"', ':"Oslo"}'])
    assert content == "" and calls == [{"id": calls[0]["id"], "name": "get_weather", "arguments": '{"city":"Oslo"}'}]

    req = tool_plan([WEATHER, TIME], "required", None)
    out = '[{"name":"get_time","arguments":{}},{"name":"get_weather","arguments":{"city":"Rome"}}]'
    content, calls = run_stream(ChoiceTools(req, hermes), [out[:10], out[10:]])
    assert content == "" and [c["name"] for c in calls] == ["get_time", "get_weather"]
    content, calls = run_stream(ChoiceTools(req, hermes), ['[{"name":"get_ti'])  # cut by max_tokens
    assert content == "" and calls == []   # the grammar's JSON is never content

    llama = Llama3JsonParser()
    content, calls = run_stream(ChoiceTools(tool_plan([TIME], "auto", None), llama), [" ", '{"name": "get_time", ', '"parameters": {}}'])
    assert content == "" and calls[0]["name"] == "get_time"
    content, calls = run_stream(ChoiceTools(tool_plan([TIME], "auto", None), llama), ["It is ", "{noon}"])
    assert content == "It is {noon}" and calls == []


def test_served_model_name_is_the_file_stem():
    assert served_model_name() == "SmolLM2-135M-Instruct"
    assert served_model_name("/m/Meta-Llama-3.1-8B-Instruct-Q4_0.gguf") == "Meta-Llama-3.1-8B-Instruct"
    assert served_model_name("/m/qwen2.5-0.5b/") == "qwen2.5-0.5b"


def test_a_forced_call_wins_over_response_format():
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    named = tools.tool_plan([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                            {"type": "function", "function": {"name": "f"}}, None)
    assert tools.turn_guide(named, rf) == (named.guide(), "tools")
    auto = tools.tool_plan([{"type": "function", "function": {"name": "f"}}], "auto", None)
    assert tools.turn_guide(auto, rf) == (tools.response_format_guide(rf), "response_format")


def test_forced_calls_cut_by_max_tokens_keep_the_complete_ones():
    hermes = HermesParser()
    req = tool_plan([WEATHER, TIME], "required", None)
    out = '[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"get_time","arguments":{}},{"name":"get_we'
    for pieces in ([out], [out[i:i + 5] for i in range(0, len(out), 5)]):  # whole (not streamed) or streamed
        ct = ChoiceTools(req, hermes)
        content, calls = run_stream(ct, pieces)
        assert content == "" and ct.content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Oslo"}),
                                                                            ("get_time", {})]
        assert [c.id for c in ct.calls] == [c["id"] for c in calls]
    # streamed: a call goes out as soon as its item is complete, before the choice ends
    ct = ChoiceTools(req, hermes)
    _, first = ct.feed(out[:51])
    assert out[:51].endswith("}}") and assemble(first)[0]["name"] == "get_weather"
    assert ct.feed(out[51:60]) == ("", [])

    named = tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    ct = ChoiceTools(named, hermes)
    assert run_stream(ct, ['{"city":"Os']) == ("", []) and ct.calls == [] and ct.content == ""


@pytest.mark.parametrize("mode", ["none", "auto", "named", "required", "required-one"])
def test_streamed_calls_assemble_to_the_whole_texts_calls(mode):
    """For every mode, a text fed in pieces gives the calls (names, arguments, order) and content
    that the same text fed at once gives, ids aside."""
    choice = {"named": {"type": "function", "function": {"name": "get_weather"}}, "required-one": "required"}.get(mode, mode)
    plan = tool_plan([WEATHER, TIME], choice, False if mode == "required-one" else None)
    texts = {"none": ["Plain text <tool_call> stays"],
             "auto": ['Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Just text"],
             "named": ['{"city":"Oslo","days":2}', '{"city":"Os'],
             "required": ['[{"name":"get_time","arguments":{}},{"name":"get_weather","arguments":{"city":"A"}}]',
                          '[{"name":"get_time","arguments":{}},{"name":"get_w'],
             "required-one": ['[{"name":"get_time","arguments":{}}]', '[{"name":"get_ti']}[mode]
    for text in texts:
        whole = ChoiceTools(plan, HermesParser())
        c_whole, calls_whole = run_stream(whole, [text])
        for size in (1, 2, 7):
            part = ChoiceTools(plan, HermesParser())
            c_part, calls_part = run_stream(part, [text[i:i + size] for i in range(0, len(text), size)])
            assert c_part == c_whole and part.content == whole.content
            strip = lambda cs: [(c["name"], c["arguments"]) for c in cs]  # noqa: E731
            assert strip(calls_part) == strip(calls_whole)
            for c in calls_part:
                json.loads(c["arguments"])


def test_a_reply_in_the_history_keeps_the_tokens_it_was_generated_as():
    """The next turn's prompt starts with exactly the last turn's prompt tokens and the reply's own
    tokens, also for a reply whose leading whitespace the BPE would merge with the prompt's last
    newline; a template that changes the reply falls back to encoding the whole text."""
    from types import SimpleNamespace

    from services.gateway.handlers import chat_prompt, encode_turns
    from services.gateway.openai_api import ChatCompletionRequest
    from shared.engine.model_files import load_tokenizer

    tok, _ = load_tokenizer()
    gw = SimpleNamespace(backend=SimpleNamespace(tokenizer=tok, max_context=8192), tool_parser=HermesParser(), native_tools=False)
    first = [{"role": "user", "content": "Hi"}]
    prompt = chat_prompt(gw, ChatCompletionRequest(model="m", messages=first), tool_plan(None, None, None))
    for reply in ("  two spaces", " Hello there", "\nHello", "Plain.\n\n"):
        messages = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
        ids = chat_prompt(gw, ChatCompletionRequest(model="m", messages=messages), tool_plan(None, None, None))
        generated = tok.encode(reply, add_special_tokens=False)
        assert ids[:len(prompt) + len(generated)] == prompt + generated, reply
        assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(messages, add_generation_prompt=True)
    whole = "<s>user: Hi</s><s>assistant: two</s>"
    assert encode_turns(tok, whole, "<s>user: Hi</s><s>assistant: \x00tandem-reply-1\x00</s>",
                        {"\x00tandem-reply-1\x00": "  two"}) == tok.encode(whole, add_special_tokens=False)


def test_a_required_call_s_schemas_keep_their_own_definitions():
    """``required`` nests each tool's parameters in one array schema: the "#/$defs/..." pointers
    pydantic and the Agents SDK write for nested models (and draft-07 "#/definitions/...", and "#"
    for a recursive one) pointed at that array's root, where nothing was (400 invalid_schema).
    Each such tool's parameters become a definition of the array, their pointers rebased; two
    tools naming the same definition keep theirs apart; the grammar compiles."""
    from shared.engine.grammar import GrammarCompiler
    from shared.engine.model_files import load_tokenizer
    ship = {"type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}, "kg": {"type": "integer"}},
            "required": ["to", "kg"], "$defs": {"Address": {"type": "object", "properties": {
                "city": {"type": "string"}}, "required": ["city"]}}}
    tag = {"type": "object", "properties": {"a": {"$ref": "#/definitions/Address"}, "next": {"$ref": "#"}},
           "required": ["a"], "definitions": {"Address": {"type": "integer"}}}
    fns = [{"type": "function", "function": {"name": "ship", "parameters": ship}},
           {"type": "function", "function": {"name": "tag", "parameters": tag}}, WEATHER]
    before = json.dumps(fns, sort_keys=True)
    guide = tool_plan(fns, "required", None).guide()
    assert json.dumps(fns, sort_keys=True) == before          # the caller's schemas are left as they were
    schema = guide["value"]
    jsonschema.validate([{"name": "ship", "arguments": {"to": {"city": "Oslo"}, "kg": 2}},
                         {"name": "tag", "arguments": {"a": 1, "next": {"a": 2}}},
                         {"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    for bad in ([{"name": "ship", "arguments": {"to": {"town": "Oslo"}, "kg": 2}}],   # closed: no "town"
                [{"name": "ship", "arguments": {"to": 3, "kg": 2}}],
                [{"name": "tag", "arguments": {"a": {"city": "x"}}}],             # tag's Address is an integer
                [{"name": "tag", "arguments": {"a": 1, "next": {"a": "x"}}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert "$ref" not in json.dumps(schema["items"]["anyOf"][2])   # a tool without pointers stays inline
    tok, _ = load_tokenizer()
    GrammarCompiler(tok).compile(guide)   # was: "Pointer '/$defs/Address' does not exist"


def test_allowed_tools_limit_the_calls_to_the_listed_functions():
    """OpenAI's ``tool_choice: {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}``: the
    model calls only the listed functions, ``required`` forcing one (it was taken as ``auto``
    over every tool on /v1/responses, and refused on chat)."""
    def allowed(mode, *names):
        return {"type": "allowed_tools", "allowed_tools": {
            "mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}
    plan = tool_plan([WEATHER, TIME], allowed("required", "get_time"), None)
    assert plan.mode == "required" and [t["name"] for t in plan.tools] == ["get_time"]
    schema = plan.guide()["value"]
    jsonschema.validate([{"name": "get_time", "arguments": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    plan = tool_plan([WEATHER, TIME], allowed("auto", "get_weather"), None)
    assert plan.mode == "auto" and [t["name"] for t in plan.tools] == ["get_weather"] and plan.guide() is None
    for bad, param in ((allowed("required", "nope"), "tool_choice.allowed_tools.tools[0]"),
                       (allowed("sometimes", "get_time"), "tool_choice.allowed_tools"),
                       (allowed("auto"), "tool_choice.allowed_tools"),
                       ({"type": "allowed_tools"}, "tool_choice.allowed_tools")):
        with pytest.raises(APIError) as e:
            tool_plan([WEATHER, TIME], bad, None)
        assert (e.value.status, e.value.param) == (400, param)


def test_a_call_the_previous_response_made_needs_its_output():
    """The previous response ended with calls: the next turn gives each its output (OpenAI: "No
    tool output found for function call ..."), once."""
    from services.gateway.responses import input_messages
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    out = [{"type": "function_call_output", "call_id": c, "output": "1"} for c in ("call_1", "call_2")]
    assert [m["tool_call_id"] for m in input_messages(out, history)] == ["call_1", "call_2"]
    for items in ("and now?", out[:1], out + [{"role": "user", "content": "ok"}, out[0]]):
        with pytest.raises(APIError) as e:
            input_messages(items, history)
        assert e.value.status == 400
    done = history + [{"role": "tool", "tool_call_id": c, "content": "1"} for c in ("call_1", "call_2")]
    assert input_messages("and now?", done) == [{"role": "user", "content": "and now?"}]
    with pytest.raises(APIError) as e:      # answered in an earlier turn already
        input_messages(out[:1], done)
    assert e.value.param == "input[0].call_id"
    # a later turn may use an id again (some backends number calls per turn): it answers that call
    again = [{"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}, out[0]]
    assert [m["role"] for m in input_messages(again, done)] == ["assistant", "tool"]
    with pytest.raises(APIError) as e:      # a call the client gives no id: nothing could answer it
        input_messages([{"type": "function_call", "name": "f", "arguments": "{}"}], done)
    assert e.value.param == "input[0].call_id"


def test_chat_tool_turns_are_checked_as_openai_does():
    """A tool message answers an open call of an earlier assistant turn, once; every call gets
    one; an id used again by a later turn is that turn's call."""
    from services.gateway.openai_api import ChatMessage, chat_messages

    def call(*ids):
        return ChatMessage(role="assistant", tool_calls=[
            {"id": c, "type": "function", "function": {"name": "f", "arguments": "{}"}} for c in ids])

    def tool(cid):
        return ChatMessage(role="tool", tool_call_id=cid, content="1")
    user = ChatMessage(role="user", content="x")
    ok = [user, call("call_0", "call_1"), tool("call_1"), tool("call_0"), user, call("call_0"), tool("call_0"), user]
    assert [m["role"] for m in chat_messages(ok)][-2:] == ["tool", "user"]
    for bad, param in (([user, call("call_0"), user], "messages"),                            # never answered
                       ([user, call("call_0"), tool("call_0"), tool("call_0")], "messages[3].tool_call_id"),
                       ([user, tool("call_0")], "messages[1].tool_call_id")):
        with pytest.raises(APIError) as e:
            chat_messages(bad)
        assert (e.value.status, e.value.param) == (400, param)
