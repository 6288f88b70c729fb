"""Data plane (TCP frames): byte-exact transfers, ordering of bytes vs handle, failures,
corruption, every path and retries (the rdma path: test_nixl.py). Throughput is measured by
``tandem bench pool``, not here.

No wall-clock thresholds: a timeout under test is told apart from the test's own deadline by
the error it raises, and a state is waited for (``until``) with a deadline that only catches a
hang, so a loaded machine makes a test slower, never red."""

from __future__ import annotations

import asyncio
import os
import socket
import struct

import pytest

from shared.transfer import (
    ChecksumError, Discarded, PeerUnavailable, TcpKVReceiver, TcpKVSender, TcpTransport, TransferError,
    TransferState, checksum,
)
from shared.transfer.frames import HEADER, MAGIC, BufferPool, size_class
from shared.transfer.shm import shm_write

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


async def until(pred, deadline: float = 30.0) -> None:
    """Wait for ``pred()`` to hold; AssertionError if it does not within ``deadline`` s (a hang)."""
    async with asyncio.timeout(deadline):
        while not pred():
            await asyncio.sleep(0.01)


@pytest.fixture
async def rx():
    r = TcpKVReceiver("127.0.0.1", 0, max_bytes=256 * MiB, timeout=5.0)
    await r.listen()
    yield r
    await r.close()


@pytest.fixture
def tx():
    return TcpKVSender(timeout=5.0, connect_timeout=1.0)


@pytest.mark.parametrize("n", [0, 1, MiB, 64 * MiB], ids=["0B", "1B", "1MiB", "64MiB"])
async def test_byte_exact(rx, tx, n):
    payload = os.urandom(n)
    host, port = rx.address
    sent, got = await asyncio.gather(tx.send(host, port, f"t-{n}", payload), rx.take(f"t-{n}", 30))
    with got:
        assert got.nbytes == n == sent.nbytes
        assert got.data == payload
        assert got.checksum == sent.checksum == checksum(payload)
    assert rx.poll(f"t-{n}") is TransferState.PENDING  # taken: forgotten


async def test_bytes_before_take_and_take_before_bytes(rx, tx):
    host, port = rx.address
    # bytes first: SUCCESS waits for take()
    await tx.send(host, port, "early", b"kv-early")
    assert rx.poll("early") is TransferState.SUCCESS
    with await rx.take("early", 1) as p:
        assert bytes(p.data) == b"kv-early"
    # take first: waits for the bytes
    waiter = asyncio.create_task(rx.take("late", 5))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await tx.send(host, port, "late", b"kv-late")
    with await waiter as p:
        assert bytes(p.data) == b"kv-late"


async def test_memoryview_payload_and_buffer_reuse(rx, tx):
    host, port = rx.address
    data = bytearray(os.urandom(3 * MiB))
    for i in range(3):
        await tx.send(host, port, f"mv-{i}", memoryview(data)[MiB:])
        with await rx.take(f"mv-{i}", 5) as p:
            assert p.data == data[MiB:]
    assert rx.pool.allocated == size_class(2 * MiB)  # one buffer, reused


async def test_concurrent_transfers(rx, tx):
    host, port = rx.address
    payloads = {f"c-{i}": os.urandom(MiB * (i + 1) + i) for i in range(8)}
    sends = [tx.send(host, port, tid, p) for tid, p in payloads.items()]
    takes = [rx.take(tid, 30) for tid in payloads]
    results = await asyncio.gather(*sends, *takes)
    for tid, got in zip(payloads, results[len(payloads):]):
        with got:
            assert got.data == payloads[tid]


