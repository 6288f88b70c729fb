"""Ring members in other processes: the per-step messages of ring decode on the data plane.

A cpu-decode worker hosts shards of ring sessions next to its engine (``EngineMember``: a
``RingMember`` over the engine's own paged KV cache and block manager, so a shard is KV the
worker's heartbeat counts as used) and serves them on a TCP port of its data plane
(``RingServer``; the port goes in its heartbeats as ``ring_port``). The coordinator of a ring
session — the cpu-decode worker the plan names first — holds one ``RemoteMember`` per other
member: a persistent connection carrying, per decode step and layer, the q|k|v rows out and the
member's segment states back (docs/protocol.md "Ring decode"). The prefill's KV blob is
scattered over the same connections (``LOAD``: each member its range's blocks) — by the
coordinator, or by the prefill worker itself (``scatter_parked``): it opens a connection per
member, ``RESERVE``s and ``LOAD``s each member's range, all members at the same time, then
``PARK``s each shard under a random claim ticket (the shard outlives that connection); the
coordinator's connection ``CLAIM``s it with the ticket (from the DecodeRequest) and owns it from
then on. A shard not claimed within the data-plane timeout is freed (logged).

Authentication (docs/security.md "Data plane"): the connection opens with a handshake under
the data-plane key — the server sends a fresh nonce, the client answers with its own and
``HMAC(key, "tandem-ring-hello-v1" ‖ server nonce ‖ client nonce)``, the server proves itself
with ``HMAC(key, "tandem-ring-welcome-v1" ‖ …)`` — before either side reads a size or
allocates anything; every message after it carries ``HMAC(session key, direction ‖ counter ‖
header ‖ meta ‖ payload)`` under a key derived from both nonces, so a message cannot be
forged, replayed, reordered or moved to another connection. Without a key (a deployment that
has none) nothing is tagged, as for the KV frames.

Message: ``!BIQ`` (op, meta bytes, payload bytes), the meta (JSON), the payload, the tag (32
bytes, with a key). A member's reply has op ``OK`` or ``ERR`` (meta: code and message).

Same host (docs/protocol.md "Ring connections"): right after the handshake the coordinator
offers its host identity (``SHM``); a member on the same running kernel with shared memory on
(``TANDEM_DATA_SHM``) creates a region in /dev/shm (``tandem-ring-<32 hex>``, mode 0600, two
areas of ``SHM_AREA`` bytes: coordinator → member and back) and names it in its reply; the
coordinator maps it and unlinks it, says so (``MAPPED``), and from then on each message's
payload (up to an area) is written to the sender's area instead of the socket, while the
header, meta and tag still go on the socket. The receiver copies the payload out of the region
before it checks the tag, so the tag covers exactly the bytes it uses (a peer rewriting the
region afterwards changes nothing). The name travels only on the authenticated connection and
is unlinked once both sides hold it (the member unlinks it too, whatever the coordinator did).
Several messages may be in flight (the fold's): a payload of up to 1/``SLOTS`` of an area goes in
slot (message counter % ``SLOTS``), a larger one (only a request / reply carries one) fills it.

Fold (``Ring(fold=True)`` with remote members; docs/protocol.md "Ring connections"): the members
pass the running attention state member to member instead of every segment's state to the
coordinator. ``CHAIN`` tells a member its place (index, where the state comes from, the next
member's address and a ticket announced there); it opens an authenticated ring connection to
the next member (``PEER`` with the ticket). A ``STEP`` carries a layer's q|k|v rows (from the
coordinator, or forwarded along the ring with ``pass``); per head group the member attends,
folds its segments into the predecessor's ``STATE`` and sends its own ``STATE`` on — to the
next member, or to the coordinator when it is the tail or the coordinator's own member comes
next. Failures travel down the ring as one ``ERR`` (``lost``: the member whose link broke).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import mmap
import os
import queue
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from kernels.cpu_ring import RingKernels
from shared.engine.kv_cache import KVBlobHeader
from shared.engine.ring import Ring, RingCapacityError, RingMember, shard_bytes
from shared.engine.sampling import SamplingParams
from shared.strategy import shard_ranges
from shared.transfer import link as links
from shared.transfer.shm import SHM_DIR, available as shm_available, shm_unlink

log = logging.getLogger("tandem.ring")

MAGIC = b"TRG1"
NONCE = 32
TAG = 32
HEAD = struct.Struct("!BIQ")
RESERVE, LOAD, ATTEND, READ, RELEASE, SHM, MAPPED = 1, 2, 3, 4, 5, 6, 7
CHAIN, PEER, STEP, STATE = 8, 9, 10, 11   # the fold along the ring (module doc, "Fold")
PARK, CLAIM = 16, 17     # the prefill's scatter: a loaded shard parked under a ticket, claimed by its coordinator
OK, ERR = 0, 255
MAX_META = 1 << 16
CONNECT_TIMEOUT = 3.0
SHM_AREA = 8 << 20       # bytes per direction of a same-host connection's region
SLOTS = 16               # a payload of up to SHM_AREA / SLOTS goes in slot (message counter % SLOTS):
                         # the fold has up to groups + 1 messages in flight per direction
LOAD_CHUNK = 8 << 20     # a scatter's LOAD messages carry at most this many bytes of blocks


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


def _mac(key: bytes, label: bytes, *parts) -> bytes:
    h = hmac.new(key, label, hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("connection closed")
        got += k
    return buf


class _Channel:
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

    def send(self, op: int, meta: dict | None = None, payload=b"") -> None:
        t0 = time.perf_counter()
        m = json.dumps(meta or {}, separators=(",", ":")).encode()
        pv = memoryview(payload).cast("B")
        head = HEAD.pack(op, len(m), pv.nbytes)
        with self._lock:
            tag = _mac(self.key, self.out_dir, self.sent.to_bytes(8, "big"), head, m, pv) if self.key else b""
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
        head = _recv_exact(self.sock, HEAD.size)
        t1 = time.perf_counter()
        op, mlen, plen = HEAD.unpack(head)
        if mlen > MAX_META or plen > self.max_payload:
            raise ConnectionError(f"message of {mlen} + {plen} bytes is over the limit")
        m = _recv_exact(self.sock, mlen)
        area = self._area(self._in, plen, self.got)
        if area is not None:   # a private copy: what the tag is checked over is what is used
            payload = bytearray(plen)
            with area:
                payload[:] = area
        else:
            payload = _recv_exact(self.sock, plen)
        if self.key:
            tag = _recv_exact(self.sock, TAG)
            want = _mac(self.key, self.in_dir, self.got.to_bytes(8, "big"), head, m, payload)
            if not hmac.compare_digest(bytes(tag), want):
                raise ConnectionError("message tag does not verify under the data-plane key")
        self.got += 1
        self.wait_s += t1 - t0
        self.xfer_s += time.perf_counter() - t1
        return op, json.loads(m) if mlen else {}, payload


def _new_region(area: int) -> tuple[str, mmap.mmap]:
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


def _map_region(name: str, area: int) -> mmap.mmap:
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


def _session_key(key: bytes, sn: bytes, cn: bytes) -> bytes:
    return _mac(key, b"tandem-ring-session-v1", sn, cn) if key else b""


def _tensor(payload: bytearray, shape) -> torch.Tensor:
    return torch.frombuffer(payload, dtype=torch.float32).view(*shape)


def group_heads(nkv: int, groups: int, g: int) -> tuple[int, int]:
    """The kv heads [lo, hi) of head group ``g`` of ``groups`` (the fold's pipelining unit)."""
    return g * nkv // groups, (g + 1) * nkv // groups


class _Chain:
    """A member's place in a session's fold (module doc, "Fold"): its index in shard order,
    where the running state comes from (``prev``: "none" for the first member, "coord" when
    the member before it is the coordinator's own, "peer" over a link from the member before
    it) and where it goes (``next``: a link to the member after it, else the coordinator)."""

    def __init__(self, sid: str, index: int, prev: str, prev_worker: str, coord: _Channel):
        self.sid, self.index, self.prev, self.prev_worker, self.coord = sid, index, prev, prev_worker, coord
        self.next: RemoteMember | None = None
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()   # states from the peer link, when the
                                                              # step runs on the coordinator's connection
        self.ticket: str | None = None

    def close(self) -> None:
        if self.next is not None:
            self.next.close()
            self.next = None


class EngineMember(RingMember):
    """A member over a worker's engine cache: ``reserve`` / ``release`` run on the engine's
    thread (``on_engine``: the block manager is the scheduler's), the rest where it is called
    (a shard's blocks are its own; the engine never touches them)."""

    def __init__(self, engine, on_engine: Callable[[Callable], object], name: str):
        kernels = RingKernels.of(engine.model)
        if kernels is None:
            raise ValueError("this engine does not run the fused CPU step: it cannot host ring members")
        super().__init__(kernels, engine.layout, 0, name, kv=engine.kv, blocks=engine.blocks)
        self.on_engine = on_engine

    def reserve(self, sid: str, start: int, end: int) -> None:
        self.on_engine(lambda: RingMember.reserve(self, sid, start, end))

    def release(self, sid: str) -> None:
        self.on_engine(lambda: RingMember.release(self, sid))


class RingServer:
    """Serves a worker's ``EngineMember`` to ring coordinators: one thread per connection; a
    connection's shards are released when it closes (its coordinator ended, or died)."""

    def __init__(self, member: RingMember, host: str = "127.0.0.1", port: int = 0, key: bytes = b"",
                 timeout: float = 30.0, shm: bool = True):
        """``shm``: offer coordinators on this host a shared-memory region (module doc)."""
        self.member, self.key, self.timeout = member, key, timeout
        self.shm = shm and shm_available()
        self.identity = links.host_identity()
        self.max_payload = member.kv.numel() * member.kv.element_size() + (1 << 20)
        self._sock = socket.create_server((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self._conns = 0
        self._live: set[socket.socket] = set()   # open connections (closed with the server)
        self._parked: dict[str, tuple[str, threading.Timer]] = {}   # claim ticket -> (shard's sid, expiry)
        self._park_lock = threading.Lock()
        self._chains: dict[str, _Chain] = {}      # session -> its place in a fold
        self._tickets: dict[str, _Chain] = {}     # a predecessor's link, announced, not yet opened
        self._chain_lock = threading.Lock()
        self.step_s = self.wait_s = 0.0           # fold steps here, and their time blocked on a
                                                  # predecessor's state (``tandem bench ring --procs``)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="ring-server", daemon=True)

    def start(self) -> tuple[str, int]:
        self._thread.start()
        log.info("ring member %s serves on %s:%d (%s)", self.member.name, self.host, self.port,
                 "authenticated" if self.key else "NO data-plane key: connections are not authenticated")
        return self.host, self.port

    def close(self) -> None:
        """Stop serving: no new connection, and the open ones end (their shards are released),
        the links to next members too."""
        self._closed = True
        self._sock.close()
        with self._park_lock:
            parked, self._parked = list(self._parked.values()), {}
        for sid, timer in parked:
            timer.cancel()
            self.member.release(sid)
        for chain in list(self._chains.values()):
            chain.close()
        for conn in list(self._live):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            self._conns += 1
            threading.Thread(target=self._serve, args=(conn, peer, self._conns), name=f"ring-conn-{self._conns}",
                             daemon=True).start()

    def _handshake(self, conn: socket.socket) -> _Channel | None:
        sn = os.urandom(NONCE)
        conn.sendall(MAGIC + sn)
        hello = _recv_exact(conn, len(MAGIC) + NONCE + TAG)
        cn, proof = bytes(hello[4:4 + NONCE]), bytes(hello[4 + NONCE:])
        if hello[:4] != MAGIC or (self.key and not hmac.compare_digest(
                proof, _mac(self.key, b"tandem-ring-hello-v1", sn, cn))):
            conn.sendall(b"\x01" + bytes(TAG))
            return None
        conn.sendall(b"\x00" + (_mac(self.key, b"tandem-ring-welcome-v1", sn, cn) if self.key else bytes(TAG)))
        return _Channel(conn, _session_key(self.key, sn, cn), client=False, max_payload=self.max_payload)

    def _offer_region(self, ch: _Channel, meta: dict) -> str | None:
        """``SHM``: a region for a coordinator on this host (its name in the reply), else none."""
        if not (self.shm and links.same_host(self.identity, str(meta.get("host", "")))):
            ch.send(OK, {"name": None})
            return None
        try:
            name, region = _new_region(SHM_AREA)
        except OSError as e:
            log.warning("ring member %s: no shared-memory region (%s): the connection stays on TCP",
                        self.member.name, e)
            ch.send(OK, {"name": None})
            return None
        try:
            ch.send(OK, {"name": name, "area": SHM_AREA})
            op, answer, _ = ch.recv()
        except BaseException:
            region.close()
            raise
        finally:
            shm_unlink(name)    # the coordinator holds it now, or never will
        if op != MAPPED:
            region.close()
            raise ConnectionError(f"op {op} where the answer to a shared-memory offer belongs")
        if not answer.get("ok"):
            region.close()
            ch.send(OK)
            return None
        ch.attach(region, SHM_AREA)
        ch.send(OK)
        return name

    def _serve(self, conn: socket.socket, peer, n: int) -> None:
        sids: set[str] = set()
        self._live.add(conn)
        ch = None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # a reply's tag follows its payload
            conn.settimeout(self.timeout)
            ch = self._handshake(conn)
            if ch is None:
                log.warning("ring member %s refused a connection from %s: no valid proof of the data-plane key",
                            self.member.name, peer)
                return
            conn.settimeout(None)    # a session may be idle between steps as long as it likes
            while True:
                op, meta, payload = ch.recv()
                if op == SHM and ch.got == 1:   # only as the first message of a connection
                    self._offer_region(ch, meta)
                    continue
                if op == PEER and not sids:      # a predecessor's link: this thread serves it
                    self._serve_peer(ch, str(meta.get("ticket", "")))
                    return
                sid = f"{n}:{meta.get('sid', '')}"
                if op == STEP:
                    chain = self._chains.get(sid)
                    if chain is None:
                        ch.send(ERR, {"code": "bad_request", "message": f"no fold set up for {meta.get('sid')!r}"})
                    else:
                        self._step(chain, meta, payload, ch)
                    continue
                try:
                    reply, body = self._do(op, sid, meta, payload, sids, ch)
                except RingCapacityError as e:
                    ch.send(ERR, {"code": "overloaded", "message": str(e)})
                except RingMemberLost as e:
                    ch.send(ERR, {"code": e.code, "lost": e.lost, "message": str(e)})
                except (ValueError, KeyError) as e:
                    ch.send(ERR, {"code": "bad_request", "message": f"{type(e).__name__}: {e}"})
                else:
                    ch.send(OK, reply, body)
        except (ConnectionError, OSError, struct.error, json.JSONDecodeError):
            pass
        except Exception:
            log.exception("ring connection %d from %s failed", n, peer)
        finally:
            for sid in sids:
                self._drop_chain(sid)
                self.member.release(sid)
            if ch is not None:
                ch.detach()
            self._live.discard(conn)
            conn.close()

    def _do(self, op: int, sid: str, meta: dict, payload: bytearray, sids: set[str], ch: _Channel):
        m = self.member
        if op == RESERVE:
            m.reserve(sid, int(meta["start"]), int(meta["end"]))
            sids.add(sid)
            return None, b""
        if op == LOAD:
            m.load(sid, payload, int(meta.get("first", 0)))
            return None, b""
        if op == ATTEND:
            layer, pos = int(meta["layer"]), int(meta["pos"])
            qkv = _tensor(payload, (-1, m.kernels.qkv_width))
            if meta.get("store"):
                m.store(sid, layer, qkv, pos)
            parts = m.attend(sid, layer, qkv, pos)
            if parts is None:
                return {"shape": None}, b""
            return {"shape": list(parts.shape)}, parts.contiguous().view(torch.uint8).numpy()
        if op == READ:
            return None, m.read(sid, int(meta["keys"]))
        if op == RELEASE:
            self._drop_chain(sid)
            m.release(sid)
            sids.discard(sid)
            return None, b""
        if op == PARK:
            return self._park(sid, _ticket(meta), sids), b""
        if op == CLAIM:
            return self._claim(sid, _ticket(meta), sids), b""
        if op == CHAIN:
            if sid not in m.shards:
                raise KeyError(f"no shard of {meta.get('sid')!r} here")
            self._set_chain(sid, meta, ch)
            return None, b""
        raise ValueError(f"unknown ring op {op}")

    def _park(self, sid: str, ticket: str, sids: set[str]) -> dict:
        """A loaded shard of this connection (a prefill's) waits for its coordinator's ``CLAIM``
        under ``ticket``: it outlives the connection, and is freed if not claimed within the
        timeout."""
        if sid not in sids:
            raise ValueError(f"no shard {sid.split(':', 1)[1]!r} on this connection to park")
        sh = self.member.shards[sid]
        with self._park_lock:
            if ticket in self._parked:
                raise ValueError("a shard is parked under that ticket already")
            timer = threading.Timer(self.timeout, self._expire, (ticket,))
            timer.daemon = True
            self._parked[ticket] = (sid, timer)
            sids.discard(sid)
        timer.start()
        return {"start": sh.start, "end": sh.end}

    def _claim(self, sid: str, ticket: str, sids: set[str]) -> dict:
        """The shard parked under ``ticket`` becomes this connection's ``sid`` (released when the
        connection closes, like one it reserved)."""
        if sid in sids:
            raise ValueError(f"this connection holds a shard {sid.split(':', 1)[1]!r} already")
        with self._park_lock:
            parked = self._parked.pop(ticket, None)
            if parked is None:
                raise ValueError("no shard is parked under that ticket (a wrong ticket, or it was not claimed "
                                 f"within {self.timeout:.0f} s and was freed)")
            old, timer = parked
            timer.cancel()
            sh = self.member.shards[sid] = self.member.shards.pop(old)
            sids.add(sid)
        return {"start": sh.start, "end": sh.end}

    def _expire(self, ticket: str) -> None:
        with self._park_lock:
            parked = self._parked.pop(ticket, None)
        if parked is None:
            return
        sh = self.member.shards.get(parked[0])
        self.member.release(parked[0])
        log.warning("ring member %s: a shard parked by a prefill (tokens [%s, %s)) was not claimed by its "
                    "coordinator within %.0f s: freed", self.member.name, sh and sh.start, sh and sh.end,
                    self.timeout)

    # ---- the fold along the ring (module doc, "Fold") -------------------------------------
    def _set_chain(self, sid: str, meta: dict, ch: _Channel) -> None:
        """``CHAIN``: this member's place in the session's fold; opens the link to the member
        after it (authenticated like any ring connection) when the coordinator names one."""
        prev = str(meta["prev"])
        if prev not in ("none", "coord", "peer"):
            raise ValueError(f"a fold's predecessor is none, coord or peer, not {prev!r}")
        chain = _Chain(sid, int(meta["index"]), prev, str(meta.get("prev_worker", "")), ch)
        self._drop_chain(sid)
        with self._chain_lock:
            self._chains[sid] = chain
            if prev == "peer":
                chain.ticket = str(meta["ticket"])
                self._tickets[chain.ticket] = chain
        nxt = meta.get("next")
        if nxt:
            worker, host, port, ticket = nxt
            link = RemoteMember(str(worker), str(host), int(port), self.key, self.member.layout, self.timeout,
                                self.shm)
            try:
                link._call(PEER, {"ticket": str(ticket)})
            except BaseException:
                link.close()
                raise
            chain.next = link

    def _drop_chain(self, sid: str) -> None:
        with self._chain_lock:
            chain = self._chains.pop(sid, None)
            if chain is not None and chain.ticket is not None:
                self._tickets.pop(chain.ticket, None)
        if chain is not None:
            chain.close()

    def _serve_peer(self, ch: _Channel, ticket: str) -> None:
        """A predecessor's link (``PEER`` with the ticket the coordinator announced): its states
        go to the session's inbox, or, when the q rows come along the ring too (``STEP`` here),
        the step runs on this thread. Its end tells the step the predecessor is lost."""
        with self._chain_lock:
            chain = self._tickets.pop(ticket, None)
        if chain is None:
            ch.send(ERR, {"code": "bad_request", "message": "no fold awaits this link"})
            return
        ch.send(OK)
        lost = {"code": "unavailable", "lost": chain.prev_worker,
                "message": f"{self.member.name}: the link from {chain.prev_worker} broke"}
        try:
            while True:
                op, meta, payload = ch.recv()
                if op == STEP:
                    self._step(chain, meta, payload, ch)
                elif op in (STATE, ERR):
                    if op == ERR and meta.get("lost"):
                        lost = meta      # a member further up is gone: name it, not the messenger
                    chain.inbox.put((op, meta, payload))
                else:
                    raise ConnectionError(f"op {op} on a predecessor's link")
        except (ConnectionError, OSError, struct.error, json.JSONDecodeError):
            pass
        finally:
            chain.inbox.put(None)
            self._broken(chain, lost)

    def _broken(self, chain: _Chain, err: dict) -> None:
        """The link from the predecessor ended while the session is live (its worker died, or
        its own predecessor did): say so down the ring and to the coordinator at once — with the
        q rows passed along the ring no step would start here to report it — and close the link
        to the next member, which does the same."""
        if self._chains.get(chain.sid) is not chain:
            return      # released: its predecessor's link ends with it
        if chain.next is not None:
            try:
                chain.next.ch.send(ERR, err)
            except OSError:
                pass
            chain.close()
        try:
            chain.coord.send(ERR, err)
        except OSError:
            pass

    def _step(self, chain: _Chain, meta: dict, payload: bytearray, src: _Channel) -> None:
        """``STEP``: a layer of a folding step. Store the new k, v (the tail), then head group by
        head group: attend this shard's segments, fold them into the predecessor's running state
        (the same left fold in segment order as ``Ring(fold=True)`` in one process) and pass the
        group's state on at once — to the next member, or back to the coordinator (the tail, or
        the coordinator's own member next) — while attending the next group. A failure goes on
        down the ring as one ``ERR`` (``lost``: the member whose link broke) to the coordinator."""
        m, sid = self.member, chain.sid
        t0 = time.perf_counter()
        err: dict | None = None
        try:
            layer, pos, tail, groups = int(meta["layer"]), int(meta["pos"]), int(meta["tail"]), int(meta["groups"])
            if not 1 <= groups <= min(m.kernels.cfg.n_kv_heads, SLOTS - 2) or not chain.index <= tail:
                raise ValueError(f"bad fold step: {groups} head groups, member {chain.index} of a tail {tail}")
            qkv = _tensor(payload, (-1, m.kernels.qkv_width))
        except (KeyError, ValueError, TypeError) as e:
            err, groups = {"code": "bad_request", "message": f"{m.name}: {type(e).__name__}: {e}"}, 1
        last = err is not None or chain.index == tail or chain.next is None
        out = chain.coord if last else chain.next.ch
        if err is None and meta.get("pass") and not last:   # the q rows go on along the ring first
            try:
                out.send(STEP, meta, payload)
            except OSError:
                return     # the next member is gone: the one after it (or the coordinator) says so
        direct = (chain.prev == "coord") == (src is chain.coord)   # its states come on this connection
        nkv = m.kernels.cfg.n_kv_heads
        try:
            if err is None and chain.index == tail:
                m.store(sid, layer, qkv, pos)
        except (KeyError, ValueError) as e:
            err = {"code": "bad_request", "message": f"{m.name}: {type(e).__name__}: {e}"}
        for g in range(groups):
            if err is None:
                heads = group_heads(nkv, groups, g)
                try:
                    parts = m.attend(sid, layer, qkv, pos, heads)
                    if parts is None:
                        raise ValueError(f"no key of positions < {pos + qkv.shape[0]} in this shard")
                except (KeyError, ValueError) as e:
                    err = {"code": "bad_request", "message": f"{m.name}: {type(e).__name__}: {e}"}
            if err is None and chain.prev != "none":
                w0 = time.perf_counter()
                try:
                    got = src.recv() if direct else chain.inbox.get(timeout=self.timeout)
                except (queue.Empty, OSError, ConnectionError):
                    got = None
                self.wait_s += time.perf_counter() - w0
                if got is None:
                    err = {"code": "unavailable", "lost": chain.prev_worker,
                           "message": f"{m.name}: the link from {chain.prev_worker} broke"}
                elif got[0] == ERR:
                    err = got[1]
                elif got[0] != STATE or got[1].get("g") != g:
                    err = {"code": "bad_request", "message": f"{m.name}: op {got[0]} where group {g}'s state belongs"}
                else:
                    parts = torch.cat([_tensor(got[2], got[1]["shape"]), parts], dim=1)
            try:
                if err is None:
                    state = m.kernels.fold(parts, pos, qkv.shape[0], heads)
            except ValueError as e:
                err = {"code": "bad_request", "message": f"{m.name}: {e}"}
            try:
                if err is not None:
                    out.send(ERR, err)
                    return
                out.send(STATE, {"g": g, "shape": list(state.shape)}, state.view(torch.uint8).numpy())
            except OSError:
                return
        self.step_s += time.perf_counter() - t0


def _ticket(meta: dict) -> str:
    ticket = str(meta.get("ticket", ""))
    if not re.fullmatch(r"[0-9a-f]{32,128}", ticket):
        raise ValueError("a claim ticket is 32 to 128 hex digits")
    return ticket


def new_ticket() -> str:
    """A claim ticket for a prefill's scatter: 128 random bits."""
    return os.urandom(16).hex()


class RemoteMember:
    """The coordinator's handle on a member in another worker (the ``RingMember`` calls ``Ring``
    makes, as messages). Connection failures raise ``RingMemberLost`` naming the worker."""

    def __init__(self, worker: str, host: str, port: int, key: bytes, layout, timeout: float = 30.0,
                 shm: bool = True):
        """``shm``: on the member's host, the payloads go through shared memory (module doc)."""
        self.name, self.layout, self.timeout = worker, layout, timeout
        self.host, self.port = host, port
        self.ranges: dict[str, tuple[int, int]] = {}
        self.bytes_out = self.bytes_back = 0
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(timeout)
            head = _recv_exact(sock, len(MAGIC) + NONCE)
            if head[:4] != MAGIC:
                raise ConnectionError(f"{host}:{port} is not a ring member")
            sn, cn = bytes(head[4:]), os.urandom(NONCE)
            sock.sendall(MAGIC + cn + (_mac(key, b"tandem-ring-hello-v1", sn, cn) if key else bytes(TAG)))
            answer = _recv_exact(sock, 1 + TAG)
            if answer[0] != 0:
                raise ConnectionError("it refused our proof of the data-plane key")
            if key and not hmac.compare_digest(bytes(answer[1:]), _mac(key, b"tandem-ring-welcome-v1", sn, cn)):
                raise ConnectionError("it could not prove it holds the data-plane key")
        except (OSError, ConnectionError) as e:
            raise RingMemberLost(worker, f"cannot open a ring connection to {host}:{port}: {e}") from None
        self.sock = sock
        self.ch = _Channel(sock, _session_key(key, sn, cn), client=True, max_payload=1 << 40)
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
        offer = self._call(SHM, {"host": links.host_identity()})[0]
        name = offer.get("name")
        if not name:
            return
        region, area = None, 0
        try:
            area = int(offer.get("area", 0))
            region = _map_region(str(name), area)
        except (OSError, ValueError) as e:
            log.warning("ring member %s: cannot map its region %s (%s): the connection stays on TCP",
                        self.name, name, e)
        self._call(MAPPED, {"ok": region is not None})
        if region is not None:
            self.ch.attach(region, area)

    def _send(self, op: int, meta: dict, payload=b"") -> None:
        try:
            self.ch.send(op, meta, payload)
        except OSError as e:
            raise RingMemberLost(self.name, str(e) or type(e).__name__) from None

    def _reply(self) -> tuple[dict, bytearray]:
        try:
            op, meta, payload = self.ch.recv()
        except (OSError, ConnectionError) as e:
            raise RingMemberLost(self.name, str(e) or type(e).__name__) from None
        if op == ERR:
            if meta.get("lost"):   # a member further up the ring, named by the one after it
                raise RingMemberLost(str(meta["lost"]), str(meta.get("message", "")))
            raise RingMemberError(meta.get("code", "internal"), f"{self.name}: {meta.get('message', '')}")
        return meta, payload

    def _call(self, op: int, meta: dict, payload=b"") -> tuple[dict, bytearray]:
        self._send(op, meta, payload)
        return self._reply()

    def reserve(self, sid: str, start: int, end: int) -> None:
        try:
            self._call(RESERVE, {"sid": sid, "start": start, "end": end})
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
            self._call(LOAD, {"sid": sid, "first": first + off // bb}, mv[off:off + step])

    def park(self, sid: str, ticket: str) -> None:
        """Leave the loaded shard ``sid`` to the coordinator that ``claim``s it with ``ticket``
        (this connection no longer holds it)."""
        self._call(PARK, {"sid": sid, "ticket": ticket})
        self.ranges.pop(sid, None)

    def claim(self, sid: str, ticket: str) -> tuple[int, int]:
        """Take over the shard a prefill parked under ``ticket``, as ``sid``; its range."""
        meta = self._call(CLAIM, {"sid": sid, "ticket": ticket})[0]
        self.ranges[sid] = (int(meta["start"]), int(meta["end"]))
        return self.ranges[sid]

    def owns(self, sid: str, pos: int) -> bool:
        a, b = self.ranges[sid]
        return a <= pos < b

    def post(self, sid: str, layer: int, qkv: torch.Tensor, pos: int, store: bool) -> None:
        body = qkv.contiguous().view(torch.uint8).numpy()
        self.bytes_out += body.nbytes
        self._send(ATTEND, {"sid": sid, "layer": layer, "pos": pos, "store": store}, body)

    def collect(self, sid: str) -> torch.Tensor | None:
        meta, payload = self._reply()
        self.bytes_back += len(payload)
        return None if meta.get("shape") is None else _tensor(payload, meta["shape"])

    def read(self, sid: str, keys: int) -> bytes:
        return bytes(self._call(READ, {"sid": sid, "keys": keys})[1])

    # ---- the fold along the ring -----------------------------------------------------------
    def chain(self, sid: str, index: int, prev: str, prev_worker: str, ticket: str | None,
              nxt: list | None) -> None:
        """Tell the member its place in the session's fold (``_Chain``); ``nxt``: [worker, host,
        port, ticket] of the member after it, which it links to (announced there first)."""
        self._call(CHAIN, {"sid": sid, "index": index, "prev": prev, "prev_worker": prev_worker,
                           "ticket": ticket, "next": nxt})

    def post_step(self, sid: str, meta: dict, qkv: torch.Tensor) -> None:
        """A layer of a folding step: the q|k|v rows (``meta``: layer, pos, tail, groups, pass)."""
        body = qkv.contiguous().view(torch.uint8).numpy()
        self.bytes_out += body.nbytes
        self._send(STEP, {"sid": sid, **meta}, body)

    def send_state(self, sid: str, g: int, state: torch.Tensor) -> None:
        """Head group ``g``'s running state, folded by the coordinator's own member before this one."""
        body = state.contiguous().view(torch.uint8).numpy()
        self.bytes_out += body.nbytes
        self._send(STATE, {"sid": sid, "g": g, "shape": list(state.shape)}, body)

    def recv_state(self, g: int) -> torch.Tensor:
        """Head group ``g``'s running state from this member (its own segments folded in last)."""
        meta, payload = self._reply()
        if meta.get("g") != g or not isinstance(meta.get("shape"), list):
            raise RingMemberError("bad_request", f"{self.name}: {meta} where group {g}'s state belongs")
        self.bytes_back += len(payload)
        return _tensor(payload, meta["shape"])

    def release(self, sid: str) -> None:
        """Free the shard (best effort: a lost member's shards went with its connection)."""
        if self.ranges.pop(sid, None) is None:
            return
        try:
            self._call(RELEASE, {"sid": sid})
        except (RingMemberLost, RingMemberError):
            pass

    def close(self) -> None:
        self.sock.close()
        self.ch.detach()


def connect_ring(ring_plan: list, me: str, local: RingMember, key: bytes, layout,
                 timeout: float = 30.0, shm: bool = True) -> list:
    """The members of a plan's ring (``RoutePlan.ring``: [worker, host, port] in shard order):
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
        if isinstance(m, RingMember):
            m.reserve(sid, a, b)
            m.load(sid, kv)
    ring.adopt(sid, h.token_ids, h.num_computed, ranges)
