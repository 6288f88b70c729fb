"""Sessions' KV resident between turns (shared/engine/retention.py) on the block manager alone."""

from __future__ import annotations

import pytest

from shared.engine.kv_cache import BlockManager
from shared.engine.retention import Resident, Residency, ResidentBlocks, eviction_order


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def manager(n: int = 8, window: float = 60.0):
    bm = BlockManager(n, 4)
    clock = Clock()
    res = Residency(window, clock)
    spilled: list[Resident] = []
    res.on_spill = spilled.append
    bm.resident = ResidentBlocks(bm, res)
    return bm, res, clock, spilled


def finish(bm: BlockManager, session: str, tokens: list[int], priority: int = 1, evict_first: bool = False,
           tenant: str = "") -> list[int]:
    """A session's turn: allocate and hash its blocks, retain them, release them (as the engine does)."""
    blocks = bm.allocate(len(tokens) // 4)
    parent = None
    for i, b in enumerate(blocks):
        parent = bm.register_full(b, parent, tokens[i * 4:(i + 1) * 4])
    if session:
        bm.resident.retain(tenant, session, priority, "", blocks, tokens)
    bm.release(blocks, evict_first=evict_first)
    return blocks


def test_eviction_order_expired_then_worst_tier_then_longest_idle():
    def r(name, prio, used):
        return Resident("", name, prio, "", [], [], used)
    order = eviction_order([r("fresh-int", 0, 990), r("old-std", 1, 900), r("fresh-batch", 2, 995),
                            r("expired-int", 0, 100), r("fresh-std", 1, 980)], now=1000, window_s=300)
    assert [x.session for x in order] == ["expired-int", "fresh-batch", "old-std", "fresh-std", "fresh-int"]


def test_resident_blocks_outlive_other_work_and_count_as_free():
    bm, res, clock, spilled = manager()
    sess = finish(bm, "s", list(range(8)))                       # 2 blocks held
    batch = finish(bm, "", list(range(100, 108)), priority=2, evict_first=True)
    assert bm.num_free == 8 and len(bm.free) == 6 and res.sessions
    got = bm.allocate(6)                                           # the queue only: the session stays
    assert not set(got) & set(sess) and set(batch) <= set(got)
    assert bm.match_prefix(list(range(8)), 8) == sess and not spilled
    # the next block comes from the session: spilled (its KV read first), then reused
    more = bm.allocate(1)
    assert len(spilled) == 1 and spilled[0].session == "s" and spilled[0].token_ids == list(range(8))
    assert more[0] in sess and not res.sessions and bm.num_free == 1


def test_sessions_evicted_by_tier_then_idle_time():
    bm, res, clock, spilled = manager(n=6)
    finish(bm, "interactive", list(range(8)), priority=0)
    clock.t += 10
    finish(bm, "standard-old", list(range(20, 28)), priority=1)
    clock.t += 10
    finish(bm, "standard-new", list(range(40, 48)), priority=1)
    assert len(bm.free) == 0 and bm.num_free == 6
    bm.allocate(2)
    bm.allocate(2)
    assert [r.session for r in spilled] == ["standard-old", "standard-new"]
    clock.t += 1000                     # past the window: the interactive one is no longer preferred
    assert eviction_order(list(res.sessions.values()), clock.t, res.window_s)[0].session == "interactive"


def test_next_turn_takes_its_blocks_back_and_replaces_the_hold():
    bm, res, clock, spilled = manager()
    turn1 = finish(bm, "s", list(range(8)))
    cached = bm.match_prefix(list(range(12)), 12)
    assert cached == turn1
    bm.acquire_cached(cached)                                      # the next turn starts on them
    assert bm.num_free == 6
    extra = bm.allocate(1)
    parent = bm.hash_of[cached[-1]]
    bm.register_full(extra[0], parent, list(range(8, 12)))
    bm.resident.retain("", "s", 1, "", cached + extra, list(range(12)))
    bm.release(cached + extra)
    assert bm.num_free == 8 and len(res.sessions) == 1 and len(res.held) == 3
    assert bm.match_prefix(list(range(13)), 13) == cached + extra and not spilled


def test_two_sessions_sharing_a_prefix_block():
    bm, res, clock, spilled = manager(n=4)
    a = finish(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    cached = bm.match_prefix([1, 2, 3, 4, 9, 9, 9, 9], 8)
    bm.acquire_cached(cached)
    b_own = bm.allocate(1)
    bm.register_full(b_own[0], bm.hash_of[cached[0]], [9, 9, 9, 9])
    bm.resident.retain("", "b", 1, "", cached + b_own, [1, 2, 3, 4, 9, 9, 9, 9])
    bm.release(cached + b_own)
    assert res.held[a[0]] == 2 and bm.num_free == 4
    assert len(bm.allocate(4)) == 4                                # both spilled, every block reused
    assert sorted(r.session for r in spilled) == ["a", "b"] and not res.held and bm.num_free == 0


def test_a_failing_spill_still_frees_the_blocks():
    bm, res, clock, spilled = manager(n=2)

    def boom(r):
        raise OSError("pool gone")
    res.on_spill = boom
    finish(bm, "s", list(range(8)))
    assert bm.allocate(2) is not None and not res.sessions


def test_bad_retention_value_is_refused():
    res = Residency(60.0)
    with pytest.raises(ValueError, match="prompt_cache_retention"):
        res.tag("r", "s", "1h")
    res.tag("r", "s", "24h")
    assert res.untag("r").retention == "24h"


async def test_a_short_prompt_asks_the_pool_only_after_this_worker_spilled_its_session():
    """Under one chunk a prompt can only continue a spilled session's tail: the worker's connector
    asks the pool for it only when it spilled a session starting with the prompt's first block
    (an ordinary short chat pays no pool round trip); the spill goes to the pool, pinned for 24h."""
    from collections import OrderedDict
    from types import SimpleNamespace

    from shared.kv_connector import KVConnector
    from shared.settings import Settings

    class Pool:
        reloads = 0

        def __init__(self):
            self.asked, self.stored = [], []

        async def fetch_prefix(self, prompt, have, tenant, spilled=False):
            self.asked.append((len(prompt), have, tenant))
            return None

        def store_later(self, tokens, kv, tenant, **kw):
            self.stored.append((tokens, tenant, kw))

    async def cached_prefix_tokens(prompt, tenant):
        raise AssertionError("a short prompt never waits for an engine step")

    conn = object.__new__(KVConnector)
    conn.pool, conn.settings, conn.role, conn._spilled_heads = Pool(), Settings(), "cpu-decode", OrderedDict()
    conn.engine = SimpleNamespace(layout=SimpleNamespace(block_size=16), cached_prefix_tokens=cached_prefix_tokens)
    session = list(range(100, 164))
    assert await conn.fetch_prefix(session + [1, 2, 3], "alice") is None and conn.pool.asked == []
    conn._spilled(session, b"kv", "alice", "24h")
    assert conn.pool.stored == [(session, "alice", {"session": True, "pin_s": 86400.0})]
    assert await conn.fetch_prefix(session + [1, 2, 3], "bob") is None and conn.pool.asked == []  # another tenant
    await conn.fetch_prefix(session + [1, 2, 3], "alice")
    assert conn.pool.asked == [(67, 0, "alice")]
