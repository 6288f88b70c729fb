"""Data-plane frames: the wire format every path shares, and the socket helpers.

Per frame (a connection may carry several in sequence)::

    header  !4sBBHQ32s  magic b"TKV1", version 1, checksum algo (1 blake3, 2 crc32, 3 xxh3-128),
                        len(transfer_id), nbytes, digest (zero-padded to 32 bytes)
            transfer_id utf-8
    payload nbytes
    reply   !BH status, len(message), then the message (receiver -> sender, after verifying)

Version 2 frames add ``!BQ flags, raw bytes`` after the transfer id (the digest is always that
of the raw payload, so it is verified after any decoding); each flag is a path whose reader
lives with the path:
- ``F_ZSTD``: the payload on the wire is zstd-compressed (``zstd.py``);
- ``F_SHM``: the payload names a file in /dev/shm holding the raw bytes (``shm.py``);
- ``F_NIXL``: the payload is an offer the receiver READs over RDMA (``nixl.py``);
- ``F_HELLO``: the payload is the sender's host identity; the reply's message is the receiver's
  (``link.py`` detects same-host peers with it);
- ``F_PROBE``: ``nbytes`` of filler the receiver reads and drops (a timed link probe);
- ``F_AUTH``: the frame is authenticated (below).

Version 3 frames are version 2 frames of a plain payload (no path flag) whose header digest is
zero: the digest follows the payload (32 bytes), so the sender hashes while sending.

Authentication (``F_AUTH``, docs/security.md "Data plane"): with a data-plane key the sender puts
``tag = HMAC-SHA256(key, "tandem-data-frame-v1" ‖ receiver host:port as dialled ‖ header ‖ id ‖
extra)`` (32 bytes) right after the extra fields — before any payload byte, so a receiver with
the key refuses a frame without a valid tag (``UNAUTHORIZED``) having allocated nothing. The tag
covers the id, the sizes, the flags and the digest in the header; a version-3 frame's trailer
digest is followed by ``HMAC-SHA256(key, "tandem-data-trailer-v1" ‖ tag ‖ digest)``, so every
frame binds its bytes too. A receiver without a key reads and ignores the tags.

Payload bytes move in worker threads with blocking ``sock.sendall`` / ``sock.recv_into`` of
``SEGMENT``-sized slices, straight from the caller's buffer into a pooled receive buffer
(``BufferPool``: bounded, so a receiver that cannot keep up stops reading and TCP's window
holds the sender); a second thread hashes the payload in ``HASH_UNIT`` pieces a step behind
(``HashBehind``: the hash holds the GIL, the socket calls release it, so on two cores they
overlap; payloads of at most two units are hashed inline).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import socket
import struct
import threading

try:
    import blake3 as _blake3
except ImportError:  # pragma: no cover
    _blake3 = None

from shared.transfer.base import ChecksumError, Hasher, TransferError

MAGIC = b"TKV1"
VERSION = 1
HEADER = struct.Struct("!4sBBHQ32s")
EXTRA = struct.Struct("!BQ")           # version 2: flags, raw payload bytes
F_ZSTD, F_SHM, F_HELLO, F_PROBE, F_NIXL, F_AUTH = 1, 2, 4, 8, 16, 32
TAG = 32                               # bytes of an authentication tag (HMAC-SHA256)
MODES = ("tcp", "tcp+zstd", "shm", "rdma")  # how send() moves a payload
REPLY = struct.Struct("!BH")
ALGOS = {"blake3": 1, "crc32": 2, "xxh3": 3}
ALGO_NAMES = {v: k for k, v in ALGOS.items()}
MAX_ID_BYTES = 256

# reply status codes
OK, BAD_HEADER, TOO_LARGE, DUPLICATE, CHECKSUM, FAILED, DISCARDED, UNAUTHORIZED = range(8)
STATUS_TEXT = {OK: "ok", BAD_HEADER: "bad header", TOO_LARGE: "too large", DUPLICATE: "duplicate id",
               CHECKSUM: "checksum mismatch", FAILED: "failed", DISCARDED: "discarded by receiver",
               UNAUTHORIZED: "not authenticated"}

MiB = 1 << 20
SEGMENT = 4 * MiB      # socket I/O unit; each is hashed right before it is sent / after it lands
MAX_IO_THREADS = 64    # per sender / receiver: transfers moving bytes at once
HASH_UNIT = 1 * MiB    # hashed per GIL hold (~50 us with xxh3) while the socket thread waits on I/O


def parse_checksum(value: str) -> tuple[str, bytes]:
    """"blake3:<hex>" -> ("blake3", digest bytes); ValueError naming the problem."""
    algo, _, hexd = value.partition(":")
    if algo not in ALGOS or not hexd:
        raise ValueError(f"bad checksum {value!r}: expected '<xxh3|blake3|crc32>:<hex>'")
    digest = bytes.fromhex(hexd)
    if len(digest) > 32:
        raise ValueError(f"bad checksum {value!r}: digest longer than 32 bytes")
    return algo, digest



def frame_tag(key: bytes, to: str, signed: bytes) -> bytes:
    """The tag of a frame sent to ``to`` ("host:port" as dialled) whose header, id and extra
    fields are ``signed``."""
    return hmac.new(key, b"tandem-data-frame-v1\0" + to.encode() + b"\0" + signed, hashlib.sha256).digest()


def trailer_tag(key: bytes, tag: bytes, digest: bytes) -> bytes:
    """The tag after a version-3 frame's trailer digest (32 bytes, zero-padded)."""
    return hmac.new(key, b"tandem-data-trailer-v1\0" + tag + digest, hashlib.sha256).digest()