async def test_backpressure_bounded_buffers(tx):
    """Budget for one 8 MiB payload: a second waits (not buffered) until the first is taken."""
    r = TcpKVReceiver("127.0.0.1", 0, max_bytes=9 * MiB, timeout=5.0)
    host, port = await r.listen()
    try:
        a, b = os.urandom(8 * MiB), os.urandom(8 * MiB)
        await tx.send(host, port, "a", a)
        second = asyncio.create_task(tx.send(host, port, "b", b))
        await until(lambda: r.poll("b") is TransferState.TRANSFERRING)   # b's header is in
        await asyncio.sleep(0.3)
        assert not second.done()                      # held back by the full budget
        assert r.poll("b") is TransferState.TRANSFERRING
        assert r.pool.allocated <= 9 * MiB
        with await r.take("a", 1) as p:
            assert p.data == a
        await second                                  # buffer released: b completes
        with await r.take("b", 5) as p:
            assert p.data == b
    finally:
        await r.close()


async def test_too_large_for_budget_is_refused(tx):
    r = TcpKVReceiver("127.0.0.1", 0, max_bytes=MiB, timeout=5.0)
    host, port = await r.listen()
    try:
        with pytest.raises(TransferError, match="refused.*exceed"):
            await tx.send(host, port, "big", os.urandom(2 * MiB))
        with pytest.raises(TransferError, match="exceed"):
            await r.take("big", 1)
    finally:
        await r.close()


async def test_corrupted_checksum_detected(rx, tx):
    host, port = rx.address
    payload = os.urandom(5 * MiB)
    wrong = checksum(payload[:-1] + bytes([payload[-1] ^ 1]))
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        await tx.send(host, port, "bad", payload, checksum=wrong)
    assert rx.poll("bad") is TransferState.FAILED
    with pytest.raises(ChecksumError):
        await rx.take("bad", 1)
    assert rx.pool.allocated <= 8 * MiB  # the buffer went back to the pool


def _v3_frame(tid: bytes, payload: bytes, trailer: bytes) -> bytes:
    """A version-3 frame by hand: digest field zero, the digest after the payload."""
    from shared.transfer.frames import EXTRA
    return HEADER.pack(MAGIC, 3, 1, len(tid), len(payload), b"\0" * 32) + tid + EXTRA.pack(0, len(payload)) \
        + payload + trailer


async def test_sender_hashes_while_sending(rx, tx):
    """No checksum given: a version-3 frame, hashed as it goes, digest in the trailer."""
    host, port = rx.address
    payload = os.urandom(5 * MiB + 3)
    sent, got = await asyncio.gather(tx.send(host, port, "v3", payload), rx.take("v3", 10))
    with got:
        assert bytes(got.data) == payload and got.checksum == sent.checksum == checksum(payload)


@pytest.mark.parametrize("where", ["payload", "trailer"])
async def test_corrupted_byte_in_v3_frame_detected(rx, where):
    host, port = rx.address
    payload = bytearray(os.urandom(3 * MiB))
    digest = bytes.fromhex(checksum(bytes(payload), "blake3").partition(":")[2])   # the frame says algo 1
    if where == "payload":
        payload[MiB + 17] ^= 0x40        # one bit flipped on the wire
    else:
        digest = digest[:-1] + bytes([digest[-1] ^ 1])
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(_v3_frame(b"flip", bytes(payload), digest))
    status = (await reader.readexactly(3))[0]
    writer.close()
    assert status == 4  # CHECKSUM
    assert rx.poll("flip") is TransferState.FAILED
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        await rx.take("flip", 1)
    assert rx.pool.allocated <= 4 * MiB  # the buffer went back to the pool


async def test_v3_frame_without_trailer_fails(rx):
    host, port = rx.address
    s = socket.create_connection((host, port))
    s.sendall(_v3_frame(b"notrailer", b"x" * 1000, b"\0" * 10))  # trailer cut short
    s.close()
    with pytest.raises(TransferError, match="short read"):
        await rx.take("notrailer", 5)


async def test_short_read_fails_not_partial(rx):
    """A sender that dies mid-payload: take() raises, never returns partial bytes."""
    host, port = rx.address
    s = socket.create_connection((host, port))
    tid = b"cut"
    s.sendall(HEADER.pack(MAGIC, 1, 1, len(tid), 1000, b"\0" * 32) + tid + b"x" * 10)
    s.close()
    with pytest.raises(TransferError, match="short read"):
        await rx.take("cut", 5)


