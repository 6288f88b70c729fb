"""The ring's wire: ops, typed metadata, the authenticated channel, same-host regions.

A ring connection (docs/protocol.md "Ring connections") opens with a handshake under the
data-plane key — the server sends ``MAGIC`` and a fresh nonce, the client answers with its own
and ``HMAC(key, "tandem-ring-hello-v1" ‖ server nonce ‖ client nonce)``, the server proves
itself with ``HMAC(key, "tandem-ring-welcome-v1" ‖ …)`` — before either side reads a size or
allocates anything; every message after it carries ``HMAC(session key, direction ‖ counter ‖
header ‖ meta ‖ payload)`` (``TAG`` bytes, the data plane's tag size) under a key derived from
both nonces, so a message cannot be forged, replayed, reordered or moved to another connection.
Without a key (a deployment that has none) nothing is tagged, as for the KV frames.

Message: ``!BIQ`` (``Op``, meta bytes, payload bytes), the meta (JSON of one of the ``Meta``
dataclasses below), the payload, the tag. A member's reply has op ``OK`` or ``ERR`` (``Err``).
``MAGIC`` carries the wire version (``WIRE_VERSION``): a peer of another version is refused at
the handshake, named as such.

Same host: right after the handshake the coordinator offers its host identity (``SHM``); a
member on the same running kernel with shared memory on (``TANDEM_DATA_SHM``) creates a region
in /dev/shm (``tandem-ring-<32 hex>``, mode 0600, two areas of ``SHM_AREA`` bytes: coordinator
→ member and back) and names it in its reply; the coordinator maps it and unlinks it, says so
(``MAPPED``), and from then on each message's payload (up to an area) is written to the sender's
area instead of the socket, while the header, meta and tag still go on the socket. The receiver
copies the payload out of the region before it checks the tag, so the tag covers exactly the
bytes it uses. Several messages may be in flight (the fold's): a payload of up to 1/``SLOTS``
of an area goes in slot (message counter % ``SLOTS``), a larger one (only a request / reply
carries one) fills it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import ClassVar

import torch

from shared.transfer.frames import TAG
from shared.transfer.shm import SHM_DIR

WIRE_VERSION = 1
MAGIC = b"TRG" + str(WIRE_VERSION).encode()
NONCE = 32
HEAD = struct.Struct("!BIQ")
MAX_META = 1 << 16
CONNECT_TIMEOUT = 3.0
SHM_AREA = 8 << 20       # bytes per direction of a same-host connection's region
SLOTS = 16               # a payload of up to SHM_AREA / SLOTS goes in slot (message counter % SLOTS):
                         # the fold has up to groups + 1 messages in flight per direction
LOAD_CHUNK = 8 << 20     # a scatter's LOAD messages carry at most this many bytes of blocks
REFUSED, OTHER_VERSION = 1, 2   # the server's refusal of a handshake (byte after the client's proof)


class Op(IntEnum):
    """A message's op (the first byte of its header)."""
    OK = 0           # a reply: done
    RESERVE = 1      # Reserve: blocks for a range
    LOAD = 2         # Load: a range's blocks (payload)
    ATTEND = 3       # Attend: a layer's q|k|v rows (payload) -> Parts
    READ = 4         # Read: the shard's blocks back (gather)
    RELEASE = 5      # Release: free the shard
    SHM = 6          # ShmOffer: the coordinator's host identity -> ShmAnswer
    MAPPED = 7       # Mapped: the region is mapped (or not)
    CHAIN = 8        # Chain: a member's place in the fold
    PEER = 9         # Peer: a predecessor's link, with the ticket announced
    STEP = 10        # Step: a layer of a folding step (q|k|v rows)
    STATE = 11       # State: a head group's running state (payload)
    PARK = 16        # Ticket: a loaded shard waits for its coordinator under a ticket -> Range
    CLAIM = 17       # Ticket: take over a parked shard -> Range
    ERR = 255        # Err: a reply: refused, or a member lost


class RingMemberLost(RuntimeError):
    """A remote member stopped answering (its process died, or the link broke): the ring
    session cannot go on. ``code`` "unavailable": the gateway resumes the request elsewhere,
    without ``lost`` (the worker)."""
    code = "unavailable"

    def __init__(self, worker: str, why: str):
        super().__init__(f"ring member {worker} lost: {why}")
        self.lost = worker


