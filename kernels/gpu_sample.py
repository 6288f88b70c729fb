"""Token selection on the device, inside the decode step's CUDA graph: greedy argmax and seeded
sampling (temperature, top-k, top-p, min-p) for every row of a decode batch, so that a step of a
mixed batch is one decode replay, one sampler replay and **one device-to-host copy** (the
tokens). The host sampler (shared/engine/sampler.py) is the reference, and this is the same
procedure, row for row:

1. ``x = logits / temperature``; top-k keeps ``x >= `` the k-th largest value; top-p sorts the
   top-k row (ties by token index), drops a token when the mass before it already reaches
   ``top_p`` (the best token always stays); min-p drops ``p < min_p * max p``; ``p = softmax(x)``;
2. the draw is the host's inverse CDF in token order: the first token whose float64 running sum
   of ``p`` exceeds ``u * sum(p)``, with ``u`` the host's very uniform number for this request
   and output index — numpy's Philox-4x64-10 keyed by the seed, counter = the index, computed on
   the device by ``gpu_triton.philox_uniform`` (bit for bit numpy's; tested) — so a seeded
   request draws what it would draw on a CPU worker, before and after a migration, up to the
   float rounding of the two sides' sums (a token differs only where ``u`` falls within that
   rounding of a CDF boundary);
3. greedy rows take ``argmax(logits)`` — the very tensor the greedy-only graph returns, so their
   tokens are bitwise those of the host's argmax path.

A batch with no sampled row skips all of this (the decode graph's argmax alone). The sort only
runs in the "filtered" variant, replayed when some row has top-k or top-p. Rows the host must
see (logprobs, grammar masks, penalties) are not drawn here: their logits rows come to the host
as before (``sampler.on_device``).
"""

from __future__ import annotations

import torch

PHILOX_BLOCK = 64


def _k():
    from kernels import gpu
    return gpu.triton_kernels()


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, counters: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[i] = sampler.uniform(seed[i], counters[i])`` (float64), seeds as int32 halves of their
    64-bit pattern: one Triton launch, no host sync."""
    n = out.shape[0]
    if n:
        _k().philox_uniform[(-(-n // PHILOX_BLOCK),)](seed_lo, seed_hi, counters, out, n, BLOCK=PHILOX_BLOCK)
    return out


def seed_halves(seed: int) -> tuple[int, int]:
    """(low, high) 32-bit halves of a seed's 64-bit pattern, each as a signed int32 value."""
    s = seed & ((1 << 64) - 1)
    lo, hi = s & 0xFFFFFFFF, s >> 32
    return lo - (1 << 32) if lo >= 1 << 31 else lo, hi - (1 << 32) if hi >= 1 << 31 else hi


def probs(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
          filtered: bool) -> torch.Tensor:
    """The distribution each row draws from [B, V] (float32; 0 where filtered out): step 1 above
    with the row's parameters (temp float32 > 0, top_k int32 (0 or >= V: off), top_p float32 in
    (0, 1], min_p float32 in [0, 1]). ``filtered``: apply top-k / top-p (a sort of every row);
    without it they must be off in every row."""
    v = logits.shape[1]
    x = logits / temp[:, None]
    if filtered:
        sx, idx = torch.sort(x, dim=-1, descending=True, stable=True)   # (ties by index: the host's order)
        k = torch.where((top_k > 0) & (top_k < v), top_k, v).long()
        kth = sx.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
        ps = x.softmax(-1).gather(1, idx)      # (the host's: the row's softmax, in sorted order)
        drop = ((ps.cumsum(-1) - ps) >= top_p[:, None]) & (top_p < 1.0)[:, None]
        drop[:, 0] = False      # the best token always stays (as the host's: a top_p that is 0 in float32)
        x = x.masked_fill(torch.zeros_like(drop).scatter(1, idx, drop), float("-inf"))
    p = x.softmax(-1)
    x = x.masked_fill(p < min_p[:, None] * p.amax(-1, keepdim=True), float("-inf"))   # min_p 0: nothing
    return x.softmax(-1)


def draw(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Step 2 above: row i's token by inverse CDF of ``p[i]`` at ``u[i]`` (int64 [B])."""
    v = p.shape[1]
    cdf = p.double().cumsum(-1)
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    # u * total rounded up to the total: the last token of non-zero probability (as the host)
    last = torch.where(p > 0, torch.arange(v, device=p.device), -1).amax(-1)
    inside = tok.clamp(max=v - 1)
    return torch.where((tok >= v) | (p.gather(1, inside[:, None]).squeeze(1) <= 0), last, inside)


def select(logits: torch.Tensor, best: torch.Tensor, mode: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor, filtered: bool) -> torch.Tensor:
    """One token per row of ``logits`` [B, V] (int64 [B]): ``best`` where ``mode`` is 0, else the
    row's draw (``probs``, ``draw``; u float64). Fixed shapes, no host sync: capturable in a CUDA
    graph; plain torch, so it runs on the CPU as well."""
    tok = draw(probs(logits, temp, top_k, top_p, min_p, filtered), u)
    return torch.where(mode != 0, tok, best)
