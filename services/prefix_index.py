"""The router's exact prefix index: which KV pool chunks every KV holder has, from KV events.

Every holder — a worker's in-engine prefix cache, a pool copy — names what it holds in one key
space, the pool's chunk keys (kvpool/keys.py), and publishes the keys it gains and loses as
``KVEvent``s (shared/kv_events.py ``KVEventPublisher``). The router keys a prompt the same way
(``chunk_keys_from_seed`` with a heartbeat's ``kv_scope`` and ``chunk_tokens``) and asks
``PrefixIndex.overlap`` how many leading chunks each holder has.

``PrefixIndex`` is pure state (no I/O). Per holder it applies events in their ``seq`` order:
a duplicate or an older epoch's event is ignored; a newer epoch (the holder restarted) empties
the holder first; an event ahead of the next seq waits (up to ``REORDER_WINDOW`` events) for
the missing ones, which then count as ``gaps``.

``IndexFeed`` keeps an index current from the bus. With JetStream, a stream captures the KV
event subjects (bounded by age and bytes); the feed applies it through an ordered consumer,
and every ``snapshot_every`` seconds or ``snapshot_events`` events (and at close) writes the
index to a JetStream KV bucket together with the stream sequence it covers. A starting feed
restores the latest snapshot, replays the stream from the sequence after it, then goes on
live: events published while no router ran are not lost. Router copies share the stream and
the bucket; a snapshot replaces the stored one only if it covers a later sequence. Without
JetStream (a plain NATS server) the feed warns and applies live events only.

Snapshot in the bucket: ``head`` = JSON {id, seq, parts, bytes, router}; the parts
``part.<id>.<i>`` hold zstd(JSON of ``PrefixIndex.snapshot()``) cut to fit a message.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
import orjson
import zstandard
from nats.js import api

from shared import schemas, subjects
from shared.bus import Bus
from shared.kv_events import STREAM, ensure_event_stream
from shared.schemas import KVEvent, SchemaError
from shared.settings import Settings

log = logging.getLogger("tandem.router.index")

REORDER_WINDOW = 64          # events a holder's out-of-order event waits behind, at most
SNAPSHOT_VERSION = 1
BUCKET = "tandem_prefix_index"
HEAD = "head"


@dataclass
class _Holder:
    role: str
    epoch: int
    seq: int                                            # the last event applied
    keys: set[str] = field(default_factory=set)
    pending: dict[int, KVEvent] = field(default_factory=dict)  # seq -> event waiting for earlier ones


class PrefixIndex:
    """Chunk key -> holders, and holder -> keys; O(1) per key applied."""

    def __init__(self):
        self.holders: dict[str, _Holder] = {}
        self.where: dict[str, set[str]] = {}   # chunk key -> holders with it
        self.applied = 0                       # events applied
        self.ignored = 0                       # duplicates and older epochs' events
        self.gaps = 0                          # events a holder numbered but this index never saw

    def __len__(self) -> int:
        return len(self.where)

    def apply(self, ev: KVEvent) -> None:
        """Apply one event, in its holder's order (see the module doc)."""
        h = self.holders.get(ev.holder)
        if h is None or ev.epoch > h.epoch:
            if h is not None:
                self._clear(ev.holder, h)
            self.gaps += ev.seq - 1            # a holder first seen after its first events
            h = self.holders[ev.holder] = _Holder(ev.role, ev.epoch, ev.seq - 1)
        elif ev.epoch < h.epoch or ev.seq <= h.seq or ev.seq in h.pending:
            self.ignored += 1
            return
        if ev.seq == h.seq + 1:
            self._apply(ev.holder, h, ev)
        else:
            h.pending[ev.seq] = ev
            if len(h.pending) <= REORDER_WINDOW:
                return
            first = min(h.pending)             # waited long enough: the missing ones are lost
            self.gaps += first - h.seq - 1
            h.seq = first - 1
        while h.seq + 1 in h.pending:
            self._apply(ev.holder, h, h.pending.pop(h.seq + 1))

    def _apply(self, name: str, h: _Holder, ev: KVEvent) -> None:
        where = self.where
        for k in ev.evicted:
            if k in h.keys:
                h.keys.discard(k)
                s = where[k]
                s.discard(name)
                if not s:
                    del where[k]
        for k in ev.stored:
            if k not in h.keys:
                h.keys.add(k)
                s = where.get(k)
                if s is None:
                    where[k] = {name}
                else:
                    s.add(name)
        h.seq = ev.seq
        self.applied += 1

    def overlap(self, keys: list[str]) -> dict[str, int]:
        """Holder -> how many of ``keys`` (a prompt's chunk keys, in order) it holds contiguously
        from the first; holders with none are left out."""
        first = self.where.get(keys[0]) if keys else None
        if not first:
            return {}
        live, out = set(first), {}
        for i in range(1, len(keys)):   # per key: set operations over the holders still in the run
            have = self.where.get(keys[i])
            gone = live - have if have else live
            if gone:
                out.update(dict.fromkeys(gone, i))
                live = live - gone
                if not live:
                    return out
        out.update(dict.fromkeys(live, len(keys)))
        return out

    def role(self, holder: str) -> str | None:
        h = self.holders.get(holder)
        return h.role if h else None

    def keys_of(self, holder: str) -> set[str]:
        h = self.holders.get(holder)
        return set(h.keys) if h else set()

    def drop_holder(self, holder: str) -> bool:
        """Forget a holder (its heartbeats stopped); False if unknown. Its next event starts it afresh."""
        h = self.holders.pop(holder, None)
        if h is None:
            return False
        self._clear(holder, h)
        return True

    def _clear(self, name: str, h: _Holder) -> None:
        for k in h.keys:
            s = self.where[k]
            s.discard(name)
            if not s:
                del self.where[k]
        h.keys.clear()
        h.pending.clear()

    def snapshot(self) -> dict:
        """The whole state as plain JSON-able data (a copy)."""
        return {"version": SNAPSHOT_VERSION, "holders": {
            name: {"role": h.role, "epoch": h.epoch, "seq": h.seq, "keys": list(h.keys),
                   "pending": [schemas.to_dict(e) for e in h.pending.values()]}
            for name, h in self.holders.items()}}

    def restore(self, snap: dict) -> None:
        """Replace the state with a ``snapshot()``; ValueError (nothing changed) if it is not one."""
        try:
            if snap.get("version") != SNAPSHOT_VERSION:
                raise ValueError(f"snapshot version {snap.get('version')!r}, expected {SNAPSHOT_VERSION}")
            holders, where = {}, {}
            for name, d in snap["holders"].items():
                pending = {}
                for e in d["pending"]:
                    ev = schemas.decode(orjson.dumps(e), KVEvent)
                    pending[ev.seq] = ev
                h = holders[name] = _Holder(str(d["role"]), int(d["epoch"]), int(d["seq"]), set(d["keys"]), pending)
                for k in h.keys:
                    s = where.get(k)
                    if s is None:
                        where[k] = {name}
                    else:
                        s.add(name)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a prefix index snapshot: {type(e).__name__}: {e}") from None
        self.holders, self.where = holders, where


