"""Pool entries: one chunk's KV, compressed, with a header, a checksum and a MAC.

Entry layout (the same bytes in RAM, on disk and on the wire)::

    header  <4sBBHQQ32s32s32s  magic b"TKVP", version 2, codec id, 0, raw bytes, payload bytes,
                               key (32-byte digest), blake3(payload), MAC
    payload codec output

MAC = HMAC-SHA256(deployment secret, the header before it): it binds the key, the codec, the
sizes and (through the checksum) the payload. The secret (TANDEM_POOL_KEY, docs/security.md) is
the workers': they write and check it; the pool service only checks the checksum. A writer
without the secret cannot make an entry a worker loads: ``decode_entry`` with the secret raises
``ForgedEntry`` for it.

Codecs (``CODECS``):
- ``raw`` (id 3, lossless, the default for a pool on local disk): the KV bytes as they are. Real
  KV compresses poorly (``shuffle-zstd`` saves ~13 %) while zstd decodes at a few hundred MB/s;
  uncompressed, a warm read is a checksum (~10 GB/s) and one copy into place.
- ``shuffle-zstd`` (id 1, lossless, the default where a Redis or shared tier makes bytes cost
  more): float16 values split into two byte planes (all low bytes, then all high bytes; the
  high bytes — sign and exponent — repeat a lot), then zstd. Decodes to exactly the input bytes.
- ``int8-zstd`` (id 2, opt-in, lossy): keys quantised to int8 with one scale per channel
  (layer, head, dim) over the chunk's tokens, values with one scale per token (layer, token,
  head), then zstd. Decodes to float16 KV in the same block layout, close but not equal.

``decode_entry`` checks magic, sizes and checksum before decoding: a corrupt or truncated
entry raises ``CorruptEntry`` — it is never turned into wrong KV.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct
from dataclasses import dataclass

import blake3
import numpy as np
import zstandard

MAGIC = b"TKVP"
VERSION = 2                    # 1: no MAC
HEADER = struct.Struct("<4sBBHQQ32s32s32s")
_SIGNED = HEADER.size - 32     # the MAC covers the header before it
_NO_MAC = bytes(32)            # written without a secret
LOSSLESS, LOSSY, RAW = "shuffle-zstd", "int8-zstd", "raw"
_IDS = {LOSSLESS: 1, LOSSY: 2, RAW: 3}
_NAMES = {v: k for k, v in _IDS.items()}
CODECS = tuple(_IDS)
_SHAPE = struct.Struct("<4I")  # lossy payload: n_layers, tokens, n_kv_heads, head_dim


class CorruptEntry(ValueError):
    """An entry whose bytes do not check out (bad magic, size or checksum): treat as a miss."""


class ForgedEntry(CorruptEntry):
    """An entry whose MAC does not check out: written without the deployment's secret."""


@dataclass(frozen=True)
class ChunkShape:
    """How a chunk's raw KV bytes are laid out: ``blocks`` KV blocks of layout v1."""
    n_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int

    @classmethod
    def from_layout(cls, layout: dict) -> "ChunkShape":
        return cls(layout["n_layers"], layout["n_kv_heads"], layout["head_dim"], layout["block_size"])

    @property
    def token_bytes(self) -> int:
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * 2


