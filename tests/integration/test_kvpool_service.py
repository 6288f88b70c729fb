"""The kvpool service on a real NATS server with the real data plane: a worker's PoolClient
writes chunks back, another finds and fetches them byte-exact; events on the bus; a missing
pool is a miss, never an error; entries go only to live workers' data planes, and a put whose
bytes are not the announced ones is not stored."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

import numpy as np
import pytest

from services.kvpool import PoolService
from shared import subjects
from shared.bus import Bus
from shared.engine.kv_cache import KVLayout
from shared.kv_connector import PoolClient, key_scope, prompt_tail_end
from shared.nats_server import EmbeddedNats
from shared.bus import RemoteError
from shared.nats_server import free_port
from shared.schemas import Heartbeat, KVEvent, PoolGet, PoolPut
from shared.settings import DataPlaneSettings, NatsSettings, PoolSettings, Settings
from shared.transfer import make_transport
from tests.unit.test_metrics import samples, value

pytestmark = pytest.mark.timeout(120)
LAYOUT = KVLayout(n_layers=2, n_kv_heads=2, head_dim=8, block_size=16)


def settings(url: str, tmp_path, **pool) -> Settings:
    pool = {"timeout": 10.0, **pool}
    return Settings(nats=NatsSettings(url=url), data=DataPlaneSettings(timeout=10.0),
                    pool=PoolSettings(dir=str(tmp_path / "pool"), ram_mb=64, chunk_tokens=32, **pool))


async def beat(bus: Bus, name: str, host: str, port: int) -> None:
    """The heartbeat of a worker whose data-plane receiver is host:port (the pool sends gets only there)."""
    await bus.publish(subjects.heartbeat(subjects.PREFILL, name), Heartbeat(
        worker_id=name, role=subjects.PREFILL, device="cpu", model="test-model", ready=True, queue_depth=0,
        running=0, free_kv_blocks=0, total_kv_blocks=0, max_context=4096, data_host=host, data_port=port,
        ts=time.time(), interval=60.0))


async def client(s: Settings, name: str) -> tuple[PoolClient, Bus, object]:
    bus = await Bus.connect(s, name=name)
    transport = make_transport(s.data)
    rx = transport.receiver()
    host, port = await rx.listen()
    await beat(bus, name, host, port)
    scope = key_scope("test-model", LAYOUT.to_dict(), s.pool)  # identity only: no weights needed
    return PoolClient(bus, s.pool, scope, LAYOUT, name, transport.sender(), rx, host, port), bus, rx


@contextlib.asynccontextmanager
async def pool_and_client(s: Settings, name: str):
    """A started pool service and one worker's client: (pool, client, the client's bus)."""
    pool = PoolService(s)
    await pool.start()
    c, bus, rx = await client(s, name)
    try:
        yield pool, c, bus
    finally:
        await c.close()
        await bus.close()
        await rx.close()
        await pool.close()


def kv_for(tokens: int) -> bytes:
    return np.random.default_rng(tokens).normal(0, 1, tokens * LAYOUT.token_bytes // 2).astype(np.float16).tobytes()


def lookups() -> dict[tuple[str, str], float]:
    """tandem_pool_lookups_total by (tier, result)."""
    return {(dict(labels)["tier"], dict(labels)["result"]): v for (name, labels), v in samples().items()
            if name == "tandem_pool_lookups_total"}


@pytest.mark.parametrize("local_read", [True, False], ids=["disk-files", "data-plane"])
async def test_write_back_then_fetch_is_byte_exact(nats_server, tmp_path, local_read):
    """On the pool's host a worker reads the disk tier's files itself (the pool only answers the
    lookup); else (TANDEM_POOL_LOCAL_READ=0, another host) through the pool's data plane."""
    s = settings(nats_server, tmp_path, local_read=local_read)
    pool = PoolService(s)
    await pool.start()
    a, bus_a, rx_a = await client(s, "worker-a")
    b, bus_b, rx_b = await client(s, "worker-b")
    events = await bus_b.subscribe(subjects.KV_EVENTS_ALL, KVEvent)
    try:
        prompt = list(range(100))
        kv = kv_for(96)
        assert await a.store(prompt[:96], kv) == 3          # three 32-token chunks
        assert await a.store(prompt[:96], kv) == 0          # already there: nothing sent
        stored = []
        while len(stored) < 3:
            ev = await events.next(timeout=5)
            assert (ev.holder, ev.role, ev.epoch, ev.evicted) == (pool.pool_id, subjects.KVPOOL, pool.events.epoch, [])
            stored += ev.stored
        assert sorted(stored) == sorted(a.keys(prompt[:96]))   # (stored tail first: a tier too small keeps the head)

        counted = lookups()
        tokens, got = await b.fetch_prefix(prompt)
        assert tokens == prompt[:96] and bytes(got) == kv
        assert (pool.pool.get_bytes == 0) == local_read       # the pool sent nothing: read here
        assert await b.fetch_prefix(prompt, have_tokens=96) is None  # the engine has it already
        assert await b.fetch_prefix(list(range(50, 150))) is None   # another prefix: a miss
        # one count a lookup (not one a chunk; a write-back's check is none), the tier of its first
        # chunk; the bytes the pool read for a worker, by the tier they came from
        moved = {k: v - counted.get(k, 0) for k, v in lookups().items() if v != counted.get(k, 0)}
        assert moved == {("ram", "hit"): 2, ("none", "miss"): 1}, moved   # (have_tokens=96: looked up, not read)
        assert value("tandem_pool_hit_bytes_total", tier="ram") >= (0 if local_read else len(kv))
    finally:
        for c, bus, rx in ((a, bus_a, rx_a), (b, bus_b, rx_b)):
            await c.close()
            await bus.close()
            await rx.close()
        await pool.close()

    watcher = await Bus.connect(s, name="watcher")
    events = await watcher.subscribe(subjects.KV_EVENTS_ALL, KVEvent)
    restarted = PoolService(s)   # the disk tier's index is rebuilt: the pool survives a restart
    await restarted.start()
    c, bus_c, rx_c = await client(s, "worker-c")
    try:
        hello = await events.next(timeout=5)              # a new epoch, announcing what it holds
        assert hello.seq == 1 and hello.epoch > 0 and sorted(hello.stored) == sorted(c.keys(prompt[:96]))
        tokens, got = await c.fetch_prefix(prompt)
        assert tokens == prompt[:96] and bytes(got) == kv
    finally:
        await c.close()
        await bus_c.close()
        await rx_c.close()
        await restarted.close()
        await watcher.close()