def digest_of(algo: str, data) -> bytes:
    if algo == "blake3" and _blake3 is not None:  # one-shot: every core
        return _blake3.blake3(data, max_threads=_blake3.blake3.AUTO).digest()
    h = Hasher(algo)
    h.update(data)
    return h.digest()


def check_digest(tid: str, algo: str, got: bytes, digest: bytes) -> None:
    if got != digest[:len(got)] or any(digest[len(got):]):
        raise ChecksumError(f"checksum mismatch: got {algo}:{got.hex()}, "
                            f"header says {algo}:{digest[:len(got)].hex()}", tid)



# -- buffers -----------------------------------------------------------------------------------

def size_class(n: int, min_block: int = 64 * 1024) -> int:
    """Round up to a quarter-power-of-two step (waste <= 25%), at least ``min_block``."""
    if n <= min_block:
        return min_block
    top = 1 << (n - 1).bit_length()          # next power of two >= n
    step = top // 8                           # classes: top/2 * (1, 1.25, 1.5, 1.75, 2)
    return -(-n // step) * step


class BufferPool:
    """Reused receive buffers, at most ``max_bytes`` allocated in total (free + in use).

    ``acquire`` waits while the budget is spent (that wait is the backpressure); free buffers
    of other sizes are dropped first to make room.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes                       # budget for all buffers together
        self._free: dict[int, list[bytearray]] = {}      # size class -> free buffers
        self._allocated = 0                              # bytes of every live buffer
        self._changed = asyncio.Event()                  # set on release

    @property
    def allocated(self) -> int:
        return self._allocated

    def fits(self, n: int) -> bool:
        return n <= self.max_bytes

    async def acquire(self, n: int) -> bytearray:
        cap = size_class(n)
        if cap > self.max_bytes:
            cap = n  # an exact-size buffer when the rounded one would not fit the budget
        if cap > self.max_bytes:
            raise ValueError(f"{n} bytes exceed the receive budget of {self.max_bytes}")
        while True:
            free = self._free.get(cap)
            if free:
                return free.pop()
            if self._allocated + cap > self.max_bytes:
                self._drop_free(self._allocated + cap - self.max_bytes)
            if self._allocated + cap <= self.max_bytes:
                self._allocated += cap
                return bytearray(cap)
            self._changed.clear()
            await self._changed.wait()

    def release(self, buf: bytearray, reuse: bool = True) -> None:
        """Return ``buf``; ``reuse=False`` when something still aliases it (it is forgotten)."""
        if reuse:
            self._free.setdefault(len(buf), []).append(buf)
        else:
            self._allocated -= len(buf)
        self._changed.set()

    def _drop_free(self, need: int) -> None:
        for cap in sorted(self._free, reverse=True):
            bufs = self._free[cap]
            while bufs and need > 0:
                bufs.pop()
                self._allocated -= cap
                need -= cap
            if need <= 0:
                return

    def clear(self) -> None:
        for cap, bufs in self._free.items():
            self._allocated -= cap * len(bufs)
        self._free.clear()


# -- socket helpers ----------------------------------------------------------------------------

async def recv_exact(loop, sock: socket.socket, view: memoryview, stall: float) -> None:
    """Fill ``view`` completely; ConnectionError on EOF, TimeoutError after ``stall`` s idle."""
    got, n = 0, view.nbytes
    async with asyncio.timeout(stall) as cm:
        while got < n:
            k = await loop.sock_recv_into(sock, view[got:])
            if k == 0:
                raise ConnectionError(f"connection closed after {got} of {n} bytes")
            got += k
            cm.reschedule(loop.time() + stall)


class HashBehind:
    """Hashes a buffer in order, in its own thread, up to where the caller says bytes are ready
    (``advance``): the payload is hashed while the socket call of the next bytes runs — the
    hash holds the GIL, the socket call releases it, so on two cores they overlap. ``finish``
    waits for the rest; ``stop`` abandons it (a failed transfer)."""

    def __init__(self, hasher: Hasher, view: memoryview, segment: int):
        self.hasher, self.view = hasher, view
        self.segment = min(segment, HASH_UNIT)  # bytes per update: the GIL is held that long
        self.ready = 0                       # bytes of view that may be hashed
        self._want = 0                       # the ready count the hashing thread waits for
        self._stopped = False
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kv-hash", daemon=True)
        self._thread.start()

    def advance(self, ready: int) -> None:
        with self._cv:
            self.ready = ready
            if ready >= self._want:          # wake the hashing thread only when it has a unit to do
                self._cv.notify()

    def _run(self) -> None:
        done, n = 0, self.view.nbytes
        try:
            while done < n:
                with self._cv:
                    self._want = min(done + self.segment, n)
                    while not self._stopped and self.ready < self._want:
                        self._cv.wait()
                    if self._stopped:
                        return
                    upto = self.ready
                self.hasher.update(self.view[done:upto])
                done = upto
        except BaseException as e:  # noqa: BLE001 - handed to finish()
            self._error = e

    def finish(self) -> None:
        self.advance(self.view.nbytes)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join()


def blocking_send(sock: socket.socket, parts, hasher: Hasher | None, segment: int, stall: float) -> None:
    """Send every part (worker thread, blocking socket), ``stall`` seconds per segment at most.

    With ``hasher``, the second part (the payload) is hashed in a second thread a segment behind
    the one going out (``HashBehind``); a callable part is called for its bytes when its turn
    comes (the trailer: the digest of what was hashed, once the hashing caught up).
    """
    sock.settimeout(stall)
    behind = None
    try:
        for i, part in enumerate(parts):
            if callable(part):
                if behind is not None:
                    behind.finish()
                    behind = None
                part = part()
            view = memoryview(part)
            if hasher is not None and i == 1:
                if view.nbytes <= 2 * HASH_UNIT:   # too small to pay for a thread: hash, then send
                    hasher.update(view)
                else:
                    behind = HashBehind(hasher, view, segment)
            for off in range(0, view.nbytes, segment):
                if behind is not None and i == 1:
                    behind.advance(off)          # everything before this segment may be hashed
                sock.sendall(view[off:off + segment])
        if behind is not None:
            behind.finish()
            behind = None
    finally:
        if behind is not None:
            behind.stop()


def blocking_recv(sock: socket.socket, view: memoryview, hasher: Hasher | None, segment: int,
                   stall: float) -> None:
    """Fill ``view`` (worker thread, blocking socket); with ``hasher``, a second thread hashes
    what landed while the next bytes arrive (``HashBehind``), caught up before returning.

    ConnectionError on EOF, TimeoutError after ``stall`` seconds without a byte.
    """
    sock.settimeout(stall)
    got, n = 0, view.nbytes
    behind = HashBehind(hasher, view, segment) if hasher is not None and n > 2 * HASH_UNIT else None
    try:
        while got < n:
            k = sock.recv_into(view[got:min(got + segment, n)])
            if k == 0:
                raise ConnectionError(f"connection closed after {got} of {n} bytes")
            got += k
            if behind is not None:
                behind.advance(got)
        if behind is not None:
            behind.finish()
            behind = None
        elif hasher is not None:
            hasher.update(view)
    finally:
        if behind is not None:
            behind.stop()


async def in_thread(executor, sock: socket.socket, fn, *args):
    """Run blocking socket I/O ``fn(sock, *args)`` in ``executor``; the socket is non-blocking
    again afterwards. Cancelled: the socket is shut down so the thread's call returns at once."""
    try:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, sock, *args)
    except asyncio.CancelledError:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        raise
    finally:
        if sock.fileno() >= 0:
            sock.setblocking(False)


