"""The weight cache (shared/engine/weight_cache.py): a mapped load runs the same bits as a fresh
conversion, a damaged cache file is rebuilt and never used, engines starting together convert once."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from kernels.dispatch import get_ops
from shared.engine import weight_cache
from shared.engine.engine import Engine, EngineConfig, run_to_completion
from shared.engine.model import AttnChunk, StepContext, runtime_weights
from shared.engine.sampling import SamplingParams
from tests.integration.tiny_models import TinySpec, save_tiny

PROMPT = [5, 77, 300, 12, 9, 250, 31, 64, 1, 2, 3, 140, 260, 18, 44, 90, 7, 111, 203, 19]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny qwen2 with biases and an untied head, as a safetensors directory."""
    d = str(tmp_path_factory.mktemp("tiny-qwen2"))
    save_tiny(TinySpec("qwen2-untied-bias", "qwen2", {"tie_word_embeddings": False}, seed=4), d)
    return d


def logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits of every position of ``ids`` (one forward step from an empty KV cache)."""
    n, bs = len(ids), engine.config.block_size
    pos = torch.arange(n)
    blocks = torch.arange(-(-n // bs))
    ctx = StepContext(positions=pos, slot_blocks=pos // bs, slot_offsets=pos % bs,
                      chunks=[AttnChunk(0, n, 0, blocks)], sample_rows=pos)
    with torch.inference_mode():
        return engine.model.forward(torch.tensor(ids), ctx, engine.kv)


def greedy(engine: Engine, ids: list[int], n: int = 12) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return run_to_completion(engine, {"r": (ids, params)})["r"].token_ids


def config(cache_dir: str) -> EngineConfig:
    return EngineConfig(num_kv_blocks=8, block_size=16, weight_cache_dir=cache_dir)


def cache_files(d) -> list:
    return sorted(p for p in os.listdir(d) if p.endswith(weight_cache.SUFFIX))


def test_tiny_round_trip_equals_fresh_conversion(tiny_dir, tmp_path, caplog):
    fresh = Engine.from_path(tiny_dir, config(""))              # converted in memory, no cache
    with caplog.at_level(logging.INFO, logger=weight_cache.__name__):
        cold = Engine.from_path(tiny_dir, config(str(tmp_path)))  # converts, writes, maps
        warm = Engine.from_path(tiny_dir, config(str(tmp_path)))  # maps
    assert sum("weight cache written" in r.message for r in caplog.records) == 1
    assert len(cache_files(tmp_path)) == 1
    want = logits(fresh, PROMPT)
    for e in (cold, warm):
        assert torch.equal(logits(e, PROMPT), want)
        assert e.model_identity == fresh.model_identity
        assert e.model_config == fresh.model_config
        assert greedy(e, PROMPT) == greedy(fresh, PROMPT)
    # the warm engine runs on the file's pages: every weight lies in a read-only mapping of it
    file = str(tmp_path / cache_files(tmp_path)[0])
    spans = [line.split()[:2] for line in open("/proc/self/maps") if line.rstrip().endswith(file)]
    ranges = [tuple(int(x, 16) for x in r.split("-")) for r, perms in spans if perms.startswith("r-")]
    ptrs = [t.data_ptr() for L in warm.model.layers for t in L.values()] + [warm.model.output.data_ptr()]
    assert ranges and all(any(a <= p < b for a, b in ranges) for p in ptrs)


def test_bundled_round_trip_equals_fresh_conversion(bundled_model, tmp_path):
    """The bundled GGUF (Q4_1 converted, tied head, GGUF tokenizer) written and mapped back."""
    ops = get_ops("cpu")
    model = bundled_model
    fresh = Engine(model, config(""))
    runtime = runtime_weights(model.config, model.weights, getattr(ops, "prepare", None))
    cached = weight_cache.LoadedModel(model.config, runtime, model.tokenizer, model.identity, model.path,
                                      runtime=weight_cache.layout_of(ops))
    file = tmp_path / "bundled.tqw"
    weight_cache.write(file, runtime, weight_cache.index_meta("k", cached))
    del runtime, cached
    w, index = weight_cache.read(file, "k")
    tok = weight_cache.Tokenizer.from_dict(index["tokenizer"])
    mapped = Engine(weight_cache.LoadedModel(weight_cache.ModelConfig(**index["config"]), w, tok,
                                             index["identity"], model.path, runtime=index["layout"]), config(""))
    assert mapped.model.embed is mapped.model.output          # tied: one copy in the file too
    ids = model.tokenizer.encode("The history of the printing press begins in")
    assert torch.equal(logits(mapped, ids), logits(fresh, ids))
    assert greedy(mapped, ids) == greedy(fresh, ids)
    msgs = [{"role": "user", "content": "Hi there, <|im_end|> what's 2+2?"}]
    assert tok.encode(tok.apply_chat_template(msgs)) == model.tokenizer.encode(model.tokenizer.apply_chat_template(msgs))
    assert tok.eos_token_ids == model.tokenizer.eos_token_ids and tok.vocab_size == model.tokenizer.vocab_size


@pytest.mark.parametrize("damage", ["truncate", "data byte", "index byte", "magic", "empty"])
def test_damaged_cache_file_is_rebuilt_never_used(tiny_dir, tmp_path, damage, caplog):
    want = logits(Engine.from_path(tiny_dir, config(str(tmp_path))), PROMPT)
    file = tmp_path / cache_files(tmp_path)[0]
    raw = bytearray(file.read_bytes())
    _, _, index_len, data_off, _, _ = weight_cache.HEADER.unpack_from(raw, 0)
    if damage == "truncate":
        raw = raw[:-100]
    elif damage == "data byte":
        raw[data_off + 1000] ^= 0x10
    elif damage == "index byte":
        raw[weight_cache.HEADER.size + weight_cache.DIGEST + index_len // 2] ^= 0x01
    elif damage == "magic":
        raw[0:8] = b"NOTACACH"
    else:
        raw = bytearray()
    # damaged beside it and renamed over it (writing the file in place would change the pages an
    # engine has mapped: the cache itself only ever renames)
    (tmp_path / "damaged").write_bytes(bytes(raw))
    os.replace(tmp_path / "damaged", file)
    with pytest.raises(weight_cache.CacheFileError):
        weight_cache.read(file)
    caplog.clear()  # the first load's records, where an earlier test left the logger at INFO
    with caplog.at_level(logging.INFO, logger=weight_cache.__name__):
        again = Engine.from_path(tiny_dir, config(str(tmp_path)))
    assert any("unusable" in r.message for r in caplog.records)
    assert sum("weight cache written" in r.message for r in caplog.records) == 1
    weight_cache.read(file)                                    # whole again
    assert torch.equal(logits(again, PROMPT), want)


def test_concurrent_builders_convert_once(tiny_dir, tmp_path, monkeypatch):
    """Four loads start together: one converts (holding the build lock), the others wait and map.
    The lock is flock on separately opened files, which excludes threads of one process as it
    excludes processes."""
    conversions = []
    real = weight_cache.convert

    def counted(*a, **kw):
        conversions.append(threading.get_ident())
        return real(*a, **kw)

    monkeypatch.setattr(weight_cache, "convert", counted)
    ops, start, results = get_ops("cpu"), threading.Barrier(4), []

    def load():
        start.wait()
        results.append(weight_cache.load(tiny_dir, ops, str(tmp_path)))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 4 and len(conversions) == 1
    assert len({m.identity for m in results}) == 1
    assert len(cache_files(tmp_path)) == 1 and not [p for p in os.listdir(tmp_path) if ".tmp" in p]


def test_unwritable_cache_dir_converts_in_memory(tiny_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    e = Engine.from_path(tiny_dir, config(str(blocker / "cache")))
    fresh = Engine.from_path(tiny_dir, config(""))
    assert torch.equal(logits(e, PROMPT), logits(fresh, PROMPT))


def test_key_follows_source_and_layout(tiny_dir, tmp_path):
    k = weight_cache.cache_key(tiny_dir, "q16")
    assert k == weight_cache.cache_key(tiny_dir, "q16") != weight_cache.cache_key(tiny_dir, "rows")
    st = os.path.join(tiny_dir, "model.safetensors")
    raw = bytearray(open(st, "rb").read())
    raw[-1] ^= 1                     # one weight bit, same size
    mtime = os.stat(st).st_mtime_ns
    with open(st, "wb") as f:
        f.write(raw)
    os.utime(st, ns=(mtime, mtime))  # same mtime too: the whole-file hash still sees it
    try:
        assert weight_cache.cache_key(tiny_dir, "q16") != k
    finally:
        raw[-1] ^= 1
        with open(st, "wb") as f:
            f.write(raw)
