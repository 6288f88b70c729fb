"""Q4_0 kernels for CUDA devices, in Triton: the signatures of ``kernels.q4_0`` (the oracle).

``matmul(x, q, out=None)`` computes ``x @ W.T`` for float32 activations x [M, K] and Q4_0
bytes q [N, K/32*18] on the GPU without ever materialising W in float:

- **GEMV** (M <= ``GEMV_MAX_M``: decode): one program per (BLOCK_N weight rows, activation row);
  it walks K in runs of BLOCK_B Q4_0 blocks, rebuilds each weight exactly as
  ``(nibble - 8) * d`` in f32 registers and reduces ``w * x`` over the run — memory bound, every
  weight byte read once per activation row (the rows of a small M hit L2).
- **GEMM** (M > GEMV_MAX_M): the fused step's ``qmatmul`` without its prologues (kernels/gpu_step.py):
  one program per 64 x 64 output tile; per run of BLOCK_B blocks the weights are dequantized into
  a [BLOCK_N, BLOCK_B*16] tile twice (low nibbles: weights 0..15 of each block; high nibbles:
  16..31) and multiplied with the matching activation columns by ``tl.dot`` in IEEE f32
  (``input_precision="ieee"``): no TF32 rounding of the activations, so the result matches the
  reference's f32 matmul up to summation order.

The weights stay in the one Q4_0 layout (llama.cpp's ``block_q4_0``, the bytes every backend and
the KV pool see); nothing is repacked. ``embedding`` is a row gather + dequantize on the device
(the reference's, which runs on CUDA tensors as is).

The kernels are built on first use; with ``TRITON_INTERPRET=1`` Triton runs them on the CPU
(numpy), which is how the tests check them on a machine without a GPU
(tests/unit/test_kernels_gpu.py); tests/gpu/ runs them on CUDA where a device exists.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from kernels import q4_0

GEMV_MAX_M = 512        # at most this many activation rows run as GEMV programs (H200: GEMV beat the GEMM
                        # kernel at every M <= 512 on every SmolLM2 shape, 4-18x; docs/kernels.md "GPU")
BLOCK_B = 4             # Q4_0 blocks (of 32 weights) per step of the K loop: 128 weights
_module = None          # kernels.gpu_triton once imported


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _triton():
    """The triton module, or None when it cannot be imported."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no GPU kernels
        return None
    return triton


def available() -> bool:
    """Whether ``matmul`` runs the Triton kernels here: triton imports and a CUDA device exists
    (or the interpreter is on)."""
    return _triton() is not None and (torch.cuda.is_available() or interpreting())


def triton_kernels():
    """kernels.gpu_triton, defined for the current TRITON_INTERPRET (reloaded when it changed)."""
    global _module
    if _triton() is None:
        raise RuntimeError("triton is not installed: the Q4_0 GPU kernels need it (pip install triton)")
    if _module is None:
        _module = importlib.import_module("kernels.gpu_triton")
    if _module.INTERPRET != interpreting():
        _module = importlib.reload(_module)
    return _module


def _describe(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ' (non-contiguous)'}"


def matmul(x: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for float32 x [M, K] and Q4_0 bytes q [N, K/32*18] on one device → float32 [M, N]."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 2-D float32 tensor, got {_describe(x)}")
    if (not isinstance(q, torch.Tensor) or q.dtype != torch.uint8 or q.dim() != 2 or not q.is_contiguous()
            or q.shape[1] % q4_0.BLOCK_BYTES):
        raise ValueError(f"q must be a contiguous 2-D uint8 Q4_0 tensor of whole blocks, got {_describe(q)}")
    if q.device != x.device:
        raise ValueError(f"x and q must be on one device, got {x.device} and {q.device}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"the Triton kernels run on CUDA tensors, got {x.device} (TRITON_INTERPRET=1 runs them on the CPU)")
    m, k = x.shape
    n = q.shape[0]
    if k % q4_0.QK or q.shape[1] != k // q4_0.QK * q4_0.BLOCK_BYTES:
        raise ValueError(f"x width {k} does not match q rows of {q.shape[1]} bytes")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    elif (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or tuple(out.shape) != (m, n)
          or out.device != x.device or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous float32 tensor of shape {(m, n)} on {x.device}, got {_describe(out)}")
    if m == 0 or n == 0:
        return out
    kern = triton_kernels()
    if m <= GEMV_MAX_M:
        block_n = 64
        kern.gemv[(-(-n // block_n), m)](x, q, out, n, k, q.shape[1], x.stride(0), out.stride(0),
                                         BLOCK_N=block_n, BLOCK_B=BLOCK_B)
    else:   # the fused step's matmul, plain: each weight block dequantized once per 64-row tile
        q = q.contiguous()
        kern.qmatmul[(-(-n // 64), -(-m // 64))](x, q, q.view(torch.float16), out, x, out, out, m, n, x.stride(0),
                                                 out.stride(0), 0.0, 0, K=k, BLOCK_M=64, BLOCK_N=64, BLOCK_B=BLOCK_B,
                                                 NORM=False, SILU=False, RESIDUAL=False, SPLIT=False, FIXUP=False,
                                                 PRECISION="ieee", NORM_W=16, PDL=0, PREFETCH=False)
    return out


def embedding(ids: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a Q4_0 table as float32 [len(ids), K], on q's device (the reference's gather)."""
    return q4_0.embedding(ids, q)
