"""Ring decode across worker processes' engines (shared/ring/): members served on ring ports
(``RingServer`` over ``EngineMember``), reached through ``RemoteMember``; the fold between
processes; a lost member; the prefill's scatter parked and claimed. The in-process ring is
tests/integration/test_ring.py (whose fixtures these share)."""

from __future__ import annotations

import os

import pytest

from kernels.cpu_ring import RingKernels
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv_cache import KVBlobHeader
from shared.ring.session import Ring, RingCapacityError
from tests.integration.test_ring import (  # noqa: F401  (fixtures: big, kernels, prompt, handoff, single)
    NEW, big, decodes_as_single, handoff, holds_single_kv, kernels, prompt, single,
)


@pytest.fixture
def two_workers(bundled_model):
    """Two cpu-decode workers' engines: ``a`` coordinates, ``b`` hosts a member on its ring port
    (both share their engine's KV cache with their member); the data-plane key is on."""
    from shared.engine.async_engine import AsyncEngine
    from shared.ring import EngineMember, RingServer
    engines = [AsyncEngine(Engine(bundled_model, EngineConfig(num_kv_blocks=64, threads=1))) for _ in range(2)]
    a, b = engines
    mb = EngineMember(b.engine, b.run_blocking, "b")
    server = RingServer(mb, "127.0.0.1", 0, key=b"data-key")
    server.start()
    yield a, b, server
    server.close()
    for e in engines:
        e.engine.seqs.clear()


def ring_of(a, server, key=b"data-key", shm=True, fold=False):
    from shared.ring import EngineMember, connect_ring
    ma = EngineMember(a.engine, a.run_blocking, "a")
    plan = [["a", "127.0.0.1", 0], ["b", "127.0.0.1", server.port]]
    return Ring(ma.kernels, connect_ring(plan, "a", ma, key, a.layout, shm=shm), fold=fold,
                groups=ma.kernels.cfg.n_kv_heads if fold else 1)


def ring_regions() -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith("tandem-ring-")] if os.path.isdir("/dev/shm") else []


@pytest.mark.parametrize("link, fold", [("tcp", False), ("shm", False), ("shm", True)])
async def test_ring_of_two_workers_over_the_data_plane_is_the_single_worker(two_workers, handoff, single, link, fold):
    """A ring of 2 — the coordinator's own member and one behind an authenticated connection,
    its payloads on the socket (TANDEM_DATA_SHM=0) or through shared memory (the default on one
    host), every segment's state back or the fold by kv head (TANDEM_RING_FOLD) — gives the
    single worker's greedy tokens through the engine's request path; both caches are free again
    when it finishes."""
    import asyncio
    a, b, server = two_workers
    ring = ring_of(a, server, shm=link == "shm", fold=fold)
    assert ring.members[1].link == link and not ring_regions()   # a region is unlinked once mapped
    h = KVBlobHeader.parse(handoff)[0]
    ranges = await asyncio.to_thread(ring.admit, "s#0", h.token_ids, h.num_computed, KVBlobHeader.parse(handoff)[1],
                                     len(h.token_ids) + NEW)
    assert len(ranges) == 2 and b.engine.blocks.num_free < b.engine.blocks.num_blocks   # b holds its shard
    toks = []
    async for out in await a.submit_ring("r", handoff, ring, "s#0"):
        toks += out.token_ids
    assert toks == single[0]
    await asyncio.sleep(0.2)   # b frees its shard when the coordinator's connection closes
    for e in (a, b):
        assert e.engine.blocks.num_free == e.engine.blocks.num_blocks
    assert ring.members[1].bytes_out > 0 and ring.members[1].bytes_back > 0


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no /dev/shm here")
async def test_ring_of_two_in_one_process_over_shm_gives_the_single_worker_s_logits(two_workers, handoff, single):
    """The acceptance's ring of 2 in one process over shm: the scatter (LOAD in 8 MiB messages)
    and every step's q|k|v and states go through the member's shared-memory region; every
    step's logits are bitwise the single worker's fused step, and its KV the same afterwards."""
    import asyncio
    a, b, server = two_workers
    ring = ring_of(a, server)
    remote = ring.members[1]
    assert remote.link == "shm" and not ring_regions()
    h, kv = KVBlobHeader.parse(handoff)
    await asyncio.to_thread(ring.admit, "s", h.token_ids, h.num_computed, kv, len(h.token_ids) + NEW)
    await decodes_as_single(ring, "s", single)
    await holds_single_kv(ring, "s", a.layout, single, len(h.token_ids))
    assert remote.bytes_back > 0
    await asyncio.to_thread(ring.release, "s")
    ring.close()
    await asyncio.sleep(0.2)
    assert b.engine.blocks.num_free == b.engine.blocks.num_blocks


