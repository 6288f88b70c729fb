"""The KV pool with the real model: a prefix's KV stored in the pool, loaded into another
engine, gives exactly the output of computing it (lossless codec)."""

from __future__ import annotations

import pytest
import torch

from kvpool.codec import LOSSLESS, LOSSY, ChunkShape, Codec, decode_entry
from kvpool.keys import KeyScope, chunk_keys
from kvpool.pool import KVPool, PoolConfig
from shared.engine.engine import Engine, EngineConfig, run_to_completion
from shared.engine.sampling import SamplingParams

CHUNK = 256
TEXT = ("The river wound through the valley, past farms and mills, carrying boats of grain to the "
        "city by the sea, where merchants traded wool, salt and stories from distant lands. ")


@pytest.fixture(scope="module")
def prompt(bundled_model) -> list[int]:
    ids = bundled_model.tokenizer.encode(TEXT * 30, add_special_tokens=False)
    assert len(ids) > 2 * CHUNK + 50
    return ids[:2 * CHUNK + 40]


def engine(bundled_model) -> Engine:
    return Engine(bundled_model, EngineConfig(num_kv_blocks=96, threads=1))


def scope_of(e: Engine, codec: str = LOSSLESS) -> KeyScope:
    return KeyScope(e.model_identity, e.layout.to_dict(), CHUNK, tenant=codec)


def greedy(e: Engine, ids: list[int], prefix=None):
    if prefix is not None:
        assert e.load_prefix(*prefix) == len(prefix[0])
    return run_to_completion(e, {"r": (ids, SamplingParams(max_tokens=12, temperature=0))})["r"]


def pool_round_trip(e: Engine, tokens: list[int], kv: bytes, codec: Codec) -> bytes:
    """Put each chunk of ``kv`` through a pool and back; returns the decoded KV."""
    pool = KVPool.from_config(PoolConfig(ram_bytes=64 << 20))
    keys = chunk_keys(scope_of(e, codec.name), tokens)
    step = CHUNK * e.layout.token_bytes
    shape = ChunkShape.from_layout(e.layout.to_dict())
    for i, k in enumerate(keys):
        pool.put(k, codec.encode(k, kv[i * step:(i + 1) * step], shape))
    assert pool.lookup(keys) == ["ram"] * len(keys)
    return b"".join(decode_entry(pool.get(k), k) for k in keys)


def test_pool_prefix_gives_identical_greedy_output(bundled_model, prompt):
    cold = engine(bundled_model)
    captured = {}
    cold.finished_kv_align = CHUNK
    cold.finished_kv_hook = lambda rid, toks, kv, tenant: captured.update(tokens=toks, kv=kv)
    want = greedy(cold, prompt)
    assert len(captured["tokens"]) == 2 * CHUNK and captured["tokens"] == prompt[:2 * CHUNK]
    kv = pool_round_trip(cold, captured["tokens"], captured["kv"], Codec(LOSSLESS))
    assert kv == captured["kv"]

    warm = engine(bundled_model)
    got = greedy(warm, prompt, (captured["tokens"], kv))
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.num_cached_tokens == 2 * CHUNK and want.num_cached_tokens == 0


def test_load_prefix_validates_and_skips_cached_blocks(bundled_model, prompt):
    e = engine(bundled_model)
    with pytest.raises(ValueError, match="whole blocks"):
        e.load_prefix(prompt[:20], b"\0" * 20 * e.layout.token_bytes)
    kv = bytes(16 * e.layout.token_bytes)
    assert e.load_prefix(prompt[:16], kv) == 16
    assert e.load_prefix(prompt[:16], kv) == 0  # already cached
    assert e.cached_prefix_tokens(prompt) == 16


def test_prompt_logits_with_pool_prefix(bundled_model, prompt):
    """Logits after a lossless pool prefix match a full computation; the int8 codec stays close."""
    e = engine(bundled_model)
    full = e.prompt_logits(prompt)
    kv = e.read_blocks(list(range(2 * CHUNK // 16)))  # prompt_logits used the first free blocks
    for codec, tol in ((Codec(LOSSLESS), 1e-3), (Codec(LOSSY), None)):
        prefix = pool_round_trip(e, prompt[:2 * CHUNK], kv, codec)
        tail = e.prompt_logits(prompt, prefix_kv=prefix)
        ref = full[2 * CHUNK:]
        if tol is not None:
            torch.testing.assert_close(tail, ref, atol=tol, rtol=0)
        else:  # lossy: same top-1 almost everywhere
            agree = (tail.argmax(-1) == ref.argmax(-1)).float().mean().item()
            assert agree >= 0.9, agree
