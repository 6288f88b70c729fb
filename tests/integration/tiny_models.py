"""Tiny random Hugging Face models (Llama / Qwen2 / Qwen3) saved as safetensors directories.

Used by ``test_architectures.py``. Every model is small enough to build, save, load and run in
well under a second on 2 cores, and shaped so that every matmul input width is a multiple of 32
(Q4_0). Weights are drawn wider than HF's default init (std 0.02) so that logits have a real
spread (a near-flat random model turns every position into a near-tie), and every norm weight and
bias is randomised too: a norm applied to the wrong tensor, a swapped bias or a missing one would
otherwise be invisible because HF initialises norms to 1 and biases to 0.

The tokenizer is a byte-level BPE with no merges (256 byte tokens), two special tokens and
ordinary added tokens padding it to exactly ``VOCAB`` ids, so any id the model emits decodes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

VOCAB = 320  # 256 bytes + <|im_start|> + <|im_end|> + 62 filler tokens
BOS, EOS = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass
class TinySpec:
    """One tiny model: an HF architecture plus the config fields that differ from the defaults."""
    id: str                                  # pytest id
    arch: str                                # "llama" | "qwen2" | "qwen3"
    config: dict = field(default_factory=dict)
    seed: int = 0


COMMON = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-6, "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": None}


def hf_classes(arch: str):
    import transformers

    return {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]


def save_tokenizer(d: str) -> None:
    """tokenizer.json (byte-level BPE, ``VOCAB`` ids) and tokenizer_config.json with a chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    assert len(vocab) == 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    tok.add_tokens([AddedToken(f"<filler{i}>", special=False) for i in range(VOCAB - 258)])
    assert tok.get_vocab_size() == VOCAB
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE}, f)


def build_hf_model(spec: TinySpec, std: float = 0.08):
    """A random HF model (fp32, eager attention, eval mode) for ``spec``."""
    cfg_cls, model_cls = hf_classes(spec.arch)
    cfg = cfg_cls(**{**COMMON, **spec.config})
    cfg._attn_implementation = "eager"
    torch.manual_seed(spec.seed)
    model = model_cls(cfg).eval()
    g = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias") or "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
        if model.config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
    return model


def save_tiny(spec: TinySpec, d: str):
    """Build the model, save it (safetensors) and the tokenizer into ``d``; return the HF model."""
    model = build_hf_model(spec)
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    save_tokenizer(d)
    return model
