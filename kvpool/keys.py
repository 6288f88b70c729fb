"""Chunk keys: a prompt cut into fixed chunks, each keyed by a rolling hash of its whole prefix.

    scope  = blake3("tandem-kvpool" | model identity | KV layout | chunk size | tenant salt)
    key[0] = blake3(scope  ‖ token ids of chunk 0)        (token ids as u32 little endian)
    key[i] = blake3(key[i-1] ‖ token ids of chunk i)

A prompt's **tail** — the whole KV blocks after its last full chunk — has a key of its own,
``tail_key`` = blake3(last chunk key ‖ "tail" ‖ its token ids): an entry
under it is used only by a prompt with exactly those tail tokens (a repeated prompt then computes
its last block only). Whole chunks stay what diverging prompts share.

Equal prefixes give equal chains of keys; a different model, KV layout, chunk size or tenant
gives a different scope and so never shares an entry. Keys are 32-byte digests, written as hex.

A request's tenant (``tenant_salt``: its API key and ``cache_salt``, docs/security.md) splits the
chain further: its seed is ``blake3(scope seed ‖ tenant salt)``, and the engines fold the same
salt into the first block hash of their prefix cache. The public tenant ``""`` keeps the scope
seed, so a deployment without API keys keys its prompts as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import blake3
import numpy as np

DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class KeyScope:
    model: str                  # the engine's model identity (hash of weights + config)
    layout: dict                # KVLayout.to_dict(): version, shapes, block size, dtype
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    tenant: str = ""            # tenant salt: tenants never share entries

    def __post_init__(self):
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        block = self.layout.get("block_size", 1)
        if self.chunk_tokens % block:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} must be a multiple of the KV block size {block}")

    def seed(self) -> bytes:
        layout = ",".join(f"{k}={self.layout[k]}" for k in sorted(self.layout))
        text = f"tandem-kvpool|{self.model}|{layout}|{self.chunk_tokens}|{self.tenant}"
        return blake3.blake3(text.encode()).digest()


PUBLIC_OWNER = "public"   # the API key tenant of every request when a gateway has no keys


def tenant_owner(tenant: str) -> str:
    """The API key a cache tenant belongs to: a request's ``cache_salt`` splits its key's cache
    as ``<owner>:<salt hash>`` (the gateway's ``cache_tenant``); "" for the public tenant ("" or
    ``public:…``). The engine's scheduler shares its queue by owner, not by cache tenant, so a
    client cannot jump the queue by salting each request differently."""
    owner = tenant.split(":", 1)[0]
    return "" if owner == PUBLIC_OWNER else owner


def tenant_salt(tenant: str) -> bytes:
    """The 16-byte salt of a tenant id (``b""`` for the public tenant ``""``)."""
    return blake3.blake3(f"tandem-tenant|{tenant}".encode()).digest(16) if tenant else b""


def tenant_seed(seed: bytes, tenant: str) -> bytes:
    """The first parent of ``tenant``'s chunk key chain in the scope of ``seed``."""
    return blake3.blake3(seed + tenant_salt(tenant)).digest() if tenant else seed


def chunk_keys(scope: KeyScope, token_ids: list[int], limit: int | None = None, tenant: str = "") -> list[str]:
    """Keys of the full chunks of ``token_ids`` (of at most ``limit`` tokens) of ``tenant``, in order."""
    return _chain(tenant_seed(scope.seed(), tenant), scope.chunk_tokens, token_ids, limit)


def chunk_keys_from_seed(seed_hex: str, chunk_tokens: int, token_ids: list[int],
                         limit: int | None = None, tenant: str = "") -> list[str]:
    """``chunk_keys`` from a scope's hex seed (``Heartbeat.kv_scope``) and chunk size
    (``Heartbeat.chunk_tokens``): keys a prompt without the model. ValueError on a bad seed."""
    try:
        seed = bytes.fromhex(seed_hex)
    except (TypeError, ValueError):
        seed = b""
    if len(seed) != 32:
        raise ValueError(f"invalid key scope seed {seed_hex!r}: expected 64 hex characters")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _chain(tenant_seed(seed, tenant), chunk_tokens, token_ids, limit)


def next_chunk_key(parent: bytes, chunk_token_ids: list[int]) -> bytes:
    """The key (raw digest) of the chunk after ``parent`` (the previous key, or the scope seed)."""
    return blake3.blake3(parent + np.asarray(chunk_token_ids, dtype="<u4").tobytes()).digest()


TAIL = b"tail"  # read as a u32 token id 1,818,845,556: no vocabulary's, so a tail never hashes like a chunk


def tail_key(parent: bytes | str, tail_token_ids: list[int]) -> str:
    """The key of a tail (the whole blocks of a prompt after its last full chunk, fewer tokens
    than a chunk) after ``parent`` (that chunk's key)."""
    parent = bytes.fromhex(parent) if isinstance(parent, str) else parent
    return blake3.blake3(parent + TAIL + np.asarray(tail_token_ids, dtype="<u4").tobytes()).hexdigest()


def _chain(seed: bytes, c: int, token_ids: list[int], limit: int | None) -> list[str]:
    n = len(token_ids) if limit is None else min(limit, len(token_ids))
    if n < c:
        return []
    ids = np.asarray(token_ids[:n // c * c], dtype="<u4").tobytes()
    step = c * 4
    parent = seed
    out = []
    for off in range(0, len(ids), step):
        parent = blake3.blake3(parent + ids[off:off + step]).digest()
        out.append(parent.hex())
    return out


def check_key(key: str) -> str:
    """A key is 64 lowercase hex characters (it becomes a file name); ValueError otherwise."""
    if not isinstance(key, str) or len(key) != 64 or any(ch not in "0123456789abcdef" for ch in key):
        raise ValueError(f"invalid pool key {key!r}: expected 64 lowercase hex characters")
    return key