async def test_stalled_sender_times_out_and_close_does_not_hang():
    """A sender that stops mid-payload but keeps the connection: FAILED after the stall
    timeout, buffer back; a receiver closed while a payload read is blocked closes at once."""
    r = TcpKVReceiver("127.0.0.1", 0, max_bytes=16 * MiB, timeout=0.5)
    host, port = await r.listen()
    stalled = []
    try:
        for tid in (b"stall", b"open"):
            s = socket.create_connection((host, port))
            s.sendall(HEADER.pack(MAGIC, 1, 1, len(tid), 4 * MiB, b"\0" * 32) + tid + b"x" * MiB)
            stalled.append(s)
        # the stall timeout (0.5 s) ends it with a short read, long before take()'s own 60 s
        with pytest.raises(TransferError, match="short read"):
            await r.take("stall", 60)
        assert r.pool.allocated <= 2 * size_class(4 * MiB)
        r.timeout = 600.0                 # the next read would block for 10 minutes
        s = socket.create_connection((host, port))
        s.sendall(HEADER.pack(MAGIC, 1, 1, 4, 4 * MiB, b"\0" * 32) + b"held" + b"x" * MiB)
        stalled.append(s)
        await until(lambda: r.poll("held") is TransferState.TRANSFERRING)
    finally:
        async with asyncio.timeout(60):   # a tenth of the blocked read's timeout: close did not wait for it
            await r.close()
        for s in stalled:
            s.close()


async def test_receiver_that_stops_reading_fails_the_sender_after_its_stall_timeout():
    srv = socket.create_server(("127.0.0.1", 0))   # accepts, never reads
    port = srv.getsockname()[1]
    t = TcpKVSender(timeout=0.5)
    payload = bytes(64 * MiB)                       # more than the socket buffers hold
    try:
        with pytest.raises(TransferError, match="stalled for 0.5s"):
            await t.send("127.0.0.1", port, "never-read", payload)
    finally:
        await t.close()
        srv.close()


async def test_dead_port_fails_fast():
    """Connection refused is reported at once, not after the connect timeout (60 s here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
    tx = TcpKVSender(timeout=5.0, connect_timeout=60.0)
    with pytest.raises(PeerUnavailable, match=f"cannot connect to 127.0.0.1:{port}"):
        async with asyncio.timeout(30):
            await tx.send("127.0.0.1", port, "nobody", b"x" * 100)


async def test_take_timeout_and_discard(rx, tx):
    with pytest.raises(TransferError, match="not received within"):
        await rx.take("never", 0.1)
    host, port = rx.address
    rx.discard("aborted")                        # request aborted before its KV arrived
    with pytest.raises(Discarded, match="discarded"):
        await tx.send(host, port, "aborted", b"kv")
    assert rx.pool.allocated <= size_class(2)


async def test_a_discarded_transfer_is_not_retried_on_another_path(rx, caplog):
    """The receiver dropped it on purpose (its request was aborted): the shm attempt's refusal
    was taken for a path's failure and the KV sent again over TCP."""
    from shared.transfer import DataPlaneSender
    sender = DataPlaneSender(TcpKVSender(timeout=5.0))
    host, port = rx.address
    assert (await sender.link(host, port)).source == "shm"
    rx.discard("gone")
    with pytest.raises(Discarded):
        await sender.send(host, port, "gone", os.urandom(MiB))
    assert "retrying on" not in caplog.text


