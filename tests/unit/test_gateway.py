"""The gateway's HTTP layer against a fake Backend, over a real uvicorn server.

The fake backend streams a fixed reply one byte-token at a time (deterministic), honours
max_tokens and stop strings, and can be told to fail (before the first token, mid-stream) or to
hang (for disconnect tests). Clients: the official ``openai`` client and httpx.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from services.gateway.app import GatewaySettings, create_app, draining_server
from services.gateway.backend import (
    NO_WORKERS, OVERLOADED, Backend, BackendError, GenerationRequest, InProcessBackend,
)
from shared.engine.sampling import RequestOutput, SamplingParams, TokenLogprob

MODEL = "fake-model"
REPLY = "Hello! I am a fake model."
EOS = 256
CACHED = 3


class FakeTokenizer:
    """Byte-level: token id = UTF-8 byte; 256 = <eos>."""
    vocab_size = 257
    eos_token_ids = {EOS}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        body = bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return body + ("" if skip_special_tokens else "<eos>" * sum(1 for i in ids if i == EOS))

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b"<eos>"

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if messages[-1]["role"] == "assistant" and add_generation_prompt:
            raise ValueError("the last message must not be the assistant's")
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


class FakeBackend:
    """A deterministic Backend: REPLY, one byte per step."""

    def __init__(self):
        self.model_name = MODEL
        self.max_context = 256
        self.tokenizer = FakeTokenizer()
        self.reset()

    def reset(self) -> None:
        self.requests: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.ready = True
        self.error: BackendError | None = None       # raised before the first output
        self.mid_error: BackendError | None = None   # raised after 3 outputs
        self.drop_after: int | None = None           # outputs sent before one that ends "abort" (dropped)
        self.hang_after = None                       # outputs sent before waiting forever (0 = none)
        self.endless = False                         # stream "x" every 2 ms until aborted
        self.endless_text = "x"                      # ... or this text a step
        self.sessions: dict[str, str] = {}          # update_session calls
        self.run_tier = ""                           # the tier the first output says it runs at (a router's)

    def health(self) -> tuple[bool, dict]:
        return self.ready, {"router": {"ready": True, "workers": 1},
                            "cpu-decode": {"ready": self.ready, "workers": int(self.ready)}}

    async def generate(self, req: GenerationRequest):
        self.requests.append(req)
        if self.error is not None:
            raise self.error
        sp = req.sampling
        while self.endless:
            if req.request_id in self.aborted:
                return
            yield RequestOutput(req.request_id, [120], self.endless_text, finished=False, num_output_tokens=1)
            await asyncio.sleep(0.002)
        stop_at = min((REPLY.index(s) for s in sp.stop if s in REPLY), default=len(REPLY))
        ids = list(REPLY[:stop_at].encode("utf-8"))  # the engine never emits a stop string
        for n, tid in enumerate(ids or [None], start=1):
            if self.hang_after is not None and n > self.hang_after:
                await asyncio.sleep(3600)
            if self.mid_error is not None and n > 3:
                raise self.mid_error
            if self.drop_after is not None and n > self.drop_after:
                yield RequestOutput(req.request_id, [], "", finished=True, finish_reason="abort",
                                    num_prompt_tokens=len(req.prompt_token_ids), num_output_tokens=n - 1)
                return
            finish = "stop" if n >= len(ids) else "length" if n >= sp.max_tokens else None
            lps = None
            if sp.logprobs and tid is not None:
                top = [(tid, -0.5), (tid + 1, -1.5), (tid + 2, float("-inf"))][: sp.top_logprobs]
                lps = [TokenLogprob(tid, -0.5, top)]
            yield RequestOutput(req.request_id, [] if tid is None else [tid], "" if tid is None else chr(tid),
                                finished=finish is not None, finish_reason=finish, logprobs=lps,
                                num_prompt_tokens=len(req.prompt_token_ids), num_cached_tokens=CACHED,
                                num_output_tokens=n if tid is not None else 0, tier=self.run_tier if n == 1 else "")
            await asyncio.sleep(0)
            if finish is not None:
                return

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def update_session(self, session_id: str, tier: str, owner: str = "public") -> dict:
        self.sessions[session_id] = tier
        return {"id": session_id, "object": "session", "tier": tier, "worker": "w", "running": [], "moved": []}


# ---- server ---------------------------------------------------------------------------------

class Server:
    def __init__(self, backend, settings: GatewaySettings | None = None):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(backend, settings)
        self.server = draining_server(self.app, settings or GatewaySettings(), log_level="warning")  # as served
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "Server":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def served():
    backend = FakeBackend()
    with Server(backend) as server:
        yield server, backend


@pytest.fixture
def backend(served) -> FakeBackend:
    served[1].reset()
    return served[1]


@pytest.fixture
def url(served, backend) -> str:
    return served[0].url


@pytest.fixture
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=10)


def chat_prompt_ids(messages: list[dict]) -> list[int]:
    tok = FakeTokenizer()
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def wait_for(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def still_serving(url: str) -> None:
    r = httpx.get(f"{url}/v1/models", timeout=5)
    assert r.status_code == 200, r.text


MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


# ---- the interface ---------------------------------------------------------------------------

def test_fake_and_in_process_backend_match_the_protocol():
    for cls in (FakeBackend, InProcessBackend):
        for name in ("health", "generate", "abort", "update_session"):
            proto = inspect.signature(getattr(Backend, name))
            impl = inspect.signature(getattr(cls, name))
            assert list(proto.parameters) == list(impl.parameters), (cls.__name__, name)
        assert inspect.iscoroutinefunction(cls.abort)
        assert inspect.isasyncgenfunction(cls.generate)
    assert isinstance(FakeBackend(), Backend)


# ---- happy paths -----------------------------------------------------------------------------

def test_models(client, url):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{url}/v1/models/nope").status_code == 404


def test_chat_non_streaming(client, backend):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=100)
    assert r.id.startswith("chatcmpl-") and len(r.id) == len("chatcmpl-") + 32
    assert r.object == "chat.completion" and r.model == MODEL
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == REPLY
    assert choice.finish_reason == "stop" and choice.logprobs is None
    prompt = chat_prompt_ids(MSGS)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(REPLY)
    assert r.usage.total_tokens == len(prompt) + len(REPLY)
    assert r.usage.prompt_tokens_details.cached_tokens == CACHED
    (req,) = backend.requests
    assert req.request_id == r.id and req.model == MODEL and req.prompt_token_ids == prompt
    assert req.tier == "standard" and req.session_id is None
    assert req.sampling.max_tokens == 100
    assert backend.aborted == []


def test_nulls_and_an_assistants_refusal_part_are_accepted(url, backend):
    """What OpenAI takes too: ``stream`` / ``ignore_eos`` null (clients send null for "not set"),
    an assistant turn of content parts with a refusal among them."""
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
            {"role": "user", "content": [{"type": "text", "text": "y"}]}]
    r = httpx.post(f"{url}/v1/chat/completions", json=_chat(messages=msgs, stream=None, ignore_eos=None), timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), r.text
    (req,) = backend.requests
    assert req.prompt_token_ids == chat_prompt_ids([{"role": "user", "content": "x"},
                                                    {"role": "assistant", "content": "I cannot."},
                                                    {"role": "user", "content": "y"}])


def test_chat_default_max_tokens_is_the_rest_of_the_context(client, backend):
    client.chat.completions.create(model=MODEL, messages=MSGS)
    assert backend.requests[0].sampling.max_tokens == backend.max_context - len(chat_prompt_ids(MSGS))


def test_deployment_defaults_fill_what_a_request_leaves_out():
    backend = FakeBackend()
    env = {"TANDEM_GENERATION_DEFAULTS": "max_tokens=7, temperature=0,repetition_penalty=1.25"}
    with Server(backend, GatewaySettings.from_env(env)) as server:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        c.chat.completions.create(model=MODEL, messages=MSGS)
        c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=9, temperature=0.5)  # the client's win
        r = c.responses.create(model=MODEL, input="hi")
        c.responses.create(model=MODEL, input="hi", extra_body={"repetition_penalty": 1.0}, store=False)
    assert [q.sampling.max_tokens for q in backend.requests] == [7, 9, 7, 7]
    assert backend.requests.pop().sampling.repetition_penalty == 1.0  # a request's own value wins
    assert [q.sampling.temperature for q in backend.requests] == [0, 0.5, 0] and r.temperature == 0
    assert {q.sampling.repetition_penalty for q in backend.requests} == {1.25}
    for bad, says in [("max_tokens=0", "max_tokens=0: must be an integer >= 1"),
                      ("temprature=0", "unknown parameter 'temprature'"), ("top_k=x", "top_k='x' is not an integer"),
                      ("temperature=3", r"temperature=3.0: must be in \[0, 2\]"), ("top_p=0", "top_p=0.0")]:
        with pytest.raises(ValueError, match=says):
            GatewaySettings.from_env({"TANDEM_GENERATION_DEFAULTS": bad})


def test_chat_streaming(client, backend):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, stream=True,
                                                 stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(REPLY)
    assert chunks[-1].usage.prompt_tokens == len(chat_prompt_ids(MSGS))
    assert chunks[-2] is finals[0]
    assert backend.aborted == []


def test_n_choices_have_their_own_requests_and_seeds(client, backend):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, n=3, seed=5, max_tokens=50)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.content == REPLY for c in r.choices)
    assert r.usage.completion_tokens == 3 * len(REPLY) and r.usage.prompt_tokens == len(chat_prompt_ids(MSGS))
    reqs = sorted(backend.requests, key=lambda q: q.request_id)
    assert [q.request_id for q in reqs] == [r.id, f"{r.id}-1", f"{r.id}-2"]
    assert reqs[0].sampling.seed == 5 and len({q.sampling.seed for q in reqs}) == 3
    backend.reset()
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, n=2, stream=True))
    text = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
    assert text == {0: REPLY, 1: REPLY}
    finals = [ch for c in chunks for ch in c.choices if ch.finish_reason]
    assert sorted(ch.index for ch in finals) == [0, 1] and backend.aborted == []


def test_openapi_describes_the_api(url):
    spec = httpx.get(f"{url}/openapi.json").json()
    assert spec["openapi"].startswith("3.") and "/v1/chat/completions" in spec["paths"]
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/ChatCompletionRequest")
    assert "tools" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]


def test_sse_framing(url):
    body = {"model": MODEL, "messages": MSGS, "stream": True, "max_tokens": 3}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [p["choices"][0]["delta"].get("content") for p in payloads[1:4]] == list(REPLY[:3])
    assert payloads[4]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert payloads[5]["choices"] == [] and payloads[5]["usage"]["completion_tokens"] == 3
    # usage always comes, include_usage or not (documented)
    assert "usage" in payloads[5] and len(payloads) == 6


def test_completions(client, backend):
    r = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=100)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].text == REPLY and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(b"Say hi") and r.usage.completion_tokens == len(REPLY)
    assert backend.requests[-1].prompt_token_ids == list(b"Say hi")

    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4)
    assert backend.requests[-1].prompt_token_ids == [5, 6, 7]
    assert r.usage.prompt_tokens == 3 and r.choices[0].text == REPLY[:4]


def test_completions_default_max_tokens_is_16(client, backend):
    r = client.completions.create(model=MODEL, prompt="x")
    assert backend.requests[-1].sampling.max_tokens == 16 and r.choices[0].finish_reason == "length"


def test_completions_streaming(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Say hi", max_tokens=6, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REPLY[:6]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_finish_reason_length(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == REPLY[:5] and r.usage.completion_tokens == 5


def test_stop_strings_reach_the_backend(client, backend):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, stop=["fake", "zzz"])
    assert backend.requests[-1].sampling.stop == ["fake", "zzz"]
    assert r.choices[0].message.content == "Hello! I am a " and r.choices[0].finish_reason == "stop"
    client.completions.create(model=MODEL, prompt="p", stop="!")
    assert backend.requests[-1].sampling.stop == ["!"]
    # an output a grammar constrains (a forced call, response_format) ends where its grammar does:
    # a stop string inside it cut the call away or left invalid JSON under finish_reason "stop"
    from services.gateway.openai_api import ChatCompletionRequest, sampling_params
    req = ChatCompletionRequest.model_validate(_chat(stop=["Paris", "x"]))
    guide = {"kind": "json_schema", "value": {"type": "object"}}
    assert sampling_params(req, 8, logprobs=False, top_logprobs=0).stop == ["Paris", "x"]
    assert sampling_params(req, 8, logprobs=False, top_logprobs=0, guide=guide).stop == []


def test_sampling_parameters_reach_the_backend(client, backend):
    client.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=0.3, top_p=0.9, seed=7, presence_penalty=0.5,
        frequency_penalty=-0.5, max_tokens=4, user="alice",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [9],
                    "ignore_eos": True})
    sp = backend.requests[-1].sampling
    assert sp == SamplingParams(max_tokens=4, temperature=0.3, top_p=0.9, top_k=20, min_p=0.05, seed=7,
                                presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                                stop_token_ids=[9], ignore_eos=True)


def test_chat_logprobs(client, backend):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, logprobs=True, top_logprobs=2)
    assert backend.requests[-1].sampling.logprobs and backend.requests[-1].sampling.top_logprobs == 2
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == list(REPLY[:4])
    for c, ch in zip(content, REPLY):
        assert c.logprob == -0.5 and c.bytes == list(ch.encode())
        assert [t.token for t in c.top_logprobs] == [ch, chr(ord(ch) + 1)]
        assert [t.logprob for t in c.top_logprobs] == [-0.5, -1.5]
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, logprobs=True,
                                                 top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == list(REPLY[:3])
    assert streamed[0].top_logprobs[2].logprob == -9999.0  # -inf is not JSON


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="p", max_tokens=3, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.tokens == list(REPLY[:3]) and lp.token_logprobs == [-0.5] * 3
    assert lp.top_logprobs == [{ch: -0.5} for ch in REPLY[:3]] and lp.text_offset == [0, 1, 2]


def test_logprobs_of_a_character_spelled_by_several_tokens():
    """A token inside a character: its own bytes (joined, the text; a decoded U+FFFD lost them),
    spelled as OpenAI does ("bytes:\\xf0..."); completions' text_offset counts the characters its
    tokens completed, and its top_logprobs always hold the sampled token (OpenAI: up to
    logprobs + 1 entries; with logprobs 0, that one)."""
    from services.gateway.openai_api import ChatFormat, CompletionFormat, TokenStrings
    ts = TokenStrings(FakeTokenizer())
    text = "a😀b"
    ids = list(text.encode())
    lps = [TokenLogprob(t, -0.5, [(t + 1, -0.25), (t, -0.5)]) for t in ids]
    content = ChatFormat("chatcmpl-x", MODEL, ts, 2).logprobs(lps)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == text.encode()
    assert [e["token"] for e in content] == ["a", "bytes:\\xf0", "bytes:\\x9f", "bytes:\\x98", "bytes:\\x80", "b"]
    comp = CompletionFormat("cmpl-x", MODEL, ts, 0).logprobs(lps)
    assert comp["text_offset"] == [0, 1, 1, 1, 1, 2]
    assert comp["top_logprobs"][0] == {"a": -0.5}
    comp = CompletionFormat("cmpl-x", MODEL, ts, 1).logprobs(lps)
    assert comp["top_logprobs"][0] == {"b": -0.25, "a": -0.5}


def test_the_sla_header_is_the_tier_the_request_ran_at(url, backend):
    """A session's tier change makes the router run a request at the session's tier: the
    X-Tandem-SLA header and the gateway's metrics say that tier, not the one asked for (they said
    "batch" for a turn that ran interactive on the GPU)."""
    from shared import metrics
    backend.run_tier = "interactive"
    try:
        for stream in (False, True):
            before = metrics.REQUESTS.labels("gateway", "interactive", "ok")._value.get()
            r = httpx.post(f"{url}/v1/chat/completions", json=_chat(sla="batch", stream=stream), timeout=10)
            assert r.status_code == 200 and r.headers["x-tandem-sla"] == "interactive", r.headers
            assert backend.requests[-1].tier == "batch"
            assert metrics.REQUESTS.labels("gateway", "interactive", "ok")._value.get() == before + 1
        backend.run_tier = ""                       # a backend that does not say: the request's tier
        r = httpx.post(f"{url}/v1/chat/completions", json=_chat(sla="batch"), timeout=10)
        assert r.headers["x-tandem-sla"] == "batch"
    finally:
        backend.run_tier = ""


def test_tier_and_session(url, client, backend):
    client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1,
                                   extra_headers={"X-Tandem-SLA": "interactive", "X-Tandem-Session": "s-1"})
    assert (backend.requests[-1].tier, backend.requests[-1].session_id) == ("interactive", "s-1")
    # body fields win over headers
    client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1,
                                   extra_headers={"X-Tandem-SLA": "interactive", "X-Tandem-Session": "s-1"},
                                   extra_body={"sla": "batch", "session_id": "s-2"})
    assert (backend.requests[-1].tier, backend.requests[-1].session_id) == ("batch", "s-2")
    client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1,     # one tier, two spellings
                                   extra_body={"sla": "Batch", "tier": "batch"})
    assert backend.requests[-1].tier == "batch"
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "p", "max_tokens": 1,
                                                  "tier": "interactive"})
    assert r.status_code == 200 and r.headers["x-tandem-sla"] == "interactive"
    assert backend.requests[-1].tier == "interactive"


def test_health(url, backend):
    r = httpx.get(f"{url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    assert r.json()["details"]["cpu-decode"]["ready"] is True
    backend.ready = False
    r = httpx.get(f"{url}/health")
    assert r.status_code == 503 and r.json()["details"]["cpu-decode"] == {"ready": False, "workers": 0}
    backend.ready = True
    assert httpx.get(f"{url}/health").status_code == 200


def test_tandem_health_checks_the_gateway_by_its_address(url, backend, capsys):
    """`tandem health --url http://host:port` (or .../health) checks the gateway's /health: it was
    a bare "HTTP Error 404" (only a service's /metrics was read)."""
    import argparse

    from services import health
    for u in (url, url + "/", url + "/health"):
        assert health.main(argparse.Namespace(url=u, timeout=3.0)) == 0, capsys.readouterr()
        assert "ready: gateway" in capsys.readouterr().out
    backend.ready = False
    try:
        assert health.main(argparse.Namespace(url=url, timeout=3.0)) == 1
        assert "not ready: gateway (HTTP 503; no ready cpu-decode)" in capsys.readouterr().err
    finally:
        backend.ready = True


# ---- errors ----------------------------------------------------------------------------------

def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": MSGS, **kw}


ERRORS = [
    # (name, path, body (bytes = raw), headers, status, param, code)
    ("malformed json", "/v1/chat/completions", b'{"model": "fake-model", "messages": [', {}, 400, None, "invalid_json"),
    ("not an object", "/v1/chat/completions", b"[1, 2]", {}, 400, None, "invalid_json"),
    # deeper than MAX_DEPTH (128): a schema 250 levels deep was a 500 (RecursionError keying the
    # grammar cache), one 129 deep could not be carried on the bus (orjson stops at 255 levels)
    ("nested too deep", "/v1/chat/completions",
     (b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": '
      b'"json_schema", "json_schema": {"name": "x", "schema": ' + b'{"properties": {"a": ' * 125 + b'{}'
      + b'}}' * 125 + b'}}}'), {}, 400, None, "invalid_json"),
    ("missing model", "/v1/chat/completions", {"messages": MSGS}, {}, 400, "model", "invalid_parameter"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, {}, 400, "messages", "invalid_parameter"),
    ("empty messages", "/v1/chat/completions", _chat(messages=[]), {}, 400, "messages", "invalid_parameter"),
    ("bad role", "/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "x"}]), {}, 400,
     "messages[0].role", "invalid_parameter"),
    ("image part", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), {}, 400,
     "messages[0].content[0]", "unsupported_parameter"),
    ("tool message without its call id", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}]), {}, 400,
     "messages[1].tool_call_id", "invalid_parameter"),
    # OpenAI: a tool message answers a call of an earlier assistant message (the Responses API checked)
    ("tool message answering no call", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
         {"role": "tool", "tool_call_id": "call_2", "content": "42"}]), {}, 400,
     "messages[2].tool_call_id", "invalid_parameter"),
    # strict types, as OpenAI's: no string for a number or a boolean, no number for a boolean
    ("max_tokens as a string", "/v1/chat/completions", _chat(max_tokens="5"), {}, 400, "max_tokens",
     "invalid_parameter"),
    ("n as a boolean", "/v1/chat/completions", _chat(n=True), {}, 400, "n", "invalid_parameter"),
    ("completion logprobs false", "/v1/completions", {"model": MODEL, "prompt": "p", "logprobs": False}, {}, 400,
     "logprobs", "invalid_parameter"),
    ("response_format without type", "/v1/chat/completions", _chat(response_format={}), {}, 400,
     "response_format.type", "invalid_parameter"),
    ("json_schema without name", "/v1/chat/completions",
     _chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}), {}, 400,
     "response_format.json_schema", "invalid_parameter"),
    ("tool_choice function not an object", "/v1/chat/completions",
     _chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": "f"}),
     {}, 400, "tool_choice", "invalid_parameter"),
    ("template error", "/v1/chat/completions", _chat(messages=[{"role": "assistant", "content": "x"}]), {}, 400,
     "messages", "invalid_parameter"),
    ("temperature type", "/v1/chat/completions", _chat(temperature="hot"), {}, 400, "temperature",
     "invalid_parameter"),
    ("temperature range", "/v1/chat/completions", _chat(temperature=-1), {}, 400, "temperature",
     "invalid_parameter"),
    ("temperature above 2", "/v1/chat/completions", _chat(temperature=2.5), {}, 400, "temperature",
     "invalid_parameter"),
    ("top_p range", "/v1/chat/completions", _chat(top_p=0), {}, 400, "top_p", "invalid_parameter"),
    ("stop type", "/v1/chat/completions", _chat(stop=[1]), {}, 400, "stop", "invalid_parameter"),
    ("max_tokens zero", "/v1/chat/completions", _chat(max_tokens=0), {}, 400, "max_tokens", "invalid_parameter"),
    ("top_logprobs without logprobs", "/v1/chat/completions", _chat(top_logprobs=2), {}, 400, "top_logprobs",
     "invalid_parameter"),
    ("top_logprobs range", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs",
     "invalid_parameter"),
    ("n=9", "/v1/chat/completions", _chat(n=9), {}, 400, "n", "invalid_parameter"),
    ("tool_choice unknown function", "/v1/chat/completions",
     _chat(tools=[{"type": "function", "function": {"name": "f"}}],
           tool_choice={"type": "function", "function": {"name": "g"}}), {}, 400, "tool_choice", "invalid_parameter"),
    ("bad tool", "/v1/chat/completions", _chat(tools=[{"type": "function"}]), {}, 400, "tools[0]", "invalid_parameter"),
    ("functions", "/v1/chat/completions", _chat(functions=[{"name": "f"}]), {}, 400, "functions",
     "unsupported_parameter"),
    ("response_format type", "/v1/chat/completions", _chat(response_format={"type": "xml"}), {}, 400,
     "response_format.type", "invalid_parameter"),
    ("unknown model", "/v1/chat/completions", _chat(model="gpt-5"), {}, 404, "model", "model_not_found"),
    ("too long", "/v1/chat/completions", _chat(max_tokens=250), {}, 400, "max_tokens", "context_length_exceeded"),
    ("long chat prompt (tokenized off the loop)", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "x" * 20000}]), {}, 400, "messages", "context_length_exceeded"),
    ("long completion prompt", "/v1/completions", {"model": MODEL, "prompt": "y" * 20000}, {}, 400, "prompt",
     "context_length_exceeded"),
    ("prompt alone too long", "/v1/completions", {"model": MODEL, "prompt": "x" * 300}, {}, 400, "prompt",
     "context_length_exceeded"),
    ("bad tier header", "/v1/chat/completions", _chat(), {"X-Tandem-SLA": "platinum"}, 400, "X-Tandem-SLA",
     "invalid_tier"),
    ("bad tier body", "/v1/chat/completions", _chat(sla="gold"), {}, 400, "sla", "invalid_tier"),
    ("sla and tier disagree", "/v1/chat/completions", _chat(sla="batch", tier="interactive"), {}, 400, "sla",
     "invalid_tier"),
    ("bad session", "/v1/chat/completions", _chat(session_id="has space"), {}, 400, "session_id",
     "invalid_session"),
    ("echo", "/v1/completions", {"model": MODEL, "prompt": "p", "echo": True}, {}, 400, "echo",
     "unsupported_parameter"),
    ("two prompts", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, {}, 400, "prompt",
     "unsupported_parameter"),
    ("token out of range", "/v1/completions", {"model": MODEL, "prompt": [1, 999]}, {}, 400, "prompt",
     "invalid_parameter"),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, {}, 400, "prompt", "invalid_parameter"),
    ("completion logprobs range", "/v1/completions", {"model": MODEL, "prompt": "p", "logprobs": 21}, {}, 400,
     "logprobs", "invalid_parameter"),
    ("unknown route", "/v1/embeddings", {"model": MODEL, "input": "x"}, {}, 404, None, "not_found"),
    # OpenAI: "Missing required parameter: 'messages[0].content'" (an assistant's may be only calls)
    ("user message without content", "/v1/chat/completions", _chat(messages=[{"role": "user"}]), {}, 400,
     "messages[0].content", "invalid_parameter"),
    ("tool message with null content", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c", "content": None}]), {},
     400, "messages[1].content", "invalid_parameter"),
]


