"""The TCP data plane: a sender that frames payloads (``frames.py``) over one connection per
transfer, and a receiver that accepts frames and keeps verified payloads until ``take()``.

The sender's ``mode`` picks the path: "tcp" (raw; hashed while it is sent, the digest follows),
"tcp+zstd" (``zstd.py``), "shm" (``shm.py``: same host, the frame names a /dev/shm file) or
"rdma" (``nixl.py``: the frame carries an offer the receiver READs). The receiver reads plain
payloads itself and hands each other flag to its path's reader.

Flow control: the receiver takes a buffer from a bounded ``BufferPool`` before reading a
payload; while none is free it stops reading, TCP's window fills and the sender's ``sendall``
waits — no unbounded buffering anywhere. Every read and write has a stall timeout; a short
read, stall, or checksum mismatch fails the transfer (TransferError) on both sides, and the
buffer goes back to the pool — a partial KV is never handed out.

Receiver life cycle per transfer: PENDING -> TRANSFERRING -> SUCCESS (until take()) | FAILED.
Unclaimed payloads are dropped after ``unclaimed_ttl`` seconds (logged).

Authentication: with a data-plane key (``key``, TANDEM_DATA_KEY) the sender tags every frame and
the receiver refuses a frame without a valid tag before it reads a payload byte or touches the
transfer's state (a forged frame can neither make it allocate nor fail someone else's transfer).
Every payload buffer comes from the ``BufferPool``, so no frame, compressed or not, makes the
receiver hold more than its budget (TANDEM_DATA_MAX_PENDING_MB).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from shared import metrics
from shared.logs import sparse
from shared.transfer import nixl, shm, zstd
from shared.transfer.base import (
    ChecksumError, Discarded, Hasher, KVPayload, KVReceiver, KVSender, KVTransport, NotAuthorized, PathUnavailable,
    PeerUnavailable, SendResult, TransferError, TransferState, default_checksum,
)
from shared.transfer.frames import (
    ALGO_NAMES, ALGOS, BAD_HEADER, CHECKSUM, DISCARDED, DUPLICATE, EXTRA, F_AUTH, F_HELLO, F_NIXL, F_PROBE,
    F_SHM, F_ZSTD, FAILED, HEADER, MAGIC, MAX_ID_BYTES, MAX_IO_THREADS, MODES, OK, REPLY, SEGMENT,
    TAG, TOO_LARGE, UNAUTHORIZED, VERSION, BufferPool, MiB, blocking_exchange, blocking_recv, check_digest,
    frame_tag, in_thread, ip_literal, parse_checksum, recv_exact, trailer_tag, tune,
)
from shared.transfer.link import host_identity
from shared.transfer.nixl import NixlEndpoint
from shared.transfer.shm import shm_unlink, shm_write

log = logging.getLogger(__name__)

READERS = {F_NIXL: nixl.read, F_SHM: shm.read, F_ZSTD: zstd.read}   # a path's flag -> its reader
FIRST_FRAME_S = 10.0   # a new connection's time, from accept, to send its first frame's header, id and tag
                       # (a sender writes them at once); a deadline, not a wait between bytes
UNPROVEN = 256         # connections at once whose first frame has not been checked; a new one closes the oldest

# -- sender ------------------------------------------------------------------------------------

def _unlink_written(work) -> None:
    """A segment write's done callback: remove the file it wrote (none if it never ran or failed)."""
    if not work.cancelled() and work.exception() is None:
        shm_unlink(work.result())