async def test_an_aborted_request_s_received_kv_is_discarded(rx, tx):
    """The KV of a hand-off whose DecodeRequest never came (its sender was aborted between the
    bytes and the message: n>1 streams whose client left) is dropped when the Abort reaches the
    receiver's worker, not 120 s later: every transfer of the request for an abort of all its
    attempts, the older attempts' hand-offs for a fence; another request's stays."""
    from types import SimpleNamespace

    from shared.kv_connector import KVConnector
    host, port = rx.address
    for tid in ("r-0", "r-2", "r-cpu-decode-1-7", "rx-0", "q-0"):
        await tx.send(host, port, tid, tid.encode() * 1000)
    kv = SimpleNamespace(receiver=rx)
    assert KVConnector.discard_request(kv, "r", below=2) == ["r-0"]          # a fence: attempt 0 only
    assert sorted(KVConnector.discard_request(kv, "r")) == ["r-2", "r-cpu-decode-1-7"]   # every attempt, a move's
    assert sorted(rx.transfers()) == ["q-0", "rx-0"]   # (their buffers back in the pool, free)
    for tid in ("r-0", "r-2"):
        with pytest.raises(TransferError, match="discarded"):
            await rx.take(tid, 1)
    for tid in ("rx-0", "q-0"):
        with await rx.take(tid, 1) as p:
            assert bytes(p.data) == tid.encode() * 1000


async def test_a_connection_that_sends_no_frame_is_closed(rx, tx, monkeypatch):
    """A sender writes its frame as soon as it is connected; a connection that sends nothing is
    closed after FIRST_FRAME_S (it held a descriptor for the 300 s between-frames wait)."""
    import shared.transfer.tcp as tcp
    monkeypatch.setattr(tcp, "FIRST_FRAME_S", 0.3)
    host, port = rx.address
    loop = asyncio.get_running_loop()
    silent = socket.create_connection((host, port))
    silent.setblocking(False)
    try:
        async with asyncio.timeout(5):
            assert await loop.sock_recv(silent, 16) == b""     # closed by the receiver
    finally:
        silent.close()
    await tx.send(host, port, "after", b"kv")                   # a sender's frame still goes in
    with await rx.take("after", 1) as p:
        assert bytes(p.data) == b"kv"


async def test_a_first_frame_sent_byte_by_byte_is_still_due_within_its_deadline(rx, tx, monkeypatch):
    """FIRST_FRAME_S is a deadline from accept for the first frame's header, id and tag, not a wait
    between bytes: a peer sending a byte every 0.1 s (a 48-byte header) is closed after ~0.3 s."""
    import time

    import shared.transfer.tcp as tcp
    monkeypatch.setattr(tcp, "FIRST_FRAME_S", 0.3)
    host, port = rx.address
    loop = asyncio.get_running_loop()
    slow = socket.create_connection((host, port))
    slow.setblocking(False)
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(5):
            while True:
                try:
                    await loop.sock_sendall(slow, b"T")
                except OSError:
                    break                                      # reset: closed by the receiver
                try:
                    async with asyncio.timeout(0.1):
                        if await loop.sock_recv(slow, 16) == b"":
                            break                              # closed by the receiver
                except TimeoutError:
                    pass
                except OSError:
                    break      # reset: closed by the receiver with our last byte unread (a race with the send)
        assert time.monotonic() - t0 < 2.0
    finally:
        slow.close()
    await tx.send(host, port, "after-slow", b"kv")
    with await rx.take("after-slow", 1) as p:
        assert bytes(p.data) == b"kv"


async def test_connections_that_prove_nothing_give_way_to_new_ones(rx, tx, monkeypatch):
    """At most UNPROVEN connections wait on their first frame at once: a new one closes the oldest
    (counted as refused), so silent connections never lock a sender out."""
    import shared.transfer.tcp as tcp
    monkeypatch.setattr(tcp, "UNPROVEN", 3)
    host, port = rx.address
    loop = asyncio.get_running_loop()
    refused = rx.refused
    silent = []
    try:
        for _ in range(5):
            s = socket.create_connection((host, port))
            s.setblocking(False)
            silent.append(s)
            await asyncio.sleep(0.05)                      # accepted in this order
        async with asyncio.timeout(5):
            for s in silent[:2]:                           # the two oldest: closed
                assert await loop.sock_recv(s, 16) == b""
        assert rx.refused - refused == 2
        await tx.send(host, port, "after-silent", b"kv")   # the sender's connection closes the 3rd
        with await rx.take("after-silent", 1) as p:
            assert bytes(p.data) == b"kv"
    finally:
        for s in silent:
            s.close()


