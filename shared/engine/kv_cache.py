"""The one KV layout of every backend, and the paged block manager over it.

Layout v1 (``KV_LAYOUT_VERSION``): one tensor per engine,

    kv[num_blocks, n_layers, 2, block_size, n_kv_heads, head_dim]   float16

``kv[b, l, 0]`` holds keys and ``kv[b, l, 1]`` values of layer ``l`` for the ``block_size``
token slots of block ``b``. Token ``t`` of a sequence lives in block ``block_table[t // block_size]``
at slot ``t % block_size``. Keys are stored after rotary embedding (Hugging Face's rotate-half
convention). One block is one contiguous run of bytes holding every layer, so a sequence's KV
serialises as its blocks in order (see ``docs/kv-layout.md``) and moves between devices as bytes.

Full blocks are content-addressed: the hash of a block chains the hash of the block before it
with the block's token ids, so two sequences with the same prefix share the same blocks. The
first block chains its tenant's salt (``kvpool.keys.tenant_salt``; none for the public tenant):
tenants never share blocks.
A freed block keeps its hash until it is reused, so a later request can still find it.

``ChunkEvents`` watches the same cache at the KV pool's chunk granularity (``chunk_tokens``,
keyed like ``kvpool.keys.chunk_keys``): which chunks it holds whole, and which it lost.
"""

from __future__ import annotations

import hashlib
import struct
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

import orjson

from kvpool.keys import next_chunk_key, tenant_seed

KV_LAYOUT_VERSION = 1