class TcpKVSender(KVSender):
    """Opens one connection per transfer, sends header + payload, waits for the verdict.

    A frame's socket I/O runs in one of this sender's worker threads (blocking calls, GIL
    released); the rdma path's NIXL calls stay on the event loop.
    """

    def __init__(self, *, chunk_bytes: int = SEGMENT, timeout: float = 30.0,
                 connect_timeout: float = 3.0, algo: str | None = None, key: bytes = b""):
        self.chunk_bytes = chunk_bytes            # bytes per send call, hashed just before it
        self.timeout = timeout                    # stall timeout, and for the receiver's verdict
        self.connect_timeout = connect_timeout    # dead peers fail within this
        self.algo = algo or default_checksum()    # checksum when the caller gives none
        self.key = key                            # data-plane key: frames are tagged (b"": not)
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
        _check(status, message, f"receiver {host}:{port} refused", transfer_id)
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
        work = self._io.submit(zstd.compress if mode == "tcp+zstd" else shm_write, view)
        jobs = [asyncio.wrap_future(work)]
        if checksum is None:
            hasher = Hasher(self.algo)
            jobs.append(loop.run_in_executor(self._io, hasher.update, view))  # blake3 drops the GIL
        try:
            done = await asyncio.gather(*jobs, return_exceptions=True)
        except asyncio.CancelledError:
            # the send was cancelled (its request aborted) while a thread writes the segment: the
            # write goes on, and its file — a prompt's KV in RAM — is removed once it is done
            # (nothing else would ever know its name: 120-175 MB a cancelled hand-off, for good)
            if mode == "shm":
                work.add_done_callback(_unlink_written)
            raise
        if mode == "shm" and isinstance(done[-1], BaseException) and isinstance(done[0], str):
            shm_unlink(done[0])
        for r in done:
            if isinstance(r, OSError):   # no room in /dev/shm, a file-size limit, no fd left: this
                # process's own, and a path the sender moves past (send: the next path) — not a crash
                raise TransferError(f"could not prepare the {mode} frame: {r.strerror or r}")
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
        _check(status, message, f"receiver {host}:{port} refused hello")
        return message

    async def probe(self, host: str, port: int, nbytes: int = 8 * MiB) -> float:
        """Seconds to push ``nbytes`` to a receiver and hear back (a timed link probe)."""
        t0 = time.perf_counter()
        status, message = await self._exchange(host, port, "probe", "crc32", b"", memoryview(bytes(nbytes)),
                                               F_PROBE, 0, self.timeout)
        _check(status, message, f"receiver {host}:{port} refused probe")
        return time.perf_counter() - t0

    async def _exchange(self, host: str, port: int, transfer_id: str, algo: str, digest: bytes,
                        body: memoryview, flags: int, raw_nbytes: int, stall: float,
                        hasher: Hasher | None = None) -> tuple[int, str]:
        """One frame on a fresh connection: header, body, then the receiver's verdict.
        With ``hasher`` (version 3) the body is hashed as it is sent and the digest follows it.
        With a key the frame is tagged (``F_AUTH``; frames.py)."""
        tid = transfer_id.encode()
        if self.key:
            flags |= F_AUTH
        version = 3 if hasher is not None else 2 if flags else VERSION
        header = HEADER.pack(MAGIC, version, ALGOS[algo], len(tid), body.nbytes, digest.ljust(32, b"\0")) + tid
        if version > 1:
            header += EXTRA.pack(flags, raw_nbytes)
        tag = frame_tag(self.key, f"{host}:{port}", header) if self.key else b""
        parts = [header + tag, body]
        if hasher is not None:
            def trailer() -> bytes:
                d = hasher.digest().ljust(32, b"\0")
                return d + trailer_tag(self.key, tag, d) if tag else d
            parts.append(trailer)
        loop = asyncio.get_running_loop()
        sock = await self._connect(loop, host, port, transfer_id)
        try:
            io = in_thread(self._io, sock, blocking_exchange, parts, hasher, self.chunk_bytes, stall)
            return await (self.nixl.progressing(io) if flags & F_NIXL else io)
        except TimeoutError:
            raise TransferError(f"stalled for {stall}s sending to {host}:{port}", transfer_id) from None
        except OSError as e:
            raise TransferError(f"connection to {host}:{port} lost: {e}", transfer_id) from None
        finally:
            sock.close()

    async def _connect(self, loop, host: str, port: int, transfer_id: str) -> socket.socket:
        literal = ip_literal(host, port)  # an address needs no resolver thread
        try:
            infos = [literal] if literal else await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise PeerUnavailable(f"cannot resolve {host}: {e}", transfer_id) from None
        family, type_, proto, _, addr = infos[0]
        try:
            sock = socket.socket(family, type_, proto)
        except OSError as e:   # this process's own limit (EMFILE, ENOBUFS): not the peer's fault
            raise TransferError(f"cannot open a socket to {host}:{port}: {e.strerror or e}", transfer_id) from None
        try:
            tune(sock)
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