async def test_duplicate_transfer_id_refused(rx, tx):
    """A second frame under a transfer's id is refused while the first is held, and after it was
    taken (a replayed frame would be held for the TTL for no one)."""
    host, port = rx.address
    await tx.send(host, port, "dup", b"one")
    with pytest.raises(TransferError, match="already received"):
        await tx.send(host, port, "dup", b"two")
    with await rx.take("dup", 1) as p:
        assert bytes(p.data) == b"one"
    with pytest.raises(TransferError, match="already received and taken"):
        await tx.send(host, port, "dup", b"one")
    assert rx.transfers() == []


def test_buffer_pool_size_classes():
    assert size_class(1) == 64 * 1024
    for n in (65537, MiB, MiB + 1, 3 * MiB + 5, 64 * MiB):
        c = size_class(n)
        assert n <= c <= n * 1.25 + 1


async def test_buffer_pool_waits_then_evicts_free():
    pool = BufferPool(4 * MiB)
    a = await pool.acquire(2 * MiB)
    b = await pool.acquire(2 * MiB)
    waiter = asyncio.create_task(pool.acquire(3 * MiB))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    pool.release(a)
    pool.release(b)
    c = await waiter            # the two free 2 MiB buffers were dropped to make room
    assert len(c) >= 3 * MiB and pool.allocated <= 4 * MiB


def test_transport_from_settings():
    from shared.settings import DataPlaneSettings
    t = TcpTransport.from_settings(DataPlaneSettings(chunk_mb=2, max_pending_mb=64, timeout=3))
    assert t.name == "tcp" and t.receiver().pool.max_bytes == 64 * MiB


def test_header_layout_is_stable():
    assert HEADER.size == struct.calcsize("!4sBBHQ32s") == 48


# -- paths: shm, compressed tcp, selection by link, retry on another path ---------------------

def _shm_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("tandem-kv-")}


