"""``tandem quantize SRC DST.gguf``: write a Q4_0 GGUF that later loads without conversion.

SRC is a GGUF (any of the types the loader reads) or a Hugging Face safetensors directory.
The output is a valid llama.cpp GGUF: llama.cpp tensor names, Q/K rows in llama.cpp's rope
order for the llama arch, the source's metadata (architecture keys, tokenizer, chat template)
with ``general.file_type`` = MOSTLY_Q4_0; every matrix and the embedding are Q4_0, norms F32.
Loading DST with ``load_model`` gives weights byte-identical to loading SRC.

Steps: load SRC (conversion happens here, once) → metadata → tensors → DST.tmp → rename.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import time

import numpy as np
import torch

from shared.engine.loader import LoadedModel, load_model, rope_permute
from shared.engine.model_files import GGUFFile, ModelLoadError

log = logging.getLogger(__name__)

MOSTLY_Q4_0 = 2  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_0
# metadata the writer sets itself, or that no longer describes the output
_SKIP_KEYS = {"general.architecture", "general.file_type", "general.alignment", "general.quantization_version"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="source model: a GGUF file or a Hugging Face safetensors directory")
    parser.add_argument("dst", help="output GGUF path (written atomically)")
    parser.add_argument("--force", action="store_true", help="overwrite DST if it exists")


def main(args: argparse.Namespace) -> int:
    if not args.dst.endswith(".gguf"):
        log.error("DST must end in .gguf, got %s", args.dst)
        return 2
    if os.path.exists(args.dst) and not args.force:
        log.error("%s exists (use --force to overwrite)", args.dst)
        return 2
    where = os.path.dirname(os.path.abspath(args.dst))
    if not os.path.isdir(where) or not os.access(where, os.W_OK):   # said now, not after the conversion
        log.error("cannot write %s: %s is %s", args.dst, where,
                  "not a writable directory" if os.path.isdir(where) else "no directory")
        return 2
    t0 = time.monotonic()
    # SIGTERM / SIGHUP end it as Ctrl-C does: through quantize_model's clean-up of its temporary file
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        quantize_model(args.src, args.dst, progress=True)
    except (ModelLoadError, ValueError, OSError) as e:
        log.error("%s", e)
        return 1
    except KeyboardInterrupt:
        log.error("interrupted: %s not written", args.dst)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("wrote %s (%.1f MB) in %.1fs", args.dst, os.path.getsize(args.dst) / 1e6, time.monotonic() - t0)
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def quantize_model(src: str, dst: str, progress: bool = False, model: LoadedModel | None = None) -> None:
    """Convert ``src`` to a Q4_0 GGUF at ``dst`` (atomic: a temp file renamed into place).
    ``model``: ``load_model(src)`` when the caller already has it."""
    import gguf

    model = load_model(src, progress=progress) if model is None else model
    cfg = model.config
    writer_arch = cfg.arch
    tmp = f"{dst}.tmp{os.getpid()}"
    writer = gguf.GGUFWriter(tmp, writer_arch)
    try:
        if os.path.isdir(src):
            _metadata_from_dir(writer, model, src)
            order = None
        else:
            gf = GGUFFile(src)
            for key, (value, vtype, itype) in gf.fields.items():
                if key in _SKIP_KEYS:
                    continue
                if isinstance(value, np.ndarray):
                    value = value.tolist()
                writer.add_key_value(key, value, gguf.GGUFValueType(vtype),
                                     sub_type=gguf.GGUFValueType(itype) if itype is not None else None)
            order = [t.name for t in gf.tensors]
        writer.add_file_type(MOSTLY_Q4_0)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for name, data, qtype in _tensors(model, order):
            writer.add_tensor(name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=progress)
        writer.close()
        os.replace(tmp, dst)
    except BaseException:
        writer.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _gguf_tensor_name(name: str) -> str:
    """Our weight name -> llama.cpp tensor name."""
    if name.endswith("_bias"):
        return name[: -len("_bias")] + ".bias"
    return name + ".weight"


def _tensors(model: LoadedModel, order: list[str] | None):
    """(llama.cpp name, numpy data, GGML type) for every weight, in ``order`` when given."""
    from gguf import GGMLQuantizationType as T

    cfg = model.config
    names = [n for n in model.weights if not (n == "output" and cfg.tie_embeddings)]
    by_gguf = {_gguf_tensor_name(n): n for n in names}
    if order is not None:
        names = [by_gguf[g] for g in order if g in by_gguf] + [n for n in names if _gguf_tensor_name(n) not in order]
    for name in names:
        w = model.weights[name]
        if cfg.arch == "llama" and name.endswith((".attn_q", ".attn_k", ".attn_q_bias", ".attn_k_bias")):
            w = rope_permute(w, cfg.n_heads if ".attn_q" in name else cfg.n_kv_heads)
        if w.dtype == torch.uint8:
            yield _gguf_tensor_name(name), w.numpy(), T.Q4_0
        else:
            yield _gguf_tensor_name(name), w.to(torch.float32).numpy(), T.F32


# ---- metadata for a safetensors directory ------------------------------------------------------

def _metadata_from_dir(writer, model: LoadedModel, src: str) -> None:
    """llama.cpp metadata for a model that came from a HF directory (byte-level BPE tokenizers)."""
    cfg, tok = model.config, model.tokenizer
    writer.add_name(cfg.name)
    writer.add_context_length(cfg.max_context)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.ffn_size)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim != cfg.hidden_size // cfg.n_heads or cfg.arch == "qwen3":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    scaling = cfg.rope_scaling or {}
    stype = scaling.get("rope_type", scaling.get("type"))
    if stype == "llama3":
        model.weights["rope_freqs"] = llama3_rope_factors(cfg.head_dim, cfg.rope_theta, scaling)
    elif stype in ("linear", "yarn"):
        writer.add_rope_scaling_type(stype)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        if "original_max_position_embeddings" in scaling:
            writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    elif stype not in (None, "default"):
        raise ValueError(f"cannot write rope scaling type {stype!r} to GGUF")
    _tokenizer_metadata(writer, tok, src, cfg.arch)


def llama3_rope_factors(head_dim: int, base: float, s: dict) -> torch.Tensor:
    """llama.cpp's ``rope_freqs`` for llama3 rope scaling (as convert_hf_to_gguf.py computes it)."""
    factor = float(s.get("factor", 8.0))
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old = int(s.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _pre_name(pre_tokenizer: dict | None, arch: str) -> str:
    """llama.cpp's tokenizer.ggml.pre for a tokenizer.json pre-tokenizer."""
    from shared.engine.tokenizer import _GPT2_SPLIT, _LLAMA3_SPLIT, _QWEN2_SPLIT

    text = json.dumps(pre_tokenizer or {})
    if '"Digits"' in text and '"individual_digits": true' in text:
        return "smollm"
    for regex, name in ((_LLAMA3_SPLIT, "llama-bpe"), (_QWEN2_SPLIT, "qwen2"), (_GPT2_SPLIT, "gpt2")):
        if json.dumps(regex)[1:-1] in text:
            return name
    if '"ByteLevel"' in text and '"use_regex": true' in text:
        return "gpt2"
    return "qwen2" if arch in ("qwen2", "qwen3") else "default"


def _tokenizer_metadata(writer, tok, src: str, arch: str) -> None:
    with open(os.path.join(src, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    model = tj.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ValueError("quantize from a directory supports byte-level BPE tokenizers only "
                         f"(tokenizer.json model {model.get('type')!r}); convert with llama.cpp instead")
    n = tok.vocab_size
    tokens = [tok.id_to_piece(i) or f"[PAD{i}]" for i in range(n)]
    added = tok.backend.get_added_tokens_decoder()
    types = [(3 if added[i].special else 4) if i in added else 1 for i in range(n)]
    merges = model.get("merges", [])
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_name(tj.get("pre_tokenizer"), arch))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if tok.bos_token_id is not None:
        writer.add_bos_token_id(tok.bos_token_id)
    if tok.eos_token_id is not None:
        writer.add_eos_token_id(tok.eos_token_id)
    writer.add_add_bos_token(bool(tok.add_bos) or (tok.bos_token_id is not None and
                                                   tok.bos_token_id in tok.backend.encode("a").ids))
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)
