"""The fused CPU forward step (``forward_cpu.cpp``): a whole ``Transformer.forward`` in one C++ call.

``FusedForward.build(model)`` returns a callable with ``Transformer.forward``'s signature, or
None where the fused step does not apply (library unavailable, Q8_0 activations, a head width
that is not a multiple of 16 — of 32 with packed q16 weights —, ``TANDEM_CPU_FUSED=0``); the
model then runs op by op. With packed weights (``kernels.cpu.prepare``, the q16 default) every
matmul input is quantized by the stage that writes it, so q16 adds no barrier. The C++
side reads the paged KV in place, runs one OpenMP team for the step and gives the same bits
for any thread count; numerics vs the op-by-op path are in docs/kernels.md.
"""

from __future__ import annotations

import ctypes
import os

import torch

from kernels import cpu

_i64, _f32, _vp = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


LAYER_FIELDS = ("attn_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "ffn_norm", "gate_up", "down")


class _Layer(ctypes.Structure):
    _fields_ = [(n, _vp) for n in LAYER_FIELDS]


class _Model(ctypes.Structure):
    _fields_ = [*[(n, _i64) for n in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn",
                                      "vocab", "max_ctx", "packed", "embed_packed")],
                ("eps", _f32), ("scale", _f32),
                *[(n, _vp) for n in ("layers", "embed", "output", "output_norm", "cos", "sin")]]


class _Batch(ctypes.Structure):
    _fields_ = [("n_tokens", _i64), ("token_ids", _vp), ("n_chunks", _i64), ("chunks", _vp),
                ("tables", _vp), ("n_sample", _i64), ("sample_rows", _vp), ("kv", _vp),
                ("block_size", _i64), ("logits", _vp)]


def enabled() -> bool:
    """``TANDEM_CPU_FUSED`` (default 1): 0 runs the model op by op with the same matmul kernels."""
    v = os.environ.get("TANDEM_CPU_FUSED", "1").strip().lower()
    return v not in ("0", "false", "no", "off")


def _ptr(t: torch.Tensor | cpu.PackedQ4 | None) -> int | None:
    if t is None:
        return None
    if isinstance(t, cpu.PackedQ4):
        return t.data_ptr()
    if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in (torch.float32, torch.uint8):
        raise ValueError(f"fused forward needs contiguous f32/u8 CPU weights, got {t.dtype} {tuple(t.shape)}")
    return t.data_ptr()


class FusedForward:
    """Holds the C structs describing one ``Transformer`` (and keeps its tensors alive)."""

    def __init__(self, model) -> None:
        cfg = model.cfg
        self.cfg = cfg
        self._keep = [model.cos.contiguous(), model.sin.contiguous()]
        self._layers = (_Layer * cfg.n_layers)()
        for i, L in enumerate(model.layers):
            self._layers[i] = _Layer(*(_ptr(L.get(n)) for n in LAYER_FIELDS))
        self.packed = isinstance(model.output, cpu.PackedQ4)   # q16 (build: all matrices or none)
        self._model = _Model(cfg.n_layers, cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                             cfg.ffn_size, model.output.shape[0], model.cos.shape[0], int(self.packed),
                             int(isinstance(model.embed, cpu.PackedQ4)), cfg.rms_eps, model.scale,
                             ctypes.cast(self._layers, _vp), _ptr(model.embed), _ptr(model.output),
                             _ptr(model.output_norm), self._keep[0].data_ptr(), self._keep[1].data_ptr())
        self._lib = cpu._library()

    @classmethod
    def build(cls, model) -> "FusedForward | None":
        cfg = model.cfg
        if (not enabled() or model.device.type != "cpu" or model.ops is not cpu or not cpu.available()
                or cfg.head_dim % 16 or cfg.hidden_size % 32):
            return None
        mats = [L[k] for L in model.layers for k in ("qkv", "o", "gate_up", "down")] + [model.output]
        packed = [isinstance(w, cpu.PackedQ4) for w in mats]
        if any(packed):   # q16: every matrix packed, heads of whole blocks (each is quantized alone)
            return cls(model) if all(packed) and cfg.head_dim % 32 == 0 else None
        return cls(model) if cpu.act() == "f32" else None

    def __call__(self, token_ids: torch.Tensor, ctx, kv: torch.Tensor) -> torch.Tensor:
        """``Transformer.forward``: write the batch's KV into ``kv``, return logits [S, vocab]."""
        cfg = self.cfg
        if (kv.dtype != torch.float16 or not kv.is_contiguous() or kv.device.type != "cpu" or kv.dim() != 6
                or kv.shape[1:3] != (cfg.n_layers, 2) or kv.shape[4:] != (cfg.n_kv_heads, cfg.head_dim)):
            raise ValueError(f"kv must be a contiguous float16 CPU tensor, got {kv.dtype} {tuple(kv.shape)}")
        ids = token_ids.to(torch.int64).contiguous()
        tables = torch.cat([c.blocks for c in ctx.chunks]).to(torch.int64).contiguous()
        bs, max_ctx, n = kv.shape[3], self._model.max_ctx, ids.numel()
        meta, off, covered = [], 0, 0
        for c in ctx.chunks:  # the C++ side trusts these: check what would read out of bounds
            end = c.start + c.num_tokens
            if c.start < 0 or end > max_ctx or end > c.blocks.numel() * bs or c.token_offset != covered:
                raise ValueError(f"bad attention chunk {c.start}+{c.num_tokens} at {c.token_offset} "
                                 f"({c.blocks.numel()} blocks of {bs}, context {max_ctx})")
            meta += (c.start, c.num_tokens, c.token_offset, off)
            off += c.blocks.numel()
            covered += c.num_tokens
        rows = ctx.sample_rows.to(torch.int64).contiguous()
        if covered != n or not n or (tables.numel() and not 0 <= int(tables.min()) <= int(tables.max()) < kv.shape[0]):
            raise ValueError("chunks must cover the batch, with block ids inside the KV cache")
        if not 0 <= int(ids.min()) <= int(ids.max()) < self._model.vocab:
            raise ValueError(f"token ids must lie in [0, {self._model.vocab})")
        if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < n:
            raise ValueError(f"sample rows must lie in [0, {n})")
        chunks = torch.tensor(meta, dtype=torch.int64)
        logits = torch.empty(rows.numel(), self._model.vocab, dtype=torch.float32)
        batch = _Batch(ids.numel(), ids.data_ptr(), len(ctx.chunks), chunks.data_ptr(), tables.data_ptr(),
                       rows.numel(), rows.data_ptr(), kv.data_ptr(), bs, logits.data_ptr())
        self._lib.tq_forward(ctypes.byref(self._model), ctypes.byref(batch), cpu.get_num_threads(), cpu._isa_arg())
        return logits