@pytest.mark.parametrize("mode", ["tcp", "tcp+zstd", "shm"])
@pytest.mark.parametrize("n", [1, 3 * MiB + 7], ids=["1B", "3MiB"])
async def test_every_path_is_byte_exact(rx, tx, mode, n):
    payload = os.urandom(n // 2) + bytes(n - n // 2)  # half noise, half compressible
    before = _shm_files()
    host, port = rx.address
    tid = f"{mode}-{n}"
    sent, got = await asyncio.gather(tx.send(host, port, tid, payload, mode=mode), rx.take(tid, 30))
    with got:
        assert bytes(got.data) == payload and got.checksum == sent.checksum == checksum(payload)
    assert sent.path == mode
    if mode == "tcp+zstd" and n > 1:
        assert sent.wire_bytes < n  # the zero half compresses
    assert _shm_files() == before  # the receiver unlinked the segment


async def test_a_send_cancelled_while_its_segment_is_written_leaves_no_file(rx, tx, monkeypatch):
    """A request aborted during its hand-off cancels the send while a thread writes the /dev/shm
    segment: the write goes on, and its file (a prompt's KV in RAM) is removed once it is done —
    nothing else knows its name (each such cancel left 120-175 MB for good)."""
    import threading

    import shared.transfer.tcp as tcp
    writing, go, written = threading.Event(), threading.Event(), threading.Event()

    def slow_write(data):
        writing.set()
        go.wait(5)
        try:
            return shm_write(data)
        finally:
            written.set()
    monkeypatch.setattr(tcp, "shm_write", slow_write)
    before = _shm_files()
    host, port = rx.address
    send = asyncio.create_task(tx.send(host, port, "cancelled", os.urandom(1 << 20), mode="shm"))
    await asyncio.to_thread(writing.wait, 5)
    send.cancel()
    with pytest.raises(asyncio.CancelledError):
        await send
    go.set()
    assert await asyncio.to_thread(written.wait, 5)     # (before it is written there is nothing to see)
    for _ in range(100):
        if _shm_files() == before:
            break
        await asyncio.sleep(0.02)
    assert _shm_files() == before


def test_segments_a_dead_sender_left_are_swept(tmp_path, monkeypatch):
    """``shm.sweep``: Tandem segments older than the age are removed (a sender killed mid-transfer
    left them in RAM across restarts); fresh ones, in flight, and other files stay."""
    from shared.transfer import shm
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    old, new, other = "tandem-kv-" + "a" * 32, "tandem-kv-" + "b" * 32, "tandem-kv-notours"
    for name in (old, new, other):
        (tmp_path / name).write_bytes(b"x" * 10)
    os.utime(tmp_path / old, (1000.0, 1000.0))
    os.utime(tmp_path / other, (1000.0, 1000.0))
    assert shm.sweep(900.0, now=1000.0 + 900) == (1, 10)
    assert sorted(os.listdir(tmp_path)) == sorted([new, other])


async def test_shm_segment_names_are_checked(rx):
    """A peer cannot make the receiver map an arbitrary file."""
    from shared.transfer.frames import EXTRA, F_SHM
    host, port = rx.address
    name = b"../../etc/passwd"
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(HEADER.pack(MAGIC, 2, 2, 3, len(name), b"\0" * 32) + b"bad" + EXTRA.pack(F_SHM, 100) + name)
    status = (await reader.readexactly(3))[0]
    writer.close()
    assert status != 0
    assert rx.poll("bad") is TransferState.PENDING  # nothing received; a retry may still come
    with pytest.raises(TransferError, match="not received"):
        await rx.take("bad", 0.5)


async def test_selector_uses_shm_on_same_host_and_retries_on_tcp(rx, monkeypatch):
    from shared.transfer import DataPlaneSender, shm
    sender = DataPlaneSender(TcpKVSender(timeout=5.0))
    host, port = rx.address
    link = await sender.link(host, port)
    assert link.same_host and link.source == "shm"
    payload = os.urandom(MiB)
    res, got = await asyncio.gather(sender.send(host, port, "a", payload), rx.take("a", 10))
    with got:
        assert res.path == "shm" and res.attempts == 1 and bytes(got.data) == payload

    def broken_map(name, n):  # e.g. another /dev/shm namespace: the segment is not visible
        raise OSError("No such file or directory")

    monkeypatch.setattr(shm, "shm_map", broken_map)
    before = _shm_files()
    res, got = await asyncio.gather(sender.send(host, port, "b", payload), rx.take("b", 10))
    with got:
        assert res.path == "tcp" and res.attempts == 2 and bytes(got.data) == payload
    assert _shm_files() == before  # the failed attempt's segment was removed


async def test_a_segment_the_sender_cannot_write_goes_over_tcp(rx, monkeypatch):
    """/dev/shm full, a file-size limit, no descriptor left: writing the segment is this sender's
    own failure — a TransferError, and the next path (a raw OSError reached the KV pool's get
    handler as an internal error with a traceback, and nothing went on TCP)."""
    from shared.transfer import DataPlaneSender, tcp
    sender = DataPlaneSender(TcpKVSender(timeout=5.0))
    host, port = rx.address

    def full(view):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tcp, "shm_write", full)
    payload = os.urandom(MiB)
    res, got = await asyncio.gather(sender.send(host, port, "c", payload), rx.take("c", 10))
    with got:
        assert res.path == "tcp" and res.attempts == 2 and bytes(got.data) == payload
    with pytest.raises(TransferError, match="No space left"):
        await TcpKVSender(timeout=5.0).send(host, port, "d", payload, mode="shm")


async def test_selector_probes_a_link_without_reported_speed(rx, monkeypatch):
    from shared.transfer import DataPlaneSender
    sender = DataPlaneSender(TcpKVSender(timeout=5.0), probe_bytes=MiB)
    sender.identity = "other-machine:other-boot"  # pretend to be another host
    monkeypatch.setattr("shared.transfer.select._interface_gbps_towards", lambda h, p: None)
    link = await sender.link(*rx.address)
    assert not link.same_host and link.source == "probe" and link.gbps > 0
    assert await sender.link(*rx.address) is link  # cached


