"""Tenant isolation through the whole stack (docs/security.md): `tandem up` with API keys and a
KV pool on a real nats-server, the official openai client over HTTP, a bus client of the test's
own in the attacker's seat.

- one key's cached prefix (engine prefix cache and pool) is never another key's: ``cached_tokens``
  0 and the KV computed afresh; ``cache_salt`` splits within a key;
- a pool entry written without the deployment's secret (a bus client that is not a worker) is
  ignored, counted, and the output is what a clean computation gives;
- a key capped at ``batch`` asking for ``interactive`` runs as batch (a request may lower its tier);
- another key's session update is 404;
- one key's flood does not hold another key's request at the end of the engine's queue.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
import uuid

import httpx
import openai
import pytest

from kvpool.codec import Codec, pack_entries
from kvpool.keys import chunk_keys_from_seed
from services.gateway.handlers import cache_tenant, key_tenant
from shared import subjects
from shared.bus import Bus
from shared.engine.kv_cache import KVLayout
from shared.kv_connector import send_and_report
from shared.schemas import Heartbeat, PoolLookup, PoolPut, RoutePlan
from shared.settings import Settings
from shared.transfer import make_transport
from tests.e2e.test_stack import running_stack

pytestmark = pytest.mark.timeout(600)

CHUNK = 16                      # pool chunk tokens: short prompts reach the pool
KEYS = {"alice": "interactive", "bob": "interactive", "carol": "interactive", "capped": "batch"}
ARGS = ["--prefill", "0", "--gpu-decode", "0", "--kvpool", "1"]
PROMPT = [100 + (i * 37) % 4000 for i in range(3 * CHUNK + 5)]    # token ids: 3 whole chunks and a tail
SLOTS = 4                       # the decode engine's sequence slots: a flood of 16 queues


@pytest.fixture(scope="module")
def stack(nats_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    env = {"TANDEM_API_KEYS": ",".join(f"{k}={t}" for k, t in KEYS.items()),
           "TANDEM_POOL_DIR": str(tmp / "pool"), "TANDEM_POOL_CHUNK_TOKENS": str(CHUNK),
           "TANDEM_POOL_KEY_FILE": str(tmp / "pool.key"), "TANDEM_DATA_KEY_FILE": str(tmp / "data.key"),
           "TANDEM_POOL_TIMEOUT": "60", "TANDEM_MAX_SEQS": str(SLOTS)}
    with running_stack(nats_server, ARGS, env) as s:
        s.key_file = tmp / "pool.key"
        s.data_key_file = tmp / "data.key"
        yield s


def client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(stack) -> str:
    return client(stack, "alice").models.list().data[0].id


def ask(stack, model: str, key: str, prompt, **extra):
    """A greedy completion as ``key``: (text, cached prompt tokens, raw response headers)."""
    raw = client(stack, key).completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra or None)
    r = raw.parse()
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens, raw.headers


async def bus_call(url: str, fn):
    bus = await Bus.connect(url=url, name=f"test-tenants-{uuid.uuid4().hex[:6]}")
    try:
        return await fn(bus)
    finally:
        await bus.close()


async def worker_scope(bus: Bus) -> Heartbeat:
    """A decode worker's heartbeat: its chunk key scope and metrics port."""
    beats = await bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, skip_invalid=True)
    try:
        while True:
            beat = await beats.next(timeout=30)
            if beat.role.endswith("decode") and beat.kv_scope:
                return beat
    finally:
        await beats.unsubscribe()


def pool_hits(url: str, keys: list[str]) -> int:
    async def go(bus):
        return (await bus.request(subjects.POOL_LOOKUP, PoolLookup(keys=keys), timeout=30)).hits
    return asyncio.run(bus_call(url, go))


def prompt_keys(url: str, ids: list[int], tenant: str) -> tuple[list[str], Heartbeat]:
    beat = asyncio.run(bus_call(url, worker_scope))
    return chunk_keys_from_seed(beat.kv_scope, beat.chunk_tokens, ids, len(ids) - 1, tenant), beat


