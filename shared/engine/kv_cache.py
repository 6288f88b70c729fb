"""The one KV layout of every backend, and the paged block manager over it.

Layout v1 (``KV_LAYOUT_VERSION``): one tensor per engine,

    kv[num_blocks, n_layers, 2, block_size, n_kv_heads, head_dim]   float16

``kv[b, l, 0]`` holds keys and ``kv[b, l, 1]`` values of layer ``l`` for the ``block_size``
token slots of block ``b``. Token ``t`` of a sequence lives in block ``block_table[t // block_size]``
at slot ``t % block_size``. Keys are stored after rotary embedding (Hugging Face's rotate-half
convention). One block is one contiguous run of bytes holding every layer, so a sequence's KV
serialises as its blocks in order (see ``docs/kv-layout.md``) and moves between devices as bytes.

Full blocks are content-addressed: the hash of a block chains the hash of the block before it
with the block's token ids, so two sequences with the same prefix share the same blocks.
A freed block keeps its hash until it is reused, so a later request can still find it.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass

import torch

KV_LAYOUT_VERSION = 1
KV_DTYPE = torch.float16


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

    @property
    def num_free(self) -> int:
        return len(self.free)

    def _take(self) -> int:
        b = self.free.popleft()
        old = self.hash_of[b]
        if old is not None and self.block_of.get(old) == b:
            del self.block_of[old]
        self.hash_of[b] = None
        self.ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free.append(b)

    def match_prefix(self, tokens: list[int], limit: int) -> list[int]:
        """Cached blocks holding the first full blocks of ``tokens`` (at most ``limit`` tokens)."""
        out: list[int] = []
        if not self.prefix_caching:
            return out
        parent = None
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
                self.free.remove(b)
            self.ref[b] += 1

    def blocks_needed(self, have: int, num_tokens: int) -> int:
        """Blocks to add to a table of ``have`` blocks so it holds ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, or None when they do not fit (nothing is taken then)."""
        if n > len(self.free):
            return None
        return [self._take() for _ in range(n)]

    def release(self, blocks: list[int], evict_first: bool = False) -> None:
        """Drop one reference on each block. Freed blocks keep their cached content until reused:
        normally they are reused last (least recently freed first); ``evict_first`` (batch
        sessions' KV: interactive KV stays hot) puts them at the front of the reuse queue."""
        if evict_first:
            for b in blocks:  # the tail ends up first in line: evicted before the shared head
                self.ref[b] -= 1
                if self.ref[b] == 0:
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