class RingMemberError(RuntimeError):
    """A member refused an operation (coded: "overloaded" for no room, "bad_request" otherwise)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


# ---- typed metadata --------------------------------------------------------------------------
_COERCE = {"int": int, "str": str, "bool": bool}
_TICKET = re.compile(r"[0-9a-f]{32,128}")


@dataclass(frozen=True)
class Meta:
    """A message's metadata: ``to_wire`` for the JSON, ``parse`` back, naming a bad field."""
    VERSION: ClassVar[int] = WIRE_VERSION
    RENAME: ClassVar[dict[str, str]] = {}     # field -> its key on the wire (a Python keyword)

    def to_wire(self) -> dict:
        return {self.RENAME.get(f.name, f.name): getattr(self, f.name) for f in fields(self)}

    @classmethod
    def parse(cls, d: dict):
        kw = {}
        for f in fields(cls):
            key = cls.RENAME.get(f.name, f.name)
            if key not in d:
                if f.default is f.default_factory:   # both MISSING: a required field
                    raise ValueError(f"ring {cls.__name__} v{cls.VERSION}: missing field {key!r}")
                continue
            v, conv = d[key], _COERCE.get(f.type)
            try:
                kw[f.name] = conv(v) if conv is not None and v is not None else v
            except (TypeError, ValueError) as e:
                raise ValueError(f"ring {cls.__name__} v{cls.VERSION}: bad field {key!r}: {e}") from None
        return cls(**kw)


def check_ticket(ticket: str) -> str:
    if not _TICKET.fullmatch(ticket):
        raise ValueError("a claim ticket is 32 to 128 hex digits")
    return ticket


@dataclass(frozen=True)
class Reserve(Meta):
    sid: str
    start: int
    end: int


@dataclass(frozen=True)
class Load(Meta):
    sid: str
    first: int = 0             # the shard's block the payload's first block goes to


@dataclass(frozen=True)
class Attend(Meta):
    sid: str
    layer: int
    pos: int
    store: bool = False        # this member owns the new position: store its k, v first


@dataclass(frozen=True)
class Parts(Meta):
    shape: list | None         # the states' shape (payload), None: no keys here yet


@dataclass(frozen=True)
class Read(Meta):
    sid: str
    keys: int                  # the blocks holding any of the first ``keys`` positions


@dataclass(frozen=True)
class Release(Meta):
    sid: str


@dataclass(frozen=True)
class Ticket(Meta):
    """``PARK`` a shard under a ticket, or ``CLAIM`` the one parked under it (-> ``Range``)."""
    sid: str
    ticket: str


@dataclass(frozen=True)
class Range(Meta):
    start: int
    end: int


@dataclass(frozen=True)
class ShmOffer(Meta):
    host: str = ""             # the coordinator's host identity (shared/transfer/link.py)


@dataclass(frozen=True)
class ShmAnswer(Meta):
    name: str | None = None    # the region's name in /dev/shm; None: stay on TCP
    area: int = 0


@dataclass(frozen=True)
class Mapped(Meta):
    ok: bool = False


@dataclass(frozen=True)
class Chain(Meta):
    sid: str
    index: int                 # the member's place in shard order
    prev: str                  # none | coord | peer: where the running state comes from
    prev_worker: str = ""
    ticket: str | None = None  # prev == peer: the ticket the predecessor's link carries
    next: list | None = None   # [worker, host, port, ticket] of the member after it, if remote


@dataclass(frozen=True)
class Peer(Meta):
    ticket: str = ""


@dataclass(frozen=True)
class Step(Meta):
    RENAME: ClassVar[dict[str, str]] = {"qpass": "pass"}
    sid: str
    layer: int
    pos: int
    tail: int                  # the member owning the new position (the fold's last)
    groups: int                # head groups the layer is pipelined in
    qpass: bool = False        # the q rows go on along the ring


@dataclass(frozen=True)
class State(Meta):
    g: int
    shape: list
    sid: str = ""


@dataclass(frozen=True)
class Err(Meta):
    code: str = "internal"
    message: str = ""
    lost: str = ""             # a member further up the ring whose link broke