def test_a_405_names_the_methods_allowed(url):
    """RFC 9110: a 405 response MUST carry an Allow header."""
    r = httpx.get(f"{url}/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("name,path,body,headers,status,param,code", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(url, backend, name, path, body, headers, status, param, code):
    for stream in (False, True):
        if isinstance(body, dict) and stream:
            body = {**body, "stream": True}
        elif stream:
            continue
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(f"{url}{path}", headers={**headers, "Content-Type": "application/json"}, timeout=10, **kw)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert (err["param"], err["code"]) == (param, code), err
        assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert backend.requests == [] and backend.aborted == []
    still_serving(url)


def test_a_body_that_is_not_utf8_json_says_why(url, backend):
    """A gzip-compressed body or one in another encoding: the 400 says so (orjson's own message
    was "str is not valid UTF-8: surrogates not allowed" for both)."""
    import gzip
    raw = json.dumps(_chat()).encode()
    for body, said in ((gzip.compress(raw), "gzip-compressed: send it uncompressed"),
                       ('{"model": "fake-model", "messages": [{"role": "user", "content": "café"}]}'.encode("latin-1"),
                        "not UTF-8 text (byte 69: b'\\xe9')")):
        r = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"},
                       timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        assert said in r.json()["error"]["message"] and "surrogates" not in r.text, r.text
    assert backend.requests == []


@pytest.mark.parametrize("body,param", [(_chat(stream="yes"), "stream"), (_chat(stream=1), "stream"),
                                        (_chat(stream_options={"include_usage": True}), "stream_options"),
                                        (_chat(stream=False, stream_options={}), "stream_options")])
def test_what_says_stream_is_checked_before_a_stream_starts(url, backend, body, param):
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert backend.requests == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("error,status,exc", [
    (BackendError(OVERLOADED, "too many requests in the batch tier", 429, retry_after=2.5), 429,
     openai.RateLimitError),
    (BackendError(NO_WORKERS, "no cpu-decode worker is ready", 503), 503, openai.InternalServerError),
])
def test_backend_errors_map_through(client, url, backend, stream, error, status, exc):
    backend.error = error
    with pytest.raises(exc) as info:
        client.chat.completions.create(model=MODEL, messages=MSGS, stream=stream)
    assert info.value.status_code == status
    body = info.value.response.json()["error"]
    assert (body["code"], body["message"]) == (error.code, error.message)
    assert info.value.response.headers.get("retry-after") == ("3" if error.retry_after else None)
    assert backend.aborted == []  # the backend ended it itself
    backend.error = None
    still_serving(url)


def test_mid_stream_error_is_an_sse_error_event(client, url, backend):
    backend.mid_error = BackendError("worker_lost", "the decode worker went away", 502)
    with pytest.raises(openai.APIError, match="the decode worker went away"):
        for _ in client.chat.completions.create(model=MODEL, messages=MSGS, stream=True):
            pass
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": MODEL, "prompt": "p", "stream": True}) as r:
        events = r.read().decode().split("\n\n")
    assert "data: [DONE]" not in events  # [DONE] would say the partial text is the whole answer
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == "worker_lost"
    r = httpx.post(f"{url}/v1/chat/completions", json=_chat(), timeout=10)
    assert r.status_code == 502 and r.json()["error"]["code"] == "worker_lost"  # not streamed yet: a status
    backend.mid_error = None
    still_serving(url)


@pytest.mark.parametrize("after", [0, 3])
def test_a_dropped_request_is_an_error_never_an_answer(client, url, backend, after):
    """A backend whose request ends "abort" (dropped, not by the client) — before any text or
    after some: the client gets worker_lost, never finish_reason "abort" nor a [DONE] after the
    partial text."""
    backend.drop_after = after
    r = httpx.post(f"{url}/v1/chat/completions", json=_chat(), timeout=10)
    assert r.status_code == 502 and r.json()["error"]["code"] == "worker_lost"
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "p"}, timeout=10)
    assert r.status_code == 502 and r.json()["error"]["code"] == "worker_lost"
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=_chat(stream=True), timeout=10) as r:
        status, events = r.status_code, [e for e in r.read().decode().split("\n\n") if e]
    if after == 0:  # nothing sent yet: a real status
        assert status == 502 and json.loads(events[0])["error"]["code"] == "worker_lost"
    else:
        payloads = [json.loads(e[len("data: "):]) for e in events]
        text = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads if p.get("choices"))
        assert status == 200 and text == REPLY[:after] and "data: [DONE]" not in events
        assert payloads[-1]["error"]["code"] == "worker_lost"
        assert not any(c.get("finish_reason") for p in payloads for c in p.get("choices", []))
        with pytest.raises(openai.APIError, match="dropped"):
            for _ in client.chat.completions.create(model=MODEL, messages=MSGS, stream=True):
                pass
    backend.drop_after = None
    still_serving(url)


def test_a_session_turn_counts_its_cached_and_computed_prompt_tokens(url, client, backend):
    from prometheus_client import REGISTRY

    def value(kind):
        return REGISTRY.get_sample_value("tandem_session_prompt_tokens_total", {"tier": "standard", "kind": kind}) or 0

    before = value("cached") + value("computed")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       extra_headers={"X-Tandem-Session": "s-metrics"})
    assert value("cached") + value("computed") == before + r.usage.prompt_tokens
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert value("cached") + value("computed") == before + r.usage.prompt_tokens   # not a session's turn


def test_each_endpoint_names_its_own_prompt_and_budget_fields(client, backend):
    """What a context error from the workers (the router's prompt_too_long) names as its param —
    the prompt or the output budget — in the endpoint's own words (NatsBackend maps the router's
    "prompt" / "max_tokens" through GenerationRequest.params)."""
    client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4)
    client.chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=4)
    client.completions.create(model=MODEL, prompt="p", max_tokens=4)
    client.responses.create(model=MODEL, input="hi", max_output_tokens=16, store=False)
    assert [r.params for r in backend.requests] == [("messages", "max_tokens"), ("messages", "max_completion_tokens"),
                                                    ("prompt", "max_tokens"), ("input", "max_output_tokens")]