async def test_a_lost_member_ends_the_request_with_a_coded_error(two_workers, handoff):
    import asyncio
    from shared.ring import RingMemberLost
    a, b, server = two_workers
    ring = ring_of(a, server)
    h, kv = KVBlobHeader.parse(handoff)
    await asyncio.to_thread(ring.admit, "s#0", h.token_ids, h.num_computed, kv, len(h.token_ids) + NEW)
    stream = await a.submit_ring("r", handoff, ring, "s#0")
    got = 0
    with pytest.raises(RingMemberLost) as err:
        async for out in stream:
            got += len(out.token_ids)
            server.close()   # the member's worker dies mid-stream
    assert got >= 1 and err.value.lost == "b" and err.value.code == "unavailable"
    assert a.engine.blocks.num_free == a.engine.blocks.num_blocks and "r" not in a.engine.seqs
    await asyncio.sleep(0.2)
    assert b.engine.blocks.num_free == b.engine.blocks.num_blocks


@pytest.fixture
def three_workers(bundled_model):
    """The coordinator's engine ``a`` and two members' workers ``b`` and ``c`` on ring ports."""
    yield from _ring_workers(bundled_model)


def _ring_workers(bundled_model, timeout: float = 30.0, fold_timeout: float = 0.0):
    """Engines ``a`` (the coordinator), ``b`` and ``c`` ({name: AsyncEngine}), ``b`` and ``c``
    hosting members on ring ports ({name: RingServer}, data-plane key on, ``timeout``)."""
    from shared.engine.async_engine import AsyncEngine
    from shared.ring import EngineMember, RingServer
    engines = {w: AsyncEngine(Engine(bundled_model, EngineConfig(num_kv_blocks=64, threads=1))) for w in "abc"}
    servers = {}
    for w in "bc":
        servers[w] = RingServer(EngineMember(engines[w].engine, engines[w].run_blocking, w), "127.0.0.1", 0,
                                key=b"data-key", timeout=timeout, fold_timeout=fold_timeout)
        servers[w].start()
    yield engines, servers
    for srv in servers.values():
        srv.close()
    for e in engines.values():
        e.engine.seqs.clear()


_SLOW = pytest.mark.slow     # each link's other cases: ~2 s each here, 5x that on an AVX2 Xeon


@pytest.mark.parametrize("order, groups, qpass, link", [
    ("ab", 1, False, "tcp"),    # a ring of 2: the coordinator's member passes its state to b, b back
    pytest.param("ab", 1, False, "shm", marks=_SLOW),
    pytest.param("ab", 3, True, "tcp", marks=_SLOW),
    ("ab", 3, True, "shm"),
    ("abc", 3, False, "tcp"),   # b passes its state to c over a link of their own, c to the coordinator
    pytest.param("abc", 3, False, "shm", marks=_SLOW),
    pytest.param("abc", 1, True, "tcp", marks=_SLOW),
    ("abc", 1, True, "shm"),    # ... and the q rows go a -> b -> c too
    pytest.param("bca", 3, True, "tcp", marks=_SLOW),
    ("bca", 3, True, "shm"),    # the coordinator's own member last: c hands it the state
])
async def test_the_fold_across_processes_is_bitwise_the_single_worker(three_workers, handoff, single, link, order,
                                                                     groups, qpass):
    """The fold along the ring between workers (each member folds its segments into the
    running state the one before it passed on, head group by head group, over authenticated
    connections of their own; shm or TCP): every step's logits are bitwise the single worker's
    and the coordinator receives one state per kv head, whatever the context."""
    import asyncio
    from shared.ring import EngineMember, connect_ring
    engines, servers = three_workers
    a = engines["a"]
    ma = EngineMember(a.engine, a.run_blocking, "a")
    plan = [[w, "127.0.0.1", servers[w].port if w in servers else 0] for w in order]
    ring = Ring(ma.kernels, connect_ring(plan, "a", ma, b"data-key", a.layout, shm=link == "shm"),
                fold=True, groups=groups, qpass=qpass)
    assert all(m.link == link for m in ring.members if m is not ma)
    h, kv = KVBlobHeader.parse(handoff)
    await asyncio.to_thread(ring.admit, "s", h.token_ids, h.num_computed, kv, len(h.token_ids) + NEW)
    await decodes_as_single(ring, "s", single)
    t = ring.times
    state = ma.kernels.cfg.n_kv_heads * ma.kernels.part_floats(1) * 4
    layers = ma.kernels.cfg.n_layers
    # back to the coordinator: one state per kv head and layer (none when its own member is last)
    assert t.bytes_back == (0 if order.endswith("a") else NEW * layers * state)
    if "bc" in order:     # b -> c on their own link
        assert t.bytes_ring >= NEW * layers * state
    await holds_single_kv(ring, "s", a.layout, single, len(h.token_ids))
    await asyncio.to_thread(ring.release, "s")
    ring.close()
    await asyncio.sleep(0.2)
    for e in engines.values():
        assert e.engine.blocks.num_free == e.engine.blocks.num_blocks
    assert not any(srv._chains or srv._tickets for srv in servers.values())


