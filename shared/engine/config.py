"""Model configuration: the shape of a decoder-only transformer, whatever file it came from.

Built by the loader from GGUF metadata (``from_gguf_fields``) or a Hugging Face
``config.json`` (``from_hf_config``). Both raise ``ValueError`` naming the bad or missing key;
the loader wraps that in ``ModelLoadError`` with the path.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass
from typing import Any, Callable

# GGUF general.architecture / HF "architectures"[0] -> our arch name
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
QK = 32  # Q4_0 block length: every matmul input dimension must be a multiple


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


@dataclass
class ModelConfig:
    arch: str                   # "llama" | "qwen2" | "qwen3"
    name: str                   # human-readable model name (general.name / directory name)
    vocab_size: int             # rows of token_embd (and of output)
    hidden_size: int            # residual width
    n_layers: int               # transformer blocks
    n_heads: int                # query heads
    n_kv_heads: int             # key/value heads (GQA when < n_heads)
    head_dim: int               # per-head width (qwen3 may differ from hidden_size / n_heads)
    ffn_size: int               # SwiGLU intermediate width
    rope_theta: float           # rope base frequency
    rope_scaling: dict | None   # HF-style dict ({"rope_type": "llama3"|"linear"|"yarn", ...}) or None
    rms_eps: float              # RMSNorm epsilon
    max_context: int            # trained context length
    tie_embeddings: bool        # output projection is token_embd
    qk_norm: bool               # per-head RMSNorm on q and k (qwen3)
    attn_bias: bool             # q/k/v projections carry biases (qwen2)

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self) -> "ModelConfig":
        """Raise ValueError naming the first inconsistent field; return self."""
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unknown architecture {self.arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        for f in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                  "ffn_size", "max_context"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rope, got {self.head_dim}")
        for f in ("hidden_size", "ffn_size"):
            if getattr(self, f) % QK:
                raise ValueError(f"{f} {getattr(self, f)} is not divisible by {QK} (Q4_0 block length)")
        if (self.n_heads * self.head_dim) % QK:
            raise ValueError(f"n_heads * head_dim = {self.n_heads * self.head_dim} is not divisible by {QK}")
        return self

    # ---- builders -------------------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, get: Callable[[str, Any], Any], tensor_names: set[str]) -> "ModelConfig":
        """From GGUF metadata. ``get(key, default)`` returns a field's value (default when absent)."""
        _missing = object()
        arch = get("general.architecture", None)
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unknown architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

        def req(key: str) -> Any:
            v = get(f"{arch}.{key}", _missing)
            if v is _missing:
                raise ValueError(f"missing metadata key {arch}.{key}")
            return v

        hidden = int(req("embedding_length"))
        n_heads = int(req("attention.head_count"))
        n_kv = int(get(f"{arch}.attention.head_count_kv", n_heads))
        head_dim = int(get(f"{arch}.attention.key_length", hidden // n_heads))
        vocab = get(f"{arch}.vocab_size", None)
        if vocab is None:
            tokens = get("tokenizer.ggml.tokens", None)
            if tokens is None:
                raise ValueError(f"missing metadata key {arch}.vocab_size and tokenizer.ggml.tokens")
            vocab = len(tokens)
        scaling = None
        stype = get(f"{arch}.rope.scaling.type", None)
        if stype not in (None, "none"):
            scaling = {"rope_type": stype, "factor": float(get(f"{arch}.rope.scaling.factor", 1.0))}
            orig = get(f"{arch}.rope.scaling.original_context_length", None)
            if orig is not None:
                scaling["original_max_position_embeddings"] = int(orig)
        return cls(
            arch=arch,
            name=str(get("general.name", arch)),
            vocab_size=int(vocab),
            hidden_size=hidden,
            n_layers=int(req("block_count")),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            ffn_size=int(req("feed_forward_length")),
            rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rms_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            max_context=int(get(f"{arch}.context_length", 4096)),
            tie_embeddings="output.weight" not in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            attn_bias="blk.0.attn_q.bias" in tensor_names,
        )

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str) -> "ModelConfig":
        """From a Hugging Face ``config.json`` dict."""
        archs = cfg.get("architectures") or []
        arch = next((HF_ARCHS[a] for a in archs if a in HF_ARCHS), None)
        if arch is None:
            raise ValueError(f"unknown architecture {archs!r} in config.json "
                             f"(supported: {', '.join(HF_ARCHS)})")
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size"):
            if key not in cfg:
                raise ValueError(f"config.json has no {key!r}")
        n_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        scaling = cfg.get("rope_scaling") or None
        theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 spelling
        if isinstance(rope_params, dict):
            theta = rope_params.get("rope_theta", theta)
            if scaling is None and rope_params.get("rope_type", "default") != "default":
                scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        return cls(
            arch=arch,
            name=name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or hidden // n_heads),
            ffn_size=int(cfg["intermediate_size"]),
            # float32-rounded, as GGUF stores them: a directory and its GGUF give equal configs
            rope_theta=_f32(theta if theta is not None else 10000.0),
            rope_scaling=dict(scaling) if scaling else None,
            rms_eps=_f32(cfg.get("rms_norm_eps", 1e-6)),
            max_context=int(cfg.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=arch == "qwen3",
            attn_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        )
