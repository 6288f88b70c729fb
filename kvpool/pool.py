"""The pool: entries by chunk key over a list of tiers, fastest first (RAM → NVMe → shared
directory → Redis).

- ``lookup(keys)``: how many leading keys are stored, and in which tier each one is;
- ``get(key)``: the entry from the fastest tier that has it (a hit in a slower tier is copied
  into the faster ones — promotion);
- ``put(key, entry)``: verify, then write through to every tier (RAM for speed, disk so the
  pool survives restarts, shared so other nodes see it).

Events (``on_event(kind, tier, keys)``: "stored" / "evicted") let the service tell the router
which prefixes are cached where. No NATS here: ``services/kvpool.py`` puts this on the bus.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

from kvpool.codec import CorruptEntry, verify_entry
from kvpool.keys import check_key
from kvpool.pins import Pins
from kvpool.store import DirTier, MemoryTier, RedisTier, Tier

log = logging.getLogger("tandem.kvpool")


@dataclass
class PoolConfig:
    ram_bytes: int = 1 << 30            # RAM tier capacity (0: no RAM tier)
    disk_dir: str | None = None         # local NVMe directory (None: no disk tier)
    disk_bytes: int = 64 << 30
    shared_dir: str | None = None       # shared filesystem directory (None: none)
    shared_bytes: int = 256 << 30
    redis_url: str | None = None        # Redis server every node shares (None: none)
    redis_bytes: int = 16 << 30
    redis_prefix: str = "tandem:kvpool:"
    pin_share: float = 0.25             # share of each tier a tenant's pinned entries may take (kvpool/pins.py)

    def validate(self) -> "PoolConfig":
        if min(self.ram_bytes, self.disk_bytes, self.shared_bytes, self.redis_bytes) < 0:
            raise ValueError("pool tier capacities must be >= 0")
        if not 0 <= self.pin_share <= 1:
            raise ValueError(f"the pool's pin share must be in [0, 1], got {self.pin_share}")
        if self.ram_bytes == 0 and not self.disk_dir and not self.shared_dir and not self.redis_url:
            raise ValueError("the pool needs at least one tier (RAM bytes > 0, a disk or a shared directory, Redis)")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"the pool's Redis URL (TANDEM_POOL_REDIS_URL) must start with redis://, rediss:// "
                             f"or unix://, got {self.redis_url!r}")
        if self.disk_dir and self.shared_dir and os.path.abspath(self.disk_dir) == os.path.abspath(self.shared_dir):
            raise ValueError("the disk and shared pool directories must differ")
        return self


class KVPool:
    def __init__(self, tiers: list[Tier], on_event: Callable[[str, str, list[str]], None] | None = None):
        if not tiers:
            raise ValueError("a pool needs at least one tier")
        self.tiers = tiers
        self.on_event = on_event
        for t in tiers:
            t.on_evict = self._evicted
        self.puts = self.put_bytes = self.get_bytes = self.rejected = 0

    @classmethod
    def from_config(cls, cfg: PoolConfig, on_event=None) -> "KVPool":
        cfg.validate()
        tiers: list[Tier] = []
        if cfg.ram_bytes:
            tiers.append(MemoryTier(cfg.ram_bytes))
        if cfg.disk_dir:
            tiers.append(DirTier(cfg.disk_dir, cfg.disk_bytes, "disk"))
        if cfg.shared_dir:
            tiers.append(DirTier(cfg.shared_dir, cfg.shared_bytes, "shared", shared=True))
        if cfg.redis_url:
            tiers.append(RedisTier(cfg.redis_url, cfg.redis_bytes, prefix=cfg.redis_prefix))
        for t in tiers:
            t.pins = Pins(cfg.pin_share, t.capacity)
        return cls(tiers, on_event)

    def lookup(self, keys: list[str], touch: bool = False) -> list[str]:
        """Tier name of each leading stored key; stops at the first key no tier has. ``touch``:
        the hits count as used (LRU) — a worker on this host reads them from the disk tier's
        files itself, without a ``get``."""
        return self.lookup_alternatives(keys, touch)[0]

    def lookup_alternatives(self, keys: list[str], touch: bool = False,
                            alternatives: int = 0) -> tuple[list[str], int]:
        """``lookup`` of all but the last ``alternatives`` keys, then — when every one of those is
        stored — the index among the alternatives of the first stored one, its tier appended to
        the tiers (-1: none)."""
        lead, alts = keys[:len(keys) - alternatives], keys[len(keys) - alternatives:]
        out: list[str] = []
        found, alt = [], -1
        for k in lead:
            if not self._found(k, out):
                break
            found.append(k)
        else:
            for i, k in enumerate(alts):
                if self._found(k, out):
                    found.append(k)
                    alt = i
                    break
        if touch:
            self.touch_chain(found)
        return out, alt

    def _found(self, key: str, out: list[str]) -> bool:
        tier = next((t for t in self.tiers if t.contains(key)), None)
        if tier is None:
            return False
        out.append(tier.name)
        return True

    def touch_chain(self, keys: list[str]) -> None:
        """The entries of one prompt's chain (head first) count as used, the head the most
        recently: eviction takes a chain's tail first, and what it leaves is still a prefix a
        lookup reaches (head first, a tier too small for a prompt kept only its unreachable tail)."""
        for k in reversed(keys):
            for t in self.tiers:
                t.touch(k)

    def pin(self, keys: list[str], tenant: str, until: float) -> int:
        """Pin the held ``keys`` in every tier holding them (``Tier.pin``); how many got a pin."""
        return sum(any([t.pin(k, tenant, until) for t in self.tiers]) for k in keys)

    def get(self, key: str) -> bytes | None:
        """The verified entry for ``key``, or None (a corrupt copy is removed, then a miss)."""
        found = self.get_from(key)
        return None if found is None else found[0]

    def get_from(self, key: str) -> tuple[bytes, str] | None:
        """``get``, and the name of the tier the entry came from."""
        check_key(key)
        for i, t in enumerate(self.tiers):
            entry = t.get(key)
            if entry is None:
                continue
            for faster in self.tiers[:i]:
                faster.put(key, entry)
            self.get_bytes += len(entry)
            return entry, t.name
        return None

    def put(self, key: str, entry, pin: tuple[str, float] | None = None, replace: bool = False) -> list[str]:
        """Store a verified entry in every tier; returns the tiers that hold it now. ``pin``:
        (tenant, until) — pinned there (``Tier.pin``); ``replace``: over an entry a tier holds
        (a writer found it unusable). Raises CorruptEntry for an entry that does not check out
        (nothing is stored)."""
        check_key(key)
        try:
            verify_entry(entry, key)
        except CorruptEntry:
            self.rejected += 1
            raise
        entry = bytes(entry)
        stored = [t.name for t in self.tiers if t.put(key, entry, replace)]
        if pin is not None:
            self.pin([key], *pin)
        self.puts += 1
        self.put_bytes += len(entry)
        if stored and self.on_event is not None:
            self.on_event("stored", ",".join(stored), [key])
        return stored

    def stats(self) -> dict:
        return {"puts": self.puts, "put_bytes": self.put_bytes, "get_bytes": self.get_bytes,
                "rejected": self.rejected, "tiers": [t.stats() for t in self.tiers]}

    def _evicted(self, tier: str, key: str) -> None:
        if self.on_event is not None:
            self.on_event("evicted", tier, [key])