async def test_a_prompts_tail_is_reused_by_exactly_that_prompt(nats_server, tmp_path):
    """Past its last full chunk, a prompt's KV up to its last token but one is an entry of its
    own (whole blocks, the last one partial, its other slots zeroed), keyed by those exact
    tokens: the same prompt again loads all but its last token; a prompt that differs there, or
    is longer or shorter, loads the shared full chunks only."""
    s = settings(nats_server, tmp_path)
    async with pool_and_client(s, "worker-t") as (pool, a, bus):
        prompt = list(range(120))                       # 3 chunks of 32, then 24 tokens
        end = prompt_tail_end(len(prompt))
        kv = kv_for(128)                                # 8 blocks: the 8th holds tokens 112..118
        assert await a.store(prompt[:end], kv, tail_end=end) == 4   # 3 chunks + the tail [96, 119)
        assert await a.store(prompt[:end], kv, tail_end=end) == 0   # already there
        tokens, got = await a.fetch_prefix(prompt)
        whole = 112 * LAYOUT.token_bytes
        assert tokens == prompt[:119] and len(got) == len(kv) and bytes(got[:whole]) == kv[:whole]
        shape = (LAYOUT.n_layers, 2, LAYOUT.block_size, LAYOUT.n_kv_heads, LAYOUT.head_dim)
        last_got = np.frombuffer(got[whole:], dtype=np.float16).reshape(shape)
        last_kv = np.frombuffer(kv[whole:], dtype=np.float16).reshape(shape)
        assert np.array_equal(last_got[:, :, :7], last_kv[:, :, :7]) and not last_got[:, :, 7:].any()
        assert await a.fetch_prefix(prompt, have_tokens=119) is None
        for other in (prompt[:100] + [7] * 20, prompt[:113], prompt[:100], prompt + [5]):
            tokens, got = await a.fetch_prefix(other)   # another tail: the shared chunks only
            assert tokens == prompt[:96] and bytes(got) == kv[:96 * LAYOUT.token_bytes]