def __getattr__(name: str):
    """``KV_DTYPE`` (torch.float16), imported on first use: the services that only read and write
    KV blobs (the gateway, the KV pool) never load torch."""
    if name == "KV_DTYPE":
        import torch
        return torch.float16
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class KVLayout:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int = 16

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.n_layers, 2, self.block_size, self.n_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * 2  # float16

    @property
    def token_bytes(self) -> int:
        return self.block_bytes // self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def to_dict(self) -> dict:
        return {"version": KV_LAYOUT_VERSION, "n_layers": self.n_layers, "n_kv_heads": self.n_kv_heads,
                "head_dim": self.head_dim, "block_size": self.block_size, "dtype": "float16"}

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        """The layout ``to_dict`` described; ValueError for another version or dtype."""
        if d.get("version") != KV_LAYOUT_VERSION or d.get("dtype") != "float16":
            raise ValueError(f"unsupported KV layout {d!r} (this build reads version {KV_LAYOUT_VERSION}, float16)")
        try:
            return cls(int(d["n_layers"]), int(d["n_kv_heads"]), int(d["head_dim"]), int(d["block_size"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad KV layout {d!r}: {e}") from None


# ---- a sequence's KV as one blob (hand-off, migration, resume) -----------------------------

KV_BLOB_MAGIC = b"TKVB"        # a KV blob; the data plane's frames have their own magic
KV_BLOB_VERSION = 2            # 1: the untyped header with torch RNG bytes (before position-keyed sampling)
_BLOB_PREFIX = struct.Struct("<4sHI")   # magic, version, header length


@dataclass
class KVBlobHeader:
    """Everything an engine needs to continue a sequence somewhere else, besides its KV bytes.

    Blob = ``magic "TKVB" | u16 version | u32 header length | header (JSON) | KV``, the KV being
    the sequence's first ``kv_blocks`` blocks in ``layout`` (``read_blocks`` order). The sampler
    keeps no hidden state: seeded draws are keyed by (seed, output index) (``sampler.draw``), so
    the seed and the tokens so far rebuild it exactly; grammar state is rebuilt by replaying the
    output tokens into a fresh matcher."""
    layout: dict                 # KVLayout.to_dict() of the KV that follows
    model: str                   # model identity (loader): KV of another model is refused
    request_id: str
    token_ids: list[int]         # prompt + output so far
    num_prompt_tokens: int
    num_computed: int            # tokens whose KV follows (the newest token is computed by the next step)
    num_cached_tokens: int       # prompt tokens the request reused from a cache (usage.cached_tokens)
    params: dict                 # SamplingParams.to_dict(), seed included
    priority: int                # scheduler priority (lower first)
    kv_blocks: int               # blocks of KV after the header
    detok: list = field(default_factory=list)  # [prefix_offset, read_offset, output_text, emitted_chars]
    tenant: str = ""             # the request's tenant (its block hashes are salted with it)
    session: str = ""            # its session id ("" none): its KV stays resident between turns
    retention: str = ""          # its prompt_cache_retention ("" | in_memory | 24h)
    pooled: int = 0              # leading tokens whose whole pool chunks are in the pool: cached where the
                                 # request came, or written back by the sender (a prefill's hand-off)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def pack(self, kv) -> bytes:
        """The blob: this header followed by ``kv`` (bytes-like, ``kv_blocks`` blocks)."""
        header = orjson.dumps(asdict(self))
        return b"".join([_BLOB_PREFIX.pack(KV_BLOB_MAGIC, KV_BLOB_VERSION, len(header)), header, kv])

    @classmethod
    def parse(cls, blob) -> tuple["KVBlobHeader", memoryview]:
        """(header, KV bytes) of a blob; ValueError naming what is wrong (magic, version, size)."""
        mv = memoryview(blob).cast("B")
        if mv.nbytes < _BLOB_PREFIX.size:
            raise ValueError(f"KV blob of {mv.nbytes} bytes is shorter than its prefix")
        magic, version, hlen = _BLOB_PREFIX.unpack(mv[:_BLOB_PREFIX.size])
        if magic != KV_BLOB_MAGIC:
            raise ValueError(f"not a Tandem KV blob (magic {bytes(magic)!r})")
        if version != KV_BLOB_VERSION:
            raise ValueError(f"KV blob version {version} not supported (this build reads {KV_BLOB_VERSION})")
        end = _BLOB_PREFIX.size + hlen
        try:
            d = orjson.loads(mv[_BLOB_PREFIX.size:end])
            h = cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})
        except (orjson.JSONDecodeError, TypeError) as e:
            raise ValueError(f"corrupt KV blob header: {e}") from None
        want = end + h.kv_blocks * KVLayout.from_dict(h.layout).block_bytes
        if mv.nbytes != want:
            raise ValueError(f"KV blob is {mv.nbytes} bytes, its header says {want}")
        return h, mv[end:]


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """Content hash of a full block: chains the previous block's hash with this block's tokens."""
    h = hashlib.blake2b(digest_size=16)
    if parent:
        h.update(parent)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


class BlockManager:
    """Hands out KV blocks; shares full blocks between sequences with the same prefix."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.block_of: dict[bytes, int] = {}
        self.free: deque[int] = deque(range(num_blocks))  # oldest-freed first: cached blocks live longest
        self.on_uncache: Callable[[bytes], None] | None = None  # a hash left the cache (its block reused)
        # free blocks resident sessions hold between turns (retention.py): not in ``free``, taken
        # only once it is empty; None: no session retention
        self.resident = None

    @property
    def num_free(self) -> int:
        return len(self.free) + (self.resident.held_free if self.resident is not None else 0)

    def _take(self) -> int:
        while not self.free:   # only resident sessions' blocks left: spill one (retention.py)
            if not self.resident.evict():
                raise RuntimeError("no free KV block although num_free counted one")
        b = self.free.popleft()
        old = self.hash_of[b]
        if old is not None and self.block_of.get(old) == b:
            del self.block_of[old]
            if self.on_uncache is not None:
                self.on_uncache(old)
        self.hash_of[b] = None
        self.ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0 and not self._held(b):
            self.free.append(b)

    def _held(self, b: int) -> bool:
        """``b`` just became free: True when a resident session holds it (kept out of ``free``)."""
        return self.resident is not None and self.resident.hold_freed(b)

    def match_prefix(self, tokens: list[int], limit: int, salt: bytes = b"") -> list[int]:
        """Cached blocks holding the first full blocks of ``tokens`` (at most ``limit`` tokens)
        of the tenant whose salt is ``salt``."""
        out: list[int] = []
        if not self.prefix_caching:
            return out
        parent = salt or None
        bs = self.block_size
        for i in range(min(limit, len(tokens)) // bs):
            parent = block_hash(parent, tokens[i * bs:(i + 1) * bs])
            b = self.block_of.get(parent)
            if b is None:
                break
            out.append(b)
        return out

    def acquire_cached(self, blocks: list[int]) -> None:
        """Take references on blocks found by ``match_prefix``."""
        for b in blocks:
            if self.ref[b] == 0:
                if self.resident is not None and self.resident.is_held(b):
                    self.resident.take_back(b)
                else:
                    self.free.remove(b)
            self.ref[b] += 1

    def blocks_needed(self, have: int, num_tokens: int) -> int:
        """Blocks to add to a table of ``have`` blocks so it holds ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, or None when they do not fit (nothing is taken then)."""
        if n > self.num_free:
            return None
        return [self._take() for _ in range(n)]

    def release(self, blocks: list[int], evict_first: bool = False) -> None:
        """Drop one reference on each block. Freed blocks keep their cached content until reused:
        normally they are reused last (least recently freed first); ``evict_first`` (batch
        sessions' KV: interactive KV stays hot) puts them at the front of the reuse queue."""
        if evict_first:
            for b in blocks:  # the tail ends up first in line: evicted before the shared head
                self.ref[b] -= 1
                if self.ref[b] == 0 and not self._held(b):
                    self.free.appendleft(b)
            return
        for b in reversed(blocks):  # the tail is least likely to be shared: free it first
            self._release(b)

    def register_full(self, block: int, parent: bytes | None, tokens: list[int]) -> bytes:
        """Record the content hash of a block that just became full; return the hash."""
        h = block_hash(parent, tokens)
        self.adopt(block, h)
        return h

    def adopt(self, block: int, h: bytes) -> None:
        """Record that ``block`` holds the full block whose content hash is ``h``."""
        if self.prefix_caching and self.hash_of[block] is None:
            self.hash_of[block] = h
            self.block_of.setdefault(h, block)


class ChunkEvents:
    """The chunks (``chunk_tokens`` tokens, a multiple of the block size) the prefix cache holds
    whole, as chunk keys: ``note`` a token sequence whose leading blocks are cached to record
    its complete chunks ("stored"); a block of a recorded chunk leaving the cache drops the
    chunk ("evicted"). ``take`` returns the net changes since the last call."""

    def __init__(self, blocks: BlockManager, seed: bytes, chunk_tokens: int):
        if chunk_tokens % blocks.block_size:
            raise ValueError(f"chunk_tokens {chunk_tokens} must be a multiple of the block size {blocks.block_size}")
        self.blocks = blocks
        self.seed = seed                  # the key scope's seed (kvpool.keys.KeyScope.seed())
        self.chunk_tokens = chunk_tokens
        self.per_chunk = chunk_tokens // blocks.block_size
        self.held: dict[bytes, tuple[bytes, tuple[bytes, ...]]] = {}  # last block hash -> (key, block hashes)
        self.chunk_of: dict[bytes, bytes] = {}   # block hash of a held chunk -> the chunk's last block hash
        self.changes: dict[str, bool] = {}       # key hex -> stored (True) / evicted (False), net
        self._seen: dict[str, tuple[list[int], int]] = {}  # request id -> (block table, chunks noted)
        blocks.on_uncache = self._uncached

    def note(self, token_ids: list[int], hashes: list[bytes], first: int = 0, tenant: str = "") -> int:
        """Record the complete chunks from chunk ``first`` of a sequence of ``tenant`` whose block
        hashes are ``hashes`` (in order); returns how many chunks ``hashes`` covers."""
        k, c, cached = self.per_chunk, self.chunk_tokens, self.blocks.block_of
        n = len(hashes) // k
        parent = None
        for i in range(first, n):
            last = hashes[(i + 1) * k - 1]
            got = self.held.get(last)
            if got is not None:
                parent = got[0]
                continue
            if parent is None:  # the key of chunk i - 1: held, or chained from the seed
                prev = self.held.get(hashes[i * k - 1]) if i else None
                parent = prev[0] if prev else self._key_before(token_ids, i, tenant)
            key = next_chunk_key(parent, token_ids[i * c:(i + 1) * c])
            own = tuple(hashes[i * k:(i + 1) * k])
            if all(h in cached for h in own):
                self.held[last] = (key, own)
                for h in own:
                    self.chunk_of[h] = last
                self.changes[key.hex()] = True
            parent = key
        return n

    def note_seq(self, seq) -> None:
        """``note`` a running sequence, from the first chunk not recorded for its block table."""
        table, done = self._seen.get(seq.request_id, (None, 0))
        if table is not seq.block_table:  # new blocks (scheduled, swapped in, imported): check all
            done = 0
        if len(seq.block_hashes) >= (done + 1) * self.per_chunk:
            done = self.note(seq.token_ids, seq.block_hashes, done, seq.tenant)
        self._seen[seq.request_id] = (seq.block_table, done)

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)

    def take(self) -> tuple[list[str], list[str]]:
        """(stored, evicted) chunk keys since the last call; a key appears once, in its last state."""
        if not self.changes:
            return [], []
        changes, self.changes = self.changes, {}
        return [k for k, v in changes.items() if v], [k for k, v in changes.items() if not v]

    def _key_before(self, token_ids: list[int], i: int, tenant: str) -> bytes:
        key = tenant_seed(self.seed, tenant)
        for j in range(i):
            key = next_chunk_key(key, token_ids[j * self.chunk_tokens:(j + 1) * self.chunk_tokens])
        return key

    def _uncached(self, h: bytes) -> None:
        last = self.chunk_of.get(h)
        if last is None:
            return
        key, own = self.held.pop(last)
        for b in own:
            self.chunk_of.pop(b, None)
        self.changes[key.hex()] = False