# ---- the channel -----------------------------------------------------------------------------
def mac(key: bytes, label: bytes, *parts) -> bytes:
    h = hmac.new(key, label, hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """``n`` bytes; with ``deadline`` (``time.monotonic()``) all of them by then, else TimeoutError
    (the socket's own timeout bounds each read only)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {n} bytes by the deadline")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("connection closed")
        got += k
    return buf


def session_key(key: bytes, sn: bytes, cn: bytes) -> bytes:
    return mac(key, b"tandem-ring-session-v1", sn, cn) if key else b""


def tensor(payload: bytearray, shape) -> torch.Tensor:
    return torch.frombuffer(payload, dtype=torch.float32).view(*shape)


class Channel:
    """One side of an authenticated connection: framed, tagged messages (module doc); with a
    shared-memory region attached, payloads travel through it."""

    def __init__(self, sock: socket.socket, session_key: bytes, client: bool, max_payload: int):
        self.sock, self.key, self.max_payload, self.client = sock, session_key, max_payload, client
        self.out_dir, self.in_dir = (b"c", b"s") if client else (b"s", b"c")
        self.sent = self.got = 0
        self.region: mmap.mmap | None = None
        self._out = self._in = None    # the two areas of the region, as seen from this side
        self._lock = threading.Lock()  # a member's states and its replies may leave from two threads
        self.wait_s = self.xfer_s = 0.0  # blocked until a message's first bytes / sending and reading

    @property
    def link(self) -> str:
        return "shm" if self.region is not None else "tcp"

    def attach(self, region: mmap.mmap, area: int) -> None:
        """Send and receive payloads of up to ``area`` bytes through ``region`` (2 × area bytes:
        the coordinator's area first)."""
        view = memoryview(region)
        mine, theirs = (view[:area], view[area:2 * area]) if self.client else (view[area:2 * area], view[:area])
        self.region, self._out, self._in = region, mine, theirs

    def detach(self) -> None:
        if self.region is not None:
            self._out.release()
            self._in.release()
            self.region.close()
            self.region = self._out = self._in = None

    def _area(self, area: memoryview, n: int, counter: int) -> memoryview | None:
        """Where message ``counter``'s payload of ``n`` bytes goes in ``area`` (None: on the
        socket). Small ones take slot counter % SLOTS, so up to SLOTS messages may be in flight
        (the fold's states); a larger one the whole area, which only a request / reply carries
        (nothing else in flight then)."""
        if area is None or not 0 < n <= area.nbytes:
            return None
        slot = area.nbytes // SLOTS
        off = counter % SLOTS * slot if n <= slot else 0
        return area[off:off + n]

    def send(self, op: int, meta: Meta | dict | None = None, payload=b"") -> None:
        t0 = time.perf_counter()
        if isinstance(meta, Meta):
            meta = meta.to_wire()
        m = json.dumps(meta or {}, separators=(",", ":")).encode()
        pv = memoryview(payload).cast("B")
        head = HEAD.pack(op, len(m), pv.nbytes)
        with self._lock:
            tag = mac(self.key, self.out_dir, self.sent.to_bytes(8, "big"), head, m, pv) if self.key else b""
            area = self._area(self._out, pv.nbytes, self.sent)
            self.sent += 1
            if area is not None:
                with area:      # released at once: the region can be closed whatever happens next
                    area[:] = pv
                self.sock.sendall(head + m + tag)
            elif pv.nbytes < 1 << 16:
                self.sock.sendall(b"".join([head, m, pv, tag]))
            else:
                self.sock.sendall(head + m)
                self.sock.sendall(pv)
                if tag:
                    self.sock.sendall(tag)
        self.xfer_s += time.perf_counter() - t0

    def recv(self) -> tuple[int, dict, bytearray]:
        t0 = time.perf_counter()
        head = recv_exact(self.sock, HEAD.size)
        t1 = time.perf_counter()
        op, mlen, plen = HEAD.unpack(head)
        if mlen > MAX_META or plen > self.max_payload:
            raise ConnectionError(f"message of {mlen} + {plen} bytes is over the limit")
        m = recv_exact(self.sock, mlen)
        area = self._area(self._in, plen, self.got)
        if area is not None:   # a private copy: what the tag is checked over is what is used
            payload = bytearray(plen)
            with area:
                payload[:] = area
        else:
            payload = recv_exact(self.sock, plen)
        if self.key:
            tag = recv_exact(self.sock, TAG)
            want = mac(self.key, self.in_dir, self.got.to_bytes(8, "big"), head, m, payload)
            if not hmac.compare_digest(bytes(tag), want):
                raise ConnectionError("message tag does not verify under the data-plane key")
        self.got += 1
        self.wait_s += t1 - t0
        self.xfer_s += time.perf_counter() - t1
        return op, json.loads(m) if mlen else {}, payload


# ---- the handshake ---------------------------------------------------------------------------
def server_handshake(conn: socket.socket, key: bytes, max_payload: int,
                     deadline: float | None = None) -> Channel | None:
    """The member's side: None when the client has no valid proof of ``key`` (it is told so);
    TimeoutError when its hello is not all in by ``deadline`` (``time.monotonic()``)."""
    sn = os.urandom(NONCE)
    conn.sendall(MAGIC + sn)
    hello = recv_exact(conn, len(MAGIC) + NONCE + TAG, deadline)
    cn, proof = bytes(hello[4:4 + NONCE]), bytes(hello[4 + NONCE:])
    if hello[:4] != MAGIC:
        conn.sendall(bytes([OTHER_VERSION if hello[:3] == MAGIC[:3] else REFUSED]) + bytes(TAG))
        return None
    if key and not hmac.compare_digest(proof, mac(key, b"tandem-ring-hello-v1", sn, cn)):
        conn.sendall(bytes([REFUSED]) + bytes(TAG))
        return None
    conn.sendall(b"\x00" + (mac(key, b"tandem-ring-welcome-v1", sn, cn) if key else bytes(TAG)))
    return Channel(conn, session_key(key, sn, cn), client=False, max_payload=max_payload)


def client_handshake(sock: socket.socket, key: bytes) -> Channel:
    """The coordinator's side; ConnectionError naming why the member is not one to talk to."""
    head = recv_exact(sock, len(MAGIC) + NONCE)
    if head[:4] != MAGIC:
        if head[:3] == MAGIC[:3]:
            raise ConnectionError(f"it speaks ring wire version {head[3:4].decode(errors='replace')}, "
                                  f"this worker {WIRE_VERSION}: run one version of Tandem")
        raise ConnectionError("it is not a ring member")
    sn, cn = bytes(head[4:]), os.urandom(NONCE)
    sock.sendall(MAGIC + cn + (mac(key, b"tandem-ring-hello-v1", sn, cn) if key else bytes(TAG)))
    answer = recv_exact(sock, 1 + TAG)
    if answer[0] == OTHER_VERSION:
        raise ConnectionError(f"it refused our ring wire version {WIRE_VERSION}: run one version of Tandem")
    if answer[0] != 0:
        raise ConnectionError("it refused our proof of the data-plane key")
    if key and not hmac.compare_digest(bytes(answer[1:]), mac(key, b"tandem-ring-welcome-v1", sn, cn)):
        raise ConnectionError("it could not prove it holds the data-plane key")
    return Channel(sock, session_key(key, sn, cn), client=True, max_payload=1 << 40)


# ---- same-host regions -----------------------------------------------------------------------
def new_region(area: int) -> tuple[str, mmap.mmap]:
    """A fresh /dev/shm region of two areas (the member's side): its name and mapping."""
    name = f"tandem-ring-{os.urandom(16).hex()}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.ftruncate(fd, 2 * area)
        return name, mmap.mmap(fd, 2 * area, flags=mmap.MAP_SHARED)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def map_region(name: str, area: int) -> mmap.mmap:
    """Map a member's region (the coordinator's side) and unlink it."""
    if not re.fullmatch(r"tandem-ring-[0-9a-f]{32}", name) or not 0 < area <= 1 << 30:
        raise ValueError(f"not a ring region: {name!r} of 2 x {area} bytes")
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.unlink(path)
        st = os.fstat(fd)
        if st.st_size != 2 * area or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError(f"region {name} is not 2 x {area} bytes of this user, mode 0600")
        return mmap.mmap(fd, 2 * area, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
