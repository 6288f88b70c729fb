"""The compressed path: zstd on the wire when the link is slower than the codec
(``link.choose_paths``). The sender compresses beside hashing the raw bytes; the receiver
decompresses into a buffer of exactly the declared raw size (never more: ``max_output_size``)
and verifies the raw bytes' digest."""

from __future__ import annotations

import zstandard

from shared.transfer.base import TransferError
from shared.transfer.frames import check_digest, digest_of, recv_bytes

MiB = 1 << 20


def compress(view: memoryview) -> bytes:
    return zstandard.ZstdCompressor(level=1, threads=2 if view.nbytes > MiB else 0).compress(view)


def decompress(wire, raw_n: int) -> bytearray:
    out = zstandard.ZstdDecompressor().decompress(wire, max_output_size=raw_n)
    if len(out) != raw_n:
        raise zstandard.ZstdError(f"decompressed to {len(out)} bytes, header says {raw_n}")
    return bytearray(out)



async def read(rx, loop, conn, tid: str, nbytes: int, raw_n: int, algo: str, digest: bytes):
    """Compressed payload: receive, decompress (in a thread), verify the raw bytes."""
    wire = await recv_bytes(loop, conn, tid, nbytes, rx.timeout)
    try:
        raw = await loop.run_in_executor(rx.io, decompress, wire, raw_n)
    except zstandard.ZstdError as e:
        raise TransferError(f"payload does not decompress: {e}", tid) from None
    got = await loop.run_in_executor(rx.io, digest_of, algo, raw)
    check_digest(tid, algo, got, digest)
    return memoryview(raw), got, None