def _check(status: int, message: str, what: str, transfer_id: str = "") -> None:
    """Raise unless the receiver's verdict is OK (NotAuthorized when it refused the frame's tag)."""
    if status != OK:
        kind = NotAuthorized if status == UNAUTHORIZED else Discarded if status == DISCARDED else TransferError
        raise kind(f"{what}: {message}", transfer_id)


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
    """Accepts frames on (host, port); keeps verified payloads until ``take()``. With a ``key``,
    only frames tagged with it for this receiver (``advertise_host`` or ``host``, and its port, as
    the sender dialled them) are read; the others are refused and counted (``refused``)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_bytes: int = 4096 * MiB,
                 timeout: float = 30.0, unclaimed_ttl: float = 120.0, key: bytes = b"",
                 advertise_host: str | None = None):
        self.host = host                      # bind address
        self.port = port                      # 0: a free port, known after listen()
        self.key = key                        # data-plane key (b"": every frame is accepted)
        self.names = [n for n in dict.fromkeys((advertise_host, host)) if n]  # how senders dial it
        if host in ("", "0.0.0.0", "::") and not advertise_host:
            self.names += ["127.0.0.1", "localhost"]
        self.refused = 0                      # frames refused: no valid tag
        self.timeout = timeout                # stall timeout per read; buffer wait bound
        self.unclaimed_ttl = unclaimed_ttl    # seconds a received-but-untaken payload is kept
        self.pool = BufferPool(max_bytes)     # bounded, reused receive buffers
        self.identity = host_identity()       # answered to hello frames (same-host detection)
        self.io = ThreadPoolExecutor(MAX_IO_THREADS, thread_name_prefix="kv-recv")  # payload reads
        self.nixl = NixlEndpoint("rx")        # pulls F_NIXL payloads; started on the first one
        self._entries: dict[str, _Entry] = {}
        self._taken: dict[str, float] = {}   # transfer id -> when taken: a replayed frame of it is a
                                             # duplicate for unclaimed_ttl (the janitor forgets it then)
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()  # accept loop, janitor, one per connection
        self._unproven: dict[socket.socket, object] = {}   # connections before their first frame's check
                                                           # -> peer, oldest first
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
        log.info("KV receiver listening on %s:%d (budget %d MiB, %s)", self.host, self.port,
                 self.pool.max_bytes // MiB, "frames authenticated" if self.key else "no data-plane key")
        if not self.key:
            log.warning("no data-plane key (TANDEM_DATA_KEY / TANDEM_DATA_KEY_FILE): the KV receiver on %s:%d "
                        "accepts frames from any process that can reach it", self.host, self.port)
        files, size = shm.sweep()
        if files:
            log.warning("removed %d shared-memory KV segment(s) (%d MiB) older than %.0f s in %s: their senders "
                        "died mid-transfer", files, size // MiB, shm.STALE_S, shm.SHM_DIR)
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
        self._taken[transfer_id] = time.monotonic()
        return entry.payload

    def transfers(self) -> list[str]:
        return [tid for tid, e in self._entries.items() if not e.discarded]

    def discard(self, transfer_id: str) -> None:
        entry = self._entries.setdefault(transfer_id, _Entry())
        entry.discarded = True
        entry.since = time.monotonic()  # the janitor forgets it after unclaimed_ttl
        if entry.payload is not None:
            entry.payload.release()
            entry.payload = None
        entry.error = TransferError("discarded", transfer_id)   # (a take of it, even one received, says so)
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
        self.io.shutdown(wait=False)

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
            tune(conn)
            if len(self._unproven) >= UNPROVEN:
                # a peer holding connections that prove nothing (slowly, within the deadline) gives
                # up its oldest, not an honest sender its place (which proves itself at once)
                old, old_peer = next(iter(self._unproven.items()))
                del self._unproven[old]
                self._refuse(old_peer, "", "unproven", f"{UNPROVEN} connections had sent no checked frame: "
                             f"the oldest is closed")
                try:
                    old.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._unproven[conn] = peer
            self._spawn(self._serve_conn(conn, peer), f"kv-conn:{peer}")

    async def _janitor(self) -> None:
        while True:
            await asyncio.sleep(max(1.0, self.unclaimed_ttl / 4))
            now = time.monotonic()
            for tid, t in list(self._taken.items()):
                if now - t >= self.unclaimed_ttl:
                    del self._taken[tid]
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
        # a sender writes its first frame as soon as it is connected: a connection whose first
        # header, id and tag are not all in FIRST_FRAME_S after accept is closed (2,000 idle ones
        # held a descriptor each for the 300 s between-frames wait; one byte every 8 s held one for
        # hours while the limit was a wait between bytes); one whose frame checked is kept idle
        # that long between frames for the sender to reuse
        wait = self.timeout * 10
        deadline: float | None = loop.time() + min(self.timeout, FIRST_FRAME_S)
        try:
            while not self._closed:
                async with asyncio.timeout_at(deadline):   # None once a frame has checked
                    try:  # idle between frames: wait longer, EOF here is a clean end
                        await recv_exact(loop, conn, memoryview(head), wait)
                    except ConnectionError:
                        return
                    magic, version, algo_id, id_len, nbytes, digest = HEADER.unpack(head)
                    if magic != MAGIC or version not in (1, 2, 3) or algo_id not in ALGO_NAMES \
                            or not 0 < id_len <= MAX_ID_BYTES:
                        await self._reply(loop, conn, BAD_HEADER, f"bad header from {peer}")
                        return
                    tid_buf = bytearray(id_len + (EXTRA.size if version > 1 else 0))
                    await recv_exact(loop, conn, memoryview(tid_buf), self.timeout)
                    tid = tid_buf[:id_len].decode(errors="replace")
                    flags, raw_n = EXTRA.unpack(tid_buf[id_len:]) if version > 1 else (0, nbytes)
                    tag = b""
                    if flags & F_AUTH:
                        tag = bytearray(TAG)
                        await recv_exact(loop, conn, memoryview(tag), self.timeout)
                if self.key and not self._authentic(bytes(head) + bytes(tid_buf), bytes(tag)):
                    self._refuse(peer, tid, "no tag" if not tag else "wrong tag")
                    await self._reply(loop, conn, UNAUTHORIZED, "frame not authenticated: it carries no valid "
                                      "tag under this deployment's data-plane key (TANDEM_DATA_KEY)")
                    return
                deadline = None
                self._unproven.pop(conn, None)
                if version == 3 and (flags & ~F_AUTH or raw_n != nbytes):  # a trailer only on plain payloads
                    await self._reply(loop, conn, BAD_HEADER, f"bad version-3 header from {peer}")
                    return
                if flags & (F_HELLO | F_PROBE):
                    await self._control(loop, conn, flags, nbytes)
                    continue
                digest = None if version == 3 else digest  # None: it follows the payload
                if not await self._receive(loop, conn, tid, nbytes, ALGO_NAMES[algo_id], digest, flags, raw_n,
                                           bytes(tag)):
                    return  # the frame could not be consumed; the connection is unusable
        except (ConnectionError, TimeoutError, OSError) as e:
            log.debug("KV connection from %s ended: %s", peer, e)
        finally:
            self._unproven.pop(conn, None)
            conn.close()

    def _authentic(self, signed: bytes, tag: bytes) -> bool:
        """``tag`` is the frame tag of ``signed`` for this receiver under its key."""
        return len(tag) == TAG and any(
            hmac.compare_digest(frame_tag(self.key, f"{name}:{self.port}", signed), tag) for name in self.names)

    def _refuse(self, peer, tid: str, why: str, detail: str = "") -> None:
        self.refused += 1
        metrics.DATA_REFUSED.labels(why).inc()
        # the 1st, 2nd, 4th, 8th... refusal is logged: a flood of forged frames does not flood the log
        sparse(log, self.refused)(
            "KV receiver %s:%d refused a frame for %r from %s: %s (%s; %d refused so far)",
            self.host, self.port, tid[:64], peer, why, detail or "data-plane key", self.refused)

    async def _control(self, loop, conn, flags: int, nbytes: int) -> None:
        """A hello (identity exchange) or a probe (read and drop ``nbytes``)."""
        if nbytes > (4096 if flags & F_HELLO else 1 << 30):
            raise ConnectionError(f"control frame of {nbytes} bytes")
        buf = bytearray(min(nbytes, 4 * MiB))
        left = nbytes
        while left:
            n = min(left, len(buf))
            await recv_exact(loop, conn, memoryview(buf)[:n], self.timeout)
            left -= n
        await self._reply(loop, conn, OK, self.identity if flags & F_HELLO else "")

    async def _receive(self, loop, conn, tid: str, nbytes: int, algo: str, digest: bytes | None,
                       flags: int = 0, raw_n: int | None = None, tag: bytes = b"") -> bool:
        """One frame's payload (``digest`` None: it follows the payload; ``tag``: the frame's
        authentication tag). Returns False when the connection must be closed."""
        raw_n = nbytes if raw_n is None else raw_n
        if tid in self._taken:    # a replay of a frame whose transfer is done: held, it would wait for nobody
            await self._reply(loop, conn, DUPLICATE, f"transfer {tid} already received and taken")
            return False
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
            path = next((flag for flag in READERS if flags & flag), None)
            if path is not None:
                view, got, release = await READERS[path](self, loop, conn, tid, nbytes, raw_n, algo, digest)
            else:
                view, got, release = await self._read_plain(loop, conn, tid, nbytes, algo, digest, tag)
        except PathUnavailable as e:  # nothing was received: the sender retries on another path
            entry.state = TransferState.PENDING
            log.info("KV %s; waiting for another path", e)
            await self._reply(loop, conn, FAILED, str(e))
            return True
        except TransferError as e:
            self._fail(tid, entry, e)
            log.warning("KV %s", e)
            status = CHECKSUM if isinstance(e, ChecksumError) else UNAUTHORIZED if isinstance(e, NotAuthorized) \
                else FAILED
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

    async def buffer(self, nbytes: int, tid: str) -> bytearray:
        """A pooled receive buffer of at least ``nbytes`` (waits while the budget is spent);
        TransferError when none is free within the stall timeout."""
        try:
            async with asyncio.timeout(self.timeout):
                return await self.pool.acquire(nbytes)
        except TimeoutError:
            raise TransferError(f"no receive buffer free within {self.timeout}s", tid) from None

    async def _read_plain(self, loop, conn, tid: str, nbytes: int, algo: str, digest: bytes | None,
                          tag: bytes = b""):
        """Raw payload into a pooled buffer, hashed segment by segment as it lands (worker
        thread), then checked against ``digest`` or the trailer after it (and the trailer's tag,
        when the frame is tagged): (view, digest, release)."""
        buf: bytearray | None = None
        view: memoryview | None = None
        try:
            buf = await self.buffer(nbytes, tid) if nbytes else bytearray()
            view = memoryview(buf)[:nbytes]
            hasher = Hasher(algo)
            try:
                await in_thread(self.io, conn, blocking_recv, view, hasher, SEGMENT, self.timeout)
                if digest is None:
                    trailer = bytearray(32 + (TAG if tag else 0))
                    await recv_exact(loop, conn, memoryview(trailer), self.timeout)
                    digest = bytes(trailer[:32])
                    if self.key and not hmac.compare_digest(trailer_tag(self.key, tag, digest), trailer[32:]):
                        raise NotAuthorized("the trailer's tag does not check out", tid)
            except (ConnectionError, TimeoutError) as e:
                raise TransferError(f"short read: {e}", tid) from None
            got = hasher.digest()
            check_digest(tid, algo, got, digest)
        except TransferError:
            self.give_back(view, buf)
            raise
        return view, got, self.release_of(buf, nbytes)

    def release_of(self, buf: bytearray, nbytes: int):
        """How the taker gives a received payload's pooled buffer back (None: no buffer taken)."""
        return (lambda reuse, b=buf: self.pool.release(b, reuse)) if nbytes else None

    def give_back(self, view: memoryview | None, buf: bytearray | None) -> None:
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
                 max_pending_bytes: int = 4096 * MiB, key: bytes = b"", advertise_host: str | None = None):
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self.max_pending_bytes = max_pending_bytes
        self.key = key                        # the data-plane key (b"": frames are not authenticated)
        self.advertise_host = advertise_host  # the name senders dial receivers by, when not their bind address

    @classmethod
    def from_settings(cls, s) -> "TcpTransport":
        """From a shared.settings.DataPlaneSettings."""
        return cls(chunk_bytes=s.chunk_mb * MiB, timeout=s.timeout, max_pending_bytes=s.max_pending_mb * MiB,
                   key=s.secret(), advertise_host=s.advertise_host)

    def sender(self) -> TcpKVSender:
        return TcpKVSender(chunk_bytes=self.chunk_bytes, timeout=self.timeout, key=self.key)

    def receiver(self, host: str = "127.0.0.1", port: int = 0) -> TcpKVReceiver:
        return TcpKVReceiver(host, port, max_bytes=self.max_pending_bytes, timeout=self.timeout, key=self.key,
                             advertise_host=self.advertise_host)
