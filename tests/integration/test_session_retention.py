"""A session's KV survives its tool pauses (shared/engine/retention.py) on the real bundled model:
resident between turns while other work takes the cache, evicted after it, and then written to
the KV pool (a real pool service on a real NATS) and loaded by the next turn instead of computed —
the same greedy output as computing it."""

from __future__ import annotations

import asyncio

import pytest

from services.kvpool import PoolService
from shared.engine.engine import Completion, Engine, EngineConfig, run_to_completion
from shared.engine.sampling import SamplingParams
from shared.bus import Bus
from shared.kv_connector import PoolClient, key_scope
from shared.settings import DataPlaneSettings, NatsSettings, PoolSettings, Settings
from shared.transfer import make_transport
from tests.integration.test_kvpool_service import beat

pytestmark = pytest.mark.timeout(180)
TEXT = ("The agent ran the test suite; three tests failed in the parser module, each on an empty "
        "input line, and the log shows the same stack trace for all of them. ")


def greedy(n: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def session_engine(bundled_model, blocks: int = 24) -> Engine:
    return Engine(bundled_model, EngineConfig(num_kv_blocks=blocks, threads=1, session_retention_s=600.0))


def turn(e: Engine, rid: str, ids: list[int], session: str = "", priority: int = 1, n: int = 16) -> Completion:
    if session:
        e.residency.tag(rid, session)
    return run_to_completion(e, {rid: (ids, greedy(n))}, priority)[rid]


def batch_flood(e: Engine, tok, tokens: int, k: int = 0, priority: int = 2) -> None:
    """A fresh prompt (no session; batch unless ``priority``) that takes ``tokens`` of KV."""
    words = [f"item{k}-{i}" for i in range(tokens)]
    ids = tok.encode(" ".join(words), add_special_tokens=False)[:tokens - 8]
    run_to_completion(e, {f"flood-{k}": (ids, greedy(4))}, priority=priority)


def test_a_session_stays_resident_under_a_flood_then_is_spilled_last(bundled_model):
    e = session_engine(bundled_model)
    tok = e.tokenizer
    spilled = []
    e.spill_hook = lambda tokens, kv, tenant, retention, session: spilled.append((tokens, kv, session))
    ids = tok.encode(TEXT * 2, add_special_tokens=False)[:70]
    first = turn(e, "t1", ids, session="agent-1")
    conversation = ids + first.token_ids
    held = e.cached_prefix_tokens(conversation)
    assert held == (len(conversation) - 1) // 16 * 16 == 80          # prompt and reply, whole blocks
    assert e.stats()["sessions_resident"] == 1
    # other work's blocks go first: 24 blocks, 5 held, a 300-token prompt needs 19 (batch, standard)
    batch_flood(e, tok, 300, 0)
    batch_flood(e, tok, 300, 1, priority=1)
    assert e.cached_prefix_tokens(conversation) == held and not spilled
    # the next turn continues it: every held block reused
    nxt = conversation + tok.encode(" The fix is in the tokenizer.", add_special_tokens=False)
    second = turn(e, "t2", nxt, session="agent-1")
    assert second.num_cached_tokens == held
    # a flood larger than what is free: the session goes, its KV handed over before reuse
    longer = nxt + second.token_ids
    before = e.read_blocks(e.blocks.match_prefix(longer, len(longer)))
    batch_flood(e, tok, 24 * 16 - 16, 2)
    assert len(spilled) == 1 and e.stats()["sessions_evicted"] == 1 and e.stats()["sessions_resident"] == 0
    tokens, kv, session = spilled[0]
    assert session == "agent-1" and tokens == longer[:len(tokens)] and len(tokens) == (len(longer) - 1) // 16 * 16
    assert kv == before


def test_without_a_session_the_flood_takes_the_blocks(bundled_model):
    """The same turn with no session: its blocks are ordinary cache, reused by a large prompt."""
    e = session_engine(bundled_model)
    tok = e.tokenizer
    ids = tok.encode(TEXT * 2, add_special_tokens=False)[:70]
    first = turn(e, "t1", ids)
    conversation = ids + first.token_ids
    batch_flood(e, tok, 24 * 16 - 16, 0, priority=1)             # the whole cache but one block
    assert e.cached_prefix_tokens(conversation) < 80


def test_sessions_evicted_by_tier_then_idle_time(bundled_model):
    e = session_engine(bundled_model, blocks=20)
    tok = e.tokenizer
    spilled = []
    e.spill_hook = lambda tokens, kv, tenant, retention, session: spilled.append(session)
    base = tok.encode(TEXT * 3, add_special_tokens=False)
    turn(e, "i", [11] + base[:40], session="interactive", priority=0)
    turn(e, "b", [12] + base[:40], session="batch", priority=2)
    turn(e, "s1", [13] + base[:40], session="standard-old", priority=1)
    turn(e, "s2", [14] + base[:40], session="standard-new", priority=1)
    assert e.stats()["sessions_resident"] == 4
    for k in range(3):
        batch_flood(e, tok, 20 * 16 - 16, k)
    assert spilled[:3] == ["batch", "standard-old", "standard-new"]


async def test_an_evicted_session_is_reloaded_from_the_pool(bundled_model, nats_server, tmp_path):
    """The spilled session's whole blocks go to a real pool service (RAM tier first); the next
    turn's prompt finds them (chunks and the session's tail) and loads them: cached, not computed,
    and the same greedy output as a cold engine computing the whole prompt."""
    s = Settings(nats=NatsSettings(url=nats_server), data=DataPlaneSettings(timeout=10.0),
                 pool=PoolSettings(dir=str(tmp_path / "pool"), ram_mb=64, chunk_tokens=64, codec="raw", timeout=10.0))
    pool = PoolService(s)
    await pool.start()
    e = session_engine(bundled_model)
    bus = await Bus.connect(s, name="worker-spill")
    transport = make_transport(s.data)
    rx = transport.receiver()
    host, port = await rx.listen()
    await beat(bus, "worker-spill", host, port)
    c = PoolClient(bus, s.pool, key_scope(e.model_identity, e.layout.to_dict(), s.pool), e.layout, "worker-spill",
                   transport.sender(), rx, host, port)
    try:
        tok = e.tokenizer
        spilled = []
        e.spill_hook = lambda tokens, kv, tenant, retention, session: spilled.append((tokens, kv))
        ids = tok.encode(TEXT * 2, add_special_tokens=False)[:70]
        first = turn(e, "t1", ids, session="agent-1", n=27)   # 96 tokens computed: 6 blocks
        batch_flood(e, tok, 24 * 16 - 16, 0)                       # evicts it
        assert len(spilled) == 1
        tokens, kv = spilled[0]
        assert len(tokens) == 96 and tokens == (ids + first.token_ids)[:96]
        assert await c.store(tokens, kv, session=True) == 2       # one 64-token chunk and a 32-token tail
        assert pool.pool.tiers[0].name == "ram" and len(pool.pool.tiers[0]) == 2

        nxt = ids + first.token_ids + tok.encode(" Next: rerun the parser tests.", add_special_tokens=False)
        assert e.cached_prefix_tokens(nxt) < 96                    # the flood overwrote its blocks
        got = await c.fetch_prefix(nxt)
        assert got is not None and got[0] == tokens and bytes(got[1]) == kv and c.reloads == 1
        warm = Engine(bundled_model, EngineConfig(num_kv_blocks=24, threads=1))
        warm.add("t2", nxt, greedy(), prefix=(got[0], bytes(got[1])))
        out = Completion("t2")
        while warm.has_work():
            for o in warm.step():
                out.add(o)
        cold = run_to_completion(Engine(bundled_model, EngineConfig(num_kv_blocks=24, threads=1)),
                                 {"t2": (nxt, greedy())})["t2"]
        assert out.num_cached_tokens == 96 and cold.num_cached_tokens == 0
        assert out.token_ids == cold.token_ids
    finally:
        await c.close()
        await bus.close()
        await rx.close()
        await pool.close()
        await asyncio.sleep(0)


@pytest.mark.slow   # two decode workers and a pool started: 90 s on a loaded 2-core machine
async def test_a_workers_evicted_session_is_reloaded_by_its_next_turn(bundled_model, nats_server, tmp_path):
    """Through real decode workers (GenerateRequest on a real NATS, a pool service, the data plane):
    the worker tags a session's turn, keeps its KV resident, spills it to the pool when a flood
    needs the blocks, and the next turn — on another worker — loads it (cached_tokens), the same
    greedy output as computing it. Counted in tandem_sessions_evicted / _reloaded."""
    import uuid

    from prometheus_client import REGISTRY

    from services.decode import DecodeWorker
    from shared import subjects
    from shared.settings import WorkerSettings
    from tests.integration.test_migration import Stream

    def cfg(wid: str) -> Settings:
        return Settings(nats=NatsSettings(url=nats_server), data=DataPlaneSettings(timeout=10.0),
                        pool=PoolSettings(dir=str(tmp_path / "pool"), ram_mb=64, chunk_tokens=64, timeout=10.0),
                        worker=WorkerSettings(worker_id=wid, threads=1, kv_blocks=24, heartbeat_interval=0.3,
                                              metrics_port=-1, session_retention_s=600.0))

    def count(name: str, role: str) -> float:
        return REGISTRY.get_sample_value(name, {"service": role}) or 0.0

    tag = uuid.uuid4().hex[:6]
    pool = PoolService(cfg(f"pool-{tag}"))
    await pool.start()
    a, b = DecodeWorker(cfg(f"ret-a-{tag}"), subjects.CPU_DECODE), DecodeWorker(cfg(f"ret-b-{tag}"), subjects.GPU_DECODE)
    for w in (a, b):
        await w.start()
    bus = await Bus.connect(url=nats_server, name="retention-test")
    try:
        for _ in range(100):   # the pool sends gets only to workers whose heartbeats it has seen
            if all(w.worker_id in pool.peers.roles for w in (a, b)):
                break
            await asyncio.sleep(0.1)
        tok = a.engine.engine.tokenizer
        ids = tok.encode(TEXT * 2, add_special_tokens=False)[:70]
        evicted, reloaded = count("tandem_sessions_evicted_total", "cpu-decode"), \
            count("tandem_sessions_reloaded_total", "gpu-decode")
        t1 = await (await Stream(bus, f"t1-{tag}").start(a, ids, 27, session="agent-9")).finish()
        reply = [t for c in sorted(t1, key=lambda c: c.seq) for t in c.token_ids]
        assert a.engine.stats()["sessions_resident"] == 1
        words = " ".join(f"item{i}" for i in range(400))
        flood = tok.encode(words, add_special_tokens=False)[:24 * 16 - 20]
        await (await Stream(bus, f"flood-{tag}").start(a, flood, 4)).finish()
        for _ in range(100):   # the spill's write-back runs in the background
            if count("tandem_sessions_evicted_total", "cpu-decode") > evicted and pool.stored >= 2:
                break
            await asyncio.sleep(0.1)
        assert count("tandem_sessions_evicted_total", "cpu-decode") == evicted + 1 and pool.stored >= 2
        nxt = ids + reply + tok.encode(" Next: rerun the parser tests.", add_special_tokens=False)
        t2 = await (await Stream(bus, f"t2-{tag}").start(b, nxt, 8, session="agent-9")).finish()
        last = max(t2, key=lambda c: c.seq)
        assert last.usage["cached_tokens"] == 96 and count("tandem_sessions_reloaded_total", "gpu-decode") == reloaded + 1
        cold = run_to_completion(Engine(bundled_model, EngineConfig(num_kv_blocks=24, threads=1)),
                                 {"c": (nxt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))})["c"]
        assert [t for c in sorted(t2, key=lambda c: c.seq) for t in c.token_ids] == cold.token_ids
    finally:
        await bus.close()
        for w in (a, b):
            await w.close()
        await pool.close()
