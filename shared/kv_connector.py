"""The worker side of KV movement: one connector per engine worker.

Every way KV leaves or enters a worker goes through here:

    hand-off (prefill -> decode)   export -> ``hand_off``: send on the data plane, report the
    migration (decode -> decode)     transfer once, DecodeRequest to the receiving worker
    resume                         (the same call with a blob rebuilt from the request's tokens)
    receive                        ``receive(handle)``: the verified bytes of a DecodeRequest
    KV pool                        ``fetch_prefix`` (lookup + get + decode) before a prompt runs,
                                   ``store_later`` (write-back) when a prompt or session finishes
    chunk events                   the engine's prefix cache announces the pool chunks it gains
                                   and loses (``KVEventPublisher``), for the routers' prefix index

A transfer is reported once: ``DataPlaneSender`` counts it in the metrics; ``send_and_report``
publishes one ``TransferEvent`` (failed ones too, for tap). The KV pool service uses
``send_and_report`` for the entries it sends; everything else here is the worker's.

Whom KV goes to and what is taken (docs/security.md, Data plane): a worker or pool copy sends KV
that a bus message asked for (a hand-off, a migration, a pool get) only to the data-plane
address of a live worker, known from its heartbeats (``DataPeers``; else a ``forbidden`` error),
and uses received bytes only once they match the size and checksum the bus message announced
(``KVPayload.expect``).

The pool can make a request faster, never make it fail: any pool error is logged and the
worker computes instead.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import mmap
import os
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from kvpool.codec import (
    LOSSY, ChunkShape, Codec, CorruptEntry, ForgedEntry, decode_entry_into, pack_entries, read_entry_into,
    unpack_entries,
)
from kvpool.keys import KeyScope, chunk_keys, tail_key, tenant_seed
from kvpool.pins import pin_seconds
from kvpool.store import entry_path
from shared import metrics, subjects
from shared.bus import Bus, BusError
from shared.engine.kv_cache import KVBlobHeader
from shared.kv_events import KVEventPublisher
from shared.liveness import Heartbeats, clock, fresh
from shared.schemas import (
    DecodeRequest, Heartbeat, PoolGet, PoolLookup, PoolLookupReply, PoolPut, RingClaim, RingPeer, TransferEvent,
    TransferHandle,
)
from shared.settings import PoolSettings, Settings
from shared.transfer import make_transport
from shared.transfer.base import KVSender, SendResult, TransferError

if TYPE_CHECKING:
    from shared.engine.async_engine import AsyncEngine

log = logging.getLogger("tandem.kv")
REFUSED_MAX = 4096   # pool keys remembered as unusable here (their entries put again at the next write-back)


def key_scope(model_identity: str, layout: dict, settings: PoolSettings) -> KeyScope:
    """The chunk key scope of an engine's KV: the same for the pool and every worker of one
    model, layout, chunk size, tenant and kind of codec — lossy entries stay apart; the lossless
    codecs (raw, shuffle-zstd) decode to the same bytes, so they share entries."""
    kind = LOSSY if settings.codec == LOSSY else "lossless"
    return KeyScope(model_identity, layout, settings.chunk_tokens, tenant=f"{settings.tenant}|{kind}")


async def send_and_report(bus: Bus, sender: KVSender, reporter: str, host: str, port: int, transfer_id: str,
                          payload, *, request_id: str = "", compressible: bool = True) -> SendResult:
    """Send ``payload`` over the data plane and publish one TransferEvent on
    ``tandem.transfer.<reporter>`` (also when it failed; the error is raised after)."""
    try:
        res = await sender.send(host, port, transfer_id, payload, compressible=compressible)
    except TransferError as e:
        await _report(bus, reporter, TransferEvent(transfer_id=transfer_id, request_id=request_id,
                                                   nbytes=memoryview(payload).nbytes, seconds=0.0, path="",
                                                   ok=False, error=str(e)))
        raise
    await _report(bus, reporter, TransferEvent(
        transfer_id=transfer_id, request_id=request_id, nbytes=res.nbytes, seconds=res.seconds, path=res.path,
        wire_bytes=res.wire_bytes, attempts=res.attempts))
    return res


async def _report(bus: Bus, reporter: str, event: TransferEvent) -> None:
    try:
        await bus.publish(subjects.transfer(reporter), event)
    except Exception as e:  # an event for tap: never worth failing the transfer for
        log.debug("transfer event %s not published: %s", event.transfer_id, e)


SPILLED_HEADS = 4096    # first blocks of the sessions this worker spilled, remembered (short prompts ask the pool)


class DataPeers:
    """The data-plane addresses of live workers, learnt from every heartbeat (``tandem.heartbeat.>``):
    (host, port) -> the worker there, while the last heartbeat naming it is fresh (shared/liveness.py).
    KV that a bus message asks for goes only to such an address (``check``)."""

    def __init__(self, bus: Bus, wait_s: float):
        self.bus = bus
        self.wait_s = wait_s    # how long ``check`` waits for a first heartbeat from an unknown address
        self._seen: dict[tuple[str, int], tuple[str, float, float]] = {}  # -> (worker id, monotonic, interval)
        self.roles: dict[str, str] = {}  # worker id -> role, of every worker heard from
        self._beat = asyncio.Event()     # set (then cleared) on every heartbeat with an address
        self.heartbeats = Heartbeats(bus, self._seen_beat, name="data-peers")

    async def start(self) -> None:
        await self.heartbeats.start()

    def _seen_beat(self, beat: Heartbeat, now: float) -> None:
        self.roles[beat.worker_id] = beat.role
        if beat.data_port:
            self._seen[(beat.data_host, beat.data_port)] = (beat.worker_id, now, beat.interval)
            if beat.ring_port:  # ring members: KV is scattered there too
                self._seen[(beat.data_host, beat.ring_port)] = (beat.worker_id, now, beat.interval)
            self._beat.set()
            self._beat.clear()

    def worker_at(self, host: str, port: int) -> str | None:
        """The live worker whose receiver is (host, port), or None."""
        seen = self._seen.get((host, port))
        if seen is None or not fresh(seen[1], seen[2], clock()):
            return None
        return seen[0]

    def was_at(self, worker: str, host: str, port: int) -> bool:
        """Whether ``worker``'s heartbeats named (host, port), fresh or not: a worker that was there
        and stopped beating is gone (lost), where an address no heartbeat named is nobody's."""
        seen = self._seen.get((host, port))
        return seen is not None and seen[0] == worker

    async def check(self, host: str, port: int, worker: str | None = None, what: str = "KV") -> str:
        """The live worker at (host, port) — ``worker``, when given — waiting ``wait_s`` at most for
        a heartbeat (a worker that just started); BusError("forbidden") when there is none."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while (found := self.worker_at(host, port)) is None or (worker is not None and found != worker):
            left = deadline - loop.time()
            if left <= 0:
                metrics.DATA_REFUSED.labels("not a live worker").inc()
                raise BusError("forbidden", f"refusing to send {what} to {host}:{port}: "
                                            f"{'no live worker' if found is None else 'the data plane of ' + found}"
                                            f"{'' if worker is None else ', not of ' + worker} is there "
                                            "(its heartbeats name the address a worker takes KV at)")
            try:
                async with asyncio.timeout(left):
                    await self._beat.wait()
            except TimeoutError:
                pass
        return found

    async def close(self) -> None:
        await self.heartbeats.close()


class KVConnector:
    """One worker's KV door (see the module doc). ``start`` binds the data-plane receiver (its
    address goes in heartbeats when the worker takes KV from others), starts the chunk events and,
    with the pool enabled, the pool client and the engine's write-back of finished sequences."""

    def __init__(self, settings: Settings, bus: Bus, engine: "AsyncEngine", worker_id: str, role: str,
                 *, write_back: bool = False):
        self.settings = settings
        self.bus = bus
        self.engine = engine
        self.worker_id = worker_id
        self.role = role
        self.scope = key_scope(engine.model_identity, engine.layout.to_dict(), settings.pool)
        self.transport = make_transport(settings.data)
        self.sender = self.transport.sender()
        self.receiver = self.transport.receiver(settings.data.host, settings.data.port)
        self.data_host, self.data_port = "", 0
        self.peers = DataPeers(bus, 2 * settings.worker.heartbeat_interval)  # where KV may go
        self.events: KVEventPublisher | None = None
        self.pool: PoolClient | None = None
        self._write_back = write_back
        self._spilled_heads: OrderedDict[tuple, None] = OrderedDict()  # (tenant, first block) of spilled sessions

    async def start(self) -> None:
        host, self.data_port = await self.receiver.listen()
        self.data_host = self.settings.data.advertise_host or host
        await self.peers.start()
        self.events = KVEventPublisher(self.bus, self.worker_id, self.role)
        await self.events.start()
        loop = asyncio.get_running_loop()
        events = self.events
        await self.engine.watch_chunks(self.scope.seed(), self.scope.chunk_tokens,
                                       lambda stored, evicted: loop.call_soon_threadsafe(events.add, stored, evicted))
        if self.settings.pool.enabled:
            self.pool = PoolClient(self.bus, self.settings.pool, self.scope, self.engine.layout, self.worker_id,
                                   self.sender, self.receiver, self.data_host, self.data_port)
            pool = self.pool
            if self._write_back:  # a finished sequence's full chunks (the session's next turn) and its
                # prompt's tail (the same prompt again) go to the pool (a 24h session's pinned); the
                # whole chunks it reused from a cache are not copied out again
                await self.engine.on_finished_kv(
                    1, lambda tokens, kv, tenant, prompt, ret, start: loop.call_soon_threadsafe(
                        functools.partial(pool.store_later, tokens, kv, tenant, prompt_tail_end(prompt),
                                          pin_s=pin_seconds(ret), start=start)),
                    skip=self.settings.pool.chunk_tokens)
            # a resident session evicted from the engine (retention.py): its KV to the pool, tail too
            await self.engine.on_spill(lambda tokens, kv, tenant, ret, session: loop.call_soon_threadsafe(
                self._spilled, tokens, kv, tenant, ret))

    # -- sending --------------------------------------------------------------------------------

    async def send(self, host: str, port: int, transfer_id: str, payload, request_id: str = "") -> SendResult:
        return await send_and_report(self.bus, self.sender, self.worker_id, host, port, transfer_id, payload,
                                     request_id=request_id)

    async def hand_off(self, blob: bytes, *, subject: str, host: str, port: int, transfer_id: str, tier: str,
                       stream_subject: str, next_seq: int, session_id: str | None, attempt: int = 0,
                       origin: str = "", timeout: float | None = None,
                       ring: list[RingPeer] | None = None, claim: RingClaim | None = None,
                       alongside: asyncio.Future | None = None, at_cap: str = "queue"
                       ) -> tuple[KVBlobHeader, SendResult]:
        """Move an exported sequence to the worker serving ``subject`` (its decode subject), whose
        receiver is ``host:port`` (the caller checked it is that worker's: ``peers.check``): the KV
        over the data plane, then a DecodeRequest carrying the handle; the receiver continues the
        stream at ``next_seq`` (``at_cap``: what the receiver does with every sequence slot taken,
        ``DecodeRequest.at_cap``).
        ``ring``: the receiver coordinates that ring (``claim``: the other
        members hold their ranges already, parked by ``shared/ring`` (``RingConnector.scatter``), run as
        ``alongside`` while the KV is sent: the DecodeRequest goes once both are done, not if it
        failed). Raises TransferError / BusError (RemoteError with the receiver's
        code) when it did not take it."""
        h, _ = KVBlobHeader.parse(blob)
        try:
            res = await self.send(host, port, transfer_id, blob, request_id=h.request_id)
        except BaseException:
            if alongside is not None:
                await asyncio.gather(alongside, return_exceptions=True)
            raise
        if alongside is not None:
            await alongside
        handle = TransferHandle(transfer_id=transfer_id, host=host, port=port, nbytes=res.nbytes,
                                checksum=res.checksum, path=res.path, num_tokens=h.num_computed)
        await self.bus.request(subject, DecodeRequest(
            request_id=h.request_id, handle=handle, prompt_token_ids=h.prompt_token_ids,
            output_token_ids=h.output_token_ids, sampling=h.params, tier=tier, stream_subject=stream_subject,
            next_seq=next_seq, session_id=session_id, attempt=attempt, origin=origin, ring=ring or [],
            claim=claim, at_cap=at_cap),
            timeout=timeout)
        return h, res

    # -- receiving ------------------------------------------------------------------------------

    async def receive(self, handle: TransferHandle) -> bytes:
        """The verified bytes of a transfer addressed to this worker (waits for them); ChecksumError
        unless they are the ones the handle announced."""
        payload = await self.receiver.take(handle.transfer_id, timeout=self.settings.data.timeout)
        payload.expect(handle.checksum, handle.nbytes)
        try:
            return bytes(payload.data)  # the engine copies it into its KV cache; the buffer goes back
        finally:
            payload.release()

    def discard(self, transfer_id: str) -> None:
        self.receiver.discard(transfer_id)

    def discard_request(self, request_id: str, below: int | None = None) -> list[str]:
        """Forget the KV received, or on its way, for ``request_id`` (aborted): every transfer
        of it (a hand-off ``<id>-<attempt>``, a move ``<id>-<worker>-<seq>``), or with ``below``
        the hand-offs of its attempts below that (a fence). A hand-off whose DecodeRequest never
        came (the sender was aborted between the bytes and the message) held its bytes in the
        receiver's budget until the janitor's TTL (120 s) otherwise. The ids discarded."""
        gone = []
        for tid in self.receiver.transfers():
            rest = tid[len(request_id) + 1:] if tid.startswith(request_id + "-") else None
            if rest is not None and (below is None or (rest.isdigit() and int(rest) < below)):
                self.receiver.discard(tid)
                gone.append(tid)
        return gone

    # -- the KV pool ----------------------------------------------------------------------------

    async def fetch_prefix(self, prompt: list[int], tenant: str = "") -> tuple[list[int], memoryview] | None:
        """The longest prefix of ``prompt`` the pool holds for ``tenant`` beyond what the engine's own
        prefix cache has, as (tokens, KV) for ``AsyncEngine.submit(prefix=...)``; None: nothing better.
        A prompt shorter than one chunk can only match a spilled session's tail: the pool is asked
        only when this worker spilled a session starting with the prompt's first block (no wait for
        an engine step then; blocks the engine holds already are skipped when loaded)."""
        bs = self.engine.layout.block_size
        if self.pool is None or len(prompt) - 1 < bs:
            return None  # not one whole block: no pool entry can match
        short = len(prompt) < self.settings.pool.chunk_tokens   # (a prompt of one chunk finds it stored)
        if short and (tenant, tuple(prompt[:bs])) not in self._spilled_heads:
            return None  # no chunk, and no session of this worker's spilled that it may continue
        have = 0 if short else await self.engine.cached_prefix_tokens(prompt, tenant)
        got = await self.pool.fetch_prefix(prompt, have, tenant, spilled=(tenant, tuple(prompt[:bs])) in self._spilled_heads)
        if self.pool.reloads:
            metrics.SESSIONS_RELOADED.labels(self.role).inc(self.pool.reloads)
            self.pool.reloads = 0
        return got

    def _spilled(self, tokens: list[int], kv, tenant: str, retention: str) -> None:
        """A resident session evicted from the engine: its whole blocks to the pool (pinned for 24h
        sessions), so that its next turn loads them."""
        metrics.SESSIONS_EVICTED.labels(self.role).inc()
        head = (tenant, tuple(tokens[:self.engine.layout.block_size]))
        self._spilled_heads[head] = None
        self._spilled_heads.move_to_end(head)
        while len(self._spilled_heads) > SPILLED_HEADS:
            self._spilled_heads.popitem(last=False)
        if self.pool is not None:
            self.pool.store_later(tokens, kv, tenant, session=True, pin_s=pin_seconds(retention))

    def store_later(self, token_ids: list[int], kv, tenant: str = "", tail_end: int = 0) -> None:
        """Write the full chunks of (``token_ids``, their KV) of ``tenant`` back to the pool, in the
        background, and the tail up to ``tail_end`` (``prompt_tail_end``; 0: none)."""
        if self.pool is not None:
            self.pool.store_later(token_ids, kv, tenant, tail_end)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        if self.events is not None:
            await self.events.close()
        await self.peers.close()
        await self.receiver.close()
        await self.sender.close()