async def test_dead_peer_is_reported_not_retried():
    from shared.transfer import DataPlaneSender
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(PeerUnavailable):
        await DataPlaneSender(TcpKVSender(connect_timeout=1.0)).send("127.0.0.1", port, "x", b"abc", mode="tcp")


# -- authentication (TANDEM_DATA_KEY) and bounds -----------------------------------------------

KEY = b"k" * 32


@pytest.fixture
async def keyed_rx():
    r = TcpKVReceiver("127.0.0.1", 0, max_bytes=64 * MiB, timeout=5.0, key=KEY)
    await r.listen()
    yield r
    await r.close()


@pytest.mark.parametrize("mode", ["tcp", "tcp+zstd", "shm"])
@pytest.mark.parametrize("known", [False, True], ids=["hashed-while-sent", "checksum-given"])
async def test_keyed_frames_are_byte_exact_on_every_path(keyed_rx, mode, known):
    tx = TcpKVSender(timeout=5.0, key=KEY)
    payload = os.urandom(3 * MiB) + bytes(MiB)
    tid = f"keyed-{mode}-{known}"
    try:
        host, port = keyed_rx.address
        sent, got = await asyncio.gather(
            tx.send(host, port, tid, payload, mode=mode, checksum=checksum(payload) if known else None),
            keyed_rx.take(tid, 30))
        with got.expect(sent.checksum, sent.nbytes):
            assert bytes(got.data) == payload
        assert keyed_rx.refused == 0
        assert await tx.hello(host, port, "me") == keyed_rx.identity   # control frames are tagged too
    finally:
        await tx.close()


@pytest.mark.parametrize("sender_key", [b"", b"another deployment's key"], ids=["no-key", "wrong-key"])
async def test_frames_without_the_key_are_refused_and_fail_nothing(keyed_rx, sender_key):
    from shared.transfer.base import NotAuthorized
    host, port = keyed_rx.address
    forger = TcpKVSender(timeout=5.0, key=sender_key)
    try:
        for mode in ("tcp", "tcp+zstd", "shm"):
            with pytest.raises(NotAuthorized, match="not authenticated"):
                await forger.send(host, port, "victim", os.urandom(MiB), mode=mode)
        with pytest.raises(NotAuthorized):
            await forger.hello(host, port, "me")
        from shared.transfer import DataPlaneSender
        with pytest.raises(NotAuthorized):   # the path selector does not retry a refusal on other paths
            await DataPlaneSender(forger).send(host, port, "victim", os.urandom(MiB), mode="tcp")
    finally:
        await forger.close()
    assert keyed_rx.refused == 5 and keyed_rx.pool.allocated == 0
    # the forged frames named a real transfer's id: it is untouched, the real one still arrives
    assert keyed_rx.poll("victim") is TransferState.PENDING
    tx = TcpKVSender(timeout=5.0, key=KEY)
    try:
        sent, got = await asyncio.gather(tx.send(host, port, "victim", b"the real KV"), keyed_rx.take("victim", 10))
        with got:
            assert bytes(got.data) == b"the real KV"
    finally:
        await tx.close()


async def test_a_frame_tagged_for_another_receiver_is_refused(keyed_rx):
    """The tag binds the receiver as dialled: a frame made for host:port A, replayed to B, is refused."""
    from shared.transfer.frames import F_AUTH, EXTRA, frame_tag
    host, port = keyed_rx.address
    header = HEADER.pack(MAGIC, 2, 1, 6, 5, bytes.fromhex(checksum(b"hello", "blake3")[7:])) \
        + b"replay" + EXTRA.pack(F_AUTH, 5)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(header + frame_tag(KEY, f"{host}:{port + 1}", header) + b"hello")
    status = (await reader.readexactly(3))[0]
    writer.close()
    assert status == 7 and keyed_rx.refused == 1   # UNAUTHORIZED
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(header + frame_tag(KEY, f"{host}:{port}", header) + b"hello")   # the same frame, for it
    status = (await reader.readexactly(3))[0]
    writer.close()
    assert status == 0
    with await keyed_rx.take("replay", 5) as got:
        assert bytes(got.data) == b"hello"