@pytest.mark.parametrize("order, qpass", [("abc", False), ("bca", True)])
async def test_a_member_lost_inside_the_fold_is_named(three_workers, handoff, order, qpass):
    """b dies between steps (its connections and its link to c close): c finds its link from b
    closed and says so down the ring and to the coordinator — also when b would have passed
    it the q rows (no step starts at c then) —, or the coordinator finds b gone itself; either
    way the next step ends with RingMemberLost naming b, at once."""
    import asyncio
    import time
    from shared.ring import EngineMember, RingMemberLost, connect_ring
    engines, servers = three_workers
    a = engines["a"]
    ma = EngineMember(a.engine, a.run_blocking, "a")
    plan = [[w, "127.0.0.1", servers[w].port if w in servers else 0] for w in order]
    ring = Ring(ma.kernels, connect_ring(plan, "a", ma, b"data-key", a.layout), fold=True, groups=3, qpass=qpass)
    h, kv = KVBlobHeader.parse(handoff)
    await asyncio.to_thread(ring.admit, "s", h.token_ids, h.num_computed, kv, len(h.token_ids) + NEW)
    await asyncio.to_thread(ring.generate, "s", 1)
    servers["b"].close()
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    with pytest.raises(RingMemberLost) as err:
        await asyncio.to_thread(ring.generate, "s", 1)
    assert err.value.lost == "b" and err.value.code == "unavailable"
    assert time.monotonic() - t0 < 5      # not the data-plane timeout (30 s)
    await asyncio.to_thread(ring.release, "s")
    await asyncio.sleep(0.2)
    for e in engines.values():
        assert e.engine.blocks.num_free == e.engine.blocks.num_blocks


async def test_a_member_that_stops_inside_the_fold_is_named_not_the_last_one(bundled_model, handoff):
    """b stops answering mid-step (SIGSTOP, a hung host): c waits for b's state, the coordinator for
    c's. Each member after the coordinator waits for its predecessor a little longer than the one
    before it, and all less than the coordinator waits for the last (RingServer.fold_wait, half of
    its member timeout): c gives up on b first and says so, and the error names b. With every wait
    alike the coordinator gave up on c first and named c — a healthy worker the resume then left
    out, and with no spare worker no ring could form again."""
    import asyncio
    import time
    from shared.ring import EngineMember, RingMemberLost, connect_ring
    for engines, servers in _ring_workers(bundled_model, fold_timeout=1.0):
        a = engines["a"]
        ma = EngineMember(a.engine, a.run_blocking, "a")
        plan = [[w, "127.0.0.1", servers[w].port if w in servers else 0] for w in "abc"]
        ring = Ring(ma.kernels, connect_ring(plan, "a", ma, b"data-key", a.layout, timeout=2.0), fold=True, groups=1)
        h, kv = KVBlobHeader.parse(handoff)
        await asyncio.to_thread(ring.admit, "s", h.token_ids, h.num_computed, kv, len(h.token_ids) + NEW)
        await asyncio.to_thread(ring.generate, "s", 1)
        b = servers["b"].member
        attend = b.attend

        def stopped(*args, **kw):
            time.sleep(4.0)
            return attend(*args, **kw)
        b.attend = stopped
        t0 = time.monotonic()
        with pytest.raises(RingMemberLost) as err:
            await asyncio.to_thread(ring.generate, "s", 1)
        assert err.value.lost == "b", err.value
        assert time.monotonic() - t0 < 2.0     # c's wait (1.15 s), not the coordinator's (2 s)
        assert servers["c"].fold_wait(2) < 2.0 and servers["c"].fold_wait(1) < servers["c"].fold_wait(2)
        await asyncio.sleep(3.0)   # b wakes, finds nobody waiting
        await asyncio.to_thread(ring.release, "s")
        ring.close()