def test_pool_secret_file_is_created_private(stack):
    mode = stat.S_IMODE(os.stat(stack.key_file).st_mode)
    assert mode == 0o600 and len(stack.key_file.read_text().strip()) == 64


def wait_for(cond, why: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, why
        time.sleep(0.3)


def test_tenant_does_not_reuse_another_tenants_kv(stack, nats_server, model):
    text_a, cached, _ = ask(stack, model, "alice", PROMPT)
    assert cached == 0
    again, cached_again, _ = ask(stack, model, "alice", PROMPT)
    assert again == text_a and cached_again >= CHUNK  # the same key reuses its prefix
    # alice's prefix is in the pool (written back) under alice's keys, not under bob's
    alice_keys, _ = prompt_keys(nats_server, PROMPT, cache_tenant(key_tenant("alice"), None))
    bob_keys, _ = prompt_keys(nats_server, PROMPT, cache_tenant(key_tenant("bob"), None))
    wait_for(lambda: pool_hits(nats_server, alice_keys) == len(alice_keys), "alice's chunks not in the pool")
    assert pool_hits(nats_server, bob_keys) == 0
    # bob: neither the worker's prefix cache nor the pool gives him alice's KV; the same greedy text
    text_b, cached_b, _ = ask(stack, model, "bob", PROMPT)
    assert cached_b == 0 and text_b == text_a
    # cache_salt splits one key's cache further
    _, cached_salted, _ = ask(stack, model, "alice", PROMPT, cache_salt="project-x")
    assert cached_salted == 0
    text_salted, cached_salted, _ = ask(stack, model, "alice", PROMPT, cache_salt="project-x")
    assert cached_salted >= CHUNK and text_salted == text_a


def forge(url: str, keys: list[str], chunk_bytes: int, data_key_file) -> int:
    """Write zero KV under ``keys`` into the pool as a bus client without the pool secret (it holds
    the data-plane key: the pool takes its frames); the pool's hits after."""
    async def go(bus):
        found = await bus.request(subjects.POOL_LOOKUP, PoolLookup(keys=keys), timeout=30)
        entries = [Codec().encode(k, bytes(chunk_bytes)) for k in keys]
        sender = make_transport(Settings.from_env({"TANDEM_DATA_KEY_FILE": str(data_key_file)}).data).sender()
        try:
            tid = f"forged-{uuid.uuid4().hex[:8]}"
            res = await send_and_report(bus, sender, "attacker", found.data_host, found.data_port, tid,
                                        pack_entries(entries), compressible=False)
            await bus.request(subjects.kvpool_put(found.pool_id), PoolPut(
                keys=keys, transfer_id=tid, nbytes=res.nbytes, checksum=res.checksum), timeout=30)
        finally:
            await sender.close()
        return (await bus.request(subjects.POOL_LOOKUP, PoolLookup(keys=keys), timeout=30)).hits
    return asyncio.run(bus_call(url, go))


def forged_count(metrics_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("tandem_pool_forged_entries_total"))


def test_pool_entry_without_the_secret_is_ignored(stack, nats_server, model, bundled_model):
    prompt = [PROMPT[0] + 1, *PROMPT[1:]]   # a prompt no one ran yet
    keys, beat = prompt_keys(nats_server, prompt, cache_tenant(key_tenant("carol"), None))
    cfg = bundled_model.config
    chunk_bytes = CHUNK * KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim).token_bytes
    before = forged_count(beat.metrics_port)
    assert forge(nats_server, keys, chunk_bytes, stack.data_key_file) == len(keys)   # the pool took them (it has no secret)
    text, cached, _ = ask(stack, model, "carol", prompt)
    assert cached == 0                                          # the worker did not load them
    assert forged_count(beat.metrics_port) > before             # ... and counted them
    clean, _, _ = ask(stack, model, "carol", prompt, cache_salt="clean")  # out of reach of the forged keys
    assert text == clean