async def test_v3_trailer_tag_binds_the_digest(keyed_rx):
    """A tagged version-3 frame whose payload and trailer digest were both swapped (a man in the
    middle, without the key) fails its trailer tag."""
    from shared.transfer.frames import F_AUTH, EXTRA, frame_tag, trailer_tag
    host, port = keyed_rx.address
    real, fake = b"real payload", b"fake payload"
    header = HEADER.pack(MAGIC, 3, 1, 2, len(real), b"\0" * 32) + b"mi" + EXTRA.pack(F_AUTH, len(real))
    tag = frame_tag(KEY, f"{host}:{port}", header)
    real_digest = bytes.fromhex(checksum(real, "blake3")[7:])
    fake_digest = bytes.fromhex(checksum(fake, "blake3")[7:])
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(header + tag + fake + fake_digest + trailer_tag(KEY, tag, real_digest))
    status = (await reader.readexactly(3))[0]
    writer.close()
    assert status == 7
    with pytest.raises(TransferError, match="trailer's tag"):
        await keyed_rx.take("mi", 5)


async def test_payload_not_matching_its_handle_is_refused(rx, tx):
    """The bytes that arrived under an id are used only if they are what the handle (on the bus)
    announced: size and checksum."""
    host, port = rx.address
    await tx.send(host, port, "swapped", b"bytes someone else sent")
    got = await rx.take("swapped", 5)
    with pytest.raises(ChecksumError, match="announced"):
        got.expect(checksum(b"the bytes the handle names"), 23)
    await tx.send(host, port, "short", b"abc")
    got = await rx.take("short", 5)
    with pytest.raises(ChecksumError, match="announced 4 bytes"):
        got.expect(got.checksum, 4)


async def test_zstd_bomb_is_refused_within_the_declared_size(rx):
    """A compressed frame declaring 1 MiB whose bytes decompress to 256 MiB: refused once the
    declared size is full; the receiver held one pooled 1 MiB buffer, never the bomb."""
    import zstandard
    from shared.transfer.frames import EXTRA, F_ZSTD
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(256 * MiB))
    assert len(bomb) < MiB
    host, port = rx.address
    header = HEADER.pack(MAGIC, 2, 1, 4, len(bomb), b"\0" * 32) + b"bomb" + EXTRA.pack(F_ZSTD, MiB)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(header + bomb)
    status = (await reader.readexactly(3))[0]
    writer.close()
    assert status == 5   # FAILED
    with pytest.raises(TransferError, match="more than the 1048576 bytes"):
        await rx.take("bomb", 5)
    assert rx.pool.allocated <= size_class(MiB)


async def test_compressed_frames_take_their_buffers_from_the_budget():
    """A compressed frame's raw size counts against the receive budget like any payload."""
    r = TcpKVReceiver("127.0.0.1", 0, max_bytes=MiB, timeout=5.0)
    tx = TcpKVSender(timeout=5.0)
    host, port = await r.listen()
    try:
        with pytest.raises(TransferError, match="exceed"):
            await tx.send(host, port, "big-z", bytes(2 * MiB), mode="tcp+zstd")
        assert r.pool.allocated == 0
    finally:
        await tx.close()
        await r.close()


async def test_no_socket_left_in_this_process_is_a_transfer_error_not_a_crash(monkeypatch):
    """EMFILE when the sender opens its socket (this process's own limit: the peer is fine) is a
    TransferError — not a PeerUnavailable (the peer is not to blame), not a raw OSError (the KV
    pool's get handler logged it as an internal error with a traceback)."""
    from shared.transfer import tcp

    def no_fd(*a, **k):
        raise OSError(24, "Too many open files")
    monkeypatch.setattr(tcp.socket, "socket", no_fd)
    with pytest.raises(TransferError, match="Too many open files") as e:
        await TcpKVSender(timeout=1.0).send("127.0.0.1", 9, "t-emfile", b"x" * 10)
    assert not isinstance(e.value, PeerUnavailable)
