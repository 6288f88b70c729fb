"""The KV pool with the real model: a prefix's KV stored in the pool, loaded into another
engine, gives exactly the output of computing it (lossless codecs), tail entry included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpool.codec import LOSSLESS, LOSSY, RAW, ChunkShape, Codec, decode_entry
from kvpool.keys import KeyScope, chunk_keys, tail_key
from kvpool.pool import KVPool, PoolConfig
from shared.engine.engine import Completion, Engine, EngineConfig, run_to_completion
from shared.engine.kv_cache import KVBlobHeader
from shared.engine.sampling import SamplingParams
from shared.kv_connector import prompt_tail_end

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
    """Put each chunk of ``kv`` — and the blocks after the last one, as a tail entry — through a
    pool and back; returns the decoded KV."""
    pool = KVPool.from_config(PoolConfig(ram_bytes=64 << 20))
    keys = chunk_keys(scope_of(e, codec.name), tokens)
    shape = ChunkShape.from_layout(e.layout.to_dict())
    at = lambda t: e.layout.blocks_for(t) * e.layout.block_bytes  # noqa: E731 (a partial last block: whole)
    pieces = [(k, i * CHUNK, (i + 1) * CHUNK) for i, k in enumerate(keys)]
    if len(tokens) > len(keys) * CHUNK:
        pieces.append((tail_key(keys[-1], tokens[len(keys) * CHUNK:]), len(keys) * CHUNK, len(tokens)))
    for k, a, b in pieces:
        pool.put(k, codec.encode(k, kv[at(a):at(b)], shape))
    assert pool.lookup([k for k, _, _ in pieces]) == ["ram"] * len(pieces)
    return b"".join(decode_entry(pool.get(k), k) for k, _, _ in pieces)


@pytest.mark.parametrize("codec", [RAW, LOSSLESS])
def test_pool_prefix_gives_identical_greedy_output(bundled_model, prompt, codec):
    """The prompt's chunks and tail (up to its last token but one, a partial block) through the
    pool: the warm engine computes the last token only, and its greedy output is the cold one's."""
    cold = engine(bundled_model)
    captured = {}
    cold.finished_kv_align = 1
    cold.finished_kv_hook = lambda rid, toks, kv, tenant, n, ret, start: captured.update(tokens=toks, kv=bytes(kv),
                                                                                         prompt=n, start=start)
    want = greedy(cold, prompt)
    end = prompt_tail_end(captured["prompt"])
    assert captured["prompt"] == len(prompt) and end == 2 * CHUNK + 39 and captured["tokens"][:end] == prompt[:end]
    raw = captured["kv"][:cold.layout.blocks_for(end) * cold.layout.block_bytes]
    kv = pool_round_trip(cold, prompt[:end], raw, Codec(codec))
    assert kv[:(end // 16) * cold.layout.block_bytes] == raw[:(end // 16) * cold.layout.block_bytes]

    warm = engine(bundled_model)
    warm.add("r", prompt, SamplingParams(max_tokens=12, temperature=0), prefix=(prompt[:end], kv))
    got = Completion("r")
    while warm.has_work():
        for o in warm.step():
            got.add(o)
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.num_cached_tokens == end and want.num_cached_tokens == 0


def test_a_finished_request_copies_out_only_what_it_did_not_reuse(bundled_model, prompt):
    """The write-back's KV leaves out the whole pool chunks of the prefix a request reused (they were
    cached when it came): its next turn copies what it added, not its whole context again."""
    e = engine(bundled_model)
    got = []
    e.finished_kv_align, e.finished_kv_skip = 1, CHUNK
    e.finished_kv_hook = lambda rid, toks, kv, tenant, n, ret, start: got.append((toks, bytes(kv), start))
    greedy(e, prompt)
    ids = bundled_model.tokenizer.encode(TEXT * 30, add_special_tokens=False)[:len(prompt) + 30]
    out = run_to_completion(e, {"r2": (ids, SamplingParams(max_tokens=12, temperature=0))})["r2"]
    (toks1, kv1, start1), (toks2, kv2, start2) = got
    bb, cached = e.layout.block_bytes, out.num_cached_tokens
    assert start1 == 0 and len(kv1) == e.layout.blocks_for(len(toks1)) * bb
    assert cached >= 2 * CHUNK and start2 == cached // CHUNK * CHUNK == 2 * CHUNK
    assert toks2 == ids + out.token_ids[:-1] and len(kv2) == (e.layout.blocks_for(len(toks2)) - start2 // 16) * bb
    # the blocks both hold from start2 on are the same cache blocks: the same bytes
    same = (cached - start2) // 16 * bb
    assert same > 0 and kv2[:same] == kv1[start2 // 16 * bb:start2 // 16 * bb + same]


def test_a_handed_off_request_leaves_out_what_its_sender_wrote_back(bundled_model, prompt):
    """A prefill worker writes the prompt's chunks back at its hand-off (``export_kv(written_back=True)``):
    the decode side's write-back starts after them, and a migration carries that on; a plain export
    (a migration from where it was computed) claims nothing."""
    def finish_start(blob) -> int:
        e, got = engine(bundled_model), []
        e.finished_kv_align, e.finished_kv_skip = 1, CHUNK
        e.finished_kv_hook = lambda rid, toks, kv, tenant, n, ret, start: got.append(start)
        e.import_kv("x", blob)
        while e.has_work():
            e.step()
        return got[0]

    for written_back, want in ((True, 2 * CHUNK), (False, 0)):
        pre = engine(bundled_model)
        pre.add("x", prompt, SamplingParams(max_tokens=6, temperature=0), prefill_only=True)
        while not any(o.finish_reason == "prefilled" for o in pre.step()):
            pass
        blob = pre.export_kv("x", written_back=written_back)
        assert finish_start(blob) == want
        mid = engine(bundled_model)          # moved once more mid-decode: what was written back stays so
        mid.import_kv("x", blob)
        mid.step()
        assert finish_start(mid.export_kv("x")) == want
    # a peer's claim only narrows the write-back, within the tokens there are; a malformed one is refused
    h, kv = KVBlobHeader.parse(blob)
    assert finish_start(dataclasses.replace(h, pooled=10 ** 9).pack(kv)) == 2 * CHUNK
    for bad in (-1, "512"):
        with pytest.raises(ValueError, match="pooled"):
            engine(bundled_model).import_kv("x", dataclasses.replace(h, pooled=bad).pack(kv))


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
