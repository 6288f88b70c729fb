"""Data plane frames: KV payloads over TCP, or named by a TCP frame (shm, NIXL).

A frame's payload moves in this sender's / receiver's worker threads with blocking
``sock.sendall`` / ``sock.recv_into`` of ``SEGMENT``-sized slices, straight from the caller's
buffer into a pooled receive buffer; a second thread hashes the payload in ``HASH_UNIT`` pieces
a step behind the bytes sent / landed (xxh3-128 by default: ~18 GB/s on one core; it holds the
GIL, the socket calls release it, so hashing overlaps the copy on another core — payloads of
at most two units are hashed inline). Headers and verdicts stay on the event loop
(``loop.sock_recv_into``); a numeric host is dialled without a resolver thread. Wire format, per frame (a connection may carry several
in sequence)::

    header  !4sBBHQ32s  magic b"TKV1", version 1, checksum algo (1 blake3, 2 crc32, 3 xxh3-128),
                        len(transfer_id), nbytes, digest (zero-padded to 32 bytes)
            transfer_id utf-8
    payload nbytes
    reply   !BH status, len(message), then the message (receiver -> sender, after verifying)

Version 2 frames add ``!BQ flags, raw bytes`` after the transfer id (the digest is always that
of the raw payload, so it is verified after any decoding):
- ``F_ZSTD``: the payload on the wire is zstd-compressed (the link is slower than the codec);
- ``F_SHM``: the payload is the name of a file in /dev/shm holding the raw bytes (same host:
  the receiver maps it, unlinks it and verifies it — one copy instead of a socket's two);
- ``F_HELLO``: the payload is the sender's host identity (machine-id:boot-id); the reply's
  message is the receiver's (``shared/transfer/link.py`` detects same-host peers with it);
- ``F_PROBE``: ``nbytes`` of filler the receiver reads and drops (a timed link probe).
- ``F_NIXL``: the payload is an offer (``nixl.OFFER`` address, length, then the sender agent's
  NIXL metadata): the receiver READs the sender's registered memory (``shared/transfer/nixl.py``).

Version 3 frames are version 2 frames of a plain payload (flags 0) whose header digest is zero:
the digest follows the payload (32 bytes), so the sender hashes while sending.

Flow control: the receiver takes a buffer from a bounded ``BufferPool`` before reading a
payload; while none is free it stops reading, TCP's window fills and the sender's
``sendall`` waits — no unbounded buffering anywhere. Every read and write has a stall
timeout; a short read, stall, or checksum mismatch fails the transfer (TransferError) on both
sides, and the buffer goes back to the pool — a partial KV is never handed out.

Receiver life cycle per transfer: PENDING -> TRANSFERRING -> SUCCESS (until take()) | FAILED.
Unclaimed payloads are dropped after ``unclaimed_ttl`` seconds (logged).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import zstandard

try:
    import blake3 as _blake3
except ImportError:  # pragma: no cover
    _blake3 = None

from shared.transfer.base import (
    ChecksumError, Hasher, KVPayload, KVReceiver, KVSender, KVTransport, PathUnavailable,
    PeerUnavailable, SendResult, TransferError, TransferState, default_checksum,
)
from shared.transfer.link import host_identity
from shared.transfer.nixl import MAX_OFFER_BYTES, NixlEndpoint
from shared.transfer.shm import shm_map, shm_unlink, shm_write

log = logging.getLogger(__name__)

MAGIC = b"TKV1"
VERSION = 1
HEADER = struct.Struct("!4sBBHQ32s")
EXTRA = struct.Struct("!BQ")           # version 2: flags, raw payload bytes
F_ZSTD, F_SHM, F_HELLO, F_PROBE, F_NIXL = 1, 2, 4, 8, 16
MODES = ("tcp", "tcp+zstd", "shm", "rdma")  # how send() moves a payload
REPLY = struct.Struct("!BH")
ALGOS = {"blake3": 1, "crc32": 2, "xxh3": 3}
ALGO_NAMES = {v: k for k, v in ALGOS.items()}
MAX_ID_BYTES = 256

# reply status codes
OK, BAD_HEADER, TOO_LARGE, DUPLICATE, CHECKSUM, FAILED, DISCARDED = range(7)
_STATUS_TEXT = {OK: "ok", BAD_HEADER: "bad header", TOO_LARGE: "too large", DUPLICATE: "duplicate id",
                CHECKSUM: "checksum mismatch", FAILED: "failed", DISCARDED: "discarded by receiver"}

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


def _compress(view: memoryview) -> bytes:
    return zstandard.ZstdCompressor(level=1, threads=2 if view.nbytes > MiB else 0).compress(view)


def _decompress(wire, raw_n: int) -> bytearray:
    out = zstandard.ZstdDecompressor().decompress(wire, max_output_size=raw_n)
    if len(out) != raw_n:
        raise zstandard.ZstdError(f"decompressed to {len(out)} bytes, header says {raw_n}")
    return bytearray(out)


def _digest(algo: str, data) -> bytes:
    if algo == "blake3" and _blake3 is not None:  # one-shot: every core
        return _blake3.blake3(data, max_threads=_blake3.blake3.AUTO).digest()
    h = Hasher(algo)
    h.update(data)
    return h.digest()


def _check_digest(tid: str, algo: str, got: bytes, digest: bytes) -> None:
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

async def _recv_exact(loop, sock: socket.socket, view: memoryview, stall: float) -> None:
    """Fill ``view`` completely; ConnectionError on EOF, TimeoutError after ``stall`` s idle."""
    got, n = 0, view.nbytes
    async with asyncio.timeout(stall) as cm:
        while got < n:
            k = await loop.sock_recv_into(sock, view[got:])
            if k == 0:
                raise ConnectionError(f"connection closed after {got} of {n} bytes")
            got += k
            cm.reschedule(loop.time() + stall)


class _HashBehind:
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


def _blocking_send(sock: socket.socket, parts, hasher: Hasher | None, segment: int, stall: float) -> None:
    """Send every part (worker thread, blocking socket), ``stall`` seconds per segment at most.

    With ``hasher``, the second part (the payload) is hashed in a second thread a segment behind
    the one going out (``_HashBehind``); a callable part is called for its bytes when its turn
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
                    behind = _HashBehind(hasher, view, segment)
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