def ip_literal(host: str, port: int):
    """A getaddrinfo-style entry for a numeric IPv4 / IPv6 host, else None."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        addr = (host, port) if family == socket.AF_INET else (host, port, 0, 0)
        return family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", addr
    return None


def tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

def blocking_exchange(sock: socket.socket, parts, hasher: Hasher | None, segment: int,
                       stall: float) -> tuple[int, str]:
    """Send a frame's parts, then read the receiver's verdict: (status, message)."""
    try:
        blocking_send(sock, parts, hasher, segment, stall)
    except (BrokenPipeError, ConnectionResetError) as e:  # a refusing receiver replies, then closes
        try:
            return blocking_reply(sock, stall)
        except OSError:
            raise e from None
    return blocking_reply(sock, stall)


def blocking_reply(sock: socket.socket, stall: float) -> tuple[int, str]:
    head = bytearray(REPLY.size)
    blocking_recv(sock, memoryview(head), None, REPLY.size, stall)
    status, mlen = REPLY.unpack(head)
    msg = bytearray(mlen)
    if mlen:
        blocking_recv(sock, memoryview(msg), None, mlen, stall)
    return status, msg.decode(errors="replace") or STATUS_TEXT.get(status, str(status))



async def recv_bytes(loop, conn: socket.socket, tid: str, nbytes: int, stall: float) -> bytearray:
    """Exactly ``nbytes`` from ``conn`` (a small frame body); TransferError on a short read."""
    buf = bytearray(nbytes)
    try:
        await recv_exact(loop, conn, memoryview(buf), stall)
    except (ConnectionError, TimeoutError) as e:
        raise TransferError(f"short read: {e}", tid) from None
    return buf