class Codec:
    """Encodes chunk KV to entries; ``threads`` zstd threads (compression only); ``secret``: the
    MAC key (empty: no MAC)."""

    def __init__(self, name: str = LOSSLESS, level: int = 1, threads: int = 2, secret: bytes = b""):
        if name not in _IDS:
            raise ValueError(f"unknown codec {name!r}: expected one of {', '.join(CODECS)}")
        self.name = name
        self.level = level
        self.threads = threads
        self.secret = secret

    @property
    def lossless(self) -> bool:
        return self.name != LOSSY

    def encode(self, key: str, raw, shape: ChunkShape | None = None) -> bytes:
        """Entry for ``raw`` (float16 KV bytes); the lossy codec needs the chunk ``shape``."""
        raw = memoryview(raw).cast("B")
        if raw.nbytes % 2:
            raise ValueError(f"KV bytes must be float16 (an even count), got {raw.nbytes}")
        if self.name == RAW:
            payload = raw
        else:
            if self.name == LOSSLESS:
                body = _shuffle(raw)
            elif shape is None:
                raise ValueError("the int8 codec needs the chunk shape")
            else:
                body = _quantize(raw, shape)
            cctx = zstandard.ZstdCompressor(level=self.level, threads=self.threads if len(body) > 1 << 20 else 0)
            payload = cctx.compress(body)
        digest = blake3.blake3(payload).digest()
        head = HEADER.pack(MAGIC, VERSION, _IDS[self.name], 0, raw.nbytes, len(payload), bytes.fromhex(key), digest,
                           _NO_MAC)[:_SIGNED]
        return head + (_mac(self.secret, head) if self.secret else _NO_MAC) + payload


def _mac(secret: bytes, signed) -> bytes:
    return hmac.new(secret, signed, hashlib.sha256).digest()


def entry_info(data) -> tuple[str, str, int, int]:
    """(key, codec name, raw bytes, entry bytes) from an entry's header; CorruptEntry if bad."""
    mv = memoryview(data)
    if mv.nbytes < HEADER.size:
        raise CorruptEntry(f"entry of {mv.nbytes} bytes is shorter than its header")
    magic, version, cid, _, raw_n, pay_n, key, _, _ = HEADER.unpack(mv[:HEADER.size])
    if magic != MAGIC or version != VERSION or cid not in _NAMES:
        raise CorruptEntry("not a pool entry (bad magic, version or codec)")
    return key.hex(), _NAMES[cid], raw_n, HEADER.size + pay_n


def decode_entry(data, key: str | None = None, secret: bytes = b"") -> bytes:
    """Raw float16 KV bytes of an entry; CorruptEntry when it does not check out, ForgedEntry
    when its MAC does not (with a ``secret``)."""
    _, _, raw_n, _ = entry_info(data)
    out = bytearray(raw_n)
    decode_entry_into(data, out, key, secret)
    return bytes(out)


def decode_entry_into(data, out, key: str | None = None, secret: bytes = b"") -> None:
    """Decode an entry straight into ``out`` (a writable buffer of exactly its raw size: a
    slice of the destination, so a raw entry costs one copy, a shuffle-zstd one one decompression
    and one pass that interleaves the byte planes into place); CorruptEntry when it does not check out,
    ForgedEntry when its MAC does not (with a ``secret``)."""
    mv = memoryview(data)
    verify_parts(mv[:HEADER.size], mv[HEADER.size:], key, secret)
    _, name, raw_n, _ = entry_info(mv)
    dst = memoryview(out).cast("B")
    if dst.nbytes != raw_n:
        raise CorruptEntry(f"entry holds {raw_n} raw bytes, its destination {dst.nbytes}")
    if name == RAW:
        if mv.nbytes - HEADER.size != raw_n:
            raise CorruptEntry(f"raw entry holds {mv.nbytes - HEADER.size} bytes, header says {raw_n}")
        dst[:] = mv[HEADER.size:]
        return
    try:
        body = zstandard.ZstdDecompressor().decompress(mv[HEADER.size:], max_output_size=raw_n + (1 << 20))
    except zstandard.ZstdError as e:
        raise CorruptEntry(f"entry does not decompress: {e}") from None
    if name == LOSSLESS:
        if len(body) != raw_n:
            raise CorruptEntry(f"entry decodes to {len(body)} bytes, header says {raw_n}")
        _unshuffle_into(body, dst)
    else:
        raw = _dequantize(body)
        if len(raw) != raw_n:
            raise CorruptEntry(f"entry decodes to {len(raw)} bytes, header says {raw_n}")
        dst[:] = raw


# -- lossless: byte planes --------------------------------------------------------------------