def test_a_member_refuses_a_connection_without_the_data_plane_key(two_workers):
    from shared.ring import RingMemberLost
    a, _, server = two_workers
    with pytest.raises(RingMemberLost, match="refused our proof"):
        ring_of(a, server, key=b"another key")


async def test_a_ring_session_is_promoted_to_one_worker_by_a_migration(two_workers, bundled_model, handoff, single):
    """Mid-stream, the coordinator gathers the ring's shards into a migration blob (the bytes a
    move of a single worker's request carries); a third worker imports it and goes on with the
    single worker's greedy tokens; the ring's KV is freed."""
    import asyncio
    from shared.engine.async_engine import AsyncEngine
    a, b, server = two_workers
    ring = ring_of(a, server)
    h, kv = KVBlobHeader.parse(handoff)
    await asyncio.to_thread(ring.admit, "s#0", h.token_ids, h.num_computed, kv, len(h.token_ids) + NEW)
    stream = await a.submit_ring("r", handoff, ring, "s#0")
    toks = []
    async for out in stream:
        toks += out.token_ids
        if len(toks) >= 3:
            blob = await a.export_for_move("r")
            break
    async for out in stream:   # the steps before the export, then the "migrated" end of the stream
        toks += out.token_ids
        assert out.finish_reason in (None, "migrated")
    assert await a.end_move("r", moved=True) is None
    moved = KVBlobHeader.parse(blob)[0]
    assert moved.num_computed == h.num_computed + len(toks) and moved.token_ids[-len(toks):] == toks
    c = AsyncEngine(Engine(bundled_model, EngineConfig(num_kv_blocks=160, threads=1)))
    try:
        async for out in await c.submit_kv("r", blob):
            toks += out.token_ids
    finally:
        await c.close()
    assert toks == single[0]
    await asyncio.sleep(0.2)
    for e in (a, b):
        assert e.engine.blocks.num_free == e.engine.blocks.num_blocks


# ---- the prefill's scatter: members' ranges parked under a ticket, claimed by the coordinator -----

@pytest.fixture
def parking_workers(bundled_model):
    """As ``three_workers`` ([a, b, c], [b's server, c's]), parked shards freed 1.5 s after the
    scatter unless claimed."""
    for engines, servers in _ring_workers(bundled_model, timeout=1.5):
        yield list(engines.values()), list(servers.values())


def plan_of(servers) -> list:
    return [["a", "127.0.0.1", 0]] + [[n, "127.0.0.1", s.port] for n, s in zip("bc", servers)]


def all_free(*engines) -> bool:
    return all(e.engine.blocks.num_free == e.engine.blocks.num_blocks for e in engines)


@pytest.mark.parametrize("fold, groups, qpass", [(False, 1, False), (True, 3, True),
                                                 pytest.param(True, 1, False, marks=_SLOW)])
