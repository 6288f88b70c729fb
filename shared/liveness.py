"""What "alive" and "gone" mean, once: heartbeats by this process's clock.

Every service (worker, router, pool copy) publishes a ``Heartbeat`` on
``tandem.heartbeat.<role>.<id>`` every ``interval`` seconds. A heartbeat vouches for its sender
for ``LIVENESS_FACTOR`` of its intervals, measured on the receiver's monotonic clock (``clock``:
senders' clocks are never compared). Alive: a fresh heartbeat that says ready. Gone: no fresh
heartbeat (ready or not). ``Heartbeats`` is the one subscriber that keeps the last heartbeat of
each sender; the router (services/router.py, its views in services/placement.py), the gateway
(services/gateway/nats_backend.py) and each worker's KV connector (shared/kv_connector.py,
whose ``DataPeers`` keys them by data-plane address) use it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from shared import subjects
from shared.schemas import Heartbeat

LIVENESS_FACTOR = 3.0   # a heartbeat vouches for its sender this many of its intervals
clock = time.monotonic  # the receiver's clock every "seen" is taken on


def fresh(seen: float, interval: float, now: float) -> bool:
    """Whether a heartbeat received at ``seen`` (``clock``) announcing ``interval`` still
    vouches for its sender at ``now``."""
    return now - seen <= LIVENESS_FACTOR * interval


class Heartbeats:
    """The last heartbeat of every sender, kept from ``tandem.heartbeat.>``; ``on_beat(beat,
    seen)`` is called for each as it arrives (on the event loop)."""

    def __init__(self, bus, on_beat: Callable[[Heartbeat, float], None] | None = None, name: str = "heartbeats"):
        self.bus, self.on_beat, self.name = bus, on_beat, name
        self.last: dict[str, tuple[Heartbeat, float]] = {}   # sender id -> (its last heartbeat, seen at)
        self._sub = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, skip_invalid=True)
        self._task = asyncio.create_task(self._watch(self._sub), name=self.name)

    async def _watch(self, sub) -> None:
        async for beat in sub:
            self.seen(beat)

    def seen(self, beat: Heartbeat, now: float | None = None) -> None:
        """Take ``beat`` as received at ``now`` (default: the clock)."""
        now = clock() if now is None else now
        self.last[beat.worker_id] = (beat, now)
        if self.on_beat is not None:
            self.on_beat(beat, now)

    def refused(self, within: float = 30.0) -> tuple[int, str]:
        """(heartbeats refused so far — another release's version, a bad field —, the last one's
        why) when the last was refused within ``within`` seconds; else (0, "")."""
        sub = self._sub
        if sub is None or not sub.skipped or time.monotonic() - sub.last_skipped_at > within:
            return 0, ""
        return sub.skipped, sub.last_skipped

    def alive(self, worker: str, now: float | None = None) -> bool:
        """A fresh heartbeat from ``worker`` that says it is ready."""
        got = self.last.get(worker)
        return got is not None and got[0].ready and fresh(got[1], got[0].interval, clock() if now is None else now)

    def gone(self, worker: str, now: float | None = None) -> bool:
        """No fresh heartbeat from ``worker`` (ready or not)."""
        got = self.last.get(worker)
        return got is None or not fresh(got[1], got[0].interval, clock() if now is None else now)

    def heard_any(self, now: float | None = None) -> bool:
        """A fresh heartbeat from any sender: this process hears the bus (its server relays)."""
        now = clock() if now is None else now
        return any(fresh(seen, b.interval, now) for b, seen in self.last.values())

    def live(self, now: float | None = None) -> list[Heartbeat]:
        """The last heartbeats of every sender alive at ``now``."""
        now = clock() if now is None else now
        return [b for b, seen in self.last.values() if b.ready and fresh(seen, b.interval, now)]

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
