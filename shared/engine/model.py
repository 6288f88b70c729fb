"""The transformer forward pass over a flat batch of tokens (Llama / Qwen2 / Qwen3).

All sequences of a step are concatenated into one [T, D] activation, so every matmul runs once
per layer for the whole batch (continuous batching, chunked prefill and decode mixed). Attention
reads and writes the paged KV cache (``kv_cache.py``) through the per-step ``StepContext``.
Weights are Q4_0 bytes (``kernels/q4_0.py``) on every device; norms and biases are float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shared.engine.config import ModelConfig
from shared.engine.loader import release_freed_memory


@dataclass
class AttnChunk:
    """One sequence's slice of the flat batch."""
    start: int               # position of the chunk's first token in its sequence
    num_tokens: int          # tokens computed in this step
    token_offset: int        # index of the chunk's first token in the flat batch
    blocks: torch.Tensor     # block ids covering positions [0, start + num_tokens), int64 [nb]
    block_ids: list[int] = field(default_factory=list)  # the same ids on the host (the GPU step's tables)


@dataclass
class StepContext:
    """What the attention layers need for one forward step."""
    positions: torch.Tensor     # [T] int64
    slot_blocks: torch.Tensor   # [T] int64: KV block of each new token
    slot_offsets: torch.Tensor  # [T] int64: slot inside that block
    chunks: list[AttnChunk]
    sample_rows: torch.Tensor   # [S] int64: rows of the flat batch whose logits are wanted