async def test_the_prefill_s_scatter_claimed_by_the_coordinator_is_the_single_worker(parking_workers, handoff, single,
                                                                                     fold, groups, qpass):
    """The prefill loads b's and c's ranges itself, at the same time, parks them under a ticket and
    closes its connections; the coordinator claims them, loads its own range (what the data plane
    brings it) and decodes: every step's logits bitwise the single worker's, the same greedy
    tokens, the same KV afterwards; every cache free once the ring is released. With the fold
    (TANDEM_RING_FOLD) the claimed members are told their places in it as a scattered ring's are."""
    import asyncio
    from shared.ring import EngineMember, admit_claimed, connect_ring, new_ticket, ring_ranges, scatter_parked
    (a, b, c), servers = parking_workers
    h, kv = KVBlobHeader.parse(handoff)
    ma = EngineMember(a.engine, a.run_blocking, "a")
    ranges = ring_ranges(h, 3, ma.kernels.max_context)
    assert len(ranges) == 3 and ranges[-1][1] == len(h.token_ids) + NEW
    ticket = new_ticket()
    links = await asyncio.to_thread(scatter_parked, plan_of(servers), "a", ranges, kv, h.num_computed, a.layout,
                                    b"data-key", "pre#0", ticket)
    assert links[0] == "data plane" and set(links[1:]) <= {"shm", "tcp"}
    assert not all_free(b) and not all_free(c)   # parked: their shards outlive the prefill's connections
    from shared.ring.session import shard_bytes
    own = shard_bytes(a.layout, kv, *ranges[0], h.num_computed)
    assert own.nbytes < kv.nbytes   # the coordinator receives its own range only
    ring = Ring(ma.kernels, connect_ring(plan_of(servers), "a", ma, b"data-key", a.layout), fold=fold, groups=groups,
                qpass=qpass)
    await asyncio.to_thread(admit_claimed, ring, "r#0", ticket, h, own, ranges)
    await decodes_as_single(ring, "r#0", single)
    await holds_single_kv(ring, "r#0", a.layout, single, len(h.token_ids))
    await asyncio.to_thread(ring.release, "r#0")
    ring.close()
    await asyncio.sleep(0.2)
    assert all_free(a, b, c)


async def test_a_claim_with_a_wrong_ticket_is_refused_and_an_unclaimed_shard_is_freed(parking_workers, handoff,
                                                                                       caplog):
    import asyncio
    import logging
    from shared.ring import RemoteMember, RingMemberError, new_ticket, ring_ranges, scatter_parked
    (a, b, c), servers = parking_workers
    h, kv = KVBlobHeader.parse(handoff)
    ranges = ring_ranges(h, 3, RingKernels.of(a.engine.model).max_context)
    ticket = new_ticket()
    await asyncio.to_thread(scatter_parked, plan_of(servers), "a", ranges, kv, h.num_computed, a.layout,
                            b"data-key", "pre#0", ticket)
    mb = RemoteMember("b", "127.0.0.1", servers[0].port, b"data-key", a.layout, shm=False)
    try:
        with pytest.raises(RingMemberError, match="no shard is parked under that ticket") as err:
            await asyncio.to_thread(mb.claim, "x", new_ticket())
        assert err.value.code == "bad_request"
        assert await asyncio.to_thread(mb.claim, "x", ticket) == ranges[1]   # the right one takes it
    finally:
        mb.close()
    await asyncio.sleep(0.2)
    assert all_free(b) and not all_free(c)   # b's claimed shard went with the claiming connection
    with caplog.at_level(logging.WARNING, logger="tandem.ring"):
        await asyncio.sleep(1.8)   # c's was never claimed: freed after the timeout
    assert all_free(c)
    assert any("was not claimed by its coordinator within 2 s: freed" in r.getMessage() for r in caplog.records)


async def test_a_member_without_room_fails_the_prefill_s_scatter_and_nothing_stays_reserved(bundled_model, parking_workers,
                                                                                          handoff):
    import asyncio
    from shared.engine.async_engine import AsyncEngine
    from shared.ring import EngineMember, RingServer, new_ticket, ring_ranges, scatter_parked
    (a, b, _), servers = parking_workers
    small = AsyncEngine(Engine(bundled_model, EngineConfig(num_kv_blocks=16, threads=1)))   # 256 tokens
    tiny = RingServer(EngineMember(small.engine, small.run_blocking, "c"), "127.0.0.1", 0, key=b"data-key")
    tiny.start()
    try:
        h, kv = KVBlobHeader.parse(handoff)
        ranges = ring_ranges(h, 3, RingKernels.of(a.engine.model).max_context)
        plan = [["a", "127.0.0.1", 0], ["b", "127.0.0.1", servers[0].port], ["c", "127.0.0.1", tiny.port]]
        with pytest.raises(RingCapacityError, match=r"c: tokens \[1024, 1529\) need 32 KV blocks"):
            await asyncio.to_thread(scatter_parked, plan, "a", ranges, kv, h.num_computed, a.layout, b"data-key",
                                    "pre#0", new_ticket())
        await asyncio.sleep(0.2)
        assert all_free(b, small) and not servers[0]._parked and not tiny._parked
    finally:
        tiny.close()
        small.engine.seqs.clear()
