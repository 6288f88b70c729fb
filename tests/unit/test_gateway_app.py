"""The gateway in process (ASGI, no server): API keys and their tiers and tenants, the session
tier endpoint, settings from the environment, and the InProcessBackend over an engine. The
HTTP layer over a real server is tests/unit/test_gateway.py."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import openai
import pytest

from services.gateway import app as gateway_app
from services.gateway.app import GatewaySettings, create_app
from services.gateway.backend import BackendError, GenerationRequest, InProcessBackend
from services.gateway.handlers import key_tenant
from shared.engine.sampling import RequestOutput, SamplingParams
from tests.unit.test_gateway import MODEL, FakeBackend, FakeTokenizer, Server


# ---- auth and settings (in-process ASGI, no server) ---------------------------------------------

async def test_api_key():
    app = create_app(FakeBackend(), GatewaySettings(api_key="sekret"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        r = await http.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await http.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200
        assert (await http.get("/health")).status_code == 200  # health needs no key


async def test_api_keys_carry_default_tiers():
    backend = FakeBackend()
    app = create_app(backend, GatewaySettings(api_key="main", api_keys="agent=batch,human=interactive"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        for key, tier in (("main", "standard"), ("agent", "batch"), ("human", "interactive")):
            r = await http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200 and r.headers["x-tandem-sla"] == tier
        r = await http.post("/v1/chat/completions", json={**body, "tier": "interactive"},
                            headers={"Authorization": "Bearer agent"})
        assert r.headers["x-tandem-sla"] == "batch"   # the key's tier is a ceiling: never raised
        r = await http.post("/v1/chat/completions", json=body,
                            headers={"Authorization": "Bearer human", "X-Tandem-SLA": "batch"})
        assert r.headers["x-tandem-sla"] == "batch"   # ... a request may lower it
        r = await http.post("/v1/chat/completions", json={**body, "tier": "interactive"},
                            headers={"Authorization": "Bearer main"})
        assert r.headers["x-tandem-sla"] == "interactive"   # TANDEM_API_KEY has no ceiling
        r = await http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        # nor through a session: a batch key's session asked for interactive runs at batch
        r = await http.post("/v1/sessions/a-1", json={"tier": "interactive"}, headers={"Authorization": "Bearer agent"})
        assert r.status_code == 200 and r.json()["tier"] == "batch" and r.json()["id"] == "a-1"
        assert backend.sessions[f"{key_tenant('agent')}/a-1"] == "batch"
        r = await http.post("/v1/sessions/h-1", json={"tier": "batch"}, headers={"Authorization": "Bearer human"})
        assert backend.sessions[f"{key_tenant('human')}/h-1"] == "batch"   # lowered: as asked
        # the auth scheme is case-insensitive (RFC 7235); the key is not
        for auth, status in (("bearer agent", 200), ("BEARER agent", 200), ("Bearer AGENT", 401), ("agent", 401),
                             ("Basic agent", 401), ("Bearer", 401), ("", 401)):
            r = await http.get("/v1/models", headers={"Authorization": auth})
            assert r.status_code == status, auth
    with pytest.raises(ValueError, match="TANDEM_API_KEYS"):
        GatewaySettings(api_keys="k=gold").validate()


async def test_tenant_from_api_key_and_cache_salt():
    backend = FakeBackend()
    app = create_app(backend, GatewaySettings(api_keys="alice=standard,bob=standard"))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        for key, salt in (("alice", None), ("alice", None), ("bob", None), ("alice", "x"), ("alice", "y")):
            r = await http.post("/v1/chat/completions", json={**body, **({"cache_salt": salt} if salt else {})},
                                headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        for bad in ("", "s" * 1025, 7):
            r = await http.post("/v1/chat/completions", json={**body, "cache_salt": bad},
                                headers={"Authorization": "Bearer alice"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    tenants = [g.tenant for g in backend.requests]
    assert tenants[0] == tenants[1] and len(set(tenants)) == 4 and all(tenants)
    owners = [g.owner for g in backend.requests]
    assert owners[0] == owners[1] == owners[3] == owners[4] != owners[2] and "alice" not in owners[0]
    backend.reset()   # without API keys: one public tenant, as before; a salt still splits it
    app = create_app(backend, GatewaySettings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        for salt in (None, "x"):
            await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **({"cache_salt": salt} if salt else {})})
    assert [g.tenant for g in backend.requests][0] == "" and backend.requests[1].tenant


async def test_session_tier_endpoint():
    backend = FakeBackend()
    app = create_app(backend, GatewaySettings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        r = await http.post("/v1/sessions/agent-7", json={"tier": "Interactive"})
        assert r.status_code == 200 and r.json()["tier"] == "interactive" and r.json()["object"] == "session"
        assert backend.sessions == {"agent-7": "interactive"}
        for bad, param in (({"tier": "gold"}, "tier"), ({"tier": 3}, "tier"), ({"color": "red"}, "color"),
                           ([1], None),
                           # two names of one setting that disagree (the chat path's 400; it kept `tier`)
                           ({"tier": "batch", "sla": "interactive"}, "sla"),
                           ({"sla": "interactive", "tier": "batch"}, "sla")):
            r = await http.post("/v1/sessions/agent-7", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = await http.post("/v1/sessions/agent-7", json={"tier": "Interactive", "sla": "interactive"})
        assert r.status_code == 200 and r.json()["tier"] == "interactive"
        r = await http.post("/v1/sessions/agent-7", content=b"{not json")
        assert r.status_code == 400
    assert backend.sessions == {"agent-7": "interactive"}


def test_settings_from_env():
    s = GatewaySettings.from_env({"TANDEM_PORT": "9001", "TANDEM_DEFAULT_TIER": "batch"})
    assert (s.port, s.default_tier, s.host) == (9001, "batch", "127.0.0.1")
    assert GatewaySettings.from_env({"TANDEM_PORT": "9001"}, port=9002).port == 9002
    with pytest.raises(ValueError, match="TANDEM_PORT"):
        GatewaySettings.from_env({"TANDEM_PORT": "http"})
    with pytest.raises(ValueError, match="TANDEM_DEFAULT_TIER"):
        GatewaySettings.from_env({"TANDEM_DEFAULT_TIER": "gold"})
    assert gateway_app.GatewaySettings().port == 8000
    parser = argparse.ArgumentParser()
    gateway_app.add_arguments(parser)
    s = gateway_app.settings_from_args(parser.parse_args(["--port", "9100", "--default-tier", "interactive"]))
    assert (s.port, s.default_tier, s.api_key) == (9100, "interactive", None)


# ---- InProcessBackend -------------------------------------------------------------------------------

class _FakeEngine:
    """The surface of shared.engine.async_engine.AsyncEngine that InProcessBackend uses."""

    def __init__(self):
        self.tokenizer = FakeTokenizer()
        self.max_context = 128
        self.calls: list = []
        self.tenants: list[str] = []
        self.aborted: list[str] = []
        self.tags: list[tuple] = []

    def tag_session(self, request_id, session, retention=""):
        self.tags.append((request_id, session, retention))

    async def generate(self, request_id, prompt_token_ids, params, priority=1, tenant=""):
        self.calls.append((request_id, prompt_token_ids, params, priority))
        self.tenants.append(tenant)
        yield RequestOutput(request_id, [72], "H", finished=True, finish_reason="length",
                            num_prompt_tokens=len(prompt_token_ids), num_output_tokens=1)

    async def abort(self, request_id):
        self.aborted.append(request_id)


async def test_in_process_backend_adapts_the_engine():
    engine = _FakeEngine()
    b = InProcessBackend(engine, MODEL)
    assert (b.max_context, b.tokenizer, b.health()[0]) == (128, engine.tokenizer, True)
    req = GenerationRequest("cmpl-1", MODEL, [1, 2], SamplingParams(max_tokens=1), "interactive", "s")
    outs = [o async for o in b.generate(req)]
    assert [o.text for o in outs] == ["H"]
    assert engine.calls == [("cmpl-1", [1, 2], req.sampling, 0)]
    await b.abort("cmpl-1")
    assert engine.aborted == ["cmpl-1"]


async def test_in_process_backend_binds_sessions_to_their_owner():
    engine = _FakeEngine()
    b = InProcessBackend(engine, MODEL)
    assert (await b.update_session("s", "batch", "alice"))["tier"] == "batch"
    with pytest.raises(BackendError) as e:
        await b.update_session("s", "interactive", "bob")
    assert (e.value.status, e.value.code) == (404, "not_found")
    req = GenerationRequest("cmpl-1", MODEL, [1, 2], SamplingParams(max_tokens=1), "interactive", "s", "t-bob", "bob")
    [o async for o in b.generate(req)]   # bob's request with alice's session id: not at her session's tier
    assert engine.calls[-1][3] == 0 and engine.tenants == ["t-bob"]


def test_in_process_backend_with_the_real_engine():
    """The gateway over the real engine and the bundled model; skipped only while
    shared.engine.async_engine cannot be imported."""
    async_engine = pytest.importorskip("shared.engine.async_engine")
    from shared.engine.engine import Engine, EngineConfig

    engine = async_engine.AsyncEngine(Engine.from_path(None, EngineConfig(threads=1, max_context=1024)))
    backend = InProcessBackend(engine)
    tok = engine.tokenizer
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    try:
        with Server(backend) as server:
            c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
            assert [m.id for m in c.models.list().data] == [backend.model_name]
            r = c.chat.completions.create(model=backend.model_name, messages=msgs, max_tokens=8, temperature=0)
            prompt = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
            assert r.usage.prompt_tokens == len(prompt)
            assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
            chunks = list(c.chat.completions.create(model=backend.model_name, messages=msgs, max_tokens=8,
                                                    temperature=0, stream=True))
            streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert streamed == r.choices[0].message.content and chunks[-1].usage.completion_tokens == 8
            with pytest.raises(openai.BadRequestError) as info:
                c.completions.create(model=backend.model_name, prompt="x", max_tokens=2000)
            assert info.value.code == "context_length_exceeded"
    finally:
        asyncio.run(engine.close())


async def test_a_session_id_is_each_key_s_own():
    """Sessions belonged to the first key that named them: another key could claim ``agent-1``
    before its owner did (POST /v1/sessions/agent-1), and the owner's tier changes were 404 from
    then on. Each key has its own namespace now; without keys ids are as given."""
    backend = FakeBackend()
    app = create_app(backend, GatewaySettings(api_keys="alice=interactive,bob=interactive"))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    alice, bob = ({"Authorization": f"Bearer {k}"} for k in ("alice", "bob"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        r = await http.post("/v1/sessions/agent-1", json={"tier": "batch"}, headers=bob)     # bob first
        assert r.status_code == 200 and r.json()["id"] == "agent-1"
        r = await http.post("/v1/sessions/agent-1", json={"tier": "interactive"}, headers=alice)
        assert r.status_code == 200 and r.json()["tier"] == "interactive"
        for h in (alice, bob):
            r = await http.post("/v1/chat/completions", json=body, headers={**h, "X-Tandem-Session": "agent-1"})
            assert r.status_code == 200
        ids = [q.session_id for q in backend.requests[-2:]]
        assert ids == [f"{key_tenant('alice')}/agent-1", f"{key_tenant('bob')}/agent-1"]
        assert backend.sessions == {ids[0]: "interactive", ids[1]: "batch"}
    keyless = FakeBackend()
    app = create_app(keyless, GatewaySettings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        await http.post("/v1/chat/completions", json={**body, "session_id": "agent-1"})
    assert keyless.requests[-1].session_id == "agent-1"
