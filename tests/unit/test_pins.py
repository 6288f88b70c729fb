"""Pinned pool entries (kvpool/pins.py): a tier's LRU skips them while pinned; a tenant never pins
more than its share of a tier — past it, its oldest pins are unpinned (never refused)."""

from __future__ import annotations

import pytest

from kvpool.keys import chunk_keys
from kvpool.pins import Pins
from kvpool.pool import KVPool, PoolConfig
from kvpool.store import MemoryTier
from tests.unit.test_kvpool import SCOPE, entry

KEYS = chunk_keys(SCOPE, list(range(16 * 8)))
SIZE = len(entry(KEYS[0]))


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def tier(entries: int, share: float, clock=None) -> MemoryTier:
    t = MemoryTier(capacity=SIZE * entries)
    t.pins = Pins(share, t.capacity, clock or Clock())
    return t


def test_a_pinned_entry_outlives_lru_eviction_until_its_pin_expires():
    clock = Clock()
    t = tier(3, 1.0, clock)
    for k in KEYS[:3]:
        assert t.put(k, entry(k))
    assert t.pin(KEYS[0], "alice", until=clock.t + 60)
    assert t.put(KEYS[3], entry(KEYS[3]))                  # the oldest unpinned one goes
    assert t.contains(KEYS[0]) and not t.contains(KEYS[1])
    clock.t += 61                                          # the pin lapsed: ordinary LRU again
    assert t.put(KEYS[4], entry(KEYS[4])) and not t.contains(KEYS[0])


def test_a_tenant_past_its_share_unpins_its_oldest_pins():
    t = tier(8, 0.25)                                       # 2 entries' worth each
    for k in KEYS[:4]:
        t.put(k, entry(k))
    assert t.pin(KEYS[0], "alice", until=2e9) and t.pin(KEYS[1], "alice", until=2e9)
    assert t.pin(KEYS[2], "bob", until=2e9)
    assert t.pin(KEYS[3], "alice", until=2e9)               # alice's third: her oldest unpinned
    assert not t.pins.pinned(KEYS[0]) and t.pins.pinned(KEYS[1]) and t.pins.pinned(KEYS[3])
    assert t.pins.tenant_bytes("alice") == 2 * SIZE and t.pins.tenant_bytes("bob") == SIZE
    assert t.pins.unpinned == 1 and t.contains(KEYS[0])      # unpinned, still stored
    assert not t.pin(KEYS[7], "alice", until=2e9)           # not held: nothing to pin


def test_pins_leave_room_for_other_tenants_and_a_full_pinned_tier_refuses_puts():
    t = tier(2, 0.5)
    t.put(KEYS[0], entry(KEYS[0]))
    t.put(KEYS[1], entry(KEYS[1]))
    assert t.pin(KEYS[0], "alice", until=2e9) and t.pin(KEYS[1], "bob", until=2e9)
    assert not t.put(KEYS[2], entry(KEYS[2]))               # every entry pinned: no room, stored nowhere
    assert t.contains(KEYS[0]) and t.contains(KEYS[1])
    t.remove(KEYS[1])                                       # a removed entry's pin goes with it
    assert t.pins.tenant_bytes("bob") == 0 and t.put(KEYS[2], entry(KEYS[2]))


def test_pool_put_and_lookup_pin_and_the_share_is_validated():
    pool = KVPool.from_config(PoolConfig(ram_bytes=SIZE * 4, pin_share=0.5))
    assert pool.put(KEYS[0], entry(KEYS[0]), pin=("alice", 2e9)) == ["ram"]
    assert pool.tiers[0].pins.pinned(KEYS[0])
    pool.put(KEYS[1], entry(KEYS[1]))
    assert pool.pin(KEYS[:3], "alice", 2e9) == 2            # the held ones
    tiers, alt = pool.lookup_alternatives([KEYS[0], KEYS[5], KEYS[1]], alternatives=2)
    assert (tiers, alt) == (["ram", "ram"], 1)              # KEYS[5] missing, the next alternative held
    assert pool.lookup_alternatives([KEYS[5], KEYS[1]], alternatives=1) == ([], -1)
    with pytest.raises(ValueError, match="pin share"):
        PoolConfig(ram_bytes=1, pin_share=1.5).validate()
    with pytest.raises(ValueError, match="pin share"):
        Pins(-0.1, 100)