async def test_a_prompt_of_whole_chunks_uses_its_last_one_and_a_grown_turn_its_spilled_tail(nats_server, tmp_path):
    """Two prefixes the pool held and never served (probe of 2026-11-29, speed only): a prompt of
    exactly one chunk (256 tokens in the stack) found nothing — its chunk holds its last token,
    which is always computed, and no tail is kept under one chunk; and a session spilled with a
    tail, whose next turn grew past a chunk boundary, got its full chunks only — the lookup asked
    for the tails after the prompt's own last chunk, which the session never filled."""
    s = settings(nats_server, tmp_path)
    async with pool_and_client(s, "worker-w") as (pool, a, bus):
        prompt = list(range(1000, 1032))                # one chunk of 32: its own last token too
        kv = kv_for(32)
        assert await a.store(prompt, kv) == 1
        tokens, got = await a.fetch_prefix(prompt)
        assert tokens == prompt[:31] and bytes(got) == kv   # (2 blocks: the last partial, the engine's own)
        two = list(range(64))                            # two chunks: the second serves 32..62
        kv2 = kv_for(64)
        assert await a.store(two, kv2) == 2
        tokens, got = await a.fetch_prefix(two)
        assert tokens == two[:63] and bytes(got) == kv2

        session = list(range(2000, 2080))               # 2 chunks, then 16 tokens: a whole-block tail
        kv3 = kv_for(80)
        assert await a.store(session, kv3, session=True) == 3
        turn = session + list(range(5000, 5030))         # the next turn: 110 tokens, chunk 3 never stored
        tokens, got = await a.fetch_prefix(turn)
        assert tokens == turn[:64]                       # not known as a spilled session's: chunks only
        tokens, got = await a.fetch_prefix(turn, spilled=True)
        assert tokens == turn[:80] and bytes(got) == kv3


async def test_a_write_back_from_a_reused_prefix_stores_what_it_holds(nats_server, tmp_path):
    """A finished request's KV starts at the whole chunks it reused (``start``): the entries from
    there the pool lacks are stored, byte-exact; one before it the pool lost is not (no KV for it)."""
    s = settings(nats_server, tmp_path)
    async with pool_and_client(s, "worker-s") as (pool, a, bus):
        prompt, kv = list(range(100)), kv_for(96)
        assert await a.store(prompt[:32], kv[:32 * LAYOUT.token_bytes]) == 1     # the reused chunk
        assert await a.store(prompt[:96], kv[32 * LAYOUT.token_bytes:], start=32) == 2
        tokens, got = await a.fetch_prefix(prompt)
        assert tokens == prompt[:96] and bytes(got) == kv
        other = list(range(1000, 1096))                                          # its first chunk never stored
        assert await a.store(other, kv[32 * LAYOUT.token_bytes:], start=32) == 2
        keys = a.keys(other)
        assert pool.pool.lookup(keys[:1]) == [] and len(pool.pool.lookup(keys[1:])) == 2


async def test_an_entry_unreadable_here_comes_over_the_data_plane(nats_server, tmp_path):
    """A worker reading the disk tier's files finds one gone (evicted meanwhile) or damaged: the
    whole prefix comes through the pool's data plane instead (its RAM tier), byte-exact."""
    s = settings(nats_server, tmp_path)
    async with pool_and_client(s, "worker-r") as (pool, a, bus):
        prompt, kv = list(range(100)), kv_for(96)
        assert await a.store(prompt[:96], kv) == 3
        k0, k1, _ = a.keys(prompt[:96])
        disk = next(t for t in pool.pool.tiers if t.name == "disk")
        os.unlink(disk.path(k1))
        tokens, got = await a.fetch_prefix(prompt)
        assert tokens == prompt[:96] and bytes(got) == kv and pool.pool.get_bytes > 0
        sent = pool.pool.get_bytes
        with open(disk.path(k0), "r+b") as f:                 # a flipped byte in the payload
            f.seek(-7, os.SEEK_END)
            byte = f.read(1)
            f.seek(-7, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x20]))
        tokens, got = await a.fetch_prefix(prompt)
        assert tokens == prompt[:96] and bytes(got) == kv and pool.pool.get_bytes > sent
        assert a.errors == 0 and a.hits == 2


