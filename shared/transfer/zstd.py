"""The compressed path: zstd on the wire when the link is slower than the codec
(``link.choose_paths``). The sender compresses beside hashing the raw bytes; the receiver
decompresses as the compressed bytes arrive (a worker thread reading the socket) straight into
a pooled buffer of exactly the declared raw size, then verifies the raw bytes' digest.

Nothing a peer sends makes the receiver hold more than that: the compressed bytes pass through
``READ_BYTES`` at a time, the output never grows past the declared size (a frame that would
decompress to more is refused: no decompression bomb) and the decoder's window is capped
(``MAX_WINDOW``; the sender's level-1 frames use 512 KiB).
"""

from __future__ import annotations

import socket

import zstandard

from shared.transfer.base import TransferError
from shared.transfer.frames import check_digest, digest_of, in_thread

MiB = 1 << 20
READ_BYTES = MiB          # compressed bytes per socket read
MAX_WINDOW = 8 * MiB      # largest zstd window a frame may ask the receiver for


def compress(view: memoryview) -> bytes:
    return zstandard.ZstdCompressor(level=1, threads=2 if view.nbytes > MiB else 0).compress(view)


class _Wire:
    """File-like reader of exactly ``nbytes`` from a blocking socket (zstd's stream reader pulls from it)."""

    def __init__(self, sock: socket.socket, nbytes: int):
        self.sock, self.left = sock, nbytes

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left, READ_BYTES)
        if n == 0:
            return b""
        data = self.sock.recv(n)
        if not data:
            raise ConnectionError(f"connection closed with {self.left} compressed bytes to come")
        self.left -= len(data)
        return data


def blocking_inflate(sock: socket.socket, nbytes: int, out: memoryview, stall: float) -> None:
    """Decompress the ``nbytes`` compressed bytes arriving on ``sock`` into ``out`` (worker thread);
    ValueError unless they decompress to exactly ``out.nbytes`` bytes."""
    sock.settimeout(stall)
    wire = _Wire(sock, nbytes)
    reader = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).stream_reader(wire, read_size=READ_BYTES)
    got = 0
    try:
        while got < out.nbytes:
            k = reader.readinto(out[got:])
            if k == 0:
                raise ValueError(f"decompressed to {got} bytes, the header says {out.nbytes}")
            got += k
        if reader.read(1):
            raise ValueError(f"decompresses to more than the {out.nbytes} bytes the header says")
    except zstandard.ZstdError as e:
        raise ValueError(str(e)) from None
    if wire.left:
        raise ValueError(f"{wire.left} compressed bytes after the end of the zstd frame")


async def read(rx, loop, conn, tid: str, nbytes: int, raw_n: int, algo: str, digest: bytes):
    """Compressed payload: decompress as it arrives into a pooled buffer, verify the raw bytes."""
    buf = await rx.buffer(raw_n, tid) if raw_n else bytearray()
    view = memoryview(buf)[:raw_n]
    try:
        try:
            await in_thread(rx.io, conn, blocking_inflate, nbytes, view, rx.timeout)
        except (ConnectionError, TimeoutError) as e:
            raise TransferError(f"short read: {e}", tid) from None
        except ValueError as e:
            raise TransferError(f"payload does not decompress: {e}", tid) from None
        got = await loop.run_in_executor(rx.io, digest_of, algo, view)
        check_digest(tid, algo, got, digest)
    except TransferError:
        rx.give_back(view, buf)
        raise
    return view, got, rx.release_of(buf, raw_n)