def _blocking_recv(sock: socket.socket, view: memoryview, hasher: Hasher | None, segment: int,
                   stall: float) -> None:
    """Fill ``view`` (worker thread, blocking socket); with ``hasher``, a second thread hashes
    what landed while the next bytes arrive (``_HashBehind``), caught up before returning.

    ConnectionError on EOF, TimeoutError after ``stall`` seconds without a byte.
    """
    sock.settimeout(stall)
    got, n = 0, view.nbytes
    behind = _HashBehind(hasher, view, segment) if hasher is not None and n > 2 * HASH_UNIT else None
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


async def _in_thread(executor, sock: socket.socket, fn, *args):
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


def _ip_literal(host: str, port: int):
    """A getaddrinfo-style entry for a numeric IPv4 / IPv6 host, else None."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        addr = (host, port) if family == socket.AF_INET else (host, port, 0, 0)
        return family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", addr
    return None


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# -- sender ------------------------------------------------------------------------------------

class TcpKVSender(KVSender):
    """Opens one connection per transfer, sends header + payload, waits for the verdict.

    A frame's socket I/O runs in one of this sender's worker threads (blocking calls, GIL
    released); the rdma path's NIXL calls stay on the event loop.
    """

    def __init__(self, *, chunk_bytes: int = SEGMENT, timeout: float = 30.0,
                 connect_timeout: float = 3.0, algo: str | None = None):
        self.chunk_bytes = chunk_bytes            # bytes per send call, hashed just before it
        self.timeout = timeout                    # stall timeout, and for the receiver's verdict
        self.connect_timeout = connect_timeout    # dead peers fail within this
        self.algo = algo or default_checksum()    # checksum when the caller gives none
        self._io = ThreadPoolExecutor(MAX_IO_THREADS, thread_name_prefix="kv-send")
        self.nixl = NixlEndpoint("tx")            # the rdma path's agent, started on first use
        self._closed = False

    async def send(self, host: str, port: int, transfer_id: str, payload, *,
                   checksum: str | None = None, timeout: float | None = None, mode: str = "tcp",
                   compressible: bool = True) -> SendResult:
        """``mode``: "tcp" (raw), "tcp+zstd" (compressed on the wire), "shm" (same host only) or
        "rdma" (NIXL; the receiver reads the payload from this process's memory).
        ``compressible`` is a hint for path selection (``DataPlaneSender``); unused here.

        Over plain tcp an unknown checksum is computed while the payload goes out (version-3
        frame: the digest follows the payload); the other paths hash beside compressing or
        writing the segment.
        """
        if self._closed:
            raise TransferError("sender closed", transfer_id)
        if mode not in MODES:
            raise ValueError(f"unknown transfer mode {mode!r}: expected one of {', '.join(MODES)}")
        tid = transfer_id.encode()
        if not tid or len(tid) > MAX_ID_BYTES:
            raise ValueError(f"transfer_id must be 1..{MAX_ID_BYTES} bytes, got {transfer_id!r}")
        view = memoryview(payload).cast("B")  # raises for non-contiguous buffers
        if mode == "rdma" and not view.nbytes:
            mode = "tcp"  # nothing to register
        stall = self.timeout if timeout is None else timeout
        t0 = time.perf_counter()
        hasher = None
        if checksum is not None:
            algo, digest = parse_checksum(checksum)
        elif mode == "tcp":
            hasher = Hasher(self.algo)
            algo, digest = hasher.name, b""
        body, flags, segment, release = view, 0, None, None
        if mode == "rdma":
            if checksum is None:
                checksum = await self._hash(view)
            body, release = self.nixl.offer(view)
            body, flags = memoryview(body), F_NIXL
            algo, digest = parse_checksum(checksum)
        elif mode != "tcp":
            body, flags, segment, checksum = await self._prepare(view, mode, checksum)
            algo, digest = parse_checksum(checksum)
        status = FAILED
        try:
            status, message = await self._exchange(host, port, transfer_id, algo, digest, body, flags,
                                                   view.nbytes, stall, hasher)
        finally:
            if segment is not None and status != OK:
                shm_unlink(segment)  # the receiver unlinks what it took; nothing is left behind
            if release is not None:
                release()            # the receiver has read the memory (or failed): deregister it
        if status == CHECKSUM:
            raise ChecksumError(f"receiver {host}:{port} reports {message}", transfer_id)
        if status != OK:
            raise TransferError(f"receiver {host}:{port} refused: {message}", transfer_id)
        if hasher is not None:
            checksum = hasher.hexdigest()
        return SendResult(transfer_id, view.nbytes, checksum, time.perf_counter() - t0, mode,
                          wire_bytes=body.nbytes if mode == "tcp+zstd" else view.nbytes)

    async def _hash(self, view: memoryview) -> str:
        hasher = Hasher(self.algo)
        await asyncio.get_running_loop().run_in_executor(self._io, hasher.update, view)
        return hasher.hexdigest()

    async def _prepare(self, view: memoryview, mode: str, checksum: str | None):
        """(body, flags, shm segment, checksum) for a zstd or shm frame; hashing runs in a
        second thread beside the compression or the segment write."""
        loop = asyncio.get_running_loop()
        work = _compress if mode == "tcp+zstd" else shm_write
        jobs = [loop.run_in_executor(self._io, work, view)]
        if checksum is None:
            hasher = Hasher(self.algo)
            jobs.append(loop.run_in_executor(self._io, hasher.update, view))  # blake3 drops the GIL
        done = await asyncio.gather(*jobs, return_exceptions=True)
        if mode == "shm" and isinstance(done[-1], BaseException) and isinstance(done[0], str):
            shm_unlink(done[0])
        for r in done:
            if isinstance(r, BaseException):
                raise r
        if checksum is None:
            checksum = hasher.hexdigest()
        if mode == "tcp+zstd":
            return memoryview(done[0]), F_ZSTD, None, checksum
        return memoryview(done[0].encode()), F_SHM, done[0], checksum

    async def hello(self, host: str, port: int, identity: str) -> str:
        """Exchange host identities with a receiver; returns the receiver's."""
        status, message = await self._exchange(host, port, "hello", "crc32", b"", memoryview(identity.encode()),
                                               F_HELLO, 0, self.timeout)
        if status != OK:
            raise TransferError(f"receiver {host}:{port} refused hello: {message}")
        return message

    async def probe(self, host: str, port: int, nbytes: int = 8 * MiB) -> float:
        """Seconds to push ``nbytes`` to a receiver and hear back (a timed link probe)."""
        t0 = time.perf_counter()
        status, message = await self._exchange(host, port, "probe", "crc32", b"", memoryview(bytes(nbytes)),
                                               F_PROBE, 0, self.timeout)
        if status != OK:
            raise TransferError(f"receiver {host}:{port} refused probe: {message}")
        return time.perf_counter() - t0

    async def _exchange(self, host: str, port: int, transfer_id: str, algo: str, digest: bytes,
                        body: memoryview, flags: int, raw_nbytes: int, stall: float,
                        hasher: Hasher | None = None) -> tuple[int, str]:
        """One frame on a fresh connection: header, body, then the receiver's verdict.
        With ``hasher`` (version 3) the body is hashed as it is sent and the digest follows it."""
        tid = transfer_id.encode()
        version = 3 if hasher is not None else 2 if flags else VERSION
        header = HEADER.pack(MAGIC, version, ALGOS[algo], len(tid), body.nbytes, digest.ljust(32, b"\0")) + tid
        if version > 1:
            header += EXTRA.pack(flags, raw_nbytes)
        parts = [header, body]
        if hasher is not None:
            parts.append(lambda: hasher.digest().ljust(32, b"\0"))
        loop = asyncio.get_running_loop()
        sock = await self._connect(loop, host, port, transfer_id)
        try:
            io = _in_thread(self._io, sock, _blocking_exchange, parts, hasher, self.chunk_bytes, stall)
            return await (self.nixl.progressing(io) if flags & F_NIXL else io)
        except TimeoutError:
            raise TransferError(f"stalled for {stall}s sending to {host}:{port}", transfer_id) from None
        except OSError as e:
            raise TransferError(f"connection to {host}:{port} lost: {e}", transfer_id) from None
        finally:
            sock.close()

    async def _connect(self, loop, host: str, port: int, transfer_id: str) -> socket.socket:
        literal = _ip_literal(host, port)  # an address needs no resolver thread
        try:
            infos = [literal] if literal else await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise PeerUnavailable(f"cannot resolve {host}: {e}", transfer_id) from None
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        try:
            _tune(sock)
            async with asyncio.timeout(self.connect_timeout):
                await loop.sock_connect(sock, addr)
        except TimeoutError:
            sock.close()
            raise PeerUnavailable(f"no answer from {host}:{port} within {self.connect_timeout}s",
                                  transfer_id) from None
        except OSError as e:
            sock.close()
            raise PeerUnavailable(f"cannot connect to {host}:{port}: {e.strerror or e}",
                                  transfer_id) from None
        return sock

    async def close(self) -> None:
        self._closed = True
        self._io.shutdown(wait=False)


def _blocking_exchange(sock: socket.socket, parts, hasher: Hasher | None, segment: int,
                       stall: float) -> tuple[int, str]:
    """Send a frame's parts, then read the receiver's verdict: (status, message)."""
    try:
        _blocking_send(sock, parts, hasher, segment, stall)
    except (BrokenPipeError, ConnectionResetError) as e:  # a refusing receiver replies, then closes
        try:
            return _blocking_reply(sock, stall)
        except OSError:
            raise e from None
    return _blocking_reply(sock, stall)


def _blocking_reply(sock: socket.socket, stall: float) -> tuple[int, str]:
    head = bytearray(REPLY.size)
    _blocking_recv(sock, memoryview(head), None, REPLY.size, stall)
    status, mlen = REPLY.unpack(head)
    msg = bytearray(mlen)
    if mlen:
        _blocking_recv(sock, memoryview(msg), None, mlen, stall)
    return status, msg.decode(errors="replace") or _STATUS_TEXT.get(status, str(status))


# -- receiver ----------------------------------------------------------------------------------

@dataclass
class _Entry:
    state: TransferState = TransferState.PENDING
    payload: KVPayload | None = None          # set in SUCCESS
    error: TransferError | None = None        # set in FAILED
    done: asyncio.Event = field(default_factory=asyncio.Event)  # SUCCESS or FAILED reached
    since: float = field(default_factory=time.monotonic)
    discarded: bool = False                   # drop the bytes when they arrive


class TcpKVReceiver(KVReceiver):
    """Accepts frames on (host, port); keeps verified payloads until ``take()``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_bytes: int = 4096 * MiB,
                 timeout: float = 30.0, unclaimed_ttl: float = 120.0):
        self.host = host                      # bind address
        self.port = port                      # 0: a free port, known after listen()
        self.timeout = timeout                # stall timeout per read; buffer wait bound
        self.unclaimed_ttl = unclaimed_ttl    # seconds a received-but-untaken payload is kept
        self.pool = BufferPool(max_bytes)     # bounded, reused receive buffers
        self.identity = host_identity()       # answered to hello frames (same-host detection)
        self._io = ThreadPoolExecutor(MAX_IO_THREADS, thread_name_prefix="kv-recv")  # payload reads
        self.nixl = NixlEndpoint("rx")        # pulls F_NIXL payloads; started on the first one
        self._entries: dict[str, _Entry] = {}
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()  # accept loop, janitor, one per connection
        self._closed = False

    # -- KVReceiver -------------------------------------------------------------------------

    async def listen(self) -> tuple[str, int]:
        if self._sock is not None:
            return self.host, self.port
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._spawn(self._accept_loop(), "kv-accept")
        self._spawn(self._janitor(), "kv-janitor")
        log.info("KV receiver listening on %s:%d (budget %d MiB)", self.host, self.port,
                 self.pool.max_bytes // MiB)
        return self.host, self.port

    def poll(self, transfer_id: str) -> TransferState:
        e = self._entries.get(transfer_id)
        return e.state if e is not None else TransferState.PENDING

    async def take(self, transfer_id: str, timeout: float | None = None) -> KVPayload:
        if self._closed:
            raise TransferError("receiver closed", transfer_id)
        entry = self._entries.setdefault(transfer_id, _Entry())
        try:
            async with asyncio.timeout(timeout):
                await entry.done.wait()
        except TimeoutError:
            self.discard(transfer_id)
            state = entry.state.value
            raise TransferError(f"not received within {timeout}s (state {state})", transfer_id) from None
        self._entries.pop(transfer_id, None)
        if entry.error is not None:
            raise entry.error
        assert entry.payload is not None
        return entry.payload

    def discard(self, transfer_id: str) -> None:
        entry = self._entries.setdefault(transfer_id, _Entry())
        entry.discarded = True
        entry.since = time.monotonic()  # the janitor forgets it after unclaimed_ttl
        if entry.payload is not None:
            entry.payload.release()
            entry.payload = None
        if not entry.done.is_set():
            entry.error = TransferError("discarded", transfer_id)
            entry.done.set()

    async def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            self._sock.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for tid in list(self._entries):
            self.discard(tid)
        self._entries.clear()
        self.pool.clear()
        self._io.shutdown(wait=False)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    # -- internals --------------------------------------------------------------------------

    def _spawn(self, coro, name: str) -> asyncio.Task:
        t = asyncio.create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(self._sock)
            except OSError as e:
                if self._closed:
                    return
                log.warning("KV receiver accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            _tune(conn)
            self._spawn(self._serve_conn(conn, peer), f"kv-conn:{peer}")

    async def _janitor(self) -> None:
        while True:
            await asyncio.sleep(max(1.0, self.unclaimed_ttl / 4))
            now = time.monotonic()
            for tid, e in list(self._entries.items()):
                if now - e.since < self.unclaimed_ttl:
                    continue
                if e.state is TransferState.SUCCESS and not e.discarded:
                    log.warning("dropping KV transfer %s: not taken within %.0fs", tid, self.unclaimed_ttl)
                if e.state is not TransferState.TRANSFERRING:
                    if e.payload is not None:
                        e.payload.release()
                    self._entries.pop(tid, None)

    async def _serve_conn(self, conn: socket.socket, peer) -> None:
        loop = asyncio.get_running_loop()
        head = bytearray(HEADER.size)
        try:
            while not self._closed:
                try:  # idle between frames: wait longer, EOF here is a clean end
                    await _recv_exact(loop, conn, memoryview(head), self.timeout * 10)
                except ConnectionError:
                    return
                magic, version, algo_id, id_len, nbytes, digest = HEADER.unpack(head)
                if magic != MAGIC or version not in (1, 2, 3) or algo_id not in ALGO_NAMES \
                        or not 0 < id_len <= MAX_ID_BYTES:
                    await self._reply(loop, conn, BAD_HEADER, f"bad header from {peer}")
                    return
                tid_buf = bytearray(id_len + (EXTRA.size if version > 1 else 0))
                await _recv_exact(loop, conn, memoryview(tid_buf), self.timeout)
                tid = tid_buf[:id_len].decode(errors="replace")
                flags, raw_n = EXTRA.unpack(tid_buf[id_len:]) if version > 1 else (0, nbytes)
                if version == 3 and (flags or raw_n != nbytes):  # a digest trailer only on plain payloads
                    await self._reply(loop, conn, BAD_HEADER, f"bad version-3 header from {peer}")
                    return
                if flags & (F_HELLO | F_PROBE):
                    await self._control(loop, conn, flags, nbytes)
                    continue
                digest = None if version == 3 else digest  # None: it follows the payload
                if not await self._receive(loop, conn, tid, nbytes, ALGO_NAMES[algo_id], digest, flags, raw_n):
                    return  # the frame could not be consumed; the connection is unusable
        except (ConnectionError, TimeoutError, OSError) as e:
            log.debug("KV connection from %s ended: %s", peer, e)
        finally:
            conn.close()

    async def _control(self, loop, conn, flags: int, nbytes: int) -> None:
        """A hello (identity exchange) or a probe (read and drop ``nbytes``)."""
        if nbytes > (4096 if flags & F_HELLO else 1 << 30):
            raise ConnectionError(f"control frame of {nbytes} bytes")
        buf = bytearray(min(nbytes, 4 * MiB))
        left = nbytes
        while left:
            n = min(left, len(buf))
            await _recv_exact(loop, conn, memoryview(buf)[:n], self.timeout)
            left -= n
        await self._reply(loop, conn, OK, self.identity if flags & F_HELLO else "")

    async def _receive(self, loop, conn, tid: str, nbytes: int, algo: str, digest: bytes | None,
                       flags: int = 0, raw_n: int | None = None) -> bool:
        """One frame's payload (``digest`` None: it follows the payload). Returns False when
        the connection must be closed."""
        raw_n = nbytes if raw_n is None else raw_n
        entry = self._entries.setdefault(tid, _Entry())
        if entry.state in (TransferState.TRANSFERRING, TransferState.SUCCESS):
            await self._reply(loop, conn, DUPLICATE, f"transfer {tid} already received")
            return False
        if not self.pool.fits(nbytes) or not self.pool.fits(raw_n):
            self._fail(tid, entry, TransferError(
                f"{max(nbytes, raw_n)} bytes exceed the receive budget of {self.pool.max_bytes}", tid))
            await self._reply(loop, conn, TOO_LARGE, str(entry.error))
            return False
        entry.state = TransferState.TRANSFERRING
        t0 = time.perf_counter()
        try:
            if flags & F_NIXL:
                view, got, release = await self._read_nixl(loop, conn, tid, nbytes, raw_n, algo, digest)
            elif flags & F_SHM:
                view, got, release = await self._read_shm(loop, conn, tid, nbytes, raw_n, algo, digest)
            elif flags & F_ZSTD:
                view, got, release = await self._read_zstd(loop, conn, tid, nbytes, raw_n, algo, digest)
            else:
                view, got, release = await self._read_plain(loop, conn, tid, nbytes, algo, digest)
        except PathUnavailable as e:  # nothing was received: the sender retries on another path
            entry.state = TransferState.PENDING
            log.info("KV %s; waiting for another path", e)
            await self._reply(loop, conn, FAILED, str(e))
            return True
        except TransferError as e:
            self._fail(tid, entry, e)
            log.warning("KV %s", e)
            status = CHECKSUM if isinstance(e, ChecksumError) else FAILED
            try:
                await self._reply(loop, conn, status, str(e))
            except (OSError, TimeoutError):
                pass
            return False
        seconds = time.perf_counter() - t0
        if entry.discarded:
            view.release()
            if release is not None:
                release(True)
            self._fail(tid, entry, TransferError("discarded", tid))
            await self._reply(loop, conn, DISCARDED, f"transfer {tid} was discarded")
            return True
        entry.payload = KVPayload(tid, view, f"{algo}:{got.hex()}", seconds, release)
        entry.state = TransferState.SUCCESS
        entry.since = time.monotonic()
        entry.done.set()
        log.debug("KV %s: %d bytes in %.3fs", tid, raw_n, seconds)
        await self._reply(loop, conn, OK, "")
        return True

    async def _read_plain(self, loop, conn, tid: str, nbytes: int, algo: str, digest: bytes | None):
        """Raw payload into a pooled buffer, hashed segment by segment as it lands (worker
        thread), then checked against ``digest`` or the trailer after it: (view, digest, release)."""
        buf: bytearray | None = None
        view: memoryview | None = None
        try:
            try:
                async with asyncio.timeout(self.timeout):
                    buf = await self.pool.acquire(nbytes) if nbytes else bytearray()
            except TimeoutError:
                raise TransferError(f"no receive buffer free within {self.timeout}s", tid) from None
            view = memoryview(buf)[:nbytes]
            hasher = Hasher(algo)
            try:
                await _in_thread(self._io, conn, _blocking_recv, view, hasher, SEGMENT, self.timeout)
                if digest is None:
                    trailer = bytearray(32)
                    await _recv_exact(loop, conn, memoryview(trailer), self.timeout)
                    digest = bytes(trailer)
            except (ConnectionError, TimeoutError) as e:
                raise TransferError(f"short read: {e}", tid) from None
            got = hasher.digest()
            _check_digest(tid, algo, got, digest)
        except TransferError:
            self._give_back(view, buf)
            raise
        release = (lambda reuse, b=buf: self.pool.release(b, reuse)) if nbytes else None
        return view, got, release

    async def _recv_bytes(self, loop, conn, tid: str, nbytes: int) -> bytearray:
        buf = bytearray(nbytes)
        try:
            await _recv_exact(loop, conn, memoryview(buf), self.timeout)
        except (ConnectionError, TimeoutError) as e:
            raise TransferError(f"short read: {e}", tid) from None
        return buf

    async def _read_zstd(self, loop, conn, tid: str, nbytes: int, raw_n: int, algo: str, digest: bytes):
        """Compressed payload: receive, decompress (in a thread), verify the raw bytes."""
        wire = await self._recv_bytes(loop, conn, tid, nbytes)
        try:
            raw = await loop.run_in_executor(self._io, _decompress, wire, raw_n)
        except zstandard.ZstdError as e:
            raise TransferError(f"payload does not decompress: {e}", tid) from None
        got = await loop.run_in_executor(self._io, _digest, algo, raw)
        _check_digest(tid, algo, got, digest)
        return memoryview(raw), got, None

    async def _read_nixl(self, loop, conn, tid: str, nbytes: int, raw_n: int, algo: str, digest: bytes):
        """RDMA payload: READ the sender's registered memory into a pooled buffer, verify it."""
        if nbytes > MAX_OFFER_BYTES:
            raise TransferError(f"NIXL offer of {nbytes} bytes", tid)
        offer = await self._recv_bytes(loop, conn, tid, nbytes)
        self.nixl.agent()  # PathUnavailable (no NIXL here) before taking a buffer: retry elsewhere
        try:
            async with asyncio.timeout(self.timeout):
                buf = await self.pool.acquire(raw_n)
        except TimeoutError:
            raise TransferError(f"no receive buffer free within {self.timeout}s", tid) from None
        view = memoryview(buf)[:raw_n]
        try:
            await self.nixl.pull(offer, view, self.timeout, tid)
        except TransferError:
            if any(v is view for v in self.nixl.stuck):
                self.pool.release(buf, reuse=False)  # RDMA may still write into it
            else:
                self._give_back(view, buf)
            raise
        got = await loop.run_in_executor(self._io, _digest, algo, view)
        try:
            _check_digest(tid, algo, got, digest)
        except ChecksumError:
            self._give_back(view, buf)
            raise
        return view, got, lambda reuse, b=buf: self.pool.release(b, reuse)

    async def _read_shm(self, loop, conn, tid: str, nbytes: int, raw_n: int, algo: str, digest: bytes):
        """Same-host payload: map the sender's /dev/shm file, unlink it, verify it."""
        if nbytes > 255:
            raise TransferError(f"shm segment name of {nbytes} bytes", tid)
        name = await self._recv_bytes(loop, conn, tid, nbytes)
        try:
            mm = shm_map(name.decode(errors="replace"), raw_n)
        except (OSError, ValueError) as e:
            raise PathUnavailable(f"shared memory: {e}", tid) from None
        view = memoryview(mm)
        got = await loop.run_in_executor(self._io, _digest, algo, view)
        try:
            _check_digest(tid, algo, got, digest)
        except ChecksumError:
            view.release()
            mm.close()
            raise

        def release(reuse: bool, m=mm) -> None:
            if reuse:  # unmapping frees the segment's pages (~15 ms for 64 MiB): off the caller's path
                try:
                    self._io.submit(m.close)
                except RuntimeError:  # receiver closed
                    m.close()
        return view, got, release

    def _give_back(self, view: memoryview | None, buf: bytearray | None) -> None:
        if view is not None:
            view.release()
        if buf:
            self.pool.release(buf)

    def _fail(self, tid: str, entry: _Entry, error: TransferError) -> None:
        entry.state = TransferState.FAILED
        entry.error = error
        entry.since = time.monotonic()
        entry.done.set()

    async def _reply(self, loop, conn, status: int, message: str) -> None:
        m = message.encode()[:4096]
        await asyncio.wait_for(loop.sock_sendall(conn, REPLY.pack(status, len(m)) + m), self.timeout)


class TcpTransport(KVTransport):
    name = "tcp"

    def __init__(self, *, chunk_bytes: int = 4 * MiB, timeout: float = 30.0,
                 max_pending_bytes: int = 4096 * MiB):
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self.max_pending_bytes = max_pending_bytes

    @classmethod
    def from_settings(cls, s) -> "TcpTransport":
        """From a shared.settings.DataPlaneSettings."""
        return cls(chunk_bytes=s.chunk_mb * MiB, timeout=s.timeout,
                   max_pending_bytes=s.max_pending_mb * MiB)

    def sender(self) -> TcpKVSender:
        return TcpKVSender(chunk_bytes=self.chunk_bytes, timeout=self.timeout)

    def receiver(self, host: str = "127.0.0.1", port: int = 0) -> TcpKVReceiver:
        return TcpKVReceiver(host, port, max_bytes=self.max_pending_bytes, timeout=self.timeout)
