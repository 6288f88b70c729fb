"""Load a model into the one in-memory format every backend uses.

    load_model(path) -> LoadedModel(config, weights, tokenizer, identity, path)

Sources: a llama.cpp GGUF file (llama / qwen2 / qwen3) or a Hugging Face safetensors directory
(config.json + *.safetensors + tokenizer.json); ``None`` means the bundled SmolLM2-135M-Instruct.

Weights come out under llama.cpp's names without ".weight" (``token_embd``, ``blk.3.attn_q``,
...), all on CPU:
- every 2-D matmul weight and the embedding as Q4_0 bytes, uint8 [N_out, K_in/32*18]
  (``kernels.q4_0`` layout, rows = output features as in HF's [out, in]);
- norms, biases and ``rope_freqs`` as float32.
Q4_0 GGUF tensors are taken byte for byte; any other type is dequantized and requantized a
chunk of rows at a time. llama-arch GGUFs store Q and K rows permuted for llama.cpp's
interleaved rope; the loader undoes that (HF rotate-half layout for every arch).

Life cycle: open → config → tokenizer → weights (tensor by tensor) → identity. Any failure
raises ``ModelLoadError`` naming the problem and the path; everything built so far is dropped
before it is raised (the error holds no traceback into the half-built model).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from kernels import q4_0
from shared.engine.config import ModelConfig
from shared.engine.model_files import (GGUFFile, GGUFTensor, ModelLoadError, bundled_model_path,
                                        dir_header, gguf_header, safetensors_files)
from shared.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CHUNK_ROWS = 256  # rows dequantized / requantized at a time (bounds peak float memory)


@dataclass
class LoadedModel:
    config: ModelConfig               # shape of the network
    weights: dict[str, torch.Tensor]  # llama.cpp names (no ".weight"); Q4_0 uint8 or float32, CPU
    tokenizer: Tokenizer              # encode / decode / chat template
    identity: str                     # hex fingerprint of config + Q4_0 weights: same model, same string
    path: str                         # the file or directory loaded
    runtime: str | None = None        # None: ``weights`` under the names above; else they are
                                      # ``model.runtime_weights`` for this kernel layout (weight_cache)


# ---- names and shapes -------------------------------------------------------------------------

def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the engine needs (plus optional ones it may use), name -> logical shape.
    2-D shapes are [out, in]. ``rope_freqs`` is not listed (optional, [head_dim/2])."""
    h, hd, q, kv = cfg.hidden_size, cfg.head_dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    s: dict[str, tuple[int, ...]] = {"token_embd": (cfg.vocab_size, h), "output_norm": (h,)}
    if not cfg.tie_embeddings:
        s["output"] = (cfg.vocab_size, h)
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        s.update({b + "attn_norm": (h,), b + "attn_q": (q, h), b + "attn_k": (kv, h), b + "attn_v": (kv, h),
                  b + "attn_output": (h, q), b + "ffn_norm": (h,), b + "ffn_gate": (cfg.ffn_size, h),
                  b + "ffn_up": (cfg.ffn_size, h), b + "ffn_down": (h, cfg.ffn_size)})
        if cfg.qk_norm:
            s[b + "attn_q_norm"] = (hd,)
            s[b + "attn_k_norm"] = (hd,)
        if cfg.attn_bias:
            s[b + "attn_q_bias"] = (q,)
            s[b + "attn_k_bias"] = (kv,)
            s[b + "attn_v_bias"] = (kv,)
    return s


def rope_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rope pairs -> HF rotate-half halves).
    Works on float rows or Q4_0 byte rows alike: only whole rows move."""
    n = w.shape[0]
    return w.reshape(n_head, n // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def rope_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's permutation (``LlamaModel.permute`` in convert_hf_to_gguf.py); inverse of the above."""
    n = w.shape[0]
    return w.reshape(n_head, 2, n // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _gguf_name(name: str) -> str:
    """llama.cpp tensor name -> our weight name ('blk.0.attn_q.weight' -> 'blk.0.attn_q',
    'blk.0.attn_q.bias' -> 'blk.0.attn_q_bias')."""
    if name.endswith(".weight"):
        return name[: -len(".weight")]
    if name.endswith(".bias"):
        return name[: -len(".bias")] + "_bias"
    return name


_HF_LAYER = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
    "self_attn.q_proj.bias": "attn_q_bias", "self_attn.k_proj.bias": "attn_k_bias",
    "self_attn.v_proj.bias": "attn_v_bias",
    "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
    "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
}
_HF_TOP = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}


