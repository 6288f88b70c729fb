"""The coordinator's handle on a ring member in another worker: ``RingMember``'s calls as messages.

One ``RemoteMember`` per other member of a session's ring: a persistent, authenticated
connection (``wire.py``) carrying, per decode step and layer, the q|k|v rows out and the
member's segment states back; with the fold (``Ring(fold=True)``), the running state of each
head group. Connection failures raise ``RingMemberLost`` naming the worker; a refusal
``RingMemberError`` (coded).
"""

from __future__ import annotations

import logging
import socket

import torch

from shared.ring.session import LocalMember, RingCapacityError
from shared.ring.wire import (
    CONNECT_TIMEOUT, LOAD_CHUNK, Attend, Chain, Err, Load, Mapped, Meta, Op, Parts, Range, Read,
    Release, Reserve, RingMemberError, RingMemberLost, ShmAnswer, ShmOffer, State, Step, Ticket, client_handshake,
    map_region, tensor,
)
from shared.transfer import link as links
from shared.transfer.shm import available as shm_available

log = logging.getLogger("tandem.ring")


class RemoteMember:
    """A ``RingMember`` in another worker (the calls ``Ring`` makes, as messages), plus the fold's
    calls (``chain``, ``post_step``, ``send_state``, ``recv_state``)."""

    def __init__(self, worker: str, host: str, port: int, key: bytes, layout, timeout: float = 30.0,
                 shm: bool = True):
        """``shm``: on the member's host, the payloads go through shared memory (``wire.py``)."""
        self.name, self.layout, self.timeout = worker, layout, timeout
        self.host, self.port = host, port
        self.ranges: dict[str, tuple[int, int]] = {}
        self.bytes_out = self.bytes_back = 0
        self.lost = False    # its connection broke or timed out: nothing more is sent on it
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(timeout)
            self.ch = client_handshake(sock, key)
        except (OSError, ConnectionError) as e:
            raise RingMemberLost(worker, f"cannot open a ring connection to {host}:{port}: {e}") from None
        self.sock = sock
        if shm and shm_available():
            try:
                self._map_shared()
            except BaseException:
                sock.close()
                raise

    @property
    def link(self) -> str:
        """``shm`` or ``tcp``: where this connection's payloads go."""
        return self.ch.link

    def _map_shared(self) -> None:
        """Offer our host identity; map the region a member on this host answers with."""
        offer = ShmAnswer.parse(self._call(Op.SHM, ShmOffer(links.host_identity()))[0])
        if not offer.name:
            return
        region = None
        try:
            region = map_region(str(offer.name), int(offer.area))
        except (OSError, ValueError) as e:
            log.warning("ring member %s: cannot map its region %s (%s): the connection stays on TCP",
                        self.name, offer.name, e)
        self._call(Op.MAPPED, Mapped(region is not None))
        if region is not None:
            self.ch.attach(region, offer.area)

    def _send(self, op: int, meta: Meta | dict, payload=b"") -> None:
        try:
            self.ch.send(op, meta, payload)
        except OSError as e:
            self.lost = True
            raise RingMemberLost(self.name, str(e) or type(e).__name__) from None

    def _reply(self) -> tuple[dict, bytearray]:
        try:
            op, meta, payload = self.ch.recv()
        except (OSError, ConnectionError) as e:   # a timeout too: the connection is out of step for good
            self.lost = True
            raise RingMemberLost(self.name, str(e) or type(e).__name__) from None
        if op == Op.ERR:
            err = Err.parse(meta)
            if err.lost:   # a member further up the ring, named by the one after it
                raise RingMemberLost(err.lost, err.message)
            raise RingMemberError(err.code, f"{self.name}: {err.message}")
        return meta, payload

    def _call(self, op: int, meta: Meta | dict, payload=b"") -> tuple[dict, bytearray]:
        self._send(op, meta, payload)
        return self._reply()

    def reserve(self, sid: str, start: int, end: int) -> None:
        try:
            self._call(Op.RESERVE, Reserve(sid, start, end))
        except RingMemberError as e:
            if e.code == "overloaded":
                raise RingCapacityError(str(e)) from None
            raise
        self.ranges[sid] = (start, end)

    def load(self, sid: str, kv, first: int = 0) -> None:
        """In messages of at most ``LOAD_CHUNK`` bytes (whole blocks): each fits a shm area."""
        mv, bb = memoryview(kv).cast("B"), self.layout.block_bytes
        step = max(1, LOAD_CHUNK // bb) * bb
        for off in range(0, mv.nbytes, step):
            self._call(Op.LOAD, Load(sid, first + off // bb), mv[off:off + step])

    def park(self, sid: str, ticket: str) -> None:
        """Leave the loaded shard ``sid`` to the coordinator that ``claim``s it with ``ticket``
        (this connection no longer holds it)."""
        self._call(Op.PARK, Ticket(sid, ticket))
        self.ranges.pop(sid, None)

    def claim(self, sid: str, ticket: str) -> tuple[int, int]:
        """Take over the shard a prefill parked under ``ticket``, as ``sid``; its range."""
        got = Range.parse(self._call(Op.CLAIM, Ticket(sid, ticket))[0])
        self.ranges[sid] = (got.start, got.end)
        return self.ranges[sid]

    def owns(self, sid: str, pos: int) -> bool:
        a, b = self.ranges[sid]
        return a <= pos < b

    def post(self, sid: str, layer: int, qkv: torch.Tensor, pos: int, store: bool) -> None:
        body = qkv.contiguous().view(torch.uint8).numpy()
        self.bytes_out += body.nbytes
        self._send(Op.ATTEND, Attend(sid, layer, pos, store), body)

    def collect(self, sid: str) -> torch.Tensor | None:
        meta, payload = self._reply()
        self.bytes_back += len(payload)
        shape = Parts.parse(meta).shape
        return None if shape is None else tensor(payload, shape)

    def read(self, sid: str, keys: int) -> bytes:
        return bytes(self._call(Op.READ, Read(sid, keys))[1])

    # ---- the fold along the ring -----------------------------------------------------------
    def chain(self, sid: str, index: int, prev: str, prev_worker: str, ticket: str | None,
              nxt: list | None) -> None:
        """Tell the member its place in the session's fold (``server._Chain``); ``nxt``: [worker,
        host, port, ticket] of the member after it, which it links to (announced there first)."""
        self._call(Op.CHAIN, Chain(sid, index, prev, prev_worker, ticket, nxt))

    def post_step(self, sid: str, step: dict, qkv: torch.Tensor) -> None:
        """A layer of a folding step: the q|k|v rows (``step``: layer, pos, tail, groups, qpass)."""
        body = qkv.contiguous().view(torch.uint8).numpy()
        self.bytes_out += body.nbytes
        self._send(Op.STEP, Step(sid, **step), body)

    def send_state(self, sid: str, g: int, state: torch.Tensor) -> None:
        """Head group ``g``'s running state, folded by the coordinator's own member before this one."""
        body = state.contiguous().view(torch.uint8).numpy()
        self.bytes_out += body.nbytes
        self._send(Op.STATE, State(g, list(state.shape), sid), body)

    def recv_state(self, g: int) -> torch.Tensor:
        """Head group ``g``'s running state from this member (its own segments folded in last)."""
        meta, payload = self._reply()
        if meta.get("g") != g or not isinstance(meta.get("shape"), list):
            raise RingMemberError("bad_request", f"{self.name}: {meta} where group {g}'s state belongs")
        self.bytes_back += len(payload)
        return tensor(payload, meta["shape"])

    def release(self, sid: str) -> None:
        """Free the shard (best effort: a lost member's shards go with its connection, which the
        ring's ``close`` closes — a member that stopped answering is not asked again: that would
        hold the coordinator's engine for another timeout, and the gateway would take the engine
        for stuck)."""
        if self.ranges.pop(sid, None) is None or self.lost:
            return
        try:
            self._call(Op.RELEASE, Release(sid))
        except (RingMemberLost, RingMemberError):
            pass

    def close(self) -> None:
        self.sock.close()
        self.ch.detach()


def connect_ring(ring_plan: list, me: str, local: LocalMember, key: bytes, layout,
                 timeout: float = 30.0, shm: bool = True) -> list:
    """The members of a plan's ring ([worker, host, port] or ``RingPeer`` in shard order):
    ``local`` for this worker, a ``RemoteMember`` (connected, authenticated; through shared
    memory where the member is on this host and ``shm``) for each other.
    Blocking; on a failure the connections opened are closed and ``RingMemberLost`` raised."""
    members: list = []
    try:
        for worker, host, port in ring_plan:
            members.append(local if worker == me else RemoteMember(worker, host, int(port), key, layout, timeout,
                                                                          shm))
    except BaseException:
        for m in members:
            if isinstance(m, RemoteMember):
                m.close()
        raise
    return members
