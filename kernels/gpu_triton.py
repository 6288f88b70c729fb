"""The Triton kernels behind ``kernels.gpu`` (imported on first use: Triton reads
TRITON_INTERPRET when a kernel is defined, and its kernels must live at module level).
The layout and the math are described in kernels/gpu.py."""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"   # how these kernels were defined


@triton.jit
def _scale(q_ptr, off, mask):
    """The fp16 block scale at byte offsets ``off`` (little endian), as f32."""
    lo = tl.load(q_ptr + off, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(q_ptr + off + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def gemv(x_ptr, q_ptr, out_ptr, N, K, row_bytes, stride_xm, stride_om,
         BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BN]; int64: byte offsets pass 2**31
    b = tl.arange(0, BLOCK_B)                                  # [BB]
    j = tl.arange(0, 16)                                       # [16]
    n_ok = n < N
    nb = K // 32
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for kb in range(0, nb, BLOCK_B):
        blk = kb + b                                           # [BB]
        b_ok = blk < nb
        base = n[:, None] * row_bytes + blk[None, :] * 18      # [BN, BB]
        ok2 = n_ok[:, None] & b_ok[None, :]
        d = _scale(q_ptr, base, ok2)                           # [BN, BB]
        ok3 = ok2[:, :, None]
        qs = tl.load(q_ptr + base[:, :, None] + 2 + j[None, None, :], mask=ok3, other=0)  # [BN, BB, 16]
        k_lo = blk[:, None] * 32 + j[None, :]                  # [BB, 16]
        x_lo = tl.load(x_ptr + m * stride_xm + k_lo, mask=b_ok[:, None], other=0.0)
        x_hi = tl.load(x_ptr + m * stride_xm + k_lo + 16, mask=b_ok[:, None], other=0.0)
        w_lo = ((qs & 15).to(tl.int32) - 8).to(tl.float32) * d[:, :, None]
        w_hi = ((qs >> 4).to(tl.int32) - 8).to(tl.float32) * d[:, :, None]
        part = w_lo * x_lo[None, :, :] + w_hi * x_hi[None, :, :]
        acc += tl.sum(tl.sum(part, axis=2), axis=1)
    tl.store(out_ptr + m * stride_om + n, acc, mask=n_ok)


@triton.jit
def gemm(x_ptr, q_ptr, out_ptr, M, N, K, row_bytes, stride_xm, stride_om,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BN]
    t = tl.arange(0, BLOCK_B * 16)                             # [T]: block t // 16, byte t % 16
    m_ok = m < M
    n_ok = n < N
    nb = K // 32
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, nb, BLOCK_B):
        blk = kb + t // 16                                     # [T]
        t_ok = blk < nb
        k_lo = blk * 32 + t % 16                               # [T]
        x_ok = m_ok[:, None] & t_ok[None, :]
        x_lo = tl.load(x_ptr + m[:, None] * stride_xm + k_lo[None, :], mask=x_ok, other=0.0)   # [BM, T]
        x_hi = tl.load(x_ptr + m[:, None] * stride_xm + k_lo[None, :] + 16, mask=x_ok, other=0.0)
        base = n[None, :] * row_bytes + blk[:, None] * 18      # [T, BN]
        w_ok = t_ok[:, None] & n_ok[None, :]
        d = _scale(q_ptr, base, w_ok)
        qs = tl.load(q_ptr + base + 2 + (t % 16)[:, None], mask=w_ok, other=0)              # [T, BN]
        w_lo = ((qs & 15).to(tl.int32) - 8).to(tl.float32) * d
        w_hi = ((qs >> 4).to(tl.int32) - 8).to(tl.float32) * d
        acc = tl.dot(x_lo, w_lo, acc, input_precision="ieee")
        acc = tl.dot(x_hi, w_hi, acc, input_precision="ieee")
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
