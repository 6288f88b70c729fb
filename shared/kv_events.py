"""KV events: which pool chunks each KV holder gained and lost, published for the routers.

Every holder of chunks — each pool copy, each worker's in-engine prefix cache — publishes the
chunk keys it gained and lost as ``KVEvent``s on ``tandem.kvevents.<holder>``, numbered per
holder and epoch (``KVEventPublisher``); a JetStream stream (``ensure_event_stream``) keeps them,
so a router that starts later replays what it missed (services/prefix_index.py reads them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

import nats.js.errors
from nats.js import api

from shared import subjects
from shared.bus import Bus
from shared.schemas import KVEvent
from shared.subjects import check_token

log = logging.getLogger("tandem.kvevents")

STREAM = "TANDEM_KVEVENTS"   # JetStream stream of every KVEvent
MAX_EVENT_KEYS = 4096   # keys per KVEvent (about 270 KB encoded, under MAX_PAYLOAD)


class KVEventPublisher:
    """One holder's KVEvents, in order. ``add`` (on the loop) merges changes, the last state of
    a key winning; they go out as one event per loop turn (split past ``MAX_EVENT_KEYS``),
    numbered 1, 2, ... in this epoch. ``start`` sends event 1 at once: a reader learns of a
    new epoch (the holder restarted) even before it caches anything."""

    def __init__(self, bus: Bus, holder: str, role: str):
        self.bus = bus
        self.holder = check_token(holder, "holder")
        self.role = subjects.check_role(role)
        self.subject = subjects.kv_events(holder)
        self.epoch = time.time_ns()
        self.seq = 0                                # the last event numbered
        self.failed = 0                             # events that could not be published
        self._changes: dict[str, bool] = {}         # key -> stored (True) / evicted (False)
        self._queue: asyncio.Queue[KVEvent | None] = asyncio.Queue()
        self._scheduled = False
        self._task: asyncio.Task | None = None

    async def start(self, stored: Iterable[str] = ()) -> None:
        """Start sending; the first event announces the epoch and ``stored``, what the holder has.
        Makes sure the JetStream stream that keeps events for the routers exists first."""
        try:
            await ensure_event_stream(self.bus.nc.jetstream(), bus=self.bus)
        except Exception as e:  # no JetStream: routers follow live events only (they log it)
            log.debug("KV event stream not ensured: %s", e)
        self._task = asyncio.create_task(self._send(), name=f"kvevents-{self.holder}")
        for k in stored:
            self._changes[k] = True
        self._flush(always=True)

    def add(self, stored: Iterable[str] = (), evicted: Iterable[str] = ()) -> None:
        """Record changes (on the loop): ``evicted`` apply before ``stored``."""
        for k in evicted:
            self._changes[k] = False
        for k in stored:
            self._changes[k] = True
        if self._changes and not self._scheduled and self._task is not None:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self, always: bool = False) -> None:
        self._scheduled = False
        if not self._changes and not always:
            return
        items, self._changes = list(self._changes.items()), {}
        for i in range(0, max(len(items), 1), MAX_EVENT_KEYS):
            part = items[i:i + MAX_EVENT_KEYS]
            self.seq += 1
            self._queue.put_nowait(KVEvent(holder=self.holder, role=self.role, epoch=self.epoch, seq=self.seq,
                                           stored=[k for k, v in part if v], evicted=[k for k, v in part if not v]))

    async def _send(self) -> None:
        while (ev := await self._queue.get()) is not None:
            try:
                await self.bus.publish(self.subject, ev)
            except Exception as e:  # a reader sees the gap in seq
                self.failed += 1
                log.warning("KVEvent %d of %s not published: %s", ev.seq, self.holder, e)
            self._queue.task_done()

    async def drain(self) -> None:
        """Send what is pending now and wait until it is handed to the connection."""
        self._flush()
        await self._queue.join()

    async def close(self, timeout: float = 5.0) -> None:
        """Send what is pending, then stop."""
        if self._task is None:
            return
        self._flush()
        self._queue.put_nowait(None)
        try:
            await asyncio.wait_for(self._task, timeout)
        except asyncio.TimeoutError:
            log.warning("KV events of %s not all sent within %.0fs", self.holder, timeout)
        self._task = None


async def ensure_event_stream(js, name: str = STREAM, max_age: float = 3600.0,
                              max_bytes: int = 256 << 20, bus=None) -> api.StreamInfo:
    """The JetStream stream capturing every KVEvent, created if missing (by the first router or
    KV holder to start: events sent before any router runs are kept too), with the replicas
    ``bus.jetstream_ensure`` picks (TANDEM_NATS_REPLICAS; one without a bus)."""
    def create(replicas: int):
        return js.add_stream(api.StreamConfig(
            name=name, subjects=[subjects.KV_EVENTS_ALL], storage=api.StorageType.FILE,
            retention=api.RetentionPolicy.LIMITS, discard=api.DiscardPolicy.OLD,
            max_age=max_age, max_bytes=max_bytes, num_replicas=replicas))
    try:
        if bus is None:
            try:
                return await js.stream_info(name)
            except nats.js.errors.NotFoundError:
                return await create(1)
        return await bus.jetstream_ensure(f"stream {name}", lambda: js.stream_info(name), create)
    except nats.js.errors.BadRequestError:  # someone else created it meanwhile
        return await js.stream_info(name)
