"""Model loading: the bundled GGUF, tiny synthetic GGUFs and HF directories, `tandem quantize`,
and bad input (clear ModelLoadError, nothing left in memory)."""

from __future__ import annotations

import gc
import json
import os
import weakref

import numpy as np
import pytest
import torch

from kernels import q4_0
from shared.engine import loader, model_files
from shared.engine.loader import load_model, rope_permute, rope_unpermute
from shared.engine.model_files import ModelLoadError, bundled_model_path
from shared.engine.quantize import quantize_model
from shared.engine.tokenizer import _bytes_to_unicode


@pytest.fixture(scope="module")
def bundled(bundled_model):
    return bundled_model


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, bundled):
    d = tmp_path_factory.mktemp("q4_0")
    dst = str(d / "smollm2-135m-instruct.Q4_0.gguf")
    quantize_model(bundled_model_path(), dst, model=bundled)
    return dst


# ---- the bundled model ---------------------------------------------------------------------------

def test_bundled_config(bundled):
    c = bundled.config
    assert (c.arch, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == ("llama", 30, 9, 3, 64)
    assert (c.hidden_size, c.ffn_size, c.vocab_size) == (576, 1536, 49152)
    assert c.tie_embeddings and not c.qk_norm and not c.attn_bias
    assert c.rope_theta == 100000.0 and c.max_context == 8192 and c.rope_scaling is None


def test_bundled_weights_format(bundled):
    w, c = bundled.weights, bundled.config
    assert w["output"] is w["token_embd"]
    assert w["token_embd"].dtype == torch.uint8 and w["token_embd"].shape == (49152, 576 // 32 * 18)
    assert w["blk.0.attn_q"].shape == (576, 576 // 32 * 18)
    assert w["blk.0.attn_k"].shape == (192, 576 // 32 * 18)
    assert w["blk.29.ffn_down"].shape == (576, 1536 // 32 * 18)
    assert w["output_norm"].dtype == torch.float32 and w["output_norm"].shape == (576,)
    expected = set(loader.expected_shapes(c)) | {"output"}
    assert set(w) == expected
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in w.values())
    assert len(bundled.identity) == 32 and int(bundled.identity, 16) >= 0


def test_bundled_conversion_is_close_to_source(bundled):
    """Q4_1 -> float -> Q4_0: within Q4_0's error of the source weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    gf = model_files.open_gguf(bundled.path)
    t = next(t for t in gf.tensors if t.name == "blk.5.ffn_up.weight")
    src = torch.from_numpy(dequantize(gf.read(t), GGMLQuantizationType(t.qtype)).reshape(t.shape).astype(np.float32))
    ours = q4_0.dequantize(bundled.weights["blk.5.ffn_up"])
    block_max = src.reshape(-1, 32).abs().amax(-1, keepdim=True)
    assert ((ours - src).reshape(-1, 32).abs() <= block_max / 8 + 1e-6).all()


def test_rope_permutation_round_trip_and_llama_cpp_formula():
    w = torch.arange(12 * 7).reshape(12, 7)
    assert torch.equal(rope_unpermute(rope_permute(w, 3), 3), w)
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    ref = w.numpy().reshape(3, 2, 2, 7).swapaxes(1, 2).reshape(12, 7)
    assert np.array_equal(rope_permute(w, 3).numpy(), ref)


def test_bundled_path_without_importing_package():
    p = bundled_model_path()
    assert p.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(p)


# ---- tandem quantize ---------------------------------------------------------------------------------

def test_quantized_loads_byte_identical(bundled, quantized):
    q = load_model(quantized)
    assert q.config == bundled.config
    assert set(q.weights) == set(bundled.weights)
    for name, t in bundled.weights.items():
        assert torch.equal(q.weights[name], t), name
    assert q.identity == bundled.identity
    assert q.tokenizer.chat_template == bundled.tokenizer.chat_template


def test_quantized_file_is_q4_0(quantized):
    from gguf import GGMLQuantizationType as T

    gf = model_files.open_gguf(quantized)
    assert gf.get("general.file_type") == 2  # MOSTLY_Q4_0
    assert gf.get("general.architecture") == "llama"
    assert gf.get("tokenizer.ggml.pre") == "smollm"
    for t in gf.tensors:
        assert t.qtype == (T.Q4_0 if len(t.shape) == 2 else T.F32), t.name


def test_quantize_cli_refuses_overwrite(quantized, tmp_path):
    from services.cli import main

    assert main(["quantize", bundled_model_path(), quantized]) == 2
    assert main(["quantize", str(tmp_path / "nope.gguf"), str(tmp_path / "out.gguf")]) == 1
    assert not any(p.name.startswith("out.gguf") for p in tmp_path.iterdir())  # no temp file left
    # a destination in no directory: said at once (it was a traceback after the conversion)
    assert main(["quantize", bundled_model_path(), str(tmp_path / "no" / "out.gguf")]) == 2


def test_quantize_stopped_by_sigterm_leaves_no_file(tmp_path):
    """SIGTERM (or SIGHUP) mid-conversion ends it as Ctrl-C does: no DST, no DST.tmp<pid> (one
    was left behind), exit code 130, no traceback."""
    import signal
    import subprocess
    import sys
    import time
    dst = tmp_path / "out.gguf"
    p = subprocess.Popen([sys.executable, "-m", "services.cli", "quantize", bundled_model_path(), str(dst)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not any(f.name.startswith("out.gguf.tmp") for f in tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.02)   # the temporary file exists: it is writing
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 130 and "Traceback" not in out and "not written" in out, out
    assert list(tmp_path.iterdir()) == []


# ---- HF safetensors directories ---------------------------------------------------------------------

def _hf_dir(tmp_path, arch: str, bundled) -> str:
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=arch != "llama")
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    extra = {"head_dim": 32} if arch == "qwen3" else {}
    torch.manual_seed(0)
    model = cls[1](cls[0](**common, **extra)).eval()
    d = tmp_path / arch
    model.save_pretrained(str(d))
    tok = bundled.tokenizer
    tok.backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": tok.chat_template}))
    return str(d)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_safetensors_dir_and_quantize_round_trip(tmp_path, bundled, arch):
    from safetensors.torch import load_file

    d = _hf_dir(tmp_path, arch, bundled)
    m = load_model(d)
    c = m.config
    assert c.arch == arch and c.n_layers == 2 and c.hidden_size == 64
    assert c.qk_norm == (arch == "qwen3") and c.attn_bias == (arch == "qwen2")
    assert c.tie_embeddings == (arch != "llama")
    sd = load_file(os.path.join(d, "model.safetensors"))
    src = sd["model.layers.1.self_attn.q_proj.weight"]
    ours = q4_0.dequantize(m.weights["blk.1.attn_q"])
    block_max = src.reshape(-1, 32).abs().amax(-1, keepdim=True)
    assert ((ours - src).reshape(-1, 32).abs() <= block_max / 8 + 1e-6).all()
    if arch == "qwen2":
        assert torch.equal(m.weights["blk.0.attn_k_bias"], sd["model.layers.0.self_attn.k_proj.bias"])
    if arch == "qwen3":
        assert m.weights["blk.0.attn_q_norm"].shape == (32,)
    # directory -> Q4_0 GGUF -> same weights
    dst = str(tmp_path / f"{arch}.gguf")
    quantize_model(d, dst)
    g = load_model(dst)
    assert g.config == c
    for name, t in m.weights.items():
        assert torch.equal(g.weights[name], t), name
    assert g.tokenizer.encode("Hello 123 <|im_end|>") == m.tokenizer.encode("Hello 123 <|im_end|>")


# ---- bad input --------------------------------------------------------------------------------------

def _tiny_gguf(path: str, arch: str = "llama", hidden: int = 64, drop: str | None = None) -> None:
    """A 2-layer GGUF with F16 / F32 tensors and a tiny byte-level vocabulary."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    heads, kv, ffn, vocab = 2, 1, 128, 288
    hd = hidden // heads
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    alphabet = list(_bytes_to_unicode().values())
    tokens = alphabet + ["Ġt"] + [f"<|t{i}|>" for i in range(vocab - 257)]
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3] * (vocab - 257))
    w.add_token_merges(["Ġ t"])
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(2):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.attn_q.weight": (hidden, hidden),
                       f"blk.{i}.attn_k.weight": (kv * hd, hidden), f"blk.{i}.attn_v.weight": (kv * hd, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, hidden), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    for name, shape in shapes.items():
        if name == drop:
            continue
        a = rng.standard_normal(shape).astype(np.float32)
        w.add_tensor(name, a.astype(np.float16) if len(shape) == 2 and "ffn" in name else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_gguf_loads(tmp_path):
    p = str(tmp_path / "tiny.gguf")
    _tiny_gguf(p)
    m = load_model(p)
    assert m.config.n_layers == 2 and m.config.vocab_size == 288 and m.config.tie_embeddings
    assert m.weights["blk.1.ffn_down"].dtype == torch.uint8
    assert m.tokenizer.encode("<|t3|>") == [260]
    assert m.tokenizer.encode(" t") == [256]


def _expect_error(path: str, *words: str) -> ModelLoadError:
    """Load must fail with ModelLoadError naming ``words`` and the path, and leave no tensor alive."""
    refs: list[weakref.ref] = []
    real_read, real_q = model_files.GGUFFile.read, loader._to_q4_0

    def read(self, *a, **k):
        out = real_read(self, *a, **k)
        refs.append(weakref.ref(out))
        return out

    def to_q4_0(*a, **k):
        out = real_q(*a, **k)
        refs.append(weakref.ref(out))
        return out

    model_files.GGUFFile.read, loader._to_q4_0 = read, to_q4_0
    try:
        with pytest.raises(ModelLoadError) as info:
            load_model(path)
    finally:
        model_files.GGUFFile.read, loader._to_q4_0 = real_read, real_q
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert path in msg, msg
    for word in words:
        assert word in msg, msg
    assert info.value.__context__ is None and info.value.__cause__ is None
    gc.collect()
    alive = [r for r in refs if r() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} tensors still alive after a failed load"
    return info.value


def test_unknown_architecture(tmp_path):
    p = str(tmp_path / "falcon.gguf")
    _tiny_gguf(p, arch="falcon")
    _expect_error(p, "unknown architecture", "'falcon'")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "junk.gguf"
    p.write_bytes(os.urandom(4096))
    _expect_error(str(p), "not a GGUF")


@pytest.mark.parametrize("size", [3, 100, 20_000, 1_000_000, 50_000_000, 98_362_000])
def test_truncated_gguf(tmp_path, size):
    p = str(tmp_path / f"cut{size}.gguf")
    with open(bundled_model_path(), "rb") as src, open(p, "wb") as dst:
        dst.write(src.read(size))
    _expect_error(p, "truncated" if size >= 4 else "not a GGUF")


def test_missing_tensor_frees_what_was_loaded(tmp_path):
    p = str(tmp_path / "missing.gguf")
    _tiny_gguf(p, drop="blk.1.ffn_down.weight")
    _expect_error(p, "missing tensor", "blk.1.ffn_down")


def test_dims_not_divisible_by_32(tmp_path):
    p = str(tmp_path / "odd.gguf")
    _tiny_gguf(p, hidden=48)
    _expect_error(p, "not divisible by 32")


def test_missing_path_and_bad_dir(tmp_path):
    _expect_error(str(tmp_path / "nothing-here.gguf"), "no such file")
    _expect_error(str(tmp_path), "config.json")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    _expect_error(str(tmp_path), "unknown architecture", "GPTNeoXForCausalLM")


def test_failed_load_releases_memory(monkeypatch, quantized):
    """A load that fails after reading every tensor gives its memory back (RSS)."""
    def fail(*a):
        raise ValueError("injected failure after the last tensor")

    monkeypatch.setattr(loader, "_identity", fail)

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    with pytest.raises(ModelLoadError, match="injected failure"):
        load_model(quantized)
    gc.collect()
    before = rss()
    for _ in range(3):  # 3 x 72 MB of Q4_0 weights if anything stayed
        with pytest.raises(ModelLoadError):
            load_model(quantized)
    gc.collect()
    assert rss() - before < 30 << 20


def test_load_tokenizer_reads_metadata_only(bundled, tmp_path):
    tok, cfg = model_files.load_tokenizer()
    assert cfg == bundled.config
    text = "Hello, 世界! <|im_start|>user"
    assert tok.encode(text) == bundled.tokenizer.encode(text)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        bundled.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    p = tmp_path / "junk.gguf"
    p.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        model_files.load_tokenizer(str(p))


def test_a_missing_model_or_an_unknown_device_is_said_plainly(tmp_path):
    """`tandem generate --model /nonexistent.gguf` said "no *.safetensors files"; `--device
    banana` was torch's RuntimeError as a traceback."""
    from shared.engine import weight_cache
    from shared.engine.engine import resolve_device
    from shared.engine.model_files import ModelLoadError
    with pytest.raises(ModelLoadError, match="nonexistent.gguf: no such file or directory"):
        weight_cache.load(str(tmp_path / "nonexistent.gguf"), None, str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"unsupported device 'banana' \(cpu or cuda\)"):
        resolve_device("banana")