async def test_entries_go_to_live_workers_only_and_puts_are_checked(nats_server, tmp_path):
    s = settings(nats_server, tmp_path)
    async with pool_and_client(s, "worker-d") as (pool, a, bus):
        prompt, kv = list(range(64)), kv_for(64)
        assert await a.store(prompt, kv) == 2
        keys = a.keys(prompt)
        # a get naming an address no live worker's heartbeat names: refused, nothing sent
        with pytest.raises(RemoteError) as e:
            await bus.request(subjects.kvpool_get(pool.pool_id),
                              PoolGet(keys=keys, transfer_id="stolen", host="127.0.0.1", port=free_port()))
        assert e.value.code == "forbidden" and "no live worker" in e.value.message
        # a put whose bytes differ from what the PoolPut announces: not stored
        other = list(range(1000, 1064))
        entries = a._encode(a.pieces(other, len(other)), kv)
        from kvpool.codec import pack_entries
        from shared.transfer import checksum
        bundle = pack_entries(entries)
        await a.sender.send(pool.data_host, pool.data_port, "swapped", bundle)
        with pytest.raises(RemoteError) as e:
            await bus.request(subjects.kvpool_put(pool.pool_id), PoolPut(
                keys=a.keys(other), transfer_id="swapped", nbytes=len(bundle), checksum=checksum(b"other bytes")))
        assert e.value.code == "bad_request" and "announced" in e.value.message
        assert pool.pool.lookup(a.keys(other)) == []
        tokens, got = await a.fetch_prefix(prompt + [1])   # the worker's own get still works
        assert tokens == prompt and bytes(got) == kv


async def test_no_pool_running_is_a_miss(tmp_path):
    server = EmbeddedNats()  # a bus of its own: no pool anywhere on it
    s = settings(server.start(), tmp_path)
    c, bus, rx = await client(s, "lonely")
    try:
        assert await c.fetch_prefix(list(range(100))) is None
        assert await c.store(list(range(64)), kv_for(64)) == 0
        assert c.errors == 2 and c.hits == 0
    finally:
        await c.close()
        await bus.close()
        await rx.close()
        server.stop()


async def test_a_hung_pool_costs_one_budget_then_nothing(tmp_path):
    """A pool that takes requests and never answers (SIGSTOP, a dead disk): the first prompt waits
    TANDEM_POOL_TIMEOUT at most and is computed; the next ones do not wait on it at all."""
    server = EmbeddedNats()
    s = settings(server.start(), tmp_path, timeout=0.3, backoff_s=30.0)
    c, bus, rx = await client(s, "patient")
    hung = await Bus.connect(s, name="hung-pool")
    stuck = asyncio.Event()
    asked = []

    async def never(msg):
        asked.append(msg)
        await stuck.wait()

    await hung.serve(subjects.POOL_LOOKUP, never, queue=subjects.POOL_QUEUE)
    try:
        t0 = time.monotonic()
        assert await asyncio.wait_for(c.fetch_prefix(list(range(100))), 30) is None  # 30 s: a hang only
        assert time.monotonic() - t0 >= 0.3 and len(asked) == 1  # it waited its budget for the one lookup
        assert await c.fetch_prefix(list(range(200))) is None
        assert len(asked) == 1 and c.errors == 1                 # the next prompt did not ask the pool
    finally:
        stuck.set()
        await hung.close()
        await c.close()
        await bus.close()
        await rx.close()
        server.stop()


async def test_stopping_pool_waits_for_announced_write_backs(nats_server, tmp_path):
    """A pool told to stop while a worker's write-back is announced (its lookup for_put saw
    missing chunks) keeps taking puts until that one came; one never put ends the wait at
    TANDEM_POOL_DRAIN_S."""
    s = settings(nats_server, tmp_path, drain_s=60.0)
    pool = PoolService(s)
    await pool.start()
    a, bus_a, rx_a = await client(s, "worker-a")
    try:
        prompt, kv = list(range(64)), kv_for(64)
        encoding, encode = threading.Event(), a._encode
        a._encode = lambda *args: encoding.wait(30) and encode(*args)  # looked up, then held here
        store = asyncio.create_task(a.store(prompt, kv))
        while pool._waiting_for() == 0:  # its lookup announced the write-back
            await asyncio.sleep(0.01)
        drain = asyncio.create_task(pool.drain())
        await asyncio.sleep(1.0)  # past the quiet window: only the announcement holds it
        assert not drain.done()
        encoding.set()
        assert await store == 2
        await asyncio.wait_for(drain, 30)
        assert pool.pool.lookup(a.keys(prompt)) == ["ram", "ram"]

        pool.settings.pool.drain_s = 0.5
        await a._lookup(a.keys(list(range(100, 164))), for_put=True)  # announced, never put
        await asyncio.wait_for(pool.drain(), 30)
    finally:
        await a.close()
        await bus_a.close()
        await rx_a.close()
        await pool.close()


