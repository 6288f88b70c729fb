"""Q4_0 reference operations in plain torch: the test oracle for every fast path.

Layout (llama.cpp's ``block_q4_0``): a weight row of K values is cut into K/32 blocks;
each block is 18 bytes: an fp16 scale ``d`` (little endian) followed by 16 bytes ``qs``.
Byte j of ``qs`` holds weight j in its low nibble and weight j+16 in its high nibble.
A weight is ``(nibble - 8) * d``. A matrix [N, K] is stored as uint8 [N, K/32*18], row-major,
so a row of the matrix is a contiguous run of blocks.
"""

from __future__ import annotations

import torch

QK = 32  # weights per block
BLOCK_BYTES = 18  # 2 (fp16 scale) + 16 (32 nibbles)


def row_bytes(k: int) -> int:
    """Bytes of one Q4_0 row of ``k`` weights."""
    if k % QK:
        raise ValueError(f"Q4_0 needs a row length divisible by {QK}, got {k}")
    return k // QK * BLOCK_BYTES


def quantize(w: torch.Tensor) -> torch.Tensor:
    """Quantize float weights [N, K] to Q4_0 bytes [N, K/32*18] (llama.cpp's reference rounding)."""
    if w.dim() != 2:
        raise ValueError(f"quantize expects a 2-D tensor, got shape {tuple(w.shape)}")
    n, k = w.shape
    row_bytes(k)
    x = w.detach().to(torch.float32).reshape(n, k // QK, QK)
    # the value with the largest magnitude, sign kept (first one on ties, as llama.cpp)
    idx = x.abs().argmax(dim=-1, keepdim=True)
    vmax = torch.gather(x, -1, idx)  # [n, nb, 1]
    d = vmax / -8.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc(x * inv + 8.5), max=15).to(torch.uint8)  # [n, nb, 32]
    qs = q[..., :16] | (q[..., 16:] << 4)
    scale = d.to(torch.float16).view(torch.uint8)  # [n, nb, 2]
    return torch.cat([scale, qs], dim=-1).reshape(n, k // QK * BLOCK_BYTES).contiguous()


def dequantize(q: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    """Q4_0 bytes [N, K/32*18] (or a row slice of them) -> float32 [N, K]."""
    if q.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] % BLOCK_BYTES:
        raise ValueError(f"not a Q4_0 byte matrix: dtype {q.dtype}, shape {tuple(q.shape)}")
    if rows is not None:
        q = q[rows]
    n, nbytes = q.shape
    nb = nbytes // BLOCK_BYTES
    b = q.reshape(n, nb, BLOCK_BYTES)
    d = b[..., :2].contiguous().view(torch.float16).to(torch.float32)  # [n, nb, 1]
    qs = b[..., 2:]
    lo = (qs & 0x0F).to(torch.int8) - 8
    hi = (qs >> 4).to(torch.int8) - 8
    vals = torch.cat([lo, hi], dim=-1).to(torch.float32)  # [n, nb, 32]
    return (vals * d).reshape(n, nb * QK)


def matmul(x: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None,
           chunk_rows: int = 4096) -> torch.Tensor:
    """``x @ W.T`` for float32 activations x [M, K] and Q4_0 weights W (bytes [N, K/32*18]).

    Dequantizes ``chunk_rows`` rows at a time, so no full float copy of W ever exists.
    """
    m, k = x.shape
    n = q.shape[0]
    if q.shape[1] != row_bytes(k):
        raise ValueError(f"activation width {k} does not match Q4_0 row of {q.shape[1]} bytes")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if n <= chunk_rows:
        return torch.matmul(x, dequantize(q).T, out=out)
    for r0 in range(0, n, chunk_rows):
        r1 = min(n, r0 + chunk_rows)
        out[:, r0:r1] = x @ dequantize(q, slice(r0, r1)).T
    return out


def embedding(ids: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a Q4_0 embedding table, as float32 [len(ids), K]."""
    return dequantize(q.index_select(0, ids.reshape(-1)))


Q16_MAX = 32639  # q16 activations: per 32 values, scale amax / Q16_MAX (= 127 * 257: two signed bytes)


def quantize_q16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The q16 activation quantization (the CPU kernels' default mode), as the oracle: x [M, K]
    float32 → (int16 [M, K], float32 scales [M, K/32]). Per block of 32: d = amax / Q16_MAX,
    q = round-half-even(x * (1 / d)) clamped to ±Q16_MAX (d = 0: q = 0)."""
    m, k = x.shape
    row_bytes(k)
    b = x.to(torch.float32).reshape(m, k // QK, QK)
    d = b.abs().amax(-1) / Q16_MAX
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * inv[..., None]).clamp(-Q16_MAX, Q16_MAX)   # torch.round: half to even
    return q.to(torch.int16).reshape(m, k), d


def matmul_q16(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` the way the q16 kernels define it (the oracle for ``kernels.cpu`` on packed
    weights): per block, the exact integer dot of the weights' nibbles - 8 with ``quantize_q16(x)``,
    times d_w * d_x, summed over blocks — here in float64, so the kernels' f32 result differs
    from it only by the f32 rounding of the block sums (~1e-7 relative)."""
    m, k = x.shape
    if q.shape[1] != row_bytes(k):
        raise ValueError(f"activation width {k} does not match Q4_0 row of {q.shape[1]} bytes")
    xq, dx = quantize_q16(x)
    n, nb = q.shape[0], k // QK
    blk = q.reshape(n, nb, BLOCK_BYTES)
    dw = blk[..., :2].contiguous().view(torch.float16).to(torch.float32).reshape(n, nb)
    w = torch.cat([(blk[..., 2:] & 0x0F).to(torch.int64) - 8, (blk[..., 2:] >> 4).to(torch.int64) - 8], dim=-1)
    dots = torch.einsum("nbj,mbj->mnb", w, xq.to(torch.int64).reshape(m, nb, QK))   # exact integers
    scale = (dw[None, :, :] * dx[:, None, :]).to(torch.float64)                     # d_w * d_x in f32
    return (dots.to(torch.float64) * scale).sum(-1).to(torch.float32)
