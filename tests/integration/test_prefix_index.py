"""The prefix index end to end on a private nats-server with JetStream: a real engine's chunk
events equal the pool's chunk keys (stored, then evicted); a router's IndexFeed restarted from
its snapshot plus the stream ends with exactly the index of a feed that never stopped; without
JetStream the feed follows live events."""

from __future__ import annotations

import asyncio
import hashlib
import logging

import pytest

from kvpool.keys import chunk_keys
from shared.kv_connector import KVConnector
from shared.kv_events import KVEventPublisher
from services.prefix_index import IndexFeed, PrefixIndex
from shared import subjects
from shared.bus import Bus
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.nats_server import EmbeddedNats
from shared.schemas import KVEvent
from shared.settings import PoolSettings, Settings

pytestmark = pytest.mark.timeout(180)
CHUNK = 256
TEXT = ("The river wound through the valley, past farms and mills, carrying boats of grain to the "
        "city by the sea, where merchants traded wool, salt and stories from distant lands. ")
OTHER = ("Seven engineers argued about queues, caches and clocks until the coffee ran out, then "
         "wrote down what they had measured and went home to sleep for a very long time. ")


@pytest.fixture
async def nats_js():
    async with EmbeddedNats() as url:   # a server of its own: the stream and bucket start empty
        yield url


def state(index: PrefixIndex) -> dict:
    return {n: (h.role, h.epoch, h.seq, frozenset(h.keys), tuple(sorted(h.pending)))
            for n, h in index.holders.items()}


async def events_until(sub, done, timeout: float = 60.0) -> list[KVEvent]:
    """Events from ``sub`` until ``done(events)`` holds."""
    got: list[KVEvent] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not done(got):
        got.append(await sub.next(timeout=max(0.1, deadline - loop.time())))
    return got


async def run(aeng: AsyncEngine, rid: str, ids: list[int]) -> None:
    async for _ in aeng.generate(rid, ids, SamplingParams(max_tokens=2, temperature=0)):
        pass


async def test_engine_chunk_events_are_the_pool_keys(nats_js, bundled_model):
    prompt = bundled_model.tokenizer.encode(TEXT * 40, add_special_tokens=False)[:3 * CHUNK + 10]
    other = bundled_model.tokenizer.encode(OTHER * 40, add_special_tokens=False)[:2 * CHUNK + 80]
    # 64 blocks of 16 tokens: the prompt (49 blocks) fits; the other prompt then needs 23 of its blocks
    aeng = AsyncEngine(Engine(bundled_model, EngineConfig(num_kv_blocks=64, threads=1)))
    bus = await Bus.connect(url=nats_js, name="w-test")
    sub = await bus.subscribe(subjects.kv_events("w-1"), KVEvent)
    conn = KVConnector(Settings(pool=PoolSettings(chunk_tokens=CHUNK, enabled=False)), bus, aeng, "w-1",
                       subjects.CPU_DECODE)
    keys, other_keys = chunk_keys(conn.scope, prompt), chunk_keys(conn.scope, other)
    assert len(prompt) > 512 and len(keys) == 3 and len(other_keys) == 2
    try:
        await conn.start()
        pub = conn.events
        index = PrefixIndex()
        hello = await sub.next(timeout=10)
        assert (hello.seq, hello.stored, hello.evicted, hello.role) == (1, [], [], subjects.CPU_DECODE)
        index.apply(hello)

        await run(aeng, "r1", prompt)
        evs = await events_until(sub, lambda e: sum(len(x.stored) for x in e) >= 3)
        assert [k for e in evs for k in e.stored] == keys              # in order, each once
        assert not any(e.evicted for e in evs)
        assert [e.seq for e in evs] == list(range(2, 2 + len(evs))) and {e.epoch for e in evs} == {pub.epoch}
        for e in evs:
            index.apply(e)
        assert index.overlap(keys) == {"w-1": 3}

        await run(aeng, "r2", other)                                   # pushes the prompt's tail out
        evs = await events_until(sub, lambda e: sum(len(x.stored) for x in e) >= 2
                                 and sum(len(x.evicted) for x in e) >= 2)
        assert [k for e in evs for k in e.stored] == other_keys
        assert sorted(k for e in evs for k in e.evicted) == sorted(keys[1:])
        for e in evs:
            index.apply(e)
        # exact: what the index says is what the engine's prefix cache finds, chunk for chunk
        for ids, ks in ((prompt, keys), (other, other_keys)):
            held = await aeng.cached_prefix_tokens(ids)
            assert index.overlap(ks).get("w-1", 0) == held // CHUNK
        assert index.overlap(keys) == {"w-1": 1} and index.overlap(other_keys) == {"w-1": 2}
    finally:
        await conn.close()
        await aeng.close()
        await sub.unsubscribe()
        await bus.close()


def key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()   # incompressible, like real chunk keys


async def wait_seq(feed: IndexFeed, seq: int, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while feed.seq < seq:
        assert asyncio.get_running_loop().time() < deadline, f"feed at {feed.seq}, want {seq}"
        await asyncio.sleep(0.02)


async def last_seq(bus: Bus, *pubs: KVEventPublisher, timeout: float = 20.0) -> int:
    """The stream's last sequence once it holds every event ``pubs`` numbered (all the stream's
    publishers, closed ones included). JetStream stores a plain publish after the server answered
    the flush, so the stream is polled until the count is reached, and must not pass it."""
    for p in pubs:
        if p._task is not None:
            await p.drain()
    await bus.flush()
    want = sum(p.seq for p in pubs)
    assert not any(p.failed for p in pubs)
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        state = (await bus.nc.jetstream().stream_info("TANDEM_KVEVENTS")).state
        if state.messages >= want or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.02)
    assert state.messages == want, f"the stream holds {state.messages} events, the publishers sent {want}"
    return state.last_seq