@pytest.mark.parametrize("local_read", [True, False], ids=["disk-files", "data-plane"])
async def test_an_entry_without_the_deployments_secret_stops_the_prefix(nats_server, tmp_path, local_read):
    """A writer without TANDEM_POOL_KEY put the third chunk (after two signed ones): a worker with
    the secret loads the two signed chunks only, and counts the forged one."""
    s = settings(nats_server, tmp_path, local_read=local_read, key="deployment")
    rogue = settings(nats_server, tmp_path, key=None, key_file=str(tmp_path / "none"))
    prompt, kv = list(range(100)), kv_for(96)
    async with pool_and_client(s, "worker-s") as (pool, a, bus):
        r, bus_r, rx_r = await client(rogue, "rogue")
        try:
            assert await a.store(prompt[:64], kv[:64 * LAYOUT.token_bytes]) == 2
            assert await r.store(prompt[:96], kv) == 1              # the pool takes it: checksum only
        finally:
            await r.close()
            await bus_r.close()
            await rx_r.close()
        tokens, got = await a.fetch_prefix(prompt)
        assert tokens == prompt[:64] and bytes(got) == kv[:64 * LAYOUT.token_bytes] and a.forged == 1
        # the worker computed the third chunk: its write-back puts it again, over the forged one
        assert await a.store(prompt[:96], kv) == 1 and not a.refused
        tokens, got = await a.fetch_prefix(prompt)
        assert tokens == prompt[:96] and bytes(got) == kv and a.forged == 1


async def test_entries_of_an_old_secret_are_written_again_under_the_new_one(nats_server, tmp_path):
    """TANDEM_POOL_KEY changed over a kept pool directory (a rotated Secret, a deleted key file):
    every entry fails the MAC, and the pool — which has no secret — holds them, so a write-back
    found them "stored" and put nothing, and each lookup kept them the most recently used: a
    chat's first chunk (the template) failed every prompt there for good (a probe's finding).
    A worker that could not use an entry now puts it again over it: the next prompt is a hit."""
    prompt, kv = list(range(100)), kv_for(96)
    old = settings(nats_server, tmp_path, key="before")
    async with pool_and_client(old, "worker-old") as (_, a, _bus):
        assert await a.store(prompt[:96], kv) == 3
    new = settings(nats_server, tmp_path, key="after")
    async with pool_and_client(new, "worker-new") as (pool, b, _bus):   # the pool restarted over its disk tier
        assert await b.fetch_prefix(prompt) is None and b.forged == 1 and len(b.refused) == 1
        assert await b.store(prompt[:96], kv) == 3 and not b.refused      # all three, over the old ones
        tokens, got = await b.fetch_prefix(prompt)
        assert tokens == prompt[:96] and bytes(got) == kv and b.forged == 1
        assert len(pool.pool.tiers[0]) == 3 and pool.pool.tiers[0].used == sum(
            len(e) for e in (pool.pool.tiers[0].get(k) for k in b.keys(prompt[:96])))


async def test_a_write_back_that_puts_entries_again_ends_its_announcement(nats_server, tmp_path):
    """Two chunks of an old secret held, the third missing: the write-back's lookup announces the
    third, and its put starts at the first (put again): the pool ends the announcement all the
    same — a lingering one held a stopping pool for TANDEM_POOL_DRAIN_S."""
    prompt, kv = list(range(100)), kv_for(96)
    async with pool_and_client(settings(nats_server, tmp_path, key="before"), "worker-old") as (_, a, _bus):
        assert await a.store(prompt[:64], kv[:64 * LAYOUT.token_bytes]) == 2
    async with pool_and_client(settings(nats_server, tmp_path, key="after"), "worker-new") as (pool, b, _bus):
        assert await b.fetch_prefix(prompt) is None and len(b.refused) == 1
        assert await b.store(prompt[:96], kv) == 3
        assert pool._waiting_for() == 0
