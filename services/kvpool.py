"""The KV pool service, and the client workers use to reach it.

Service (``tandem serve kvpool``): a ``kvpool.pool.KVPool`` (RAM → local disk → shared
directory) on the bus. Control on NATS, entries on the data plane:

    worker                                   pool copy
    lookup(keys)  -- tandem.kvpool.lookup (queue group) -->  hits, tiers, pool id, data address
    get(keys, my receiver) -- tandem.kvpool.<id>.get -->     sends a bundle of entries to the
                                                             worker's receiver, then replies
    bundle -> pool receiver (data plane), then
    put(keys, transfer id) -- tandem.kvpool.<id>.put -->     takes it, verifies, stores

KV events (``KVEventPublisher``): every holder of chunks — each pool copy, each worker's
in-engine prefix cache — publishes the chunk keys it gained and lost as ``KVEvent``s on
``tandem.kvevents.<holder>``, numbered per holder; the router's prefix index
(services/prefix_index.py) follows them. A pool copy announces what it holds when it starts.

Client (``PoolClient``, used by prefill and decode workers): ``fetch_prefix`` asks for the
longest stored prefix of a prompt and returns its decoded KV; ``store`` writes back the chunks
the pool does not hold yet, encoding them in a thread, off the request's critical path. Any
pool failure (none running, timeout, bad entry) is logged and the worker computes instead —
the pool can make a request faster, never make it fail.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterable

from kvpool.codec import ChunkShape, Codec, CorruptEntry, decode_entry, pack_entries, unpack_entries
from kvpool.keys import KeyScope, check_key, chunk_keys
from kvpool.pool import KVPool
from shared import metrics, subjects
from shared.bus import Bus, BusError
from shared.schemas import (
    KVEvent, PoolGet, PoolGetReply, PoolLookup, PoolLookupReply, PoolPut, PoolPutReply, TransferEvent,
)
from shared.settings import PoolSettings, Settings
from shared.subjects import check_token
from shared.transfer import make_transport
from shared.transfer.base import TransferError
from services.prefix_index import ensure_event_stream

log = logging.getLogger("tandem.kvpool")


MAX_EVENT_KEYS = 4096   # keys per KVEvent (about 270 KB encoded, under MAX_PAYLOAD)


def _keys(keys: list[str]) -> list[str]:
    return [check_key(k) for k in keys]


def key_scope(engine, settings: PoolSettings) -> KeyScope:
    """The chunk key scope of ``engine``'s KV: the same for the pool and every worker of one
    model, layout, chunk size, tenant and codec (lossy entries stay apart)."""
    return KeyScope(engine.model_identity, engine.layout.to_dict(), settings.chunk_tokens,
                    tenant=f"{settings.tenant}|{settings.codec}")


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
            await ensure_event_stream(self.bus.nc.jetstream())
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


async def publish_chunk_events(bus: Bus, engine, holder: str, role: str, scope: KeyScope) -> KVEventPublisher:
    """Publish which chunks ``engine``'s prefix cache gains and loses (``Engine.watch_chunks``),
    as ``holder``. Call before the engine takes requests: it is set up from this thread."""
    events = KVEventPublisher(bus, holder, role)
    await events.start()
    loop = asyncio.get_running_loop()
    engine.watch_chunks(scope.seed(), scope.chunk_tokens,
                        lambda stored, evicted: loop.call_soon_threadsafe(events.add, stored, evicted))
    return events


class PoolService:
    role = subjects.KVPOOL

    def __init__(self, settings: Settings):
        self.settings = settings
        self.pool_id = settings.worker.resolved_worker_id(self.role)
        self.pool = KVPool.from_config(settings.pool.pool_config(), on_event=self._on_event)
        self.transport = make_transport(settings.data)
        self.receiver = self.transport.receiver(settings.data.host, settings.data.port)
        self.sender = self.transport.sender()
        self.bus: Bus | None = None
        self.events: KVEventPublisher | None = None
        self.data_host, self.data_port = "", 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        metrics.serve_http(self.settings.worker.metrics_port, self.settings.worker.metrics_host)
        host, self.data_port = await self.receiver.listen()
        self.data_host = self.settings.data.advertise_host or host
        self.bus = await Bus.connect(self.settings, name=self.pool_id)
        self.events = KVEventPublisher(self.bus, self.pool_id, self.role)
        await self.events.start(sorted(set().union(*(t.keys() for t in self.pool.tiers))))
        await self.bus.serve(subjects.POOL_LOOKUP, self.lookup, queue=subjects.POOL_QUEUE, expected=PoolLookup)
        await self.bus.serve(subjects.kvpool_get(self.pool_id), self.get, expected=PoolGet)
        await self.bus.serve(subjects.kvpool_put(self.pool_id), self.put, expected=PoolPut)
        for t in self.pool.tiers:
            metrics.pool_stored(t.name, t.used)
        log.info("kvpool %s ready: tiers %s, data plane %s:%d", self.pool_id,
                 ", ".join(f"{t.name} {len(t)} entries" for t in self.pool.tiers), self.data_host, self.data_port)

    async def lookup(self, req: PoolLookup) -> PoolLookupReply:
        tiers = await asyncio.to_thread(self.pool.lookup, _keys(req.keys))
        for t in tiers:
            metrics.pool_lookup(t, hit=True)
        if len(tiers) < len(req.keys):
            metrics.pool_lookup("all", hit=False)
        return PoolLookupReply(pool_id=self.pool_id, hits=len(tiers), tiers=tiers,
                               chunk_tokens=self.settings.pool.chunk_tokens,
                               data_host=self.data_host, data_port=self.data_port)

    async def get(self, req: PoolGet) -> PoolGetReply:
        keys = _keys(req.keys)
        entries = await asyncio.to_thread(self._read, keys)
        if not entries:
            return PoolGetReply(found=0)
        bundle = pack_entries(entries)
        res = await self.sender.send(req.host, req.port, req.transfer_id, bundle, compressible=False)
        await self.bus.publish(subjects.transfer(self.pool_id), TransferEvent(
            transfer_id=req.transfer_id, request_id="", nbytes=res.nbytes, seconds=res.seconds, path=res.path,
            wire_bytes=res.wire_bytes, attempts=res.attempts))
        return PoolGetReply(found=len(entries), nbytes=res.nbytes, path=res.path)

    def _read(self, keys: list[str]) -> list[bytes]:
        out = []
        for k in keys:
            e = self.pool.get(k)
            if e is None:
                break
            out.append(e)
        return out

    async def put(self, req: PoolPut) -> PoolPutReply:
        keys = _keys(req.keys)
        payload = await self.receiver.take(req.transfer_id, timeout=self.settings.data.timeout)
        with payload:
            stored = await asyncio.to_thread(self._store, keys, payload.data)
        return PoolPutReply(stored=stored)

    def _store(self, keys: list[str], bundle) -> int:
        entries = unpack_entries(bundle)
        if len(entries) != len(keys):
            raise ValueError(f"PoolPut.keys names {len(keys)} entries, the bundle holds {len(entries)}")
        stored = 0
        for k, e in zip(keys, entries):
            try:
                stored += bool(self.pool.put(k, e))
            except CorruptEntry as err:
                log.warning("rejected entry %s: %s", k[:16], err)
        for t in self.pool.tiers:
            metrics.pool_stored(t.name, t.used)
        return stored

    def _on_event(self, kind: str, tier: str, keys: list[str]) -> None:
        """From pool threads (a tier's lock may be held): hand the change to the loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._changed, kind, keys)

    def _changed(self, kind: str, keys: list[str]) -> None:
        """A chunk stored anywhere is held; one evicted from a tier only once no tier has it."""
        if self.events is None:
            return
        if kind == "stored":
            self.events.add(stored=keys)
        else:
            self.events.add(evicted=[k for k in keys if not any(t.contains(k) for t in self.pool.tiers)])

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        await stop.wait()
        await self.close()

    async def close(self) -> None:
        if self.events is not None:
            await self.events.close()
        if self.bus is not None:
            await self.bus.close()
        await self.receiver.close()
        await self.sender.close()


class PoolClient:
    """A worker's side of the pool: fetch a cached prefix, write chunks back."""

    def __init__(self, bus: Bus, settings: PoolSettings, engine, worker_id: str, sender, receiver,
                 data_host: str, data_port: int):
        self.bus = bus
        self.settings = settings
        self.scope = key_scope(engine, settings)
        self.shape = ChunkShape.from_layout(engine.layout.to_dict())
        self.chunk_bytes = settings.chunk_tokens * engine.layout.token_bytes
        self.codec = Codec(settings.codec)
        self.worker_id = worker_id
        self.sender, self.receiver = sender, receiver
        self.data_host, self.data_port = data_host, data_port
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        self.hits = self.misses = self.errors = self.stored = 0

    def keys(self, token_ids: list[int], limit: int | None = None) -> list[str]:
        return chunk_keys(self.scope, token_ids, limit)

    async def _lookup(self, keys: list[str]) -> PoolLookupReply:
        return await self.bus.request(subjects.POOL_LOOKUP, PoolLookup(keys=keys), timeout=self.settings.timeout)

    async def fetch_prefix(self, prompt: list[int], have_tokens: int = 0) -> tuple[list[int], bytearray] | None:
        """(tokens, KV) of the longest stored prefix of ``prompt`` (at most len − 1 tokens: the
        last one is always computed), or None when the pool has no more than ``have_tokens``."""
        keys = self.keys(prompt, len(prompt) - 1)
        if len(keys) * self.settings.chunk_tokens <= have_tokens:
            return None
        try:
            t0 = time.perf_counter()
            found = await self._lookup(keys)
            if found.hits * self.settings.chunk_tokens <= have_tokens:
                self.misses += 1
                return None
            tid = f"{self.worker_id}-pool-{next(self._ids)}"
            reply = await self.bus.request(subjects.kvpool_get(found.pool_id), PoolGet(
                keys=keys[:found.hits], transfer_id=tid, host=self.data_host, port=self.data_port),
                timeout=self.settings.timeout)
            if reply.found == 0:
                self.receiver.discard(tid)
                return None
            payload = await self.receiver.take(tid, timeout=self.settings.timeout)
            with payload:
                kv = await asyncio.to_thread(self._decode, keys[:reply.found], payload.data)
        except (BusError, TransferError, CorruptEntry, TimeoutError) as e:
            self.errors += 1
            log.warning("KV pool unavailable for this prompt (%s); computing it", e)
            return None
        self.hits += 1
        n = reply.found * self.settings.chunk_tokens
        log.info("KV pool: %d prefix tokens (%s) in %.1f ms", n, ",".join(sorted(set(found.tiers))),
                 (time.perf_counter() - t0) * 1e3)
        return prompt[:n], kv

    def _decode(self, keys: list[str], bundle) -> bytearray:
        entries = unpack_entries(bundle)
        out = bytearray(len(entries) * self.chunk_bytes)
        for i, (k, e) in enumerate(zip(keys, entries)):
            raw = decode_entry(e, k)
            if len(raw) != self.chunk_bytes:
                raise CorruptEntry(f"entry {k[:16]} holds {len(raw)} bytes, a chunk is {self.chunk_bytes}")
            out[i * self.chunk_bytes:(i + 1) * self.chunk_bytes] = raw
        return out

    def store_later(self, token_ids: list[int], kv) -> None:
        """Write back the full chunks of (``token_ids``, their KV) in the background."""
        if len(token_ids) < self.settings.chunk_tokens:
            return
        t = asyncio.create_task(self.store(token_ids, kv), name="pool-store")
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def store(self, token_ids: list[int], kv) -> int:
        """Put the chunks the pool lacks; returns how many it stored (0 on any failure)."""
        keys = self.keys(token_ids)
        try:
            found = await self._lookup(keys)
            missing = keys[found.hits:]
            if not missing or not found.data_port:
                return 0
            entries = await asyncio.to_thread(self._encode, missing, kv, found.hits)
            tid = f"{self.worker_id}-put-{next(self._ids)}"
            res = await self.sender.send(found.data_host, found.data_port, tid, pack_entries(entries),
                                         compressible=False)
            await self.bus.publish(subjects.transfer(self.worker_id), TransferEvent(
                transfer_id=tid, request_id="", nbytes=res.nbytes, seconds=res.seconds, path=res.path,
                wire_bytes=res.wire_bytes, attempts=res.attempts))
            reply = await self.bus.request(subjects.kvpool_put(found.pool_id),
                                           PoolPut(keys=missing, transfer_id=tid), timeout=self.settings.timeout)
        except (BusError, TransferError, TimeoutError) as e:
            self.errors += 1
            log.warning("KV pool write-back failed: %s", e)
            return 0
        self.stored += reply.stored
        return reply.stored

    def _encode(self, keys: list[str], kv, first: int) -> list[bytes]:
        mv = memoryview(kv).cast("B")
        c = self.chunk_bytes
        return [self.codec.encode(k, mv[(first + i) * c:(first + i + 1) * c], self.shape) for i, k in enumerate(keys)]

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=30)

