"""The worker side of a ring session: what services/prefill.py and services/decode.py call.

``RingConnector`` is to the ring what ``shared/kv_connector.py`` is to the hand-off: the one
place a worker plans a session's ranges, checks the members' addresses, scatters, claims, hosts
its own member, and turns a ring error into a bus error (``bus_error``). The life cycle it
drives is the package's (``shared/ring/__init__.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from shared import metrics
from shared.bus import BusError
from shared.engine.kv_cache import KVBlobHeader
from shared.engine.sampling import SamplingParams
from shared.ring.remote import RemoteMember, connect_ring
from shared.ring.server import EngineMember, RingServer
from shared.ring.session import LocalMember, Ring, RingCapacityError, shard_bytes
from shared.ring.wire import RingMemberError, RingMemberLost
from shared.schemas import RingClaim, RingPeer
from shared.settings import DataPlaneSettings
from shared.strategy import shard_ranges

if TYPE_CHECKING:
    from shared.engine.async_engine import AsyncEngine
    from shared.kv_connector import DataPeers

log = logging.getLogger("tandem.ring")

RING_ERRORS = (RingCapacityError, RingMemberError, RingMemberLost)   # what a ring's set-up raises


def bus_error(e: Exception, request_id: str) -> BusError:
    """The one mapping of a ring error to the bus's: overloaded (a member has no room: nothing
    is kept), unavailable (a member cannot be reached: the gateway resumes without it), the
    member's code (it refused), bad_request (a plan or claim that does not add up)."""
    if isinstance(e, RingCapacityError):
        return BusError("overloaded", str(e))
    if isinstance(e, RingMemberLost):
        return BusError("unavailable", str(e), lost=e.lost)
    if isinstance(e, RingMemberError):
        return BusError(e.code, str(e))
    return BusError("bad_request", f"{request_id}: {e}")


def new_ticket() -> str:
    """A claim ticket for a prefill's scatter: 128 random bits."""
    return os.urandom(16).hex()


def ring_ranges(h: KVBlobHeader, members: int, max_context: int) -> list[tuple[int, int]]:
    """The members' token ranges of the session a hand-off blob's header describes: planned over
    its whole length (its tokens and the outputs it may still make, within the model's context)."""
    max_tokens = SamplingParams.from_dict(h.params).max_tokens
    return shard_ranges(min(len(h.token_ids) + max_tokens - len(h.output_token_ids), max_context), members)


def scatter_parked(ring_plan: list, coordinator: str, ranges: list[tuple[int, int]], kv, num_computed: int,
                   layout, key: bytes, sid: str, ticket: str, timeout: float = 30.0, shm: bool = True) -> list[str]:
    """The prefill's side of a ring hand-off: every member of ``ring_plan`` ([worker, host,
    port] in shard order) but the ``coordinator`` (which takes its range over the data plane)
    ``RESERVE``s and ``LOAD``s its range of ``kv`` (the whole blocks of ``num_computed``
    positions) — all at the same time, a connection and a thread each — then each shard is
    ``PARK``ed under ``ticket`` for the coordinator to ``CLAIM``. Returns each member's link
    (in plan order, the coordinator's "data plane"). On any failure nothing stays reserved
    anywhere, and the error is raised: RingCapacityError (a member has no room: the message
    names it), RingMemberLost (one cannot be reached), RingMemberError."""
    mv = memoryview(kv).cast("B")
    todo = [(w, h, int(p), r) for (w, h, p), r in zip(ring_plan, ranges) if w != coordinator]
    opened: list[RemoteMember] = []
    lock = threading.Lock()

    def one(worker: str, host: str, port: int, rng: tuple[int, int]) -> RemoteMember:
        m = RemoteMember(worker, host, port, key, layout, timeout, shm)
        with lock:
            opened.append(m)
        m.reserve(sid, *rng)
        m.load(sid, shard_bytes(layout, mv, rng[0], rng[1], num_computed))
        return m

    parked: list[RemoteMember] = []
    try:
        with ThreadPoolExecutor(max(1, len(todo)), thread_name_prefix="ring-scatter") as pool:
            futures = [pool.submit(one, *t) for t in todo]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:   # the room a member lacks says more than the connections others lost meanwhile
            raise next((e for e in errors if isinstance(e, RingCapacityError)), errors[0])
        members = {m.name: m for m in opened}
        for w, _, _, _ in todo:
            members[w].park(sid, ticket)
            parked.append(members[w])
        links = {m.name: m.link for m in opened}
        return [links.get(w, "data plane") for w, _, _ in ring_plan]
    except BaseException:
        for m in parked:   # back on this connection, which frees it as it closes
            try:
                m.claim(sid, ticket)
            except (RingMemberLost, RingMemberError):
                pass
        raise
    finally:
        for m in opened:   # a member frees what a closed connection holds: what was not parked
            m.close()