def _shuffle(raw: memoryview) -> bytes:
    a = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 2)
    return a.T.tobytes()  # [2, n]: every low byte, then every high byte


def _unshuffle_into(body: bytes, dst: memoryview) -> None:
    planes = np.frombuffer(body, dtype=np.uint8).reshape(2, -1)
    np.copyto(np.frombuffer(dst, dtype=np.uint8).reshape(-1, 2), planes.T)


# -- lossy: int8, per-channel K, per-token V ---------------------------------------------------

def _quantize(raw: memoryview, s: ChunkShape) -> bytes:
    tokens = raw.nbytes // s.token_bytes
    if tokens * s.token_bytes != raw.nbytes or tokens % s.block_size:
        raise ValueError(f"{raw.nbytes} bytes are not whole KV blocks of {s}")
    x = np.frombuffer(raw, dtype=np.float16).reshape(
        tokens // s.block_size, s.n_layers, 2, s.block_size, s.n_kv_heads, s.head_dim)
    x = x.transpose(1, 2, 0, 3, 4, 5).reshape(s.n_layers, 2, tokens, s.n_kv_heads, s.head_dim).astype(np.float32)
    k, v = x[:, 0], x[:, 1]                                   # [L, T, H, D]
    k_scale = np.abs(k).max(axis=1, keepdims=True) / 127.0    # [L, 1, H, D]: per channel
    v_scale = np.abs(v).max(axis=3, keepdims=True) / 127.0    # [L, T, H, 1]: per token
    k_scale[k_scale == 0] = 1.0
    v_scale[v_scale == 0] = 1.0
    kq = np.rint(k / k_scale).astype(np.int8)
    vq = np.rint(v / v_scale).astype(np.int8)
    return b"".join((_SHAPE.pack(s.n_layers, tokens, s.n_kv_heads, s.head_dim) + _SHAPE.pack(s.block_size, 0, 0, 0),
                     k_scale.astype(np.float32).tobytes(), v_scale.astype(np.float32).tobytes(),
                     kq.tobytes(), vq.tobytes()))


def _dequantize(body: bytes) -> bytes:
    n_layers, tokens, heads, dim = _SHAPE.unpack_from(body, 0)
    (block, *_) = _SHAPE.unpack_from(body, _SHAPE.size)
    off = 2 * _SHAPE.size
    sizes = [n_layers * heads * dim * 4, n_layers * tokens * heads * 4,
             n_layers * tokens * heads * dim, n_layers * tokens * heads * dim]
    if off + sum(sizes) != len(body) or not block or tokens % block:
        raise CorruptEntry("int8 entry body has the wrong size")
    parts = []
    for n in sizes:
        parts.append(body[off:off + n])
        off += n
    k_scale = np.frombuffer(parts[0], dtype=np.float32).reshape(n_layers, 1, heads, dim)
    v_scale = np.frombuffer(parts[1], dtype=np.float32).reshape(n_layers, tokens, heads, 1)
    k = np.frombuffer(parts[2], dtype=np.int8).reshape(n_layers, tokens, heads, dim) * k_scale
    v = np.frombuffer(parts[3], dtype=np.int8).reshape(n_layers, tokens, heads, dim) * v_scale
    x = np.stack([k, v], axis=1).astype(np.float16)            # [L, 2, T, H, D]
    x = x.reshape(n_layers, 2, tokens // block, block, heads, dim).transpose(2, 0, 1, 3, 4, 5)
    return np.ascontiguousarray(x).tobytes()


def verify_entry(data, key: str | None = None) -> None:
    """Check an entry's header, size and checksum without decoding it; CorruptEntry if bad."""
    mv = memoryview(data)
    verify_parts(mv[:HEADER.size], mv[HEADER.size:], key)


def verify_parts(head, payload, key: str | None = None, secret: bytes = b"") -> None:
    """``verify_entry`` (and with a ``secret`` the MAC: ForgedEntry) for an entry held as its
    header and its payload apart — a raw payload read from a file straight into its destination."""
    head, payload = memoryview(head), memoryview(payload).cast("B")
    got_key, _, _, total = entry_info(head)
    if key is not None and got_key != key:
        at = next((i for i, (a, b) in enumerate(zip(got_key, key)) if a != b), min(len(got_key), len(key)))
        raise CorruptEntry(f"entry holds key {got_key[:16]}…, expected {key[:16]}… (they differ from "
                           f"character {at}: {got_key[at:at + 8]!r} against {key[at:at + 8]!r})")
    if head.nbytes != HEADER.size or HEADER.size + payload.nbytes != total:
        raise CorruptEntry(f"entry is {head.nbytes + payload.nbytes} bytes, header says {total} (truncated?)")
    if blake3.blake3(payload).digest() != bytes(head[_SIGNED - 32:_SIGNED]):
        raise CorruptEntry("entry checksum mismatch")
    if secret and not hmac.compare_digest(_mac(secret, head[:_SIGNED]), head[_SIGNED:]):
        raise ForgedEntry("entry MAC does not check out: not written with this deployment's TANDEM_POOL_KEY "
                          "(another key's — was it changed? — or altered since)")


def open_entry(path: str):
    """The entry file at ``path`` opened for reading (unbuffered), or CorruptEntry when it is no
    regular file: a FIFO, a device or a socket put in its place would block a reader thread in
    ``open`` or ``read`` for good (opened non-blocking, checked with fstat, then read as usual)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptEntry("not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def read_entry_into(path: str, out, key: str, secret: bytes = b"") -> None:
    """Decode the entry in file ``path`` into ``out`` (like ``decode_entry_into``); a raw entry's
    payload is read from the file straight into ``out`` (the page cache's one copy) and verified
    there. OSError when the file cannot be read, CorruptEntry / ForgedEntry as for an entry."""
    with open_entry(path) as f:
        head = f.read(HEADER.size)
        _, name, raw_n, total = entry_info(head)
        if name != RAW:
            decode_entry_into(head + f.read(), out, key, secret)
            return
        dst = memoryview(out).cast("B")
        if dst.nbytes != raw_n or total != HEADER.size + raw_n:
            raise CorruptEntry(f"entry holds {raw_n} raw bytes, its destination {dst.nbytes}")
        got = 0
        while got < raw_n and (n := f.readinto(dst[got:])):
            got += n
        if got < raw_n or f.read(1):
            raise CorruptEntry(f"entry file {path} does not hold the {total} bytes its header says (truncated?)")
        verify_parts(head, dst, key, secret)


# -- bundles: several entries in one data-plane payload ----------------------------------------

_COUNT = struct.Struct("<I")


def pack_entries(entries: list) -> bytes:
    """``u32 count, u64 size × count, entries`` — one payload for one transfer."""
    sizes = [memoryview(e).nbytes for e in entries]
    return b"".join([_COUNT.pack(len(entries)), struct.pack(f"<{len(sizes)}Q", *sizes), *entries])


def unpack_entries(data) -> list[memoryview]:
    """The entries of a bundle (views into ``data``); CorruptEntry when sizes do not add up."""
    mv = memoryview(data)
    if mv.nbytes < _COUNT.size:
        raise CorruptEntry("bundle shorter than its count")
    (n,) = _COUNT.unpack(mv[:_COUNT.size])
    off = _COUNT.size + 8 * n
    if mv.nbytes < off:
        raise CorruptEntry(f"bundle of {mv.nbytes} bytes cannot hold {n} sizes")
    sizes = struct.unpack(f"<{n}Q", mv[_COUNT.size:off])
    if off + sum(sizes) != mv.nbytes:
        raise CorruptEntry(f"bundle is {mv.nbytes} bytes, its sizes say {off + sum(sizes)}")
    out = []
    for size in sizes:
        out.append(mv[off:off + size])
        off += size
    return out