async def test_router_restart_rebuilds_the_prefix_index(nats_js):
    buses = [await Bus.connect(url=nats_js, name=f"c{i}") for i in range(4)]
    pubs_bus, ref_bus, a_bus, b_bus = buses
    ref_ix = PrefixIndex()
    ref = IndexFeed(ref_bus, ref_ix, snapshot_every=3600, snapshot_events=10**9)  # never writes before close
    feed_b = None
    try:
        await ref.start()
        a_ix = PrefixIndex()
        feed_a = IndexFeed(a_bus, a_ix, part_bytes=1024, snapshot_every=3600, snapshot_events=10**9)
        await feed_a.start()
        assert feed_a.mode == ref.mode == "jetstream"
        w1 = KVEventPublisher(pubs_bus, "cpu-1", subjects.CPU_DECODE)
        w2 = KVEventPublisher(pubs_bus, "gpu-1", subjects.GPU_DECODE)
        pool = KVEventPublisher(pubs_bus, "pool-1", subjects.KVPOOL)
        for p in (w1, w2):
            await p.start()
        await pool.start(key(i) for i in range(1000, 1100))           # a pool announces what it holds
        for step in range(40):                                         # 40 loop turns of changes
            w1.add(stored=[key(step * 3 + j) for j in range(3)], evicted=[key(step * 3 - 30)] if step > 10 else [])
            w2.add(stored=[key(step)])
            await asyncio.sleep(0)
        s1 = await last_seq(pubs_bus, w1, w2, pool)
        await wait_seq(feed_a, s1)
        await wait_seq(ref, s1)
        assert state(a_ix) == state(ref_ix) and len(ref_ix) > 100
        await feed_a.close()                                           # the router goes away: snapshot
        assert feed_a.saved_seq == s1
        head = await feed_a._head()
        assert head[1]["seq"] == s1 and head[1]["parts"] > 1          # cut into several KV values

        # while no router runs: more events, a worker restarts (new epoch), the pool evicts
        for step in range(40, 70):
            w1.add(stored=[key(step * 3)], evicted=[key(step * 3 - 60)])
            pool.add(evicted=[key(1000 + step)])
            await asyncio.sleep(0)
        await w2.close()
        w2b = KVEventPublisher(pubs_bus, "gpu-1", subjects.GPU_DECODE)
        await w2b.start()
        w2b.add(stored=[key(5000), key(5001)])
        await asyncio.sleep(0)
        s2 = await last_seq(pubs_bus, w1, w2, w2b, pool)
        assert s2 > s1 + 30

        feed_b = IndexFeed(b_bus, PrefixIndex())                      # the new router: a fresh index
        await feed_b.start()
        await wait_seq(ref, s2)
        assert feed_b.seq == s2 and feed_b.replayed == s2 - s1        # snapshot + only the events after it
        assert state(feed_b.index) == state(ref_ix)
        assert feed_b.index.where == ref_ix.where
        assert ref_ix.keys_of("gpu-1") == {key(5000), key(5001)}       # the restart emptied it first

        w1.add(stored=[key(9999)], evicted=[key(207)])                # and both go on live alike
        s3 = await last_seq(pubs_bus, w1, w2, w2b, pool)
        await wait_seq(feed_b, s3)
        await wait_seq(ref, s3)
        assert state(feed_b.index) == state(ref_ix)
        for p in (w1, w2b, pool):
            await p.close()
    finally:
        if feed_b is not None:
            await feed_b.close()
        await ref.close()
        for b in buses:
            await b.close()


async def test_an_older_snapshot_does_not_replace_a_newer_one(nats_js):
    bus = await Bus.connect(url=nats_js, name="c")
    try:
        pub = KVEventPublisher(bus, "cpu-1", subjects.CPU_DECODE)
        await pub.start([key(1)])
        a, b = IndexFeed(bus, PrefixIndex()), IndexFeed(bus, PrefixIndex())
        await a.start()
        await b.start()
        pub.add(stored=[key(2)])
        s = await last_seq(bus, pub)
        await wait_seq(a, s)
        await wait_seq(b, s)
        assert await b.save()
        a.seq = 1                                                   # a copy that lags behind
        assert not await a.save()
        assert (await b._head())[1]["seq"] == s
        await pub.close()
        for f in (a, b):
            await f.close()
    finally:
        await bus.close()


async def test_without_jetstream_the_feed_follows_live_events(caplog):
    async with EmbeddedNats(extra_args=["--jetstream=false"]) as url:
        bus = await Bus.connect(url=url, name="plain")
        try:
            ix = PrefixIndex()
            feed = IndexFeed(bus, ix)
            with caplog.at_level(logging.WARNING, "tandem.router.index"):
                await feed.start()
            assert feed.mode == "live" and "JetStream unavailable" in caplog.text
            pub = KVEventPublisher(bus, "cpu-1", subjects.CPU_DECODE)
            await pub.start([key(1), key(2)])
            pub.add(evicted=[key(2)])
            await bus.flush()
            for _ in range(200):
                if ix.holders.get("cpu-1") and ix.holders["cpu-1"].seq == 2:
                    break
                await asyncio.sleep(0.02)
            assert ix.overlap([key(1), key(2)]) == {"cpu-1": 1}
            await pub.close()
            await feed.close()
        finally:
            await bus.close()