def prompt_tail_end(num_prompt_tokens: int) -> int:
    """Where a prompt's cacheable KV ends: its last token but one (the last is always computed:
    its logits give the first output token). A prompt sent again loads up to here."""
    return num_prompt_tokens - 1


def kv_buffer(nbytes: int):
    """A writable, zeroed buffer for ``nbytes`` of KV, on huge pages where the kernel allows
    (``madvise``): writing a fresh 4 KiB-page buffer costs a page fault per page — on a VM, a
    large share of loading a long prefix."""
    buf = mmap.mmap(-1, max(nbytes, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(buf)[:nbytes]


@functools.cache
def _decoders() -> ThreadPoolExecutor:
    """Threads that decode pool entries (one per core, 4 at most)."""
    return ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="pool-decode")


class PoolClient:
    """A worker's side of the pool: fetch a cached prefix, write chunks back.

    Control on NATS, entries on the data plane (services/kvpool.py has the other side)::

        lookup(keys)  -- tandem.kvpool.lookup (queue group) -->  hits, tiers, pool id, data address
        get(keys, my receiver) -- tandem.kvpool.<id>.get -->     the pool sends a bundle of entries
        bundle -> pool receiver, then put(keys, transfer id) -- tandem.kvpool.<id>.put --> stored
    """

    def __init__(self, bus: Bus, settings: PoolSettings, scope: KeyScope, layout, worker_id: str,
                 sender: KVSender, receiver, data_host: str, data_port: int):
        self.bus = bus
        self.settings = settings
        self.scope = scope
        self.shape = ChunkShape.from_layout(layout.to_dict())
        self.token_bytes, self.block_size = layout.token_bytes, layout.block_size
        # the pool's disk tier, when this worker can read it: cached entries straight from their files
        self.local_dir = os.path.expanduser(settings.dir) if settings.dir and settings.local_read else None
        self.secret = settings.secret()
        if not self.secret:
            log.warning("no pool secret (TANDEM_POOL_KEY / TANDEM_POOL_KEY_FILE): KV pool entries are not "
                        "authenticated; any bus client can write KV this worker loads")
        self.codec = Codec(settings.resolved_codec(), secret=self.secret)
        self.worker_id = worker_id
        self.sender, self.receiver = sender, receiver
        self.data_host, self.data_port = data_host, data_port
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        self._skip_until = 0.0    # after a pool failure, prompts do not wait on it until then
        self.hits = self.misses = self.errors = self.stored = self.forged = 0
        # keys whose pool entries failed the MAC here (another secret's — TANDEM_POOL_KEY changed —
        # or altered): the pool still holds them, so a write-back puts them again, over them
        self.refused: OrderedDict[str, None] = OrderedDict()
        self.reloads = 0          # fetches whose hit ended in a spilled session's tail (the connector resets it)

    def keys(self, token_ids: list[int], limit: int | None = None, tenant: str = "") -> list[str]:
        return chunk_keys(self.scope, token_ids, limit, tenant)

    def pieces(self, token_ids: list[int], limit: int, tail_end: int = 0,
               tenant: str = "") -> list[tuple[str, int, int]]:
        """(key, first token, end) of the entries of ``token_ids``: its full chunks within
        ``limit`` tokens, then — when ``tail_end`` (at most ``limit``) is past a chunk boundary
        (not the first) — the tail from there up to ``tail_end`` (``tail_key``; its KV is whole
        blocks, the last one partial). A prompt's pieces (``tail_end`` = ``prompt_tail_end``)
        follow each other from token 0."""
        c = self.settings.chunk_tokens
        keys = self.keys(token_ids, limit, tenant)
        out = [(k, i * c, (i + 1) * c) for i, k in enumerate(keys)]
        whole = tail_end // c   # the tail hangs off the chunk before it (a prompt shorter than one
        if 0 < whole * c < tail_end <= limit:  # chunk is not worth a pool round trip: no tail)
            out.append((tail_key(keys[whole - 1], token_ids[whole * c:tail_end]), whole * c, tail_end))
        return out

    def session_pieces(self, token_ids: list[int], tenant: str = "") -> list[tuple[str, int, int]]:
        """(key, first token, end) of a spilled session's entries: its full chunks, then its
        tokens after them (whole blocks) as a tail — hung off the last chunk, or off the tenant's
        seed when there is none — under the key ``fetch_prefix`` tries for a prompt continuing it."""
        c, n = self.settings.chunk_tokens, len(token_ids)
        keys = self.keys(token_ids, n, tenant)
        out = [(k, i * c, (i + 1) * c) for i, k in enumerate(keys)]
        whole = n // c * c
        if whole < n:
            parent = keys[-1] if keys else tenant_seed(self.scope.seed(), tenant)
            out.append((tail_key(parent, token_ids[whole:n]), whole, n))
        return out

    def tails(self, prompt: list[int], keys: list[str], tenant: str = "",
              upto: int | None = None) -> list[tuple[str, int, int]]:
        """The tails a prompt may continue after its full chunks (``keys``; its first ones, when a
        lookup found only those), longest first: its own (up to its last token but one), then
        every whole-block end after the last chunk up to ``upto`` — where a spilled session
        (``session_pieces``) ended."""
        c, bs = self.settings.chunk_tokens, self.block_size
        end = min(prompt_tail_end(len(prompt)), upto if upto is not None else len(prompt))
        whole = len(keys) * c
        parent = keys[-1] if keys else tenant_seed(self.scope.seed(), tenant)
        ends = [end] if end % bs else []
        ends += range(end // bs * bs, whole, -bs)
        return [(tail_key(parent, prompt[whole:e]), whole, e) for e in ends if e > whole]

    async def _lookup(self, keys: list[str], for_put: bool = False, alternatives: int = 0,
                      pin_s: float = 0.0, tenant: str = "") -> PoolLookupReply:
        return await self.bus.request(subjects.POOL_LOOKUP, PoolLookup(
            keys=keys, for_put=for_put, alternatives=alternatives, pin_s=pin_s, tenant=tenant),
            timeout=self.settings.timeout)

    async def fetch_prefix(self, prompt: list[int], have_tokens: int = 0, tenant: str = "",
                           spilled: bool = False) -> tuple[list[int], memoryview] | None:
        """(tokens, KV) of the longest stored prefix of ``prompt`` of ``tenant`` — its full chunks,
        then, when every one is stored, the longest stored of its tails (``tails``: its own, up to
        ``prompt_tail_end`` — the last token is always computed —, or where a spilled session it
        continues ended) — or None when the pool has no more than ``have_tokens``. ``spilled``: a
        session this prompt may continue was spilled (a turn that grew past a chunk boundary finds
        its chunks stored up to the one the session ended in): where the chunks stop, the tails
        hung off the last one found are asked for too (a second lookup)."""
        t0 = time.perf_counter()
        chunks = self.pieces(prompt, len(prompt) - 1, 0, tenant)
        tails = self.tails(prompt, [k for k, _, _ in chunks], tenant)
        c = self.settings.chunk_tokens
        if len(prompt) % c == 0:   # its last chunk, stored whole, serves up to its last token but one
            tails.insert(0, (self.keys(prompt, len(prompt), tenant)[-1], len(prompt) - c, len(prompt) - 1))
        pieces = chunks + tails
        if not pieces or max(e for _, _, e in pieces) <= have_tokens:
            return None
        if time.monotonic() < self._skip_until:  # the pool failed just now: do not wait on it again
            return None
        keys = [k for k, _, _ in pieces]
        tid = f"{self.worker_id}-pool-{next(self._ids)}"
        try:
            async with asyncio.timeout(self.settings.timeout):  # the whole fetch, not each step
                found = await self._lookup(keys, alternatives=len(tails))
                hit = chunks[:found.hits] + ([tails[found.alternative]] if found.alternative >= 0 else [])
                if spilled and found.hits < len(chunks):   # the session's tail within the chunk missed?
                    lead = chunks[:found.hits]
                    more = self.tails(prompt, [k for k, _, _ in lead], tenant,
                                      upto=(found.hits + 1) * self.settings.chunk_tokens)
                    again = await self._lookup([k for k, _, _ in lead + more], alternatives=len(more)) \
                        if more else None
                    if again is not None and again.hits == found.hits and again.alternative >= 0:
                        found, hit = again, lead + [more[again.alternative]]
                t1 = time.perf_counter()
                if not hit or hit[-1][2] <= have_tokens:
                    self.misses += 1
                    return None
                keys = [k for k, _, _ in hit]
                kv = await asyncio.to_thread(self._read_local, hit) if self.local_dir else None
                if kv is not None:
                    stages = f"read+verify {(time.perf_counter() - t1) * 1e3:.1f} (the disk tier's files, here)"
                else:
                    reply = await self.bus.request(subjects.kvpool_get(found.pool_id), PoolGet(
                        keys=keys, transfer_id=tid, host=self.data_host, port=self.data_port),
                        timeout=self.settings.timeout)
                    if reply.found == 0:
                        self.receiver.discard(tid)
                        return None
                    payload = await self.receiver.take(tid, timeout=self.settings.timeout)
                    payload.expect(reply.checksum, reply.nbytes)
                    t2 = time.perf_counter()
                    with payload:
                        kv = await asyncio.to_thread(self._decode, hit[:reply.found], payload.data)
                    stages = (f"get (pool read + transfer, {reply.nbytes} bytes over {reply.path}) "
                              f"{(t2 - t1) * 1e3:.1f}, verify+decode {(time.perf_counter() - t2) * 1e3:.1f}")
                kv, n = kv
                if not n:  # the first entry was forged
                    self.misses += 1
                    return None
        except (BusError, TransferError, CorruptEntry, TimeoutError) as e:
            self.receiver.discard(tid)
            self.errors += 1
            self._skip_until = time.monotonic() + self.settings.backoff_s
            log.warning("KV pool unavailable for this prompt (%s); computing it, and not asking the pool "
                        "for %.0f s", str(e) or f"no answer within {self.settings.timeout:.1f} s", self.settings.backoff_s)
            return None
        self.hits += 1
        if found.alternative >= 0 and n == hit[-1][2] and n % self.block_size == 0:
            self.reloads += 1   # a whole-block tail: where a spilled session ended
        log.info("KV pool: %d prefix tokens (%s) in %.1f ms: keys+lookup %.1f, %s", n, ",".join(sorted(set(found.tiers))),
                 (time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3, stages)
        return prompt[:n], kv

    def _read_local(self, pieces: list[tuple[str, int, int]]):
        """The entries of ``pieces`` read from the disk tier's files into one buffer, several at a
        time (file reads and blake3 release the GIL), verified and decoded like ``_decode``; None
        when one cannot be read here (not on this host's disk, evicted, corrupt: the pool's data
        plane then)."""
        out = kv_buffer(self._bytes(pieces[-1][2]))
        futures = [_decoders().submit(read_entry_into, entry_path(self.local_dir, k),
                                      out[self._bytes(a):self._bytes(b)], k, self.secret) for k, a, b in pieces]
        return self._settle(pieces, futures, out, (OSError, CorruptEntry))

    def _bytes(self, tokens: int) -> int:
        """Bytes of the KV blocks holding ``tokens`` tokens (the last block may be partial)."""
        return -(-tokens // self.block_size) * self.block_size * self.token_bytes

    def _settle(self, pieces, futures, out, fail_on=()):
        """(``out``, its tokens) once every future is done; up to the first forged entry when one
        is (counted); None when one raised ``fail_on`` (after all are done: none writes then)."""
        end, failed = None, None
        for (k, a, _), f in zip(pieces, futures):
            try:
                f.result()
            except ForgedEntry as err:
                if end is None:
                    self.forged += 1
                    metrics.POOL_FORGED.inc()
                    log.warning("KV pool entry %s ignored: %s (this worker computes it and writes it again)",
                                k[:16], err)
                    self.refused[k] = None
                    while len(self.refused) > REFUSED_MAX:
                        self.refused.popitem(last=False)
                    end = a
            except fail_on as err:
                failed = failed or err
        if failed is not None:  # a slot before a forged entry may be unfilled too: all or nothing
            log.info("KV pool: a cached entry is not readable here (%s): through the pool's data plane", failed)
            return None
        return (out, pieces[-1][2]) if end is None else (out[:self._bytes(end)], end)

    def _decode(self, pieces: list[tuple[str, int, int]], bundle):
        """The bundle's entries decoded straight into one buffer, several at a time (blake3, zstd
        and the copies release the GIL): each entry is verified, its MAC checked and decoded into
        its slice — no intermediate copy of the raw KV. The KV up to the first forged entry
        (ignored and counted)."""
        entries = unpack_entries(bundle)
        if len(entries) != len(pieces):
            raise CorruptEntry(f"the pool sent {len(entries)} entries for {len(pieces)} keys")
        out = kv_buffer(self._bytes(pieces[-1][2]))
        futures = [_decoders().submit(decode_entry_into, e, out[self._bytes(a):self._bytes(b)], k, self.secret)
                   for (k, a, b), e in zip(pieces, entries)]
        return self._settle(pieces, futures, out)

    def store_later(self, token_ids: list[int], kv, tenant: str = "", tail_end: int = 0, *,
                    session: bool = False, pin_s: float = 0.0, start: int = 0) -> None:
        """Write back the full chunks of (``token_ids``, their KV from token ``start``) of ``tenant``,
        and the tail up to ``tail_end`` (0: none) — or a spilled ``session``'s entries
        (``session_pieces``) — in the background, pinned ``pin_s`` seconds (0: not)."""
        if len(token_ids) < (self.block_size if session else self.settings.chunk_tokens):
            return
        t = asyncio.create_task(self.store(token_ids, kv, tenant, tail_end, session=session, pin_s=pin_s,
                                           start=start), name="pool-store")
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def store(self, token_ids: list[int], kv, tenant: str = "", tail_end: int = 0, *,
                    session: bool = False, pin_s: float = 0.0, start: int = 0) -> int:
        """Put the entries the pool lacks (``session``: a spilled session's, ``session_pieces``),
        pinning them all ``pin_s`` seconds under ``tenant`` (0: none); returns how many it stored
        (0 on any failure). ``kv`` holds the tokens from ``start`` (a block boundary): an entry
        before it that the pool lacks (evicted since this request reused it) is not stored — the
        next request that computes it writes it back."""
        pieces = self.session_pieces(token_ids, tenant) if session else \
            self.pieces(token_ids, len(token_ids), tail_end, tenant)
        keys = [k for k, _, _ in pieces]
        t0 = time.perf_counter()
        try:
            found = await self._lookup(keys, for_put=True, pin_s=pin_s, tenant=tenant)
            # held entries this worker could not use are put again (over them), from the first on
            hits = next((i for i, k in enumerate(keys[:found.hits]) if k in self.refused), found.hits)
            missing = [p for p in pieces[hits:] if p[1] >= start]
            if len(missing) < len(pieces) - hits:
                log.info("KV pool: %d entries before token %d lacking, not written back (reused from a cache, "
                         "not copied out)", len(pieces) - hits - len(missing), start)
            if not missing or not found.data_port:
                return 0
            entries = await asyncio.to_thread(self._encode, missing, kv, start)
            tid = f"{self.worker_id}-put-{next(self._ids)}"
            res = await send_and_report(self.bus, self.sender, self.worker_id, found.data_host, found.data_port,
                                        tid, pack_entries(entries), compressible=False)
            held = set(keys[hits:found.hits])    # after an unusable one: put again too (the same secret's now)
            replace = [k for k, _, _ in missing if k in held]
            reply = await self.bus.request(subjects.kvpool_put(found.pool_id), PoolPut(
                keys=[k for k, _, _ in missing], transfer_id=tid, nbytes=res.nbytes, checksum=res.checksum,
                pin_s=pin_s, tenant=tenant, replace=replace),
                timeout=self.settings.timeout)
            for k in replace:
                self.refused.pop(k, None)
            if replace:
                log.info("KV pool: %d entr%s this worker could not use put again", len(replace),
                         "y" if len(replace) == 1 else "ies")
        except (BusError, TransferError, TimeoutError) as e:
            self.errors += 1
            log.warning("KV pool write-back failed: %s", e)
            return 0
        self.stored += reply.stored
        log.info("KV pool: wrote back %d of %d entries in %.1f ms", reply.stored, len(keys),
                 (time.perf_counter() - t0) * 1e3)
        return reply.stored

    def _encode(self, pieces: list[tuple[str, int, int]], kv, start: int = 0) -> list[bytes]:
        mv = memoryview(kv).cast("B")
        return [self.codec.encode(k, self._kv_of(mv, a - start, b - start), self.shape) for k, a, b in pieces]

    def _kv_of(self, mv: memoryview, a: int, b: int):
        """The KV blocks of tokens [a, b) (``a`` at a block's start); a partial last block with
        its slots past ``b`` zeroed (whatever the sequence computed after: not the entry's)."""
        kv = mv[self._bytes(a):self._bytes(b)]
        if b % self.block_size == 0:
            return kv
        kv = bytearray(kv)
        s = self.shape
        last = np.frombuffer(kv, dtype=np.float16)[-self._bytes(1) // 2:].reshape(
            s.n_layers, 2, s.block_size, s.n_kv_heads, s.head_dim)
        last[:, :, b % self.block_size:] = 0
        return kv

    async def close(self) -> None:
        """Drain the pending write-backs (``TANDEM_POOL_DRAIN_S`` at most), cancel the rest."""
        if not self._tasks:
            return
        pending, errors = list(self._tasks), self.errors
        t0 = time.perf_counter()
        _, late = await asyncio.wait(pending, timeout=self.settings.drain_s)
        for t in late:
            t.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        dropped = len(late) + self.errors - errors
        (log.warning if dropped else log.info)(
            "KV pool: %d pending write-back(s) at shutdown: %d drained in %.1f ms, %d dropped "
            "(failed, or not done within TANDEM_POOL_DRAIN_S %.1f s)", len(pending), len(pending) - dropped,
            (time.perf_counter() - t0) * 1e3, dropped, self.settings.drain_s)
