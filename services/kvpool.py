"""The KV pool service (``tandem serve kvpool``): a ``kvpool.pool.KVPool`` (RAM → local disk →
shared directory) on the bus. Control on NATS, entries on the data plane:

    worker                                   pool copy
    lookup(keys)  -- tandem.kvpool.lookup (queue group) -->  hits, tiers, pool id, data address
    get(keys, my receiver) -- tandem.kvpool.<id>.get -->     sends a bundle of entries to the
                                                             worker's receiver, then replies
    bundle -> pool receiver (data plane), then
    put(keys, transfer id) -- tandem.kvpool.<id>.put -->     takes it, verifies, stores

A get is sent only to the data-plane address of a live worker (from its heartbeats; else a
``forbidden`` error), a put is stored only if the bytes received match the size and checksum the
PoolPut announced (docs/security.md, Data plane).

A pool copy announces what it holds as KV events when it starts and as its tiers change
(shared/kv_events.py), so the routers' prefix index counts the pool as a holder. It publishes a
heartbeat like every service (role ``kvpool``; no data-plane address in it: that one comes with a
lookup's reply), so the gateway's ``/health`` lists the pool copies live and a router forgets a
dead copy's index entries once its heartbeats stop. The workers' side is
``shared/kv_connector.PoolClient``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from kvpool.codec import CorruptEntry, pack_entries, unpack_entries
from kvpool.keys import check_key
from kvpool.pool import KVPool
from shared import metrics, subjects
from shared.bus import Bus, BusError
from shared.kv_connector import DataPeers, send_and_report
from shared.kv_events import KVEventPublisher
from shared.schemas import Heartbeat, PoolGet, PoolGetReply, PoolLookup, PoolLookupReply, PoolPut, PoolPutReply
from shared.settings import Settings
from shared.transfer import ChecksumError, make_transport
from shared.transfer.base import TransferError

log = logging.getLogger("tandem.kvpool")


def _keys(keys: list[str]) -> list[str]:
    return [check_key(k) for k in keys]


QUIET_S = 0.5          # draining: a pool with nothing announced or in flight for this long stops
ANNOUNCED_TTL_S = 30.0  # a write-back announced this long ago and never put has failed: forgotten


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
        self.peers: DataPeers | None = None   # live workers' data-plane addresses: where gets may go
        self.events: KVEventPublisher | None = None
        self.data_host, self.data_port = "", 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._readers = ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="pool-read")
        # write-backs announced by a lookup(for_put) and not put yet: first missing key -> times
        self._announced: dict[str, list[float]] = defaultdict(list)
        self._putting = 0                     # puts in flight
        self._last_seen = 0.0                 # monotonic time of the last lookup / put
        self.stored = 0                       # chunks stored by puts since the start
        self.metrics_port = 0
        self.stopping = False                 # SIGTERM: draining the last write-backs (not ready)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.metrics_port = metrics.serve_http(self.settings.worker.metrics_port,
                                               self.settings.worker.metrics_host) or 0
        host, self.data_port = await self.receiver.listen()
        self.data_host = self.settings.data.advertise_host or host
        self.bus = await Bus.connect(self.settings, name=self.pool_id, role=subjects.KVPOOL)
        self.peers = DataPeers(self.bus, 2 * self.settings.worker.heartbeat_interval)
        await self.peers.start()
        self.events = KVEventPublisher(self.bus, self.pool_id, self.role)
        await self.events.start(sorted(set().union(*(t.keys() for t in self.pool.tiers))))
        await self.bus.serve(subjects.POOL_LOOKUP, self.lookup, queue=subjects.POOL_QUEUE, expected=PoolLookup)
        await self.bus.serve(subjects.kvpool_get(self.pool_id), self.get, expected=PoolGet)
        await self.bus.serve(subjects.kvpool_put(self.pool_id), self.put, expected=PoolPut)
        for t in self.pool.tiers:
            metrics.pool_stored(t.name, t.used)
        metrics.watch_pool_tiers(self.pool.tiers)
        metrics.set_ready(self.role, True)  # from here on it serves; NATS reconnects on its own
        self.bus.start_heartbeat(subjects.heartbeat(self.role, self.pool_id), self.heartbeat,
                                 self.settings.worker.heartbeat_interval)
        log.info("kvpool %s ready: tiers %s, data plane %s:%d", self.pool_id,
                 ", ".join(f"{t.name} {len(t)} entries" for t in self.pool.tiers), self.data_host, self.data_port)

    def heartbeat(self) -> Heartbeat:
        """Alive, and ready unless stopping; no load figures, no data-plane address (module doc)."""
        return Heartbeat(worker_id=self.pool_id, role=self.role, device="cpu", model="", ready=not self.stopping,
                         queue_depth=0, running=self._putting, free_kv_blocks=0, total_kv_blocks=0, max_context=0,
                         data_host="", data_port=0, ts=time.time(),
                         interval=self.settings.worker.heartbeat_interval, metrics_port=self.metrics_port)

    async def lookup(self, req: PoolLookup) -> PoolLookupReply:
        self._last_seen = time.monotonic()
        if not 0 <= req.alternatives <= len(req.keys) or req.pin_s < 0:
            raise BusError("bad_request", f"alternatives={req.alternatives} of {len(req.keys)} keys, "
                                          f"pin_s={req.pin_s}")
        tiers, alt = await asyncio.to_thread(self.pool.lookup_alternatives, _keys(req.keys), not req.for_put,
                                             req.alternatives)
        hits = len(tiers) - (alt >= 0)
        if req.for_put and req.pin_s and hits:   # a pinned session's write-back: what is stored already
            await asyncio.to_thread(self.pool.pin, req.keys[:hits], req.tenant, time.time() + req.pin_s)
        if req.for_put and hits < len(req.keys):  # the writer puts keys[hits:] next
            self._announced[req.keys[hits]].append(time.monotonic())
        if not req.for_put:   # a read (a write-back's "what is there already" is no lookup for KV)
            metrics.pool_lookup(tiers[0] if hits else "none", hit=bool(hits))
        return PoolLookupReply(pool_id=self.pool_id, hits=hits, tiers=tiers,
                               chunk_tokens=self.settings.pool.chunk_tokens,
                               data_host=self.data_host, data_port=self.data_port, alternative=alt)

    async def get(self, req: PoolGet) -> PoolGetReply:
        keys = _keys(req.keys)
        await self.peers.check(req.host, req.port, what="KV pool entries")
        entries = await asyncio.to_thread(self._read, keys)
        if not entries:
            return PoolGetReply(found=0)
        try:
            res = await send_and_report(self.bus, self.sender, self.pool_id, req.host, req.port, req.transfer_id,
                                        pack_entries(entries), compressible=False)
        except TransferError as e:   # a coded answer (the worker computes the prefix), not an internal error
            raise BusError("unavailable", f"the entries could not be sent to {req.host}:{req.port}: {e}") from None
        return PoolGetReply(found=len(entries), nbytes=res.nbytes, path=res.path, checksum=res.checksum)

    def _read(self, keys: list[str]) -> list[bytes]:
        """The leading entries of ``keys`` the pool has, read and verified several at a time (file
        reads and blake3 release the GIL)."""
        out = []
        for found in self._readers.map(self.pool.get_from, keys):
            if found is None:
                break
            out.append(found[0])
            metrics.pool_hit_bytes(found[1], len(found[0]))
        self.pool.touch_chain(keys[:len(out)])
        return out

    async def put(self, req: PoolPut) -> PoolPutReply:
        keys = _keys(req.keys)
        if req.pin_s < 0:
            raise BusError("bad_request", f"pin_s must be >= 0, got {req.pin_s}")
        self._putting += 1
        try:
            payload = await self.receiver.take(req.transfer_id, timeout=self.settings.data.timeout)
            try:
                payload.expect(req.checksum, req.nbytes)
            except ChecksumError as e:
                raise BusError("bad_request", f"put {req.transfer_id} not stored: {e}") from None
            pin = (req.tenant, time.time() + req.pin_s) if req.pin_s else None
            with payload:
                stored = await asyncio.to_thread(self._store, keys, payload.data, pin, set(_keys(req.replace)))
        finally:
            self._putting -= 1
            self._last_seen = time.monotonic()
            # the key its lookup announced: the first it lacked — the put's first, or a later one
            # when the writer puts entries it could not use again before it (``PoolPut.replace``)
            first = next((k for k in keys if k in self._announced), None)
            if first is not None and (times := self._announced[first]):
                times.pop(0)
                if not times:
                    del self._announced[first]
        self.stored += stored
        return PoolPutReply(stored=stored)

    def _waiting_for(self) -> int:
        """Write-backs announced and not put yet (those announced over ANNOUNCED_TTL_S ago forgotten)."""
        old = time.monotonic() - ANNOUNCED_TTL_S
        for k in list(self._announced):
            self._announced[k] = times = [t for t in self._announced[k] if t > old]
            if not times:
                del self._announced[k]
        return sum(map(len, self._announced.values())) + self._putting

    async def drain(self) -> None:
        """After SIGTERM: go on taking write-backs while any is announced or in flight, or a
        lookup / put came within QUIET_S — TANDEM_POOL_DRAIN_S at most. Under ``tandem up`` the
        workers stopped first (nothing left to wait for); when every process gets SIGTERM at
        once (systemd, ``kill -9`` of ``tandem up``) the workers' last write-backs land here."""
        self.stopping = True
        t0 = time.monotonic()
        deadline, stored = t0 + self.settings.pool.drain_s, self.stored
        while (waiting := self._waiting_for()) or time.monotonic() - self._last_seen < QUIET_S:
            if time.monotonic() >= deadline:
                log.warning("kvpool %s stopping with %d write-back(s) announced or in flight still "
                            "(TANDEM_POOL_DRAIN_S %.1f s)", self.pool_id, waiting, self.settings.pool.drain_s)
                break
            await asyncio.sleep(0.05)
        log.info("kvpool %s: %d chunk(s) stored while stopping, in %.1f s", self.pool_id, self.stored - stored,
                 time.monotonic() - t0)

    def _store(self, keys: list[str], bundle, pin: tuple[str, float] | None = None,
               replace: set[str] = frozenset()) -> int:
        entries = unpack_entries(bundle)
        if len(entries) != len(keys):
            raise ValueError(f"PoolPut.keys names {len(keys)} entries, the bundle holds {len(entries)}")
        if replace:
            log.info("replacing %d entr%s a worker could not use (MAC): %s", len(replace),
                     "y" if len(replace) == 1 else "ies", ", ".join(k[:16] for k in sorted(replace)[:4]))
        stored = 0
        # the chain's tail first: a tier that cannot hold the whole prompt keeps its head (a
        # reachable prefix), evicting the tail put a moment before — not the other way round
        for k, e in reversed(list(zip(keys, entries))):
            try:
                stored += bool(self.pool.put(k, e, pin, k in replace))
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
        """A chunk stored anywhere is held; one evicted from a tier only once no tier indexes it
        (the index only: this runs on the event loop, a shared tier's store is a network away)."""
        if self.events is None:
            return
        if kind == "stored":
            self.events.add(stored=keys)
        else:
            self.events.add(evicted=[k for k in keys if not any(t.holds(k) for t in self.pool.tiers)])

    async def run_until(self, stop: asyncio.Event) -> None:
        """Started: serve until ``stop`` is set, then drain and close."""
        await stop.wait()
        await self.drain()
        await self.close()

    async def close(self) -> None:
        if self.events is not None:
            await self.events.close()
        if self.peers is not None:
            await self.peers.close()
        if self.bus is not None:
            await self.bus.close()
        await self.receiver.close()
        await self.sender.close()
        self._readers.shutdown(wait=False)
