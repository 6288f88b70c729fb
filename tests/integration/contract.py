"""The CPU↔GPU numerics contract, as one check both lanes run (tests/integration/test_contract.py
on the CPU kernels vs the f32 reference; tests/gpu/test_contract_cuda.py on CPU vs CUDA).

One weight format and one KV layout on every backend means a session moves between devices as
bytes; it does not mean bit-equal logits. The CPU engine runs q16 (int16 activations, exact Q4_0
weights, int32 sums: docs/kernels.md); the CUDA engine f32 activations (the fused Triton step,
kernels/gpu_step.py) like the torch reference. So the contract is stated on teacher-forced
logits of one 512-token text (every position's logits, the same tokens fed on both sides):

- max |Δ| ≤ ``MAX_ABS`` and mean |Δ| ≤ ``MEAN_ABS`` over all positions × vocabulary (logits of
  this model span about ±40). Measured 2026-11-27, CPU q16 vs the f32 reference on an Intel Xeon
  (AMX): max 0.021, mean 0.0018. The bounds are ~4× that: room for another CPU's summation
  order, not for a wrong kernel (a hi/lo nibble swap or an off-by-one slot moves logits by whole
  units);
- the same top-1 token wherever the reference side's top-2 margin exceeds ``2 × MAX_ABS`` (which
  the max bound implies) and at ≥ ``TOP1_SHARE`` of all positions (measured: every position);
- KV computed on one side continues on the other within the same bounds: the first 256 tokens
  prefilled on A and exported (the hand-off blob), the last 256 computed on B from that KV,
  against B's own logits of the whole text.
"""

from __future__ import annotations

import torch

from shared.engine.kv_cache import KVBlobHeader
from shared.engine.sampling import SamplingParams

MAX_ABS = 0.1
MEAN_ABS = 0.01
TOP1_SHARE = 0.99
TEXT_TOKENS = 512
SPLIT = 256          # whole blocks: the continuation's prefix


def text_ids(tokenizer) -> list[int]:
    text = ("The printing press changed how knowledge moved through Europe. Before it, books were copied "
            "by hand in monasteries, slowly and at great cost; a single Bible could take a scribe years. "
            "Gutenberg's movable type, around 1450, made a page something a workshop could set once and "
            "print many times. Within fifty years presses ran in more than two hundred towns. Prices fell, "
            "literacy rose, and ideas that would once have stayed in one library crossed borders in weeks. ")
    ids = tokenizer.encode(text * 8)[:TEXT_TOKENS]
    assert len(ids) == TEXT_TOKENS
    return ids


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """The contract's figures for logits ``a`` against the reference side ``b`` (both [n, vocab])."""
    a, b = a.float().cpu(), b.float().cpu()
    d = (a - b).abs()
    top2 = b.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * MAX_ABS
    same = a.argmax(-1) == b.argmax(-1)
    return {"max": float(d.max()), "mean": float(d.mean()), "top1": float(same.float().mean()),
            "clear_same": bool(same[clear].all()), "clear": int(clear.sum())}


def holds(f: dict) -> bool:
    return f["max"] <= MAX_ABS and f["mean"] <= MEAN_ABS and f["top1"] >= TOP1_SHARE and f["clear_same"]


def prefix_kv(engine, ids: list[int]) -> bytes:
    """The KV of ``ids`` computed by ``engine`` (a prefill-only request, exported as for a hand-off)."""
    engine.add("contract-prefix", ids, SamplingParams(max_tokens=2, temperature=0.0), prefill_only=True)
    while engine.has_work():
        engine.step()
    h, kv = KVBlobHeader.parse(engine.export_kv("contract-prefix"))
    assert h.num_computed == len(ids) and len(ids) % engine.layout.block_size == 0
    return bytes(kv)


def check(a, b, la=None, lb=None) -> dict[str, dict]:
    """The contract between engines ``a`` and ``b`` (``b`` is the reference side): the whole
    text on each (``la``, ``lb``: its logits, when computed already), and KV of its first SPLIT
    tokens handed over either way."""
    ids = text_ids(a.tokenizer)
    la = a.prompt_logits(ids) if la is None else la
    lb = b.prompt_logits(ids) if lb is None else lb
    out = {"whole": compare(la, lb)}
    out["a_to_b"] = compare(b.prompt_logits(ids, prefix_kv(a, ids[:SPLIT])), lb[SPLIT:])
    out["b_to_a"] = compare(a.prompt_logits(ids, prefix_kv(b, ids[:SPLIT])), la[SPLIT:])
    return out