def rope_inv_freq(cfg: ModelConfig, rope_freqs: torch.Tensor | None) -> torch.Tensor:
    """Rotary inverse frequencies as Hugging Face computes them (incl. llama3 / linear scaling)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if rope_freqs is not None:  # llama.cpp stores llama3 scaling as per-frequency factors
        return inv / rope_freqs.float()
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind == "llama3":
        factor = float(rs["factor"])
        lo, hi = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs["original_max_position_embeddings"])
        lo_wav, hi_wav = old_ctx / lo, old_ctx / hi
        wav = 2 * math.pi / inv
        scaled = torch.where(wav > lo_wav, inv / factor, inv)
        smooth = (old_ctx / wav - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wav >= hi_wav) & (wav <= lo_wav)
        return torch.where(is_mid, mid, scaled)
    if kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    return inv


def _fused_forward(model: "Transformer"):
    """kernels.cpu_forward.FusedForward for ``model``, or None (op-by-op forward)."""
    try:
        from kernels.cpu_forward import FusedForward
    except ImportError:
        return None
    return FusedForward.build(model)


LAYER_WEIGHTS = ("attn_norm", "qkv", "o", "ffn_norm", "gate_up", "down", "qkv_bias", "q_norm", "k_norm")


def runtime_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], prepare=None,
                    consume: bool = False) -> dict[str, torch.Tensor]:
    """The loader's weights (``loader.py`` names) in the form the model runs on, on CPU:
    ``blk.{i}.{LAYER_WEIGHTS}`` (q|k|v and gate|up fused: row concatenation is exact on Q4_0
    bytes; biases and q/k norms only where the arch has them), ``embed``, ``output`` (the same
    object when tied), ``output_norm`` and, when the model has one, ``rope_freqs``.
    ``prepare(q)``: the layout the kernels run fastest on (CPU q16: ``kernels.cpu.PackedQ4``),
    applied to every matrix. ``consume``: take the tensors out of ``weights`` one matrix at a time,
    so the loader's separate copies are freed as we go (the caller's dict ends up empty).
    The weight cache (``weight_cache.py``) stores exactly this dict."""
    src = weights if consume else dict(weights)
    prepare = prepare or (lambda q: q)
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        out[p + "attn_norm"] = src.pop(p + "attn_norm").float()
        out[p + "qkv"] = prepare(torch.cat([src.pop(p + "attn_q"), src.pop(p + "attn_k"), src.pop(p + "attn_v")]))
        out[p + "o"] = prepare(src.pop(p + "attn_output"))
        out[p + "ffn_norm"] = src.pop(p + "ffn_norm").float()
        out[p + "gate_up"] = prepare(torch.cat([src.pop(p + "ffn_gate"), src.pop(p + "ffn_up")]))
        out[p + "down"] = prepare(src.pop(p + "ffn_down"))
        if cfg.attn_bias:
            out[p + "qkv_bias"] = torch.cat([src.pop(p + "attn_q_bias"), src.pop(p + "attn_k_bias"),
                                             src.pop(p + "attn_v_bias")]).float()
        if cfg.qk_norm:
            out[p + "q_norm"] = src.pop(p + "attn_q_norm").float()
            out[p + "k_norm"] = src.pop(p + "attn_k_norm").float()
        if consume:  # the layer's separate tensors are garbage now: give their pages back
            release_freed_memory()
    tied = src.get("output") is None or src.get("output") is src.get("token_embd")
    embed = src.pop("token_embd")
    out["output"] = prepare(embed if tied else src.pop("output"))
    out["embed"] = out["output"] if tied else embed  # tied: the embedding reads rows of the lm head
    src.pop("output", None)
    out["output_norm"] = src.pop("output_norm").float()
    if "rope_freqs" in src:
        out["rope_freqs"] = src.pop("rope_freqs").float()
    return out


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, ops):
        """``weights``: the ``runtime_weights`` form (CPU tensors, or read-only views of the weight
        cache's mapping; they are moved to ``device`` where that is not the CPU)."""
        self.cfg = cfg
        self.device = device
        self.ops = ops  # matmul(x, q) / embedding(ids, q) with Q4_0 weights (optional: prepare(q))

        def on_device(t):
            return t if device.type == "cpu" else t.to(device)

        self.layers = [{k: on_device(weights[f"blk.{i}.{k}"]) for k in LAYER_WEIGHTS if f"blk.{i}.{k}" in weights}
                       for i in range(cfg.n_layers)]
        self.output = on_device(weights["output"])
        self.embed = self.output if weights["embed"] is weights["output"] else on_device(weights["embed"])
        self.output_norm = on_device(weights["output_norm"])
        inv = rope_inv_freq(cfg, weights.get("rope_freqs"))
        pos = torch.arange(cfg.max_context, dtype=torch.float32)
        freqs = torch.outer(pos, inv)  # [max_ctx, head_dim/2]
        self.cos, self.sin = freqs.cos().to(device), freqs.sin().to(device)
        self.q_size = cfg.n_heads * cfg.head_dim
        self.kv_size = cfg.n_kv_heads * cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.fused = _fused_forward(self)  # the whole step in C++ where it applies (CPU kernels)
        self.gpu = None  # kernels.gpu_step.GpuStep: the whole step in fused Triton kernels (set by the engine)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps) * w

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]; cos/sin: [T, 1, D/2]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, token_ids: torch.Tensor, ctx: StepContext, kv: torch.Tensor) -> torch.Tensor:
        """Run the flat batch; write its KV into ``kv``; return logits [S, vocab] of ``ctx.sample_rows``."""
        if self.gpu is not None:
            return self.gpu.forward(token_ids, ctx, kv)
        if self.fused is not None:
            return self.fused(token_ids, ctx, kv)
        return self.forward_ops(token_ids, ctx, kv)

    def forward_ops(self, token_ids: torch.Tensor, ctx: StepContext, kv: torch.Tensor) -> torch.Tensor:
        """``forward`` op by op in torch around ``ops.matmul`` (the reference; CUDA; any device)."""
        cfg, mm = self.cfg, self.ops.matmul
        hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        x = self.ops.embedding(token_ids, self.embed)  # [T, D]
        cos = self.cos[ctx.positions].unsqueeze(1)     # [T, 1, hd/2]
        sin = self.sin[ctx.positions].unsqueeze(1)
        for li, L in enumerate(self.layers):
            h = self._norm(x, L["attn_norm"])
            qkv = mm(h, L["qkv"])                       # [T, (nh + 2 nkv) * hd]
            if "qkv_bias" in L:
                qkv = qkv + L["qkv_bias"]
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(-1, nh, hd)
            k = k.reshape(-1, nkv, hd)
            v = v.reshape(-1, nkv, hd)
            if "q_norm" in L:
                q = self._norm(q, L["q_norm"])
                k = self._norm(k, L["k_norm"])
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
            layer_kv = kv[:, li]                        # [nblocks, 2, bs, nkv, hd]
            layer_kv[ctx.slot_blocks, 0, ctx.slot_offsets] = k.to(kv.dtype)
            layer_kv[ctx.slot_blocks, 1, ctx.slot_offsets] = v.to(kv.dtype)
            attn = self._attention(q, layer_kv, ctx)    # [T, nh * hd]
            x = x + mm(attn, L["o"])
            h = self._norm(x, L["ffn_norm"])
            gu = mm(h, L["gate_up"])                    # [T, 2 * ffn]
            g, u = gu.chunk(2, dim=-1)
            x = x + mm(F.silu(g) * u, L["down"])
        h = self._norm(x.index_select(0, ctx.sample_rows), self.output_norm)
        return mm(h, self.output)                       # [S, vocab]

    def _attention(self, q: torch.Tensor, layer_kv: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        # One sequence at a time, so a sequence's numbers do not depend on its batch neighbours.
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        for c in ctx.chunks:
            n, ctx_len = c.num_tokens, c.start + c.num_tokens
            qs = q[c.token_offset:c.token_offset + n].transpose(0, 1).unsqueeze(0)   # [1, nh, n, hd]
            blk = layer_kv.index_select(0, c.blocks)                                  # [nb, 2, bs, nkv, hd]
            k = blk[:, 0].flatten(0, 1)[:ctx_len].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, nkv, L, hd]
            v = blk[:, 1].flatten(0, 1)[:ctx_len].transpose(0, 1).unsqueeze(0).to(q.dtype)
            if n == 1:
                # torch's one-query CPU kernel splits the context across threads, so its result
                # depends on the thread count; the multi-query kernel does not. Two copies of the
                # query keep every worker's numbers equal whatever its thread count.
                qs = qs.expand(1, qs.shape[1], 2, qs.shape[3])
                mask = torch.ones(2, ctx_len, dtype=torch.bool, device=q.device)
            else:  # causal, with the chunk's queries at the end of the context
                qpos = torch.arange(c.start, ctx_len, device=q.device).unsqueeze(1)
                mask = torch.arange(ctx_len, device=q.device).unsqueeze(0) <= qpos   # [n, L]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=self.scale,
                                               enable_gqa=True)                       # [1, nh, n, hd]
            out[c.token_offset:c.token_offset + n] = o[0, :, :n].transpose(0, 1).reshape(n, -1)
        return out