class IndexFeed:
    """Keeps a ``PrefixIndex`` current from the KV events on the bus (see the module doc)."""

    def __init__(self, bus: Bus, index: PrefixIndex, settings: Settings | None = None, *,
                 stream: str = STREAM, bucket: str = BUCKET, max_age: float = 3600.0,
                 max_bytes: int = 256 << 20, snapshot_every: float = 10.0, snapshot_events: int = 10_000,
                 part_bytes: int = 512 << 10, catch_up_timeout: float = 30.0):
        self.bus = bus
        self.index = index
        self.name = settings.worker.resolved_worker_id(subjects.ROUTER) if settings else "router"
        self.stream, self.bucket = stream, bucket
        self.max_age, self.max_bytes = max_age, max_bytes          # the stream's bounds (when this feed creates it)
        self.snapshot_every, self.snapshot_events = snapshot_every, snapshot_events
        self.part_bytes = part_bytes                               # snapshot bytes per KV value
        self.catch_up_timeout = catch_up_timeout                   # start() waits this long for the replay
        self.mode = ""                  # "jetstream" or "live" (no JetStream) once started
        self.seq = 0                    # the last stream sequence applied
        self.saved_seq = 0              # the stream sequence of the last snapshot written or restored
        self.replayed = 0               # events replayed at start (up to the stream's end then)
        self._since = 0                 # events since the last snapshot
        self._target = 0                # the stream's last sequence at start
        self._caught_up = asyncio.Event()
        self._wake = asyncio.Event()
        self._sub = None
        self._kv = None
        self._js = None
        self._task: asyncio.Task | None = None

    # ---- start / close ------------------------------------------------------------------
    async def start(self) -> None:
        """Restore, replay, go live; returns once the replay reached the stream's end at start."""
        js = self.bus.nc.jetstream()
        try:
            info = await self._ensure_stream(js)
            self._kv = await self._ensure_bucket(js)
        except (nats.errors.Error, asyncio.TimeoutError) as e:
            log.warning("prefix index: JetStream unavailable (%s: %s); following live KV events only — "
                        "events published while no router runs are lost", type(e).__name__, e)
            self.mode = "live"
            self._sub = await self.bus.nc.subscribe(subjects.KV_EVENTS_ALL, cb=self._on_live)
            await self.bus.flush()
            return
        self._js, self.mode = js, "jetstream"
        try:
            head = await self._restore()
        except (nats.errors.Error, asyncio.TimeoutError) as e:
            log.warning("prefix index: snapshot not read (%s: %s); replaying the whole stream", type(e).__name__, e)
            head = None
        first, self._target = info.state.first_seq, info.state.last_seq
        if head is not None and self.seq > self._target:
            log.warning("prefix index: snapshot covers stream seq %d, the stream ends at %d (it was "
                        "recreated): snapshot dropped, replaying the stream", self.seq, self._target)
            self.index.restore(PrefixIndex().snapshot())
            self.seq = self.saved_seq = 0
            await self._kv.purge(HEAD)
        start = self.seq + 1
        if head is not None and start < first:
            log.warning("prefix index: snapshot covers up to stream seq %d, the stream starts at %d: "
                        "%d events aged out, the index may miss changes", self.seq, first, first - start)
        if self._target < max(start, first):
            self._caught_up.set()
        t0 = time.perf_counter()
        # a fresh config (so a fresh inbox) an attempt: a consumer whose creation timed out may
        # still exist, and must not deliver to the next attempt's subscription
        self._sub = await self.bus.jetstream_retry("consumer of the KV events", lambda: js.subscribe(
            subjects.KV_EVENTS_ALL, stream=self.stream, cb=self._on_msg, ordered_consumer=True,
            config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)))
        try:
            await asyncio.wait_for(self._caught_up.wait(), self.catch_up_timeout)
        except asyncio.TimeoutError:
            log.warning("prefix index: replay not done within %.0fs (at stream seq %d of %d); going on",
                        self.catch_up_timeout, self.seq, self._target)
        self.replayed = self._since
        log.info("prefix index: %d keys, %d holders (snapshot to seq %d, %d events replayed in %.2fs)",
                 len(self.index), len(self.index.holders), self.saved_seq, self.replayed, time.perf_counter() - t0)
        self._task = asyncio.create_task(self._snapshots(), name="prefix-index-snapshots")

    async def close(self) -> None:
        """Stop following; with JetStream, write a last snapshot."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except (nats.errors.Error, asyncio.TimeoutError):
                pass
            self._sub = None
        if self.mode == "jetstream" and self.seq > self.saved_seq:
            try:
                await self.save()
            except (nats.errors.Error, asyncio.TimeoutError) as e:
                log.warning("prefix index: last snapshot not written: %s", e)

    async def _ensure_stream(self, js) -> api.StreamInfo:
        return await ensure_event_stream(js, self.stream, self.max_age, self.max_bytes, bus=self.bus)

    async def _ensure_bucket(self, js):
        return await self.bus.jetstream_ensure(
            f"KV bucket {self.bucket}", lambda: js.key_value(self.bucket), lambda replicas: js.create_key_value(
                bucket=self.bucket, history=1, storage=api.StorageType.FILE, replicas=replicas,
                description="the router's prefix index (services/prefix_index.py)"))

    # ---- events -----------------------------------------------------------------------
    async def _on_msg(self, msg) -> None:
        self._apply(msg.data, msg.subject)
        self.seq = msg.metadata.sequence.stream
        self._since += 1
        if self.seq >= self._target:
            self._caught_up.set()
        if self._since >= self.snapshot_events:
            self._wake.set()

    async def _on_live(self, msg) -> None:
        self._apply(msg.data, msg.subject)

    def _apply(self, data: bytes, subject: str) -> None:
        try:
            ev = schemas.decode(data, KVEvent)
        except SchemaError as e:
            log.warning("prefix index: skipping an invalid KVEvent on %s: %s", subject, e)
            return
        self.index.apply(ev)

    # ---- snapshots ----------------------------------------------------------------------
    async def _snapshots(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.snapshot_every)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if self.seq > self.saved_seq:
                try:
                    await self.save()
                except (nats.errors.Error, asyncio.TimeoutError) as e:
                    log.warning("prefix index: snapshot not written (%s); retrying later", e)

    async def save(self) -> bool:
        """Write a snapshot of the index as of the last applied stream sequence; False when the
        bucket holds one as recent already (another router copy wrote it)."""
        seq, state = self.seq, self.index.snapshot()
        self._since = 0
        blob = await asyncio.to_thread(lambda: zstandard.ZstdCompressor(level=3).compress(orjson.dumps(state)))
        sid = f"{seq}-{uuid.uuid4().hex[:8]}"
        parts = range(0, max(len(blob), 1), self.part_bytes)
        for i, off in enumerate(parts):
            await self._kv.put(f"part.{sid}.{i}", blob[off:off + self.part_bytes])
        head = orjson.dumps({"id": sid, "seq": seq, "parts": len(parts), "bytes": len(blob), "router": self.name})
        for _ in range(5):
            cur = await self._head()
            if cur is not None and cur[1]["seq"] >= seq:
                await self._purge(sid)
                self.saved_seq = max(self.saved_seq, seq)
                return False
            try:
                if cur is None:
                    await self._kv.create(HEAD, head)
                else:
                    await self._kv.update(HEAD, head, last=cur[0])
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # another copy wrote meanwhile: look again
            if cur is not None:
                await self._purge(cur[1]["id"])
            self.saved_seq = seq
            log.debug("prefix index snapshot %s: %d keys, %d bytes", sid, len(self.index), len(blob))
            return True
        await self._purge(sid)
        return False

    async def _head(self) -> tuple[int, dict] | None:
        """(revision, head) of the stored snapshot, or None."""
        try:
            entry = await self._kv.get(HEAD)
        except nats.js.errors.NotFoundError:  # none yet, or purged
            return None
        return entry.revision, orjson.loads(entry.value)

    async def _purge(self, sid: str) -> None:
        await self._js.purge_stream(f"KV_{self.bucket}", subject=f"$KV.{self.bucket}.part.{sid}.>")

    async def _restore(self) -> dict | None:
        """Load the stored snapshot into the index (the seq it covers becomes ``self.seq``);
        None when there is none or it cannot be read (then the whole stream is replayed)."""
        for _ in range(3):
            cur = await self._head()
            if cur is None:
                return None
            head = cur[1]
            try:
                blob = b"".join([(await self._kv.get(f"part.{head['id']}.{i}")).value or b""
                                 for i in range(head["parts"])])
                state = await asyncio.to_thread(lambda: orjson.loads(zstandard.ZstdDecompressor().decompress(blob)))
                self.index.restore(state)
            except nats.js.errors.KeyNotFoundError:
                continue  # replaced and purged while we read: read the new one
            except (ValueError, zstandard.ZstdError) as e:
                log.warning("prefix index: snapshot %s unreadable (%s); replaying the whole stream", head["id"], e)
                return None
            self.seq = self.saved_seq = head["seq"]
            return head
        log.warning("prefix index: snapshot kept changing while read; replaying the whole stream")
        return None