def test_key_tier_is_a_ceiling(stack, nats_server, model):
    async def go():
        bus = await Bus.connect(url=nats_server, name="test-tenants-plans")
        plans = await bus.subscribe(subjects.ROUTER_DECISION, RoutePlan, skip_invalid=True)
        try:
            asked = await asyncio.to_thread(ask, stack, model, "capped", PROMPT[:8], tier="interactive")
            lowered = await asyncio.to_thread(ask, stack, model, "alice", PROMPT[:8], sla="batch")
            seen = {}
            while not {asked[2]["x-request-id"], lowered[2]["x-request-id"]} <= seen.keys():
                p = await plans.next(timeout=30)
                seen[p.request_id] = p.tier
            return asked[2], lowered[2], seen
        finally:
            await bus.close()

    capped, lowered, plans = asyncio.run(go())
    assert capped["x-tandem-sla"] == "batch" and plans[capped["x-request-id"]] == "batch"
    assert lowered["x-tandem-sla"] == "batch" and plans[lowered["x-request-id"]] == "batch"


def test_a_session_id_is_each_key_s_own(stack, model):
    """Two keys naming the same session id have two sessions: bob's tier changes and requests never
    touch alice's session (they were 404 once alice had it — and a key that named an id first
    could keep its owner from ever changing its tier)."""
    sid = f"agent-{uuid.uuid4().hex[:8]}"
    update = lambda key, tier: client(stack, key).post(f"/sessions/{sid}", body={"tier": tier},  # noqa: E731
                                                       cast_to=object)
    bob = update("bob", "batch")                                      # bob names it first
    assert bob["id"] == sid and bob["tier"] == "batch"
    text, _, _ = ask(stack, model, "alice", PROMPT[:8], session_id=sid)
    assert text
    assert update("alice", "interactive")["tier"] == "interactive"   # hers to change
    ask(stack, model, "bob", PROMPT[:8], session_id=sid)
    assert update("bob", "batch")["tier"] == "batch"
    alice = update("alice", "interactive")
    assert alice["tier"] == "interactive" and alice["id"] == sid


async def test_one_key_s_flood_does_not_queue_another_key_s_request_behind_it(stack, nats_server, model):
    """Alice sends 16 requests to an engine with 4 sequence slots; once 8 of them are queued there,
    Bob sends one: it starts at the next free slots, with the first of alice's queued ones — its
    first token among the first 2 x 4 (alice's 4 running, then the 4 slots they free: her
    requests are alike and end together, so bob's first token comes in the same step as 3 of
    hers, in any order) — not after all 12 (docs/routing.md: the queue is shared fairly between
    keys; TANDEM_FAIR_TENANTS=0 gives the arrival order: 16th). Counting only the first tokens
    after the queue was seen full was timing-dependent: a heartbeat can say 8 queued before the
    client has the running ones' first tokens (it failed 2 of 4 runs on an idle machine)."""
    firsts: list[str] = []
    beats: dict[str, Heartbeat] = {}

    async def one(key: str, tag: str, tokens: int) -> None:
        c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=300)
        stream = await c.completions.create(model=model, prompt=f"[{tag}] Tell me about boat {tag}.",
                                            max_tokens=tokens, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
        async for ch in stream:
            if ch.choices and ch.choices[0].text and tag not in firsts:
                firsts.append(tag)
        await c.close()

    bus = await Bus.connect(url=nats_server, name="test-tenants-fair")
    sub = await bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, skip_invalid=True)

    async def watch():
        async for b in sub:
            beats[b.worker_id] = b
    watcher = asyncio.create_task(watch())
    try:
        # long enough that no running one ends while bob's request is on its way (under load: a
        # full test run beside two other stacks, 48 tokens let 3 end first)
        flood = [asyncio.create_task(one("alice", f"a{i}", 128)) for i in range(16)]
        deadline = time.monotonic() + 60
        while not any(b.role == subjects.CPU_DECODE and b.queue_depth >= 8 for b in beats.values()):
            assert time.monotonic() < deadline, beats
            await asyncio.sleep(0.02)
        await one("bob", "b", 4)
        await asyncio.gather(*flood)
        assert firsts.index("b") < 2 * SLOTS, firsts
    finally:
        watcher.cancel()
        await bus.close()