def hf_name(name: str) -> str | None:
    """Hugging Face parameter name -> our weight name, or None for tensors the engine does not use."""
    if name in _HF_TOP:
        return _HF_TOP[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[0] == "model" and parts[1] == "layers" and parts[3] in _HF_LAYER:
        return f"blk.{parts[2]}.{_HF_LAYER[parts[3]]}"
    return None


# ---- conversion -------------------------------------------------------------------------------

def _to_q4_0(rows: int, read_rows: Callable[[int, int], torch.Tensor], name: str) -> torch.Tensor:
    """Q4_0 bytes of a [rows, K] matrix read ``CHUNK_ROWS`` float rows at a time."""
    out: torch.Tensor | None = None
    for r0 in range(0, rows, CHUNK_ROWS):
        r1 = min(rows, r0 + CHUNK_ROWS)
        chunk = read_rows(r0, r1)
        if chunk.dim() != 2 or chunk.shape[0] != r1 - r0:
            raise ValueError(f"tensor {name}: bad row chunk shape {tuple(chunk.shape)}")
        if chunk.shape[1] % q4_0.QK:
            raise ValueError(f"tensor {name}: row length {chunk.shape[1]} is not divisible by {q4_0.QK} (Q4_0)")
        if out is None:
            out = torch.empty(rows, q4_0.row_bytes(chunk.shape[1]), dtype=torch.uint8)
        out[r0:r1] = q4_0.quantize(chunk)
        del chunk
    assert out is not None
    return out


def _identity(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> str:
    try:
        from blake3 import blake3 as hasher
    except ImportError:  # pragma: no cover - blake3 is a dependency
        from hashlib import sha256 as hasher
    h = hasher()
    h.update(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    for name in sorted(weights):
        t = weights[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else t.numpy().data)
    return h.hexdigest()[:32]


class _Progress:
    def __init__(self, enabled: bool, total: int, what: str):
        self.enabled, self.total, self.what, self.done, self.t0 = enabled, max(total, 1), what, 0, time.monotonic()
        self.last = -1

    def add(self, n: int = 1) -> None:
        if not self.enabled:
            return
        self.done += n
        pct = 100 * self.done // self.total
        if pct != self.last and (pct % 5 == 0 or self.done == self.total):
            self.last = pct
            sys.stderr.write(f"\r{self.what}: {pct:3d}% ({time.monotonic() - self.t0:.1f}s)")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


# ---- GGUF -------------------------------------------------------------------------------------

def _dequantize_rows(raw: np.ndarray, t: GGUFTensor) -> torch.Tensor:
    """uint8 rows of tensor ``t`` -> float32 [rows, K]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qt = GGMLQuantizationType(t.qtype)
    if qt == GGMLQuantizationType.F32:
        out = raw.view(np.float32)
    elif qt == GGMLQuantizationType.F16:
        out = raw.view(np.float16).astype(np.float32)
    else:
        out = dequantize(raw, qt)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(raw.shape[0], -1))


def _gguf_tensors(gf: GGUFFile, cfg: ModelConfig, weights: dict[str, torch.Tensor], progress: _Progress) -> None:
    from gguf import GGMLQuantizationType as T

    shapes = expected_shapes(cfg)
    for t in gf.tensors:
        name = _gguf_name(t.name)
        want = shapes.get(name)
        if want is None and name != "rope_freqs":
            log.debug("ignoring tensor %s", t.name)
            progress.add()
            continue
        if want is not None and t.shape != want:
            raise ValueError(f"tensor {t.name} has shape {list(t.shape)}, expected {list(want)}")
        if len(t.shape) == 1:
            w = _dequantize_rows(gf.read(t), t).reshape(t.shape)
        elif len(t.shape) == 2:
            n, k = t.shape
            if k % q4_0.QK:
                raise ValueError(f"tensor {t.name}: row length {k} is not divisible by {q4_0.QK} (Q4_0)")
            if t.qtype == T.Q4_0:
                w = torch.from_numpy(gf.read(t))
            else:
                w = _to_q4_0(n, lambda r0, r1: _dequantize_rows(gf.read(t, r0, r1), t), t.name)
            if cfg.arch == "llama" and name.endswith((".attn_q", ".attn_k")):
                w = rope_unpermute(w, cfg.n_heads if name.endswith(".attn_q") else cfg.n_kv_heads)
        else:
            raise ValueError(f"tensor {t.name} has {len(t.shape)} dimensions")
        if cfg.arch == "llama" and name.endswith((".attn_q_bias", ".attn_k_bias")):
            w = rope_unpermute(w, cfg.n_heads if name.endswith("q_bias") else cfg.n_kv_heads)
        weights[name] = w
        progress.add()


def _load_gguf(path: str, weights: dict[str, torch.Tensor], progress: bool):
    gf, cfg, tok = gguf_header(path)
    _gguf_tensors(gf, cfg, weights, _Progress(progress, len(gf.tensors), f"loading {os.path.basename(path)}"))
    return cfg, tok


# ---- safetensors directory ----------------------------------------------------------------------

def iter_safetensors(path: str) -> Iterator[tuple[str, Any]]:
    """(our name, safetensors slice) for every tensor the engine uses, file by file."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                name = hf_name(key)
                if name is None:
                    log.debug("ignoring tensor %s", key)
                    continue
                yield name, f.get_slice(key)


def _load_dir(path: str, weights: dict[str, torch.Tensor], progress: bool):
    cfg, tok = dir_header(path)
    shapes = expected_shapes(cfg)
    prog = _Progress(progress, len(shapes), f"loading {os.path.basename(os.path.normpath(path))}")
    seen_output = False
    for name, sl in iter_safetensors(path):
        if name == "output":
            seen_output = True
            if cfg.tie_embeddings:
                continue
        shape = tuple(sl.get_shape())
        if shape != shapes.get(name):
            raise ValueError(f"tensor {name} has shape {list(shape)}, expected {list(shapes.get(name, ()))}")
        if len(shape) == 2:
            weights[name] = _to_q4_0(shape[0], lambda r0, r1: sl[r0:r1].to(torch.float32), name)
        else:
            weights[name] = sl[:].to(torch.float32).contiguous()
        prog.add()
    if not cfg.tie_embeddings and not seen_output:
        cfg.tie_embeddings = True  # config says untied, but there is no lm_head: HF ties it
    return cfg, tok


_LIBC: Any = None
M_MMAP_THRESHOLD = -3          # glibc mallopt parameter
MMAP_THRESHOLD = 128 * 1024    # glibc's initial value, kept fixed (see below)


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim, _LIBC.mallopt  # noqa: B018 -- both must exist (glibc)
        except (OSError, AttributeError):
            _LIBC = False  # not glibc: nothing to do
    return _LIBC


def _pin_mmap_threshold() -> None:
    """Keep glibc from moving large allocations onto the heap.

    glibc raises its mmap threshold to the size of each large block freed, after which blocks
    that size come from the heap, whose freed pages stay resident. Loading converts weights
    through scratch buffers and the engine fuses matrices, so the heap would keep ~50 MiB of
    dead scratch (measured: peak 167 MiB over baseline vs 140 MiB budget). With the threshold
    fixed, every block over 128 KiB is its own mapping, returned to the OS when freed.
    """
    libc = _libc()
    if libc:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def release_freed_memory() -> None:
    """Give freed heap pages back to the OS."""
    libc = _libc()
    if libc:
        libc.malloc_trim(0)


# ---- entry points -------------------------------------------------------------------------------

def load_model(path: str | None = None, progress: bool = False) -> LoadedModel:
    """Load a GGUF file or HF safetensors directory (None: the bundled model). Raises ModelLoadError."""
    path = bundled_model_path() if path is None else os.fspath(path)
    _pin_mmap_threshold()
    t0 = time.monotonic()
    weights: dict[str, torch.Tensor] = {}
    problem = None
    try:
        if not os.path.exists(path):
            raise ValueError("no such file or directory")
        if os.path.isdir(path):
            cfg, tok = _load_dir(path, weights, progress)
        else:
            cfg, tok = _load_gguf(path, weights, progress)
        missing = [n for n in expected_shapes(cfg) if n not in weights]
        if missing:
            raise ValueError(f"missing tensor{'s' if len(missing) > 1 else ''} {', '.join(missing[:5])}"
                             + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
        if cfg.tie_embeddings:
            weights["output"] = weights["token_embd"]
        identity = _identity(cfg, weights)
    except (ValueError, KeyError, OSError, RuntimeError, TypeError, IndexError, ArithmeticError,
            MemoryError, struct.error) as e:
        log.debug("loading %s failed", path, exc_info=True)
        problem = f"cannot load model {path}: {e}" if not isinstance(e, KeyError) else \
            f"cannot load model {path}: missing key {e}"
    if problem is not None:
        # raised outside the except block: no __context__ traceback keeps the partial model alive
        weights.clear()
        raise ModelLoadError(problem)
    release_freed_memory()
    log.info("loaded %s (%s, %d layers) in %.2fs", path, cfg.arch, cfg.n_layers, time.monotonic() - t0)
    return LoadedModel(config=cfg, weights=weights, tokenizer=tok, identity=identity, path=path)
