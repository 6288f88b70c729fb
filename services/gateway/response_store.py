"""Stored Responses (``/v1/responses`` with ``store``), capped per tenant.

Where: a JetStream KV bucket on the bus when there is one (durable on the NATS server's store, so
they outlive the gateway — and the stack, when the store is kept: compose's volume, or
``TANDEM_NATS_STORE_DIR`` for ``tandem up``), else this process's memory. Keys are
``<tenant>.<id>``: another API key's lookup misses.

Bounded state: each tenant (API key) keeps at most ``max_entries`` responses and ``max_bytes`` of
stored records (``TANDEM_RESPONSES_MAX_PER_TENANT``, ``TANDEM_RESPONSES_MAX_BYTES_PER_TENANT``);
storing one more removes that tenant's oldest first until both hold (a single record larger than
``max_bytes`` is not stored). The ledger of a tenant's records (id -> bytes, oldest first) lives
in this process: on a bus it is read from the bucket at the tenant's first use here (the keys
under ``<tenant>.``, ordered by their stream revision), then kept as this process stores and
deletes. With several gateway copies, each enforces the caps over what it read at that first use
plus what it stored itself; the bucket's TTL (``TANDEM_RESPONSES_RETENTION_S``) bounds the rest.
Counted in ``tandem_responses_stored{what}`` (records, bytes this process knows of) and
``tandem_responses_evicted_total{cap}``.

When the bus does not take a record (JetStream without a quorum, NATS gone — after ``BUS_TRIES``),
this gateway holds it (up to ``HELD_MAX_BYTES`` in all) and writes it once the bus answers again,
tried every ``HELD_RETRY_S`` (doubling to ``HELD_RETRY_MAX_S``), and at shutdown: the answer says
``"store": true`` and its next turn (``previous_response_id``) or GET finds it on this gateway
meanwhile, and on every gateway once written. Past the bound the answer says ``"store": false``,
as before: a chain of turns through this gateway no longer breaks at a bus outage
(``tandem_responses_stored{what="held"}``: records held).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import asdict, dataclass

import orjson
from nats.errors import Error as NatsError

from shared import metrics
from shared.bus import BusError

log = logging.getLogger("tandem.gateway")

BUCKET = "tandem_responses"      # JetStream KV bucket of stored responses (key: <tenant>.<response id>)
DEFAULT_RETENTION_S = 30 * 86400
MAX_VALUE = 8 << 20              # a record larger than this is not stored (the bucket's value limit)
BUS_TRIES = 4                    # a bus timeout is tried again 0.5, 1, 2 s later (a cluster that lost a
                                 # server elects new stream and consumer leaders within seconds)
HELD_MAX_BYTES = 64 << 20        # records the bus did not take, held here until it does (module doc)
HELD_RETRY_S, HELD_RETRY_MAX_S = 1.0, 15.0
HELD_CLOSE_S = 5.0               # at shutdown: how long the held records may take to be written
BUS_TIMEOUT_S = 5.0              # one JetStream call's answer (nats-py's default): a put, a get, a delete


async def retried(op):
    """``await op()``, again after a NATS timeout, ``BUS_TRIES`` tries in all: a response finished
    while a clustered NATS server was just lost is stored, not dropped (its next turn would 404)."""
    import nats.errors
    for i in range(BUS_TRIES):
        try:
            return await op()
        except nats.errors.TimeoutError:
            if i == BUS_TRIES - 1:
                raise
            log.info("stored responses: the bus timed out (try %d of %d); again in %.1f s", i + 1, BUS_TRIES,
                     0.5 * 2 ** i)
            await asyncio.sleep(0.5 * 2 ** i)

class StoreUnavailable(Exception):
    """The bus did not store or read a response: JetStream without a quorum (a cluster that lost
    most of its servers), NATS gone. Nothing is known to be lost; ask again later."""


def _unavailable(e: Exception) -> StoreUnavailable:
    return StoreUnavailable(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)


@dataclass
class StoredResponse:
    """One stored response: what ``GET /v1/responses/{id}`` answers and a next turn continues."""
    response: dict               # the response object as sent (its public fields)
    input_items: list[dict]      # the turn's input items (``GET .../input_items``)
    messages: list[dict]         # the conversation as chat messages, this turn's reply last
    session: str | None          # the conversation's session (its next turn goes to the same worker)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StoredResponse":
        """ValueError naming the field a stored record lacks or has of the wrong type."""
        for name, tp in (("response", dict), ("input_items", list), ("messages", list)):
            if not isinstance(d.get(name), tp):
                raise ValueError(f"stored response: field {name!r} is not a {tp.__name__}")
        if d.get("session") is not None and not isinstance(d["session"], str):
            raise ValueError("stored response: field 'session' is not a string")
        return cls(d["response"], d["input_items"], d["messages"], d.get("session"))


class ResponseStore:
    """Stored responses per tenant, with per-tenant caps (module doc)."""

    def __init__(self, bus=None, retention_s: float = DEFAULT_RETENTION_S, max_entries: int = 0,
                 max_bytes: int = 0):
        self.bus, self.retention_s = bus, retention_s
        self.max_entries, self.max_bytes = max_entries, max_bytes   # 0: no cap
        self._kv = None
        self._mem: dict[str, bytes] = {}
        self._lock = asyncio.Lock()
        self._ledgers: dict[str, OrderedDict[str, int]] = {}   # tenant -> response id -> bytes, oldest first
        self._tenant_locks: dict[str, asyncio.Lock] = {}
        # key -> (tenant, id, record, bytes): records the bus did not take, in the order they came;
        # record None: one deleted while held, to purge too (a put nats-py buffered while it
        # reconnected can still reach the bucket after it timed out here)
        self._held: OrderedDict[str, tuple[str, str, dict | None, int]] = OrderedDict()
        self._writer: asyncio.Task | None = None

    async def _bucket(self):
        async with self._lock:
            if self._kv is None:
                from nats.js.api import KeyValueConfig
                js = self.bus.nc.jetstream(timeout=BUS_TIMEOUT_S)
                self._kv = await self.bus.jetstream_ensure(
                    f"KV bucket {BUCKET}", lambda: js.key_value(BUCKET), lambda replicas: js.create_key_value(
                        KeyValueConfig(bucket=BUCKET, ttl=self.retention_s, max_value_size=MAX_VALUE,
                                       replicas=replicas)))
            return self._kv

    async def _ledger(self, tenant: str) -> OrderedDict[str, int]:
        """The tenant's records, oldest first (read from the bucket at first use here)."""
        ledger = self._ledgers.get(tenant)
        if ledger is not None:
            return ledger
        found: list[tuple[int, str, int]] = []
        if self.bus is not None:
            from nats.js.errors import KeyNotFoundError
            kv = await self._bucket()
            for key in await self.bus.kv_keys(BUCKET, f"{tenant}.*"):
                try:
                    entry = await kv.get(key)
                except KeyNotFoundError:
                    continue
                if entry.value:
                    found.append((entry.revision or 0, key.split(".", 1)[1], len(entry.value)))
        ledger = self._ledgers.setdefault(tenant, OrderedDict((rid, n) for _, rid, n in sorted(found)))
        self._count()
        return ledger

    def _count(self) -> None:
        metrics.RESPONSES_STORED.labels("records").set(sum(len(led) for led in self._ledgers.values()))
        metrics.RESPONSES_STORED.labels("bytes").set(sum(sum(led.values()) for led in self._ledgers.values()))
        metrics.RESPONSES_STORED.labels("held").set(sum(v[2] is not None for v in self._held.values()))

    async def put(self, tenant: str, rid: str, record: dict) -> None:
        """Store ``record``: on the bus, or — where the bus does not take it — held here until it
        does (module doc); StoreUnavailable when it does not and the held records are at their
        bound, ValueError when it is over the caps."""
        try:
            await self._store(tenant, rid, record)
        except (NatsError, BusError) as e:
            size = len(orjson.dumps(record))
            if sum(n for *_, n in self._held.values()) + size > HELD_MAX_BYTES:
                raise _unavailable(e) from e
            self._held[f"{tenant}.{rid}"] = (tenant, rid, record, size)
            self._count()
            log.warning("stored responses: the bus did not take %s (%s); held in this gateway (%d held) and "
                        "written once it answers", rid, _unavailable(e), len(self._held))
            if self._writer is None or self._writer.done():
                self._writer = asyncio.create_task(self._write_held(), name="responses-held")

    async def _write_held(self, once: bool = False) -> None:
        """The held records written in the order they came, tried again (backing off) while the
        bus does not take them; ``once``: one pass."""
        delay = HELD_RETRY_S
        while self._held:
            if not once:
                await asyncio.sleep(delay)
            for key, (tenant, rid, record, _) in list(self._held.items()):
                try:
                    if record is None:
                        await self._remove(tenant, rid)
                    else:
                        await self._store(tenant, rid, record)
                except (NatsError, BusError) as e:
                    log.info("stored responses: %d held, the bus still does not take them (%s)", len(self._held),
                             _unavailable(e))
                    delay = min(2 * delay, HELD_RETRY_MAX_S)
                    break
                except ValueError as e:      # (caps that changed since: as put would have said)
                    log.warning("stored responses: held %s dropped: %s", rid, e)
                cur = self._held.get(key)
                if cur is not None and cur[2] is record:      # (not if deleted or put anew meanwhile)
                    del self._held[key]
                self._count()
            else:
                log.info("stored responses: the held records are written")
            if once:
                return

    async def close(self) -> None:
        """At shutdown: the held records written, for ``HELD_CLOSE_S`` at most (else said lost)."""
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
        if self._held:
            try:
                await asyncio.wait_for(self._write_held(once=True), HELD_CLOSE_S)
            except asyncio.TimeoutError:
                pass
        if self._held:
            log.error("stored responses: %d held record(s) not written before shutdown: lost (%s)", len(self._held),
                      ", ".join(rid for _, rid, *_ in self._held.values())[:500])

    async def _store(self, tenant: str, rid: str, record: dict) -> None:
        data = orjson.dumps(record)
        if self.max_bytes and len(data) > self.max_bytes or len(data) > MAX_VALUE:
            raise ValueError(f"the stored response is {len(data)} bytes, over the cap of "
                             f"{min(self.max_bytes or MAX_VALUE, MAX_VALUE)}")
        lock = self._tenant_locks.setdefault(tenant, asyncio.Lock())
        async with lock:
            ledger = await retried(lambda: self._ledger(tenant))
            ledger[rid] = len(data)
            ledger.move_to_end(rid)
            total = sum(ledger.values())
            gone: list[tuple[str, str]] = []   # (response id, the cap it went for), oldest first
            while len(ledger) > 1:             # never the new one (it fits max_bytes alone)
                if self.max_entries and len(ledger) > self.max_entries:
                    cap = "entries"
                elif self.max_bytes and total > self.max_bytes:
                    cap = "bytes"
                else:
                    break
                old, n = ledger.popitem(last=False)
                gone.append((old, cap))
                total -= n
            for old, cap in gone:
                await self._remove(tenant, old)
                metrics.RESPONSES_EVICTED.labels(cap).inc()
            if gone:
                log.info("stored responses of tenant %s: %d oldest removed (caps: %d entries, %d bytes)",
                         tenant[:8], len(gone), self.max_entries, self.max_bytes)
            if self.bus is None:
                self._mem[f"{tenant}.{rid}"] = data
            else:
                await retried(lambda: self._put(f"{tenant}.{rid}", data))
            self._count()

    async def _put(self, key: str, data: bytes) -> None:
        await (await self._bucket()).put(key, data)

    async def _remove(self, tenant: str, rid: str) -> None:
        if self.bus is None:
            self._mem.pop(f"{tenant}.{rid}", None)
        else:
            await (await self._bucket()).purge(f"{tenant}.{rid}")

    async def get(self, tenant: str, rid: str) -> dict | None:
        """The record (None: no such response of ``tenant``); StoreUnavailable when the bus does not answer."""
        held = self._held.get(f"{tenant}.{rid}")
        if held is not None:        # a copy, as the bus's would be (None: deleted while held)
            return None if held[2] is None else orjson.loads(orjson.dumps(held[2]))
        try:
            return await self._get(tenant, rid)
        except (NatsError, BusError) as e:
            raise _unavailable(e) from e

    async def _get(self, tenant: str, rid: str) -> dict | None:
        if self.bus is None:
            data = self._mem.get(f"{tenant}.{rid}")
            return None if data is None else orjson.loads(data)
        from nats.js.errors import KeyNotFoundError
        try:
            entry = await (await self._bucket()).get(f"{tenant}.{rid}")
        except KeyNotFoundError:
            return None
        return orjson.loads(entry.value) if entry.value else None

    async def delete(self, tenant: str, rid: str) -> bool:
        """True if it was there: of two deletes of one response at once on this gateway, one
        (under the tenant's lock, as ``put``; across gateway copies both may say so)."""
        async with self._tenant_locks.setdefault(tenant, asyncio.Lock()):
            held = self._held.get(f"{tenant}.{rid}")
            if held is not None:        # purged from the bus once it answers (``_held``)
                if held[2] is None:
                    return False
                self._held[f"{tenant}.{rid}"] = (tenant, rid, None, 0)
                ledger = self._ledgers.get(tenant)
                if ledger is not None:
                    ledger.pop(rid, None)
                self._count()
                return True
            if await self.get(tenant, rid) is None:
                return False
            try:
                await self._remove(tenant, rid)
            except (NatsError, BusError) as e:
                raise _unavailable(e) from e
            ledger = self._ledgers.get(tenant)
            if ledger is not None:
                ledger.pop(rid, None)
                self._count()
            return True
