"""Pinned entries: kept by a tier's LRU eviction until their time is up, within a tenant's share.

A session sent with ``prompt_cache_retention: "24h"`` pins its pool entries for a day under its
tenant (docs/api.md): a tier evicts unpinned entries first and skips pinned ones while their pin
lasts. A tenant's pinned bytes in a tier never exceed ``share`` of the tier's capacity: pinning
past it unpins that tenant's **oldest** pins (they stay stored, as ordinary LRU entries) — a
request is never refused for it, and one tenant can never pin the pool full for the others.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable


PIN_S = {"24h": 86400.0}   # prompt_cache_retention -> seconds a session's pool entries are pinned


def pin_seconds(retention: str) -> float:
    """How long a session with this ``prompt_cache_retention`` pins its entries (0: not)."""
    return PIN_S.get(retention, 0.0)


class Pins:
    def __init__(self, share: float, capacity: int, clock: Callable[[], float] = time.time):
        if not 0 <= share <= 1:
            raise ValueError(f"the pin share must be in [0, 1], got {share}")
        self.limit = int(share * capacity)       # bytes one tenant may pin
        self.clock = clock
        self._pins: dict[str, tuple[str, float, int]] = {}          # key -> (tenant, until, bytes)
        self._by_tenant: dict[str, OrderedDict[str, int]] = {}      # tenant -> key -> bytes, oldest first
        self.bytes: dict[str, int] = {}                              # tenant -> bytes pinned
        self.unpinned = 0                                            # pins dropped to keep a share

    def pin(self, key: str, tenant: str, nbytes: int, until: float) -> list[str]:
        """Pin ``key`` (``nbytes``) for ``tenant`` until ``until`` (a later pin of a pinned key
        extends it and makes it the newest); returns the keys unpinned to stay within the share
        (``key`` itself when it alone is larger)."""
        old = self._pins.get(key)
        if old is not None:
            self._unpin(key)
            until = max(until, old[1])
        mine = self._by_tenant.setdefault(tenant, OrderedDict())
        mine[key] = nbytes
        self._pins[key] = (tenant, until, nbytes)
        self.bytes[tenant] = self.bytes.get(tenant, 0) + nbytes
        dropped = []
        while self.bytes[tenant] > self.limit and mine:
            dropped.append(next(iter(mine)))
            self._unpin(dropped[-1])
            self.unpinned += 1
        return dropped

    def pinned(self, key: str) -> bool:
        """``key`` is pinned now (an expired pin is dropped here)."""
        p = self._pins.get(key)
        if p is None:
            return False
        if p[1] <= self.clock():
            self._unpin(key)
            return False
        return True

    def forget(self, key: str) -> None:
        """``key`` left the tier (removed, corrupt): its pin goes too."""
        if key in self._pins:
            self._unpin(key)

    def tenant_bytes(self, tenant: str) -> int:
        return self.bytes.get(tenant, 0)

    def _unpin(self, key: str) -> None:
        tenant, _, nbytes = self._pins.pop(key)
        mine = self._by_tenant[tenant]
        del mine[key]
        self.bytes[tenant] -= nbytes
        if not mine:
            del self._by_tenant[tenant]
            del self.bytes[tenant]

    def __len__(self) -> int:
        return len(self._pins)