def admit_claimed(ring: Ring, sid: str, ticket: str, h: KVBlobHeader, kv, ranges: list[tuple[int, int]]) -> None:
    """The coordinator's side of a prefill's scatter (``scatter_parked``): each remote member's
    shard is ``CLAIM``ed with ``ticket`` (it must hold the range the plan gives it), this
    worker's own member reserves its range and loads ``kv`` (its range's blocks, from the data
    plane); then ``ring`` decodes the session as ``sid``. On a failure the caller releases
    ``sid`` on the ring (claimed shards are then freed)."""
    for m, (a, b) in zip(ring.members, ranges):
        if isinstance(m, RemoteMember):
            got = m.claim(sid, ticket)
            if got != (a, b):
                raise ValueError(f"{m.name} holds tokens [{got[0]}, {got[1]}) of the session, not [{a}, {b})")
    for m, (a, b) in zip(ring.members, ranges):
        if isinstance(m, LocalMember):
            m.reserve(sid, a, b)
            m.load(sid, kv)
    ring.adopt(sid, h.token_ids, h.num_computed, ranges)


class RingConnector:
    """One worker's ring door: ``host`` its member (cpu-decode), ``scatter`` a prefilled
    session's ranges (prefill), ``coordinate`` a session (the decode worker the plan names
    first), ``close``. Member addresses are checked against live heartbeats (``peers``) before
    any KV goes there."""

    def __init__(self, worker_id: str, data: DataPlaneSettings, peers: "DataPeers", engine: "AsyncEngine",
                 step_deadline_s: float = 0.0):
        self.worker_id, self.data, self.peers, self.engine = worker_id, data, peers, engine
        # a coordinator waits for a silent member a little less than its engine's step deadline, so
        # that the ring's error names the member before the gateway finds this worker's engine stuck
        # in that step and resumes the request without this worker (TANDEM_STEP_DEADLINE_S)
        self.member_timeout = min(data.timeout, 0.8 * step_deadline_s) if step_deadline_s > 0 else data.timeout
        self.member: EngineMember | None = None
        self.server: RingServer | None = None

    def host(self) -> int:
        """Serve this worker's engine cache as a ring member (cpu-decode): its ring port."""
        d = self.data
        self.member = EngineMember(self.engine.engine, self.engine.run_blocking, self.worker_id)
        self.server = RingServer(self.member, d.host, d.ring_port, d.secret(), d.timeout, d.shm,
                                 fold_timeout=0.5 * self.member_timeout)
        return self.server.start()[1]

    async def check(self, ring: list[RingPeer], coordinator: str, request_id: str) -> int:
        """The coordinator's place in ``ring``, once every other member's address is the ring port
        of that live worker (a heartbeat names it). BusError bad_request / forbidden;
        RingMemberLost for a member whose heartbeats named that port but stopped (it died since
        the router planned the ring): the gateway resumes the request without that member, not
        without this worker."""
        me = next((i for i, p in enumerate(ring) if p.worker == coordinator), None)
        if me is None:
            raise BusError("bad_request", f"the coordinator {coordinator} is not a member of the ring "
                                          f"{[p.worker for p in ring]}")
        for p in ring:   # KV goes only to live members' advertised ring ports
            if p.worker != coordinator:
                try:
                    await self.peers.check(p.host, p.port, p.worker, f"ring shards of {request_id}")
                except BusError as e:
                    if e.code == "forbidden" and self.peers.was_at(p.worker, p.host, p.port):
                        raise RingMemberLost(p.worker, f"no heartbeat from it lately ({e.message})") from None
                    raise
        return me

    @staticmethod
    def ranges(h: KVBlobHeader, members: int, max_context: int) -> list[tuple[int, int]]:
        """``ring_ranges``, or BusError bad_request when no ring of ``members`` can hold it."""
        try:
            return ring_ranges(h, members, max_context)
        except ValueError as e:
            raise BusError("bad_request", f"{h.request_id}: no ring of {members}: {e}") from None

    async def scatter(self, ring: list[RingPeer], coordinator: str, h: KVBlobHeader, kv,
                      sid: str) -> tuple[bytes, RingClaim, asyncio.Future]:
        """A prefill's ring hand-off: the members but the coordinator get their ranges from here,
        all at the same time, parked under a fresh ticket (``scatter_parked``, started here in a
        thread: the coordinator's range goes over the data plane meanwhile). Returns the
        coordinator's blob (its own range only), the claim for its DecodeRequest, and the
        scatter: a future of (links, seconds)."""
        me = await self.check(ring, coordinator, h.request_id)
        layout = self.engine.layout
        ranges = self.ranges(h, len(ring), self.engine.engine.model_config.max_context)
        ticket, d = new_ticket(), self.data
        plan = [p.as_list() for p in ring]

        def run() -> tuple[list[str], float]:
            t0 = time.monotonic()
            try:
                links = scatter_parked(plan, coordinator, ranges, kv, h.num_computed, layout, d.secret(), sid,
                                       ticket, d.timeout, d.shm)
            except BaseException as e:
                metrics.ring_session("parked", bus_error(e, h.request_id).code if isinstance(e, Exception)
                                     else "aborted")
                raise
            own = shard_bytes(layout, memoryview(kv).cast("B"), *ranges[me], h.num_computed).nbytes
            metrics.ring_session("parked", "ok", memoryview(kv).nbytes - own)
            return links, time.monotonic() - t0

        task = asyncio.ensure_future(asyncio.to_thread(run))
        own = shard_bytes(layout, kv, *ranges[me], h.num_computed)
        blob = dataclasses.replace(h, kv_blocks=own.nbytes // layout.block_bytes).pack(own)
        return blob, RingClaim(ticket=ticket, ranges=[list(r) for r in ranges]), task

    async def coordinate(self, ring: list[RingPeer], blob: bytes, sid: str, claim: RingClaim | None,
                         priority: int | None) -> asyncio.Future:
        """Decode ``blob`` on ``ring`` (this worker among them): the request's output stream.
        With ``claim`` the prefill scattered the other members' ranges itself: ``blob`` holds
        this worker's range only, the others are claimed with the ticket; without, this worker
        scatters the blob over the members. Coded errors (``bus_error``): forbidden (a member
        address no live worker's heartbeat names), overloaded (a member has no room: nothing is
        kept), unavailable (a member cannot be reached), bad_request (a claim that does not
        match the plan, or a wrong ticket)."""
        if self.member is None:
            raise BusError("bad_request", f"{self.worker_id} cannot coordinate a ring (no fused CPU kernels)")
        h, kv = KVBlobHeader.parse(blob)
        rid = h.request_id
        try:
            me = await self.check(ring, self.worker_id, rid)
        except RingMemberLost as e:
            raise bus_error(e, rid) from None
        k = self.member.kernels
        ranges = self.ranges(h, len(ring), k.max_context)
        if claim is not None and [tuple(r) for r in claim.ranges] != ranges:
            raise BusError("bad_request", f"{rid}: the prefill scattered the ranges {claim.ranges}, this "
                                          f"coordinator plans {ranges}")
        d, how = self.data, "claimed" if claim is not None else "scattered"

        def build() -> Ring:
            nkv = k.cfg.n_kv_heads
            r = Ring(k, connect_ring([p.as_list() for p in ring], self.worker_id, self.member, d.secret(),
                                     self.engine.layout, self.member_timeout, d.shm),
                     fold=d.ring_fold, groups=min(d.ring_groups or nkv, nkv), qpass=d.ring_qpass)
            try:
                if claim is not None:
                    admit_claimed(r, sid, claim.ticket, h, kv, ranges)
                else:
                    r.admit(sid, h.token_ids, h.num_computed, kv, ranges[-1][1])
                return r
            except BaseException:
                r.release(sid)
                r.close()
                raise

        t0 = time.monotonic()
        try:
            r = await asyncio.to_thread(build)
        except (*RING_ERRORS, ValueError) as e:
            err = bus_error(e, rid)
            metrics.ring_session(how, err.code)
            raise err from None
        if claim is None:   # the other members' ranges went from here
            own = shard_bytes(self.engine.layout, memoryview(kv).cast("B"), *ranges[me], h.num_computed).nbytes
            metrics.ring_session(how, "ok", memoryview(kv).nbytes - own)
        else:
            metrics.ring_session(how, "ok")
        log.info("%s: ring of %d %s (links %s), ranges %s: %d tokens of KV %s in %.0f ms", rid, len(ranges),
                 [p.worker for p in ring], [getattr(m, "link", "local") for m in r.members], ranges,
                 h.num_computed, "claimed (the prefill scattered it)" if claim is not None else "scattered",
                 (time.monotonic() - t0) * 1e3)
        try:
            return await self.engine.submit_ring(rid, blob, r, sid, priority)
        except BaseException:
            await asyncio.to_thread(r.release, sid)
            r.close()
            raise

    def hosting(self) -> int:
        """Shards this worker's member holds for rings other workers coordinate (or a prefill parked
        for them): a stopping worker serves them until their requests end (``EngineWorker.run_until``)."""
        return len(self.member.shards) if self.member is not None else 0

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
