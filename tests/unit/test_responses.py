"""The Responses API on the gateway with a fake backend (the official openai client): request
translation, the non-streamed object, the streamed event sequence, stored responses per tenant,
previous_response_id continuing the conversation. End to end on the real stack:
tests/e2e/test_responses.py."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from services.gateway.handlers import key_tenant
from shared.settings import GatewaySettings
from tests.unit.test_gateway import MODEL, REPLY, FakeBackend, FakeTokenizer, Server


@pytest.fixture(scope="module")
def served():
    backend = FakeBackend()
    settings = GatewaySettings(api_keys="alice=standard,bob=batch")
    with Server(backend, settings) as server:
        yield server, backend


@pytest.fixture
def backend(served):
    served[1].reset()
    return served[1]


def client(served, key="alice"):
    return openai.OpenAI(base_url=f"{served[0].url}/v1", api_key=key, max_retries=0, timeout=10)


def prompt_text(backend) -> str:
    return FakeTokenizer().decode(backend.requests[-1].prompt_token_ids)


def test_a_string_input_gives_a_response_object(served, backend):
    r = client(served).responses.create(model=MODEL, input="Hi there", instructions="Be brief.")
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == REPLY and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == len(backend.requests[-1].prompt_token_ids) and r.usage.output_tokens == len(REPLY)
    assert r.usage.input_tokens_details.cached_tokens == 3
    assert prompt_text(backend) == "<|system|>Be brief.\n<|user|>Hi there\n<|assistant|>"
    assert r.instructions == "Be brief." and r.store is True


def test_responses_and_their_events_validate_against_the_sdks_types(served, backend):
    """Every field the openai SDK's types require is there (usage's cache_write_tokens was not),
    and a completed response says when (completed_at)."""
    import json

    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter
    h = {"Authorization": "Bearer alice"}
    url = served[0].url + "/v1/responses"
    r = httpx.post(url, json={"model": MODEL, "input": "Hi"}, headers=h).json()
    got = Response.model_validate(r)
    assert got.status == "completed" and got.completed_at >= got.created_at
    assert got.usage.input_tokens_details.cache_write_tokens == 0
    events = TypeAdapter(ResponseStreamEvent)
    with httpx.stream("POST", url, json={"model": MODEL, "input": "Hi", "stream": True}, headers=h) as s:
        data = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert data and [events.validate_python(e).type for e in data][-1] == "response.completed"
    r = httpx.post(url, json={"model": MODEL, "input": "Hi", "max_output_tokens": 2}, headers=h).json()
    assert Response.model_validate(r).status == "incomplete" and "completed_at" not in r


def test_items_map_to_chat_messages(served, backend):
    client(served).responses.create(model=MODEL, input=[
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                          {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"role": "user", "content": "c"}])
    assert prompt_text(backend) == "<|system|>Rules.\n<|user|>a\nb\n<|assistant|>ok\n<|user|>c\n<|assistant|>"


def test_max_output_tokens_gives_incomplete(served, backend):
    r = client(served).responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == REPLY[:4] and r.output[0].status == "incomplete"   # the cut message item too
    events = list(client(served).responses.create(model=MODEL, input="Hi", max_output_tokens=4, stream=True))
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]


def test_streamed_events_assemble_to_the_response(served, backend):
    events = list(client(served).responses.create(model=MODEL, input="Hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == REPLY == final.output_text and events[-4].text == REPLY
    assert events[2].item.id == final.output[0].id


def test_stored_turns_continue_and_belong_to_their_tenant(served, backend):
    alice, bob = client(served), client(served, "bob")
    first = alice.responses.create(model=MODEL, input="One", instructions="Sys.")
    second = alice.responses.create(model=MODEL, input="Two", instructions="Sys.", previous_response_id=first.id)
    assert prompt_text(backend) == f"<|system|>Sys.\n<|user|>One\n<|assistant|>{REPLY}\n<|user|>Two\n<|assistant|>"
    # the turns share a session: the router keeps them on the worker holding the prefix
    assert backend.requests[-1].session_id == backend.requests[-2].session_id == f"{key_tenant('alice')}/{first.id}"
    got = alice.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == REPLY and got.previous_response_id == first.id
    items = alice.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["Two"]
    for call in (lambda: bob.responses.retrieve(first.id),
                 lambda: bob.responses.create(model=MODEL, input="x", previous_response_id=first.id),
                 lambda: bob.responses.delete(first.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    alice.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(first.id)


def test_store_false_keeps_nothing(served, backend):
    r = client(served).responses.create(model=MODEL, input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client(served).responses.retrieve(r.id)


def test_prompt_cache_key_is_the_session(served, backend):
    client(served).responses.create(model=MODEL, input="Hi", prompt_cache_key="codex session 42")
    sid = backend.requests[-1].session_id
    assert sid.startswith(f"{key_tenant('alice')}/pck-")   # the key's own namespace
    client(served).responses.create(model=MODEL, input="Hi", prompt_cache_key="codex session 42")
    assert backend.requests[-1].session_id == sid


def test_prompt_cache_retention_on_both_apis(served, backend):
    """OpenAI's ``prompt_cache_retention`` (in_memory | 24h) reaches the backend with the request's
    session, on chat completions and Responses; another value is an OpenAI-shaped 400 naming it."""
    h = {"Authorization": "Bearer alice"}
    base = served[0].url + "/v1"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    for value in ("in_memory", "24h"):
        r = httpx.post(base + "/chat/completions", json={**chat, "prompt_cache_retention": value,
                                                         "prompt_cache_key": "agent 7"}, headers=h)
        assert r.status_code == 200, r.text
        assert backend.requests[-1].cache_retention == value and backend.requests[-1].session_id.startswith(f"{key_tenant('alice')}/pck-")
        r = httpx.post(base + "/responses", json={"model": MODEL, "input": "Hi", "prompt_cache_retention": value},
                       headers=h)
        assert r.status_code == 200 and r.json()["prompt_cache_retention"] == value, r.text
        assert backend.requests[-1].cache_retention == value
    httpx.post(base + "/chat/completions", json=chat, headers=h)
    assert backend.requests[-1].cache_retention == "" and backend.requests[-1].session_id is None
    for url, body in ((base + "/chat/completions", chat), (base + "/responses", {"model": MODEL, "input": "Hi"}),
                      (base + "/completions", {"model": MODEL, "prompt": "Hi"})):
        n = len(backend.requests)
        for bad in ("1h", "IN_MEMORY", ""):
            r = httpx.post(url, json={**body, "prompt_cache_retention": bad}, headers=h)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "prompt_cache_retention", r.text
            assert err["type"] == "invalid_request_error" and "in_memory, 24h" in err["message"]
        assert len(backend.requests) == n   # nothing ran


def test_bad_input_is_an_openai_400(served, backend):
    h = {"Authorization": "Bearer alice"}
    url = served[0].url + "/v1/responses"
    for body, param in (({"model": MODEL, "input": [{"type": "bogus"}]}, "input[0].type"),
                        ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                         "input[0].content[0]"),
                        ({"model": MODEL, "input": []}, "input"),
                        ({"model": MODEL}, "input")):
        r = httpx.post(url, json=body, headers=h)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.post(url, json={"model": "other", "input": "x"}, headers=h).status_code == 404
    assert httpx.get(served[0].url + "/v1/responses/resp_nope", headers=h).status_code == 404
    assert httpx.post(url, json={"model": MODEL, "input": "x"}).status_code == 401


def test_errors_name_the_responses_parameters(served, backend):
    """A Responses request's error names its own parameter (not the chat one it became); ids the
    server never makes (NATS wildcards among them) are a 404, not a 500; fields that would change
    the contract are refused; an item or a tool without what it needs is a 400."""
    h = {"Authorization": "Bearer alice"}
    url = served[0].url + "/v1/responses"
    for body, status, param, code in (
            ({"max_output_tokens": 0}, 400, "max_output_tokens", "invalid_parameter"),
            ({"previous_response_id": "resp_nope"}, 404, "previous_response_id", "not_found"),
            ({"previous_response_id": "resp_>"}, 404, "previous_response_id", "not_found"),
            ({"previous_response_id": "resp_*"}, 404, "previous_response_id", "not_found"),
            ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, 400, "input[0].content[0].text",
             "invalid_parameter"),
            ({"input": [{"type": "function_call_output", "call_id": "c"}]}, 400, "input[0].output", "invalid_parameter"),
            # OpenAI: "No tool call found for function call output with call_id ..."
            ({"input": [{"type": "function_call_output", "call_id": "call_never_made", "output": "x"}]}, 400,
             "input[0].call_id", "invalid_parameter"),
            ({"tools": [{"type": "function"}]}, 400, "tools[0].name", "invalid_parameter"),
            ({"tool_choice": "required"}, 400, "tool_choice", "invalid_parameter"),
            ({"text": {"format": {"type": "yaml"}}}, 400, "text.format.type", "invalid_parameter"),
            ({"background": True}, 400, "background", "unsupported_parameter"),
            ({"prompt": {"id": "pmpt_1"}}, 400, "prompt", "unsupported_parameter"),
            ({"top_logprobs": 3}, 400, "top_logprobs", "unsupported_parameter"),
            ({"include": ["reasoning.encrypted_content", "nope"]}, 400, "include[1]", "invalid_parameter"),
            ({"include": ["message.output_text.logprobs"]}, 400, "include[0]", "unsupported_parameter"),
            ({"text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text.format.name", "invalid_parameter"),
            # allowed_tools (OpenAI's shape) naming a function the request does not have
            ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {
                "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "g"}]}}, 400,
             "tool_choice.tools[0]", "invalid_parameter"),
            # a call without its output (OpenAI: "No tool output found for function call ..."), one
            # answered twice
            ({"input": [{"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                        {"role": "user", "content": "and?"}]}, 400, "input", "invalid_parameter"),
            ({"input": [{"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": "call_1", "output": "1"},
                        {"type": "function_call_output", "call_id": "call_1", "output": "2"}]}, 400,
             "input[2].call_id", "invalid_parameter"),
            ({"conversation": "conv_1"}, 400, "conversation", "unsupported_parameter"),
            ({"stream": "yes"}, 400, "stream", "invalid_parameter"),
            # metadata as OpenAI takes it (16 string pairs; keys <= 64, values <= 512 characters):
            # a nested value 300 levels deep was generated, then failed to encode (a 500)
            ({"metadata": {"k": {"a": 1}}}, 400, "metadata.k", "invalid_parameter"),
            ({"metadata": {"k": "v" * 513}}, 400, "metadata.k", "invalid_parameter"),
            ({"metadata": {"k" * 65: "v"}}, 400, "metadata", "invalid_parameter"),
            ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata", "invalid_parameter")):
        for stream in (False, True):
            r = httpx.post(url, json={"model": MODEL, "input": "x", "stream": stream, **body}, headers=h)
            assert r.status_code == status, (body, r.text)
            assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code), r.text
    for rid in ("resp_*", "resp_%3E", "resp_a.b", "resp_a%20b"):
        for method, path in (("GET", ""), ("GET", "/input_items"), ("DELETE", "")):
            r = httpx.request(method, f"{url}/{rid}{path}", headers=h)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, rid, r.text)
    r = httpx.post(url, json={"model": MODEL, "input": "x", "max_output_tokens": 0}, headers=h)
    assert "max_output_tokens" in r.json()["error"]["message"] and "max_completion" not in r.text, r.text
    # hosted tools only (Codex sends web_search): nothing to force here, never a 400 that stops an agent
    for choice in ("required", {"type": "allowed_tools", "mode": "required", "tools": [{"type": "web_search"}]}):
        r = httpx.post(url, json={"model": MODEL, "input": "x", "tools": [{"type": "web_search"}], "tool_choice": choice,
                                  "include": ["reasoning.encrypted_content"]}, headers=h)
        assert r.status_code == 200, r.text
    # an output answering a call made earlier in the input is taken
    r = httpx.post(url, json={"model": MODEL, "input": [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}, headers=h)
    assert r.status_code == 200, r.text
    backend.requests.clear()
    deep = b'{"model": "%s", "input": "x", "metadata": {"k": ' % MODEL.encode() + b'[' * 200 + b']' * 200 + b'}}'
    r = httpx.post(url, content=deep, headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert backend.requests == []
    r = httpx.post(url, json={"model": MODEL, "input": "x", "stream": None, "store": None,
                              "metadata": {f"k{i}": "v" * 512 for i in range(16)}}, headers=h)
    assert r.status_code == 200 and r.json()["store"] is True and len(r.json()["metadata"]) == 16


def test_input_items_page_newest_first(served, backend):
    c = client(served)
    r = c.responses.create(model=MODEL, input=[{"role": "user", "content": t} for t in "abcde"])
    texts = lambda page: [i.content[0].text for i in page.data]   # noqa: E731
    assert texts(c.responses.input_items.list(r.id)) == list("edcba")   # OpenAI's default: desc
    page = c.responses.input_items.list(r.id, limit=2, order="asc")
    assert texts(page) == ["a", "b"] and page.has_more and page.last_id == page.data[-1].id
    rest = c.responses.input_items.list(r.id, limit=10, order="asc", after=page.last_id)
    assert texts(rest) == ["c", "d", "e"] and not rest.has_more
    assert [i.content[0].text for i in c.responses.input_items.list(r.id, order="asc")] == list("abcde")  # every page
    h = {"Authorization": "Bearer alice"}
    for q, param in (("limit=0", "limit"), ("limit=abc", "limit"), ("limit=101", "limit"), ("order=up", "order"),
                     ("after=msg_nope", "after")):
        got = httpx.get(f"{served[0].url}/v1/responses/{r.id}/input_items?{q}", headers=h)
        assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text


def test_a_failure_mid_stream_is_a_failed_event(served, backend):
    from services.gateway.backend import BackendError
    backend.mid_error = BackendError("worker_lost", "the worker died", 502)
    events = list(client(served).responses.create(model=MODEL, input="Hi", stream=True))
    assert events[-2].type == "response.failed" and events[-2].response.error.code == "worker_lost"
    assert events[-1].type == "error"


def _value(name: str, labels: dict) -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_the_store_keeps_each_tenant_within_its_caps_oldest_out_first():
    from services.gateway.response_store import ResponseStore
    store = ResponseStore(max_entries=3, max_bytes=400)
    before = {cap: _value("tandem_responses_evicted_total", {"cap": cap}) for cap in ("entries", "bytes")}
    for i in range(5):  # small records: the entry cap bites
        await store.put("alice", f"resp_{i}", {"n": i})
    await store.put("bob", "resp_b", {"n": 0})   # another tenant: its own caps
    assert [await store.get("alice", f"resp_{i}") for i in range(5)] == [None, None, {"n": 2}, {"n": 3}, {"n": 4}]
    assert await store.get("bob", "resp_b") == {"n": 0}
    assert _value("tandem_responses_evicted_total", {"cap": "entries"}) == before["entries"] + 2
    await store.put("alice", "resp_big", {"text": "x" * 385})  # 396 bytes: the older ones go by bytes
    assert await store.get("alice", "resp_big") is not None and await store.get("alice", "resp_2") is None
    assert _value("tandem_responses_evicted_total", {"cap": "bytes"}) > before["bytes"]
    kept = [await store.get("alice", r) for r in store._ledgers["alice"]]
    assert sum(len(orjson_dumps(v)) for v in kept) <= 400 and {"text": "x" * 385} in kept
    with pytest.raises(ValueError):   # one record over the byte cap alone is not stored
        await store.put("alice", "resp_huge", {"text": "x" * 500})
    assert await store.delete("alice", "resp_big") and "resp_big" not in store._ledgers["alice"]
    assert _value("tandem_responses_stored", {"what": "records"}) == sum(len(v) for v in store._ledgers.values())


def orjson_dumps(obj) -> bytes:
    import orjson
    return orjson.dumps(obj)


@pytest.mark.parametrize("after", [0, 3])
def test_a_dropped_request_is_a_failed_response(served, backend, after):
    """A request the backend dropped ("abort"): response.failed when streamed (after text), a
    502 worker_lost otherwise — never a completed response with a cut text."""
    backend.drop_after = after
    with pytest.raises(openai.APIStatusError) as e:
        client(served).responses.create(model=MODEL, input="Hi")
    assert e.value.status_code == 502 and e.value.response.json()["error"]["code"] == "worker_lost"
    if after:
        events = list(client(served).responses.create(model=MODEL, input="Hi", stream=True))
        assert events[-2].type == "response.failed" and events[-2].response.error.code == "worker_lost"
        assert events[-1].type == "error"
        assert not any(ev.type in ("response.completed", "response.incomplete") for ev in events)


def test_a_bus_timeout_while_storing_is_tried_again(monkeypatch):
    """A clustered NATS server just lost: the store's listing or write times out once or twice
    while leaders are elected; the response is stored anyway, and a timeout that lasts is raised."""
    import nats.errors

    from services.gateway import response_store

    async def no_wait(_s):
        return None

    monkeypatch.setattr(response_store.asyncio, "sleep", no_wait)
    calls = []

    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise nats.errors.TimeoutError
        return "stored"

    assert asyncio.run(response_store.retried(flaky)) == "stored" and len(calls) == 3

    async def down():
        calls.append(1)
        raise nats.errors.TimeoutError

    calls.clear()
    with pytest.raises(nats.errors.TimeoutError):
        asyncio.run(response_store.retried(down))
    assert len(calls) == response_store.BUS_TRIES


def test_a_bus_that_cannot_store_holds_the_record_then_says_store_false_and_reads_are_503(served, backend,
                                                                                          monkeypatch):
    """JetStream without a quorum (2 of 3 NATS servers gone): the gateway holds what the bus does
    not take — the answer says ``"store": true`` and its next turn and GET find it here — and past
    the bound of what it holds the answer still goes out, saying ``"store": false``; a read or
    delete of what it does not hold is a 503 ``unavailable`` with Retry-After (it was a 500).
    (tests/integration/test_responses_held.py: the same on a real nats-server killed and back.)"""
    import nats.js.errors

    from services.gateway import response_store
    from services.gateway.response_store import ResponseStore

    class NoQuorum(ResponseStore):
        async def _store(self, *a):
            raise nats.js.errors.ServiceUnavailableError()

        async def _get(self, *a):
            raise nats.errors.TimeoutError()

    gw = served[0].app.state.gw
    kept, gw.responses = gw.responses, NoQuorum()
    try:
        r = client(served).responses.create(model=MODEL, input="Hi")
        assert r.status == "completed" and r.output_text == REPLY and r.store is True
        h = {"Authorization": "Bearer alice"}
        got = httpx.get(f"{served[0].url}/v1/responses/{r.id}", headers=h)
        assert got.status_code == 200 and got.json()["id"] == r.id
        nxt = client(served).responses.create(model=MODEL, input="And then?", previous_response_id=r.id)
        assert nxt.status == "completed" and nxt.previous_response_id == r.id
        monkeypatch.setattr(response_store, "HELD_MAX_BYTES", 0)           # nothing more held
        r = client(served).responses.create(model=MODEL, input="Hi")
        assert r.status == "completed" and r.output_text == REPLY and r.store is False
        events = list(client(served).responses.create(model=MODEL, input="Hi", stream=True))
        assert events[0].response.store is True and events[-1].type == "response.completed"
        assert events[-1].response.store is False
        assert client(served).responses.create(model=MODEL, input="Hi", store=False).store is False
        for method in ("GET", "DELETE"):
            got = httpx.request(method, f"{served[0].url}/v1/responses/resp_{'0' * 32}", headers=h)
            assert got.status_code == 503 and got.json()["error"]["code"] == "unavailable", got.text
            assert got.headers["retry-after"] == "5"
        with pytest.raises(openai.APIStatusError) as e:     # a next turn cannot be continued: 503 too
            client(served).responses.create(model=MODEL, input="again", previous_response_id=f"resp_{'1' * 32}")
        assert e.value.status_code == 503
    finally:
        gw.responses._held.clear()                          # (its writer stops at its next try)
        gw.responses = kept
