"""The whole forward step on a GPU in a few fused Triton kernels (in ``kernels/gpu_triton.py``),
and the decode step captured as a CUDA graph per batch-size bucket.

Why: the op-by-op path (``Transformer.forward_ops``) launched ~1,860 kernels for one decode step
of one sequence on an H200 (32.9 ms of wall time for 4.3 ms of GPU work), and ran attention per
sequence. Here a layer of a decode-only step is five launches for the whole batch (six in a step
with prefill chunks: ``rope_kv`` on its own), the split-K sums and attention's key segments added
up by each launch's last program to finish (``_last_arrival`` in kernels/gpu_triton.py;
TANDEM_GPU_REDUCE=launch: each of these by a launch of its own, as before, the sums' bits the same):

1. ``qmatmul`` q|k|v — RMSNorm of the residual stream in its prologue (each program recomputes
   its rows' RMS over the whole of K: the rows are a few KB and in L2), every Q4_0 weight block
   dequantized once for all activation rows of the tile (``tl.dot``, f32 "ieee" by default:
   no TF32 rounding of the activations), split over K where N alone gives few programs (its
   partial sums left for the next kernel to add as it reads them);
2. ``rope_kv`` (steps with prefill chunks) — q|k|v's split partial sums added as they are read,
   bias and per-head norm where the arch has them, rotary embedding, and the new token's key and
   value written into its KV slot (float16), one program per (token, head); in a decode-only step
   ``attn_decode`` does this for its token (the kv head's key and value by the program of the
   segment that holds the token, before it reads the keys);
3. attention over the paged cache in place through the block tables: ``attn_decode`` for every
   one-token chunk (grid: entry × kv head × key segment of ``SEG`` keys; the query heads of a kv
   head together; online softmax; the last segment to finish merges them in order), and
   ``attn_prefill`` for chunks of several tokens (tiles of (token, head) rows against key tiles
   through ``tl.dot``, causal);
4. ``qmatmul`` o with the residual add in its epilogue;
5. ``qmatmul`` gate|up with the FFN's RMSNorm in its prologue;
6. ``qmatmul`` down with SiLU(gate)·up in its prologue and the residual add in its epilogue.

The lm head is one more ``qmatmul`` with the final norm in its prologue; the embedding one
``embed`` launch. Where the card's tile for a weight says so (kernels/gpu_tuning.py, ``gemv``),
a decode batch of up to 16 rows runs ``qgemv`` in ``qmatmul``'s place: the same contract
without ``tl.dot`` or the 16-row padding. Numbers: every kernel accumulates in f32; a token's result does not depend on
its batch neighbours (per-row reductions; key segments at fixed multiples of ``SEG``; the split
over K chosen from N and K only), so a sequence decodes the same alone or in any batch of decodes,
eager or replayed — with a tuned ``gemv`` or ``decode`` tile, in any batch on the same side of its
bound (16 rows for ``decode``). A step
with prefill chunks is another matter for the decodes in it: its matmuls run in TF32 past 64 rows
where chosen, and from ``GEMM_ROWS`` rows through cuBLAS (``gemm``: in 3xTF32 at the default
precision, its weights split once and kept), whose sums go in their own order — within the
CPU↔GPU contract, not bit for bit.

``DecodeGraphs`` runs decode-only steps through static buffers — ids, positions, KV slots,
block tables padded to the context's width, context lengths — and captures ``GpuStep.decode``
once per bucket (1, 2, 4, …, up to the engine's sequence cap); a step of n sequences replays the
smallest bucket ≥ n, its padding rows writing their KV to a scratch block of their own. Greedy
argmax runs in the graph; where some rows sample (temperature, top-k / top-p / min-p, their
seeds), the bucket's graph with the sampler after the step draws their tokens on the device
(kernels/gpu_sample.py); either way one replay, and one device-to-host copy returns the tokens.
Without CUDA (the tests, ``TRITON_INTERPRET=1``) the same buffers run eagerly through the
interpreter.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from kernels import gpu_tuning, q4_0

SEG = 256          # keys per attention segment of a decode token (fixed: batch-independent numbers)
# Tile shapes, chosen from ptxas' register report for sm_90 (tests/unit/test_gpu_compile.py
# compiles every variant the step launches and fails on a register spill). The qmatmul's tiles
# are per GPU and weight shape (kernels/gpu_tuning.py: measured tables, else one Q4_0 block a K
# step with 8 warps); attention's prefill tiles 16 tokens x 32 keys with 8 warps on the tensor
# cores ("tf32", "fp16": 106-117 registers), x 16 keys in f32 "ieee" (205 registers; with 32 keys,
# compiled as the JIT specializes it — aligned pointers and strides — 255 and 648 B spilled);
# decode 16 keys a step with 4 warps.
EMBED_BLOCK_B = 4
BLOCK_K_DECODE, DECODE_WARPS = 16, 4
MODES = ("graphs", "fused", "ops")   # EngineConfig.gpu_step / TANDEM_GPU_STEP
REDUCE = ("fused", "launch")         # TANDEM_GPU_REDUCE
PREFETCH = ("auto", "0", "1")        # TANDEM_GPU_PREFETCH (``prefetch``)
PREFILL_ATTN = ("ieee", "tf32", "fp16", "tf32x3")   # TANDEM_GPU_PREFILL_ATTN: attn_prefill's dots
DECODE_ATTN = ("dot", "sum")              # TANDEM_GPU_DECODE_ATTN: attn_decode's scores and sums (``decode_dot``)
PRECISIONS = ("ieee", "tf32", "tf32x3")   # TANDEM_GPU_PRECISION: the Q4_0 matmuls' dots
DEFAULT_PRECISION = {"cuda": "tf32x3"}     # by device type; "ieee" elsewhere
PREFETCH_STEPS = 3   # "auto": K steps a program needs to fetch each step's weights during the one before
GEMM_ROWS = 128      # a prefill step of this many rows or more: its matmuls through cuBLAS (TANDEM_GPU_GEMM_ROWS)
GEMM_CHUNK = 4096    # weight rows dequantized at a time for it (no f32 copy of the lm head whole)
GEMM_CACHE_MB = 2048  # tf32x3: the weights' TF32 parts and remainders kept on the device up to this (TANDEM_GPU_GEMM_CACHE_MB)
TF32_MASK = -(1 << 13)   # an f32's bits with the 13 mantissa bits TF32 drops cleared (int32)
MATRICES = ("qkv", "o", "gate_up", "down")   # a layer's Q4_0 matrices (``Transformer.layers``)
COUNTERS = 1 << 16   # arrival counters (int32, one a matmul tile or (entry, kv head)); a launch with more: split_sum

log = logging.getLogger("tandem.gpu")


def _k():
    from kernels import gpu
    return gpu.triton_kernels()


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


PDL_MODES = {"0": 0, "1": 1, "exit": 2}   # TANDEM_GPU_PDL -> the kernels' PDL constexpr


def pdl_mode(device) -> int:
    """Do the step's kernels launch with programmatic dependent launch, and when does a kernel let
    the next one launch? TANDEM_GPU_PDL on a CUDA device of compute capability 9.0 or above
    (Hopper), where Triton has it: "1" — each kernel right after its wait (1), "exit" — none
    asked, the next one launching as this one's programs exit (2); "0" (the default) or any other
    device — plain launches (0). Off by default until a GPU run has measured it (``tandem bench
    gpu --modes graphs graphs-pdl graphs-pdl-exit``; "1" measured 0.72-0.78x on an H200,
    2026-11-30). Each kernel waits for its predecessor before touching what it wrote
    (``_grid_dependency`` in kernels/gpu_triton.py), so the bits are the same every way; what
    changes is that a launch overlaps the tail of the kernel before it, inside a CUDA graph too."""
    value = os.environ.get("TANDEM_GPU_PDL", "0")
    if value not in PDL_MODES:
        raise ValueError(f"TANDEM_GPU_PDL must be one of {', '.join(PDL_MODES)}, got {value!r}")
    if not PDL_MODES[value] or getattr(device, "type", None) != "cuda":
        return 0
    from kernels import gpu_triton
    ok = gpu_triton.gdc_wait is not None and torch.cuda.get_device_capability(device)[0] >= 9
    return PDL_MODES[value] if ok else 0


def pdl_args(pdl: int) -> dict:
    """The launch arguments of a step kernel under ``pdl_mode`` ``pdl``."""
    return {"PDL": pdl, "launch_pdl": True} if pdl else {"PDL": 0}


def unsupported(cfg, block_size: int) -> str | None:
    """Why the fused step cannot run this model (None: it can)."""
    hd = cfg.head_dim
    if hd < 16 or hd & (hd - 1):
        return f"head_dim {hd} is not a power of two >= 16"
    if block_size & (block_size - 1) or block_size > SEG:
        return f"KV block size {block_size} is not a power of two up to {SEG}"
    if cfg.hidden_size % 32 or cfg.ffn_size % 32:
        return "hidden and FFN sizes must be multiples of 32 (Q4_0 blocks)"
    return None


def prefetch(block_m: int, blocks: int, block_b: int, mode: str = "auto", norm_split: bool = False) -> bool:
    """Whether a matmul's programs fetch each K step's Q4_0 bytes during the step before (the
    ``PREFETCH`` of ``qmatmul`` / ``qgemv``; the same bits either way). ``mode``
    (TANDEM_GPU_PREFETCH): "1" wherever a program has two K steps or more (``blocks`` a split,
    ``block_b`` a step); "0" never; "auto" (the default) where it has at least ``PREFETCH_STEPS``
    and is not a split matmul with the RMSNorm prologue (``norm_split``): a step saves one
    weight latency, but there (gate|up's 16-row split tile) holding the next bytes took ptxas
    (sm_90) from 80 to 208 registers — an SM holds half as many programs — where o, down and the
    lm head took +12 to +38. Never past 32 rows (at 64 the held bytes spilled 68–72 B)."""
    steps = -(-blocks // block_b)
    if mode == "0" or block_m > 32:
        return False
    if mode == "1":
        return steps >= 2
    return steps >= PREFETCH_STEPS and not norm_split


@dataclass(frozen=True)
class Q4Weight:
    """A Q4_0 matrix [N, K] as the step's kernels read it: its ``block_q4_0`` rows ``q`` (uint8
    [N, K/32*18]: the model's tensor itself, no copy) and the same bytes as float16 ``d`` (a
    block's scale is loaded as one value)."""
    q: torch.Tensor
    d: torch.Tensor

    @classmethod
    def of(cls, q: torch.Tensor) -> "Q4Weight":
        if q.dim() != 2 or q.dtype != torch.uint8 or q.shape[1] % q4_0.BLOCK_BYTES:
            raise ValueError(f"not a Q4_0 byte matrix: dtype {q.dtype}, shape {tuple(q.shape)}")
        q = q.contiguous()
        return cls(q, q.view(torch.float16))

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1] // q4_0.BLOCK_BYTES * q4_0.QK


def qmatmul(x: torch.Tensor, w: Q4Weight, out: torch.Tensor, tile: gpu_tuning.Tile,
            norm: torch.Tensor | None = None, silu: bool = False, residual: bool = False, eps: float = 1e-5,
            precision: str = "ieee", part: torch.Tensor | None = None, reduce: bool = True,
            counters: torch.Tensor | None = None, pdl: int = 0, prefetch_mode: str = "auto"):
    """Launch ``GpuStep.matmul``'s kernels for ``tile``: ``qgemv`` for up to ``tile.gemv`` rows, else
    ``qmatmul`` (``precision`` past 64 rows; "tf32x3" at every M). Where K is split, the partial sums go to ``part``
    (allocated when not given) and are added up in split order by the last split of each tile to
    finish, given ``counters`` (zeroed int32, one a tile: ``GpuStep.counters``) — else by a
    ``split_sum`` launch; ``reduce=False`` leaves them there, unsummed, for a consumer that adds
    them as it reads (``rope_kv``). Either way the same bits. ``pdl``: ``pdl_mode``'s (0: plain
    launches; ``GpuStep.pdl``). Returns the matmul's compiled kernel (registers, spills)."""
    m, n, k = x.shape[0], w.n, w.k
    splits, per = tile.plan(n, k)
    kern = _k()
    args = dict(BLOCK_N=tile.block_n, BLOCK_B=tile.block_b, NORM=norm is not None, SILU=silu,
                num_warps=tile.warps, **pdl_args(pdl))
    if m <= tile.gemv:      # a decode batch: no tl.dot (kernels/gpu_tuning.py)
        fn, block_m = kern.qgemv, _pow2(m)
        args["NORM_W"] = tile.norm_step
    else:
        fn, block_m = kern.qmatmul, 16 if m <= 16 else 32 if m <= 32 else 64
        args |= dict(PRECISION=precision if m > 64 or precision == "tf32x3" else "ieee", NORM_W=16 * tile.block_b)
    grid = (-(-n // tile.block_n), -(-m // block_m))
    args["PREFETCH"] = prefetch(block_m, per, tile.block_b, prefetch_mode, norm is not None and splits > 1)
    nw = norm if norm is not None else x
    if splits == 1:
        return fn[grid](x, w.q, w.d, out, nw, out, out, m, n, x.stride(0), out.stride(0), eps, 0, K=k,
                        RESIDUAL=residual, SPLIT=False, FIXUP=False, BLOCK_M=block_m, **args)
    if part is None:
        part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    fixup = reduce and counters is not None and grid[0] * grid[1] <= counters.numel()
    c = fn[(*grid, splits)](x, w.q, w.d, out, nw, part, counters if fixup else out, m, n, x.stride(0),
                            out.stride(0), eps, per, K=k, RESIDUAL=residual, SPLIT=True, FIXUP=fixup,
                            BLOCK_M=block_m, **args)
    if reduce and not fixup:
        kern.split_sum[(-(-n // 256), m)](part, out, m, n, out.stride(0), SPLITS=splits, RESIDUAL=residual,
                                          BLOCK=256, **pdl_args(pdl))
    return c


@dataclass
class PagedBatch:
    """Where each token's attention reads, as device tensors (int32).

    Decode entries (one-token chunks): ``rows`` (the token's row of the flat batch), ``tables``
    [E, width] (block ids, padded), ``lens`` (keys, the new one included). Prefill chunks:
    ``offs`` (first row), ``starts`` (first position), ``qlens``, ``ptables`` [C, width];
    ``max_q``: the longest chunk, ``max_k``: the most keys a chunk's last token sees (host ints,
    for the grid)."""
    rows: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    offs: torch.Tensor
    starts: torch.Tensor
    qlens: torch.Tensor
    ptables: torch.Tensor
    max_q: int
    max_k: int = 0

    @classmethod
    def of(cls, chunks, device) -> "PagedBatch":
        """From the step's ``AttnChunk`` list (their ``block_ids``)."""
        dec = [c for c in chunks if c.num_tokens == 1]
        pre = [c for c in chunks if c.num_tokens > 1]

        def table(cs):
            ids = [c.block_ids or c.blocks.tolist() for c in cs]
            t = np.zeros((len(cs), max([len(b) for b in ids], default=1)), dtype=np.int32)
            for i, b in enumerate(ids):
                t[i, :len(b)] = b
            return torch.from_numpy(t).to(device)

        def ints(v):
            return torch.tensor(v, dtype=torch.int32).to(device)
        return cls(ints([c.token_offset for c in dec]), table(dec), ints([c.start + 1 for c in dec]),
                   ints([c.token_offset for c in pre]), ints([c.start for c in pre]),
                   ints([c.num_tokens for c in pre]), table(pre), max([c.num_tokens for c in pre], default=0),
                   max([c.start + c.num_tokens for c in pre], default=0))


def prefill_attention(q, layer_kv, pb: PagedBatch, out, group: int, scale: float, tile: "gpu_tuning.PrefillTile",
                      precision: str, counters=None, pdl: int = 0):
    """The prefill chunks of ``pb``: ``q``'s rows (heads of ``group`` query heads a kv head)
    against their keys in ``layer_kv`` [blocks, 2, BS, kv heads, HD], into ``out`` — one
    ``attn_prefill`` launch, its keys split into ``tile.seg``-key segments where a tile's span
    more than one and ``counters`` (arrival counters, zero) has one a tile. Returns the launch's
    compiled kernel (its registers and spills, on CUDA)."""
    c, nkv, hd = pb.offs.shape[0], layer_kv.shape[3], layer_kv.shape[4]
    s = layer_kv.stride()
    gp = _pow2(group)
    qtiles = -(-pb.max_q // tile.block_q)
    pseg = tile.seg if (tile.seg and pb.max_k > tile.seg and counters is not None
                        and c * nkv * qtiles <= counters.numel()) else 0
    nseg = -(-pb.max_k // pseg) if pseg else 1
    po = pml = out
    if pseg:
        rows = c * nkv * qtiles * nseg * tile.block_q * gp
        po = torch.empty(rows, hd, dtype=torch.float32, device=q.device)
        pml = torch.empty(rows, 2, dtype=torch.float32, device=q.device)
    return _k().attn_prefill[(c, nkv, qtiles * nseg)](
        q, layer_kv, pb.ptables, pb.starts, pb.qlens, pb.offs, out, po, pml, counters if pseg else pb.qlens,
        q.stride(0), pb.ptables.stride(0), s[0], s[1], s[2], s[3], scale, nseg, GROUP=group, GROUP_P=gp, HD=hd,
        BS=layer_kv.shape[2], BLOCK_Q=tile.block_q, BLOCK_K=tile.block_k, PSEG=pseg, PRECISION=precision,
        num_warps=tile.warps, **pdl_args(pdl))


def split_tf32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) of an f32 tensor: ``hi`` its values with the 13 mantissa bits TF32 lacks cleared
    (exact in TF32), ``lo = x - hi`` (exact in f32: at most 13 significant bits)."""
    hi = (x.view(torch.int32) & TF32_MASK).view(torch.float32)
    return hi, x - hi


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(r0, min(n, r0 + GEMM_CHUNK)) for r0 in range(0, n, GEMM_CHUNK)]


class GpuStep:
    """The forward step of a ``Transformer`` in the fused kernels (its weights on the device)."""

    def __init__(self, model, max_context: int, precision: str | None = None,
                 tuning: "gpu_tuning.Tuning | None" = None):
        cfg = model.cfg
        self.m = model
        self.cfg = cfg
        self.device = model.device
        self.nh, self.nkv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.group = self.nh // self.nkv
        self.nseg = -(-max_context // SEG)
        # the qmatmul dots: f32 "ieee" keeps the activations' bits (no TF32 rounding); "tf32" runs
        # the tensor cores past 64 rows; "tf32x3" runs them at every M, three TF32 products a term
        # (each operand split into a TF32 part and its remainder: f32's accuracy, not its bits).
        # Default on CUDA tf32x3: 1.28-1.40x the decode rate of "ieee" on an H200 (2026-11-30,
        # docs/kernels.md); elsewhere (Triton's interpreter) "ieee"
        self.precision = precision or os.environ.get("TANDEM_GPU_PRECISION", DEFAULT_PRECISION.get(
            torch.device(self.device).type, "ieee"))
        if self.precision not in PRECISIONS:
            raise ValueError(f"TANDEM_GPU_PRECISION must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        self.tuning = tuning if tuning is not None else gpu_tuning.load(self.device)
        # split-K sums and attention's key segments added up by the last program of a launch to
        # finish, and a decode step's rope in attn_decode ("fused": no launches of their own), or
        # each by a launch of its own ("launch": the step's kernels as they were, to compare)
        self.reduce = os.environ.get("TANDEM_GPU_REDUCE", "fused")
        if self.reduce not in REDUCE:
            raise ValueError(f"TANDEM_GPU_REDUCE must be one of {', '.join(REDUCE)}, got {self.reduce!r}")
        self.counters = (torch.zeros(COUNTERS, dtype=torch.int32, device=self.device) if self.reduce == "fused"
                         else None)
        self.pdl = pdl_mode(self.device)   # (validated everywhere, used on CUDA sm_90+)
        # each K step's weight bytes fetched during the step before, in programs of several steps
        self.prefetch = os.environ.get("TANDEM_GPU_PREFETCH", "auto")
        if self.prefetch not in PREFETCH:
            raise ValueError(f"TANDEM_GPU_PREFETCH must be one of {', '.join(PREFETCH)}, got {self.prefetch!r}")
        # the prefill chunks' attention dots: f32 "ieee", "tf32", or "fp16" (q and the softmax weights
        # rounded to meet the float16 cache on the tensor cores); decodes' attention stays f32
        self.prefill_attn = os.environ.get("TANDEM_GPU_PREFILL_ATTN", "ieee")
        if self.prefill_attn not in PREFILL_ATTN:
            raise ValueError(f"TANDEM_GPU_PREFILL_ATTN must be one of {', '.join(PREFILL_ATTN)}, "
                             f"got {self.prefill_attn!r}")
        # a decode's attention: its scores and weighted values as tl.dot in 3xTF32 ("dot": the GQA
        # group's rows padded to 16; 494 instructions, 12 shuffles and 14 CTA barriers a 16-key
        # step in the loop's SASS for sm_90) or as products reduced across lanes ("sum": 1,082,
        # 216 and 26); "sum" wherever the matmuls are "ieee" (``decode_dot``)
        self.decode_attn = os.environ.get("TANDEM_GPU_DECODE_ATTN", "dot")
        if self.decode_attn not in DECODE_ATTN:
            raise ValueError(f"TANDEM_GPU_DECODE_ATTN must be one of {', '.join(DECODE_ATTN)}, "
                             f"got {self.decode_attn!r}")
        # a step with prefill chunks of at least this many rows runs its matmuls as dequantized
        # weights through torch.matmul (cuBLAS on CUDA); 0: never (``gemm``)
        self.gemm_rows = int(os.environ.get("TANDEM_GPU_GEMM_ROWS", GEMM_ROWS))
        self.row_ids = torch.arange(0, dtype=torch.int32, device=self.device)   # ``dequantized``'s rows
        if self.gemm_rows < 0:
            raise ValueError(f"TANDEM_GPU_GEMM_ROWS must be >= 0, got {self.gemm_rows}")
        # tf32x3: each weight's (TF32 part, remainder) in f32 for ``gemm``, kept while they fit in
        # this many MB (8 bytes a weight: 1.1 GB for the bundled model), made again each call past it
        self.gemm_cache_mb = int(os.environ.get("TANDEM_GPU_GEMM_CACHE_MB", GEMM_CACHE_MB))
        if self.gemm_cache_mb < 0:
            raise ValueError(f"TANDEM_GPU_GEMM_CACHE_MB must be >= 0, got {self.gemm_cache_mb}")
        self._split: dict[int, tuple[Q4Weight, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._split_bytes = 0
        self.cos = model.cos.contiguous()
        self.sin = model.sin.contiguous()
        # the matmuls' weights as the kernels read them (the model's block_q4_0 tensors; ``Q4Weight``)
        self.layers = [{name: Q4Weight.of(v) if name in MATRICES else v for name, v in L.items()}
                       for L in model.layers]
        self.output = Q4Weight.of(model.output)
    # ---- the kernels, launched ------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.m.embed
        k = q.shape[1] // 18 * 32
        out = torch.empty(ids.shape[0], k, dtype=torch.float32, device=self.device)
        if ids.shape[0]:
            _k().embed[(ids.shape[0],)](ids, q, out, k, q.shape[1], out.stride(0), BLOCK_B=EMBED_BLOCK_B,
                                        **pdl_args(self.pdl))
        return out

    def matmul(self, x: torch.Tensor, w: Q4Weight, out: torch.Tensor | None = None,
               norm: torch.Tensor | None = None, silu: bool = False, residual: bool = False,
               gemm: bool = False) -> torch.Tensor:
        """``a @ W.T`` for Q4_0 W [N, K]: a = x, or silu(x[:, :K]) * x[:, K:] (``silu``), RMS-normed
        with weight ``norm`` (given); into ``out``, added to it (``residual``). ``gemm``: through
        ``gemm`` (torch.matmul) instead of the Q4_0 kernels."""
        m = x.shape[0]
        if gemm:
            return self.gemm(x, w, out, norm, silu, residual)
        if out is None:
            out = torch.empty(m, w.n, dtype=torch.float32, device=self.device)
        if m == 0:
            return out
        qmatmul(x, w, out, self.tuning.tile(w.n, w.k, m), norm, silu, residual, self.cfg.rms_eps, self.precision,
                counters=self.counters, pdl=self.pdl, prefetch_mode=self.prefetch)
        return out

    def dequantized(self, w: Q4Weight, r0: int, r1: int) -> torch.Tensor:
        """Rows r0..r1 of W as float32 — ``q4_0.dequantize``'s values, bit for bit — in one ``embed``
        launch (the reference's torch ops were ~12 launches a matrix: ~1,400 a prefill step of the
        bundled model, each a few µs of the host's)."""
        if self.row_ids.shape[0] < r1:
            self.row_ids = torch.arange(max(r1, 2 * self.row_ids.shape[0]), dtype=torch.int32, device=self.device)
        k = w.k
        out = torch.empty(r1 - r0, k, dtype=torch.float32, device=self.device)
        _k().embed[(r1 - r0,)](self.row_ids[r0:], w.q, out, k, w.q.shape[1], out.stride(0),
                               BLOCK_B=EMBED_BLOCK_B, **pdl_args(self.pdl))
        return out

    def gemm(self, x: torch.Tensor, w: Q4Weight, out: torch.Tensor | None = None,
             norm: torch.Tensor | None = None, silu: bool = False, residual: bool = False) -> torch.Tensor:
        """``matmul``'s contract through torch: the prologue as torch ops, the weight dequantized
        (``dequantized``: 4,096 rows at a time, f32) and multiplied by ``torch.matmul`` — cuBLAS
        on CUDA: in f32 ("ieee"), on its tensor cores in TF32 ("tf32"), or in 3xTF32 ("tf32x3",
        the decode kernels' precision: ``_tf32x3``). For prefill-sized M, where cuBLAS beat the
        Q4_0 kernels 5–80× on an H200 (docs/kernels.md); an f32 copy of the weight exists only
        during the call, but for tf32x3's split of it (cached: ``split_weight``)."""
        k = w.k
        a = torch.nn.functional.silu(x[:, :k]) * x[:, k:] if silu else x
        if norm is not None:      # (one fused kernel on CUDA; six torch ops composed it before)
            a = torch.nn.functional.rms_norm(a, (a.shape[1],), norm, self.cfg.rms_eps)
        a = a.contiguous()
        n = w.n
        y = torch.empty(a.shape[0], n, dtype=torch.float32, device=self.device)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.precision != "ieee"
        try:
            if self.precision == "tf32x3":
                self._tf32x3(a, w, y)
            else:
                for r0, r1 in _chunks(n):
                    torch.matmul(a, self.dequantized(w, r0, r1).T, out=y if r1 - r0 == n else y[:, r0:r1])
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        if out is None:
            return y
        return out.add_(y) if residual else out.copy_(y)

    def _tf32x3(self, a: torch.Tensor, w: Q4Weight, y: torch.Tensor) -> None:
        """``y = a @ W.T`` as three TF32 products per chunk of W's rows: a_hi·w_lo + a_lo·w_hi +
        a_hi·w_hi, the small terms first (CUTLASS's 3xTF32; a_lo·w_lo, ~2^-22 of a term, dropped).
        ``hi`` is an f32 with TF32's 13 dropped mantissa bits cleared — exact in TF32, whatever
        the tensor cores' rounding — and ``lo = x - hi`` exactly, so the products carry f32's
        accuracy (not its bits) at the tensor cores' rate."""
        a_hi, a_lo = split_tf32(a)
        for (r0, r1), (w_hi, w_lo) in zip(_chunks(w.n), self.split_weight(w)):
            part = y if r1 - r0 == w.n else y[:, r0:r1]
            torch.matmul(a_hi, w_lo.T, out=part)
            part.addmm_(a_lo, w_hi.T)
            part.addmm_(a_hi, w_hi.T)

    def split_weight(self, w: Q4Weight) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """W's (TF32 part, remainder) per ``GEMM_CHUNK`` rows, kept for the next call while
        ``gemm_cache_mb`` allows (``_tf32x3``)."""
        got = self._split.get(id(w))
        if got is not None and got[0] is w:
            return got[1]
        parts = [split_tf32(self.dequantized(w, r0, r1)) for r0, r1 in _chunks(w.n)]
        size = 8 * w.n * w.k
        if self._split_bytes + size <= self.gemm_cache_mb << 20:
            self._split[id(w)] = (w, parts)
            self._split_bytes += size
        return parts

    def mlp(self, x: torch.Tensor, L: dict, gemm: bool = False) -> None:
        """The layer's FFN into the residual stream ``x`` (in place): x += down(silu(gate) * up) of
        RMSNorm(x), as two matmuls (the norm in gate|up's prologue, SiLU·mul in down's)."""
        hid = self.matmul(x, L["gate_up"], norm=L["ffn_norm"], gemm=gemm)
        self.matmul(hid, L["down"], out=x, silu=True, residual=True, gemm=gemm)

    def matmul_parts(self, x: torch.Tensor, w: Q4Weight, norm: torch.Tensor | None = None,
                     gemm: bool = False) -> torch.Tensor:
        """``matmul``'s split partial sums [splits, M, N], not added up ([1, M, N]: the output
        itself): for ``rope_kv``, which adds them in split order as it reads — the sum ``split_sum``
        makes, bit for bit, one launch fewer."""
        m, n, k = x.shape[0], w.n, w.k
        if gemm:
            return self.gemm(x, w, norm=norm)[None]
        tile = self.tuning.tile(n, k, m)
        splits, _ = tile.plan(n, k)
        part = torch.empty(splits, m, n, dtype=torch.float32, device=self.device)
        if m:
            qmatmul(x, w, part[0], tile, norm, eps=self.cfg.rms_eps, precision=self.precision, part=part,
                    reduce=False, pdl=self.pdl, prefetch_mode=self.prefetch)
        return part

    def rope_kv(self, qkv, layer, positions, slot_blocks, slot_offsets, layer_kv) -> torch.Tensor:
        """``qkv``: the projection [tokens, N], or its split partial sums [splits, tokens, N]
        (``matmul_parts``)."""
        parts = qkv if qkv.dim() == 3 else qkv[None]
        t = parts.shape[1]
        q = torch.empty(t, self.nh * self.hd, dtype=torch.float32, device=self.device)
        if t:
            bias = layer.get("qkv_bias", q)
            qn, kn = layer.get("q_norm", q), layer.get("k_norm", q)
            s = layer_kv.stride()
            _k().rope_kv[(t, self.nkv)](
                parts, bias, qn, kn, self.cos, self.sin, positions, slot_blocks, slot_offsets, q, layer_kv,
                parts.stride(1), q.stride(0), s[0], s[1], s[2], s[3], self.cfg.rms_eps, parts.stride(0),
                NH=self.nh, NKV=self.nkv, HD=self.hd, GROUP=self.group, GROUP_P=_pow2(self.group),
                HAS_BIAS="qkv_bias" in layer, QK_NORM="q_norm" in layer, SPLITS=parts.shape[0], **pdl_args(self.pdl))
        return q

    def attend(self, q: torch.Tensor, layer_kv: torch.Tensor, pb: PagedBatch,
               rope: tuple | None = None) -> torch.Tensor:
        """Attention of q [tokens, NH * HD] over the paged cache; ``rope`` = (layer, positions, slot
        blocks, slot offsets) of a decode-only step: q is then the q|k|v projection's split
        partials [splits, tokens, N] (``matmul_parts``) and ``attn_decode`` does ``rope_kv``'s work
        for each token (no launch of its own)."""
        s = layer_kv.stride()
        if rope is not None:
            L, positions, slot_blocks, slot_offsets = rope
            parts = q
            out = torch.empty(parts.shape[1], self.nh * self.hd, dtype=torch.float32, device=self.device)
            ra = (L.get("qkv_bias", out), L.get("q_norm", out), L.get("k_norm", out), self.cos, self.sin,
                  positions, slot_blocks, slot_offsets, parts.stride(0), self.cfg.rms_eps)
            rc = dict(ROPE=True, NH=self.nh, HAS_BIAS="qkv_bias" in L, QK_NORM="q_norm" in L, SPLITS=parts.shape[0])
            stride_q = parts.stride(1)
        else:
            out = torch.empty_like(q)
            ra = (q, q, q, q, q, pb.lens, pb.lens, pb.lens, 0, 0.0)
            rc = dict(ROPE=False, NH=self.nh, HAS_BIAS=False, QK_NORM=False, SPLITS=1)
            stride_q = q.stride(0)
        kern = _k()
        scale = self.m.scale
        bs = layer_kv.shape[2]
        gp = self.decode_rows
        e = pb.rows.shape[0]
        if e:
            split = self.nseg > 1
            fixup = split and self.counters is not None
            if fixup and e * self.nkv > self.counters.numel():
                raise ValueError(f"{e} decode entries x {self.nkv} kv heads exceed the {self.counters.numel()} "
                                 "arrival counters")
            po = pml = out
            if split:
                po = torch.empty(e, self.nh, self.nseg, self.hd, dtype=torch.float32, device=self.device)
                pml = torch.empty(e, self.nh, self.nseg, 2, dtype=torch.float32, device=self.device)
            kern.attn_decode[(e, self.nkv, self.nseg)](
                q, layer_kv, pb.tables, pb.lens, pb.rows, out, po, pml, self.counters if fixup else pb.lens,
                stride_q, out.stride(0), pb.tables.stride(0), s[0], s[1], s[2], s[3], scale, *ra,
                SEG=SEG, NSEG=self.nseg, NSEG_P=_pow2(self.nseg), GROUP=self.group, GROUP_P=gp, HD=self.hd,
                BS=bs, BLOCK_K=BLOCK_K_DECODE, SPLIT=split, FIXUP=fixup, DOT=self.decode_dot,
                num_warps=DECODE_WARPS, **rc,
                **pdl_args(self.pdl))
            if split and not fixup:
                kern.attn_merge[(e, self.nh)](po, pml, pb.lens, pb.rows, out, out.stride(0), SEG=SEG,
                                              NSEG=self.nseg, NSEG_P=_pow2(self.nseg), HD=self.hd,
                                              **pdl_args(self.pdl))
        if pb.offs.shape[0]:
            prefill_attention(q, layer_kv, pb, out, self.group, scale, self.prefill_tile, self.prefill_attn,
                              self.counters, self.pdl)
        return out

    # ---- the step --------------------------------------------------------------------------
    def _layers(self, ids, positions, slot_blocks, slot_offsets, kv, pb: PagedBatch,
                gemm: bool = False) -> torch.Tensor:
        x = self.embed(ids)
        for li, L in enumerate(self.layers):
            layer_kv = kv[:, li]
            qkv = self.matmul_parts(x, L["qkv"], norm=L["attn_norm"], gemm=gemm)   # summed as it is read
            if pb.max_q == 0 and self.reduce == "fused":   # decodes only: attn_decode rotates q, writes the KV
                attn = self.attend(qkv, layer_kv, pb, (L, positions, slot_blocks, slot_offsets))
            else:
                q = self.rope_kv(qkv, L, positions, slot_blocks, slot_offsets, layer_kv)
                attn = self.attend(q, layer_kv, pb)
            self.matmul(attn, L["o"], out=x, residual=True, gemm=gemm)
            self.mlp(x, L, gemm)
        return x

    def forward(self, token_ids: torch.Tensor, ctx, kv: torch.Tensor) -> torch.Tensor:
        """``Transformer.forward`` (any mix of prefill chunks and decodes): logits of ``ctx.sample_rows``."""
        pb = PagedBatch.of(ctx.chunks, self.device)
        x = self._layers(token_ids, ctx.positions, ctx.slot_blocks, ctx.slot_offsets, kv, pb,
                         self._gemm(pb, token_ids))
        if ctx.sample_rows.shape[0] != x.shape[0]:
            x = x.index_select(0, ctx.sample_rows)
        return self.matmul(x, self.output, norm=self.m.output_norm, gemm=self._gemm(pb, x))

    @property
    def decode_dot(self) -> str:
        """``attn_decode``'s DOT: "tf32x3" (the tensor cores; the keys and values are float16, exact
        in TF32, so only q and the softmax weights are split: f32's accuracy), or "" — the sum
        form — with TANDEM_GPU_DECODE_ATTN=sum and where the matmuls are f32 "ieee" (a dot in
        "ieee" took 249 registers a thread on sm_90, the sum form 128)."""
        return "" if self.decode_attn == "sum" or self.precision == "ieee" else "tf32x3"

    @property
    def decode_rows(self) -> int:
        """``attn_decode``'s rows a program (GROUP_P): the GQA group's, to a power of two, and at
        least 16 for its dots."""
        return max(16, _pow2(self.group)) if self.decode_dot else _pow2(self.group)

    @property
    def prefill_tile(self) -> "gpu_tuning.PrefillTile":
        """``attn_prefill``'s tile (TANDEM_GPU_PREFILL_TILE, the tuning table's, or the built-in one)."""
        return self.tuning.prefill_tile(self.prefill_attn)

    def _gemm(self, pb: PagedBatch, x: torch.Tensor) -> bool:
        """Do a step's matmuls over ``x``'s rows go through ``gemm``? Where the step has prefill
        chunks and at least ``gemm_rows`` rows (decode-only steps, the graphs' among them, never:
        their rows' bits stay those of the Q4_0 kernels)."""
        return bool(self.gemm_rows) and pb.max_q > 0 and x.shape[0] >= self.gemm_rows

    def decode(self, ids, positions, slot_blocks, slot_offsets, tables, lens, rows, kv) -> torch.Tensor:
        """One decode token per row, every row sampled: logits [B, vocab]. No host sync, fixed
        grids for a given B: capturable as a CUDA graph."""
        empty = torch.empty(0, dtype=torch.int32, device=self.device)
        pb = PagedBatch(rows, tables, lens, empty, empty, empty, tables, 0, 0)
        x = self._layers(ids, positions, slot_blocks, slot_offsets, kv, pb)
        return self.matmul(x, self.output, norm=self.m.output_norm)

# ---- CUDA graphs over the decode step ------------------------------------------------------

def buckets(max_seqs: int) -> list[int]:
    """Batch sizes a decode graph is captured for: powers of two up to the cap, and the cap."""
    if max_seqs < 1:
        raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
    out = [1 << i for i in range(max_seqs.bit_length()) if 1 << i < max_seqs]
    return out + [max_seqs]


def bucket_for(n: int, sizes: list[int]) -> int:
    """The smallest bucket holding ``n`` rows (ValueError past the largest)."""
    for b in sizes:
        if b >= n:
            return b
    raise ValueError(f"{n} decode rows exceed the largest graph bucket {sizes[-1]}")


class DecodeInputs:
    """The static inputs of the decode graphs: one int32 buffer on the device, laid out as
    ``ids | positions | slot blocks | slot offsets | lens | rows | tables`` (``cap`` entries each,
    tables ``cap × width``), filled from a pinned host twin with one copy per step. Rows past a
    step's n (up to its bucket) are padding: token 0 at position 0, its KV slot in the scratch
    block, a table of the scratch block, one key. The sampler's per-row parameters follow
    ``rows`` (``SAMPLE_FIELDS``; the float ones as float32 bit patterns): mode (0: argmax, 1:
    draw), temperature, top-k, top-p, min-p, the seed's two 32-bit halves and the draw's index;
    then ``feed``: the row of the step before whose token is this row's id (-1: ``ids`` has it;
    ``DecodeGraphs.start``)."""

    SAMPLE_FIELDS = ("mode", "temp", "top_k", "top_p", "min_p", "seed_lo", "seed_hi", "counter")
    FLOATS = ("temp", "top_p", "min_p")
    FIELDS = ("ids", "positions", "slot_blocks", "slot_offsets", "lens", "rows") + SAMPLE_FIELDS + ("feed",)

    def __init__(self, cap: int, width: int, scratch_block: int, device):
        self.cap, self.width, self.scratch = cap, width, scratch_block
        size = cap * (len(self.FIELDS) + width)
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=torch.device(device).type == "cuda")
        self.h = self.host.numpy()
        self.dev = torch.zeros(size, dtype=torch.int32, device=device)
        self.views = {f: self.dev[i * cap:(i + 1) * cap] for i, f in enumerate(self.FIELDS)}
        self.views["tables"] = self.dev[len(self.FIELDS) * cap:].view(cap, width)
        for f in self.FLOATS:
            self.views[f] = self.views[f].view(torch.float32)
        self.h[5 * cap:6 * cap] = np.arange(cap)      # rows: entry i is row i
        self.host_view("temp")[:] = 1.0                # (no division by 0 in an idle row)
        self.host_view("top_p")[:] = 1.0
        self.host_view("feed")[:] = -1
        # the last host-to-device copy: the pinned twin is written again only once it is done (a
        # step launched ahead fills the next one's inputs while the GPU may not have read these)
        self.copied = torch.cuda.Event() if torch.device(device).type == "cuda" else None

    def host_view(self, name: str) -> np.ndarray:
        i = self.FIELDS.index(name) if name != "tables" else len(self.FIELDS)
        if name == "tables":
            return self.h[i * self.cap:].reshape(self.cap, self.width)
        v = self.h[i * self.cap:(i + 1) * self.cap]
        return v.view(np.float32) if name in self.FLOATS else v

    def _fill_sampling(self, sampling, bucket: int) -> bool | None:
        """The sampler's rows: None (no row draws: they are left as they were), else whether some
        row has top-k or top-p (the "filtered" variant)."""
        if sampling is None or all(s is None for s in sampling):
            return None
        from kernels.gpu_sample import seed_halves
        h = {f: self.host_view(f) for f in self.SAMPLE_FIELDS}
        for f, pad in (("mode", 0), ("temp", 1.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("seed_lo", 0),
                       ("seed_hi", 0), ("counter", 0)):
            h[f][:bucket] = pad
        filtered = False
        for i, s in enumerate(sampling):
            if s is None:
                continue
            temp, top_k, top_p, min_p, seed, counter = s
            if not temp > 0:
                raise ValueError(f"row {i}: a drawn row needs temperature > 0, got {temp}")
            h["mode"][i], h["temp"][i], h["top_p"][i], h["min_p"][i] = 1, temp, top_p, min_p
            h["top_k"][i] = min(top_k, 1 << 30)                # (past the vocabulary: off)
            h["seed_lo"][i], h["seed_hi"][i] = seed_halves(seed)
            h["counter"][i] = counter
            filtered = filtered or bool(top_k) or top_p < 1.0
        return filtered

    def fill(self, ids, positions, tables: list[list[int]], block_size: int, bucket: int,
             sampling: list | None = None, feed: list[int] | None = None) -> bool | None:
        """Rows 0..n-1 from the step, n..bucket-1 padding; one host-to-device copy. ``sampling``:
        per row None (argmax) or (temperature, top_k, top_p, min_p, seed, index) of a row drawn
        on the device; ``feed``: per row the row of the step before whose token is its id, or -1.
        Returns None when no row draws, else whether the draw filters (top-k/p)."""
        n = len(ids)
        if len(positions) != n or len(tables) != n or (feed is not None and len(feed) != n):
            raise ValueError("ids, positions, tables and feed must have one entry per row")
        if not n <= bucket <= self.cap:
            raise ValueError(f"{n} rows in a bucket of {bucket} (cap {self.cap})")
        if self.copied is not None:
            self.copied.synchronize()
        pos = np.asarray(positions, dtype=np.int64)
        tab = self.host_view("tables")
        lens = list(map(len, tables))
        w = max(lens, default=0)
        if w > self.width:
            i = lens.index(w)
            raise ValueError(f"row {i}: {w} blocks exceed the table width {self.width}")
        # the rows' blocks, then the scratch block: one masked store of them all (a row at a time
        # took 100 us at 64 rows on a 2-vCPU EPYC, this 30)
        tab[:bucket] = self.scratch
        if n:
            tab[:n, :w][np.arange(w) < np.array(lens)[:, None]] = \
                np.fromiter(itertools.chain.from_iterable(tables), np.int32, sum(lens))
        self.host_view("ids")[:n] = ids
        self.host_view("ids")[n:bucket] = 0
        self.host_view("positions")[:n] = pos
        self.host_view("positions")[n:bucket] = 0
        blk = self.host_view("slot_blocks")
        blk[:n] = tab[np.arange(n), pos // block_size] if n else blk[:0]
        blk[n:bucket] = self.scratch
        self.host_view("slot_offsets")[:n] = pos % block_size
        self.host_view("slot_offsets")[n:bucket] = 0
        self.host_view("lens")[:n] = pos + 1
        self.host_view("lens")[n:bucket] = 1
        if sampling is not None and len(sampling) != n:
            raise ValueError("sampling must have one entry per row")
        variant = self._fill_sampling(sampling, bucket)
        fed = self.host_view("feed")
        fed[:bucket] = -1
        if feed is not None:
            fed[:n] = feed
        self.dev.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return variant

    def args(self, bucket: int) -> tuple:
        v = self.views
        return (v["ids"][:bucket], v["positions"][:bucket], v["slot_blocks"][:bucket],
                v["slot_offsets"][:bucket], v["tables"][:bucket], v["lens"][:bucket], v["rows"][:bucket])

    def sample_args(self, bucket: int) -> dict:
        return {f: self.views[f][:bucket] for f in self.SAMPLE_FIELDS}


@dataclass
class Started:
    """A decode step ``DecodeGraphs.start`` put on the device: its n rows, the graph's logits and
    tokens (device), the rows drawn there, and the tokens' host copy with its event."""
    n: int
    logits: torch.Tensor
    best: torch.Tensor
    sampling: list | None
    variant: bool | None      # None: no row draws; else the sampler's variant (filtered)
    drawn: bool               # the sampler ran in the graph (else its rows are the host's)
    host: torch.Tensor
    done: object              # torch.cuda.Event, or None off CUDA (the copy was synchronous)


class DecodeGraphs:
    """Decode-only steps through static buffers, replayed as one CUDA graph per bucket (captured on
    first use) where ``capture``; run eagerly over the same buffers otherwise. A step with rows
    that sample (``sampler.on_device``) replays instead the bucket's graph with the sampler
    (kernels/gpu_sample.py) after the step — one per (bucket, filtered): still one replay —
    unless TANDEM_GPU_SAMPLE=0 (then the host draws them, as before)."""

    def __init__(self, step: GpuStep, kv: torch.Tensor, max_seqs: int, width: int, block_size: int,
                 scratch_block: int, capture: bool):
        self.step, self.kv, self.block_size = step, kv, block_size
        self.sizes = buckets(max_seqs)
        self.inputs = DecodeInputs(self.sizes[-1], width, scratch_block, step.device)
        self.capture = capture
        self.device_sample = os.environ.get("TANDEM_GPU_SAMPLE", "1") != "0"
        # TANDEM_GPU_AHEAD=1: the engine launches the next decode step before it reads the last one's
        # tokens, its ids fed on the device (Engine.step, "launched ahead"). Default on CUDA: 1.06-1.19x
        # the decode rate on an H200 (2026-11-30); elsewhere (Triton's interpreter) off
        default = "1" if torch.device(step.device).type == "cuda" else "0"
        self.ahead = os.environ.get("TANDEM_GPU_AHEAD", default) == "1"
        # the sampler's variants that may run: False (temperature / min-p), True (top-k / top-p: a sort);
        # one whose graph could not be captured leaves its rows to the host from then on
        self.variants = {False: self.device_sample, True: self.device_sample}
        self.u = torch.zeros(self.sizes[-1], dtype=torch.float64, device=step.device)
        self.graphs: dict[int, tuple] = {}    # bucket -> (CUDAGraph, logits, argmax)
        self.samplers: dict[tuple[int, bool], tuple] = {}   # (bucket, filtered) -> (CUDAGraph, logits, tokens)
        self._pool = None    # the sampler graphs' one memory pool (never replayed at once)
        # the tokens read back, two pinned buffers in turn (a step launched ahead copies its tokens
        # while the host has not read the step before's yet), each with its copy's event
        pinned = step.device.type == "cuda"
        self.tokens_host = [torch.zeros(self.sizes[-1], dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.tokens_done = [torch.cuda.Event() for _ in range(2)] if pinned else [None, None]
        self.turn = 0
        self.steps = 0       # decode steps run here
        self.replays = 0     # of them, graph replays
        self.drawn = 0       # rows whose token was drawn on the device (not argmax)

    def _body(self, bucket: int, filtered: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, tokens) of the bucket's rows: argmax, or (``filtered`` not None) the sampler's
        tokens over it."""
        logits = self.step.decode(*self.inputs.args(bucket), self.kv)
        best = torch.argmax(logits, dim=-1)
        if filtered is not None:
            best = self._sample_body(bucket, filtered, logits, best)
        return logits, best

    def _sample_body(self, bucket: int, filtered: bool, logits: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
        from kernels import gpu_sample
        a = self.inputs.sample_args(bucket)
        u = gpu_sample.uniforms(a["seed_lo"], a["seed_hi"], a["counter"], self.u[:bucket])
        return gpu_sample.select(logits, best, a["mode"], a["temp"], a["top_k"], a["top_p"], a["min_p"], u, filtered)

    @staticmethod
    def _capture(body, pool=None):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):          # compile and warm up outside the capture
            body()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = body()
        return graph, out

    def _graph(self, bucket: int) -> tuple:
        g = self.graphs.get(bucket)
        if g is None:
            graph, (logits, best) = self._capture(lambda: self._body(bucket))
            g = self.graphs[bucket] = (graph, logits, best)
        return g

    def _sampler(self, bucket: int, filtered: bool) -> tuple | None:
        """The graph of (bucket, filtered): the decode step and the sampler in one replay; None
        (and the host draws from now on) where it cannot be captured."""
        g = self.samplers.get((bucket, filtered))
        if g is None and self.variants[filtered]:
            if self._pool is None:      # one pool for these graphs: they never replay at once
                self._pool = torch.cuda.graph_pool_handle()
            try:
                graph, (logits, tokens) = self._capture(lambda: self._body(bucket, filtered), self._pool)
                g = self.samplers[(bucket, filtered)] = (graph, logits, tokens)
            except Exception:  # noqa: BLE001 - a sampler that cannot be captured leaves the draws to the host
                log.exception("the decode graphs' sampler (%s) could not be captured: those rows are drawn on the "
                              "host", "top-k / top-p" if filtered else "temperature / min-p")
                self.variants[filtered] = False
                torch.cuda.synchronize()
        return g

    def warm_up(self) -> int:
        """Capture every bucket's graphs now (the kernels compile on the way), with padding rows
        only: their KV goes to the scratch block, nothing else is touched. Returns the decode
        graphs captured (none without CUDA); the sampler's two variants are captured too."""
        if not self.capture:
            return 0
        for b in self.sizes:
            self.inputs.fill([], [], [], self.block_size, b)
            self._graph(b)
            if self.device_sample:
                for filtered in (False, True):
                    self._sampler(b, filtered)
        torch.cuda.synchronize()
        return len(self.graphs)

    def try_step(self, chunks) -> tuple[torch.Tensor, list[int | None]] | None:
        """Run a scheduled step here when it is decode only (one sampled token per sequence, at
        most the largest bucket): (logits, tokens) in chunk order — greedy rows their argmax,
        rows drawn on the device their draw, None where the host samples; None otherwise."""
        started = self.launch(chunks)
        return None if started is None else self.collect(started)

    def launch(self, chunks, feed: tuple | None = None) -> tuple | None:
        """``try_step``'s first half: a decode-only step's inputs filled and its graph replayed —
        on CUDA queued behind the work before it, its tokens copied back as they come — or None
        when the step is not decode only. ``collect`` then reads its tokens. ``feed``: (a step
        launched before, {id(sequence): its row there}): a row of such a sequence takes its id
        from that step's token on the device, not from its token ids (a placeholder there)."""
        if not chunks or len(chunks) > self.sizes[-1] or any(c.num_tokens != 1 or not c.sample for c in chunks):
            return None
        from shared.engine import sampler
        bs = self.block_size
        sampling = [None] * len(chunks)
        for i, c in enumerate(chunks):
            p = c.seq.params
            if sampler.on_device(c.seq) and self.variants[bool(p.top_k) or p.top_p < 1.0]:
                sampling[i] = (p.temperature, p.top_k, p.top_p, p.min_p, c.seq.seed, c.seq.num_output_tokens)
        rows = [-1] * len(chunks)
        if feed is not None:
            (before, _), where = feed
            rows = [where.get(id(c.seq), -1) for c in chunks]
            feed = before, rows
        ids = [c.seq.token_ids[c.start] if r < 0 else 0 for c, r in zip(chunks, rows)]
        started = self.start(ids, [c.start for c in chunks], [c.seq.block_table[:c.start // bs + 1] for c in chunks],
                             sampling, feed)
        return started, [c.seq.params.greedy or s is not None for c, s in zip(chunks, sampling)]

    @staticmethod
    def chosen(launched: tuple) -> list[bool]:
        """Per row of a launched step: is its token the graph's (an argmax, or a draw its sampler
        made), not the host's to draw?"""
        started, taken = launched
        return [ok and (started.drawn or started.sampling is None or started.sampling[i] is None)
                for i, ok in enumerate(taken)]

    def collect(self, launched: tuple) -> tuple[torch.Tensor, list[int | None]]:
        """(logits, tokens) of a step ``launch`` started, as ``try_step`` returns them (the wait
        for the GPU is here)."""
        started, taken = launched
        logits, tokens = self.finish(started)
        return logits, [t if ok else None for t, ok in zip(tokens, taken)]

    def run(self, ids: list[int], positions: list[int], tables: list[list[int]],
            sampling: list | None = None) -> tuple[torch.Tensor, list[int | None]]:
        """(logits [n, vocab], tokens) of one decode token for each of the n rows: each row's
        argmax, or its draw where ``sampling`` gives it parameters (``DecodeInputs.fill``; None
        there if the sampler could not be captured)."""
        return self.finish(self.start(ids, positions, tables, sampling))

    def start(self, ids: list[int], positions: list[int], tables: list[list[int]],
              sampling: list | None = None, feed: tuple | None = None) -> Started:
        """``run``'s first half: the inputs filled (one host-to-device copy) and the step
        replayed (CUDA: queued), its tokens copied back as they come; ``finish`` reads them.
        ``feed``: (a started step, per row the row of it whose token is this row's id, or -1)."""
        n = len(ids)
        bucket = bucket_for(n, self.sizes)
        variant = self.inputs.fill(ids, positions, tables, self.block_size, bucket, sampling,
                                   None if feed is None else feed[1])
        if feed is not None:    # the ids from the step before's tokens, on the device, before this step reads them
            before = feed[0].best
            v = self.inputs.views
            ids_dev, rows = v["ids"][:bucket], v["feed"][:bucket]
            ids_dev.copy_(torch.where(rows >= 0, before[rows.clamp(min=0).long()].to(torch.int32), ids_dev))
        self.steps += 1
        if self.capture:
            g = self._sampler(bucket, variant) if variant is not None else None
            drawn = g is not None
            graph, logits, best = g or self._graph(bucket)
            graph.replay()
            self.replays += 1
        else:
            logits, best = self._body(bucket, variant)
            drawn = variant is not None
        self.turn ^= 1
        host, done = self.tokens_host[self.turn][:n], self.tokens_done[self.turn]
        host.copy_(best[:n], non_blocking=done is not None)    # the step's one device-to-host copy
        if done is not None:
            done.record()
        return Started(n, logits, best, sampling, variant, drawn, host, done)

    def finish(self, started: Started) -> tuple[torch.Tensor, list[int | None]]:
        """``run``'s second half: the step's tokens, once they are here."""
        n, logits, sampling, variant, drawn = (started.n, started.logits, started.sampling, started.variant,
                                               started.drawn)
        if started.done is not None:
            started.done.synchronize()
        tokens = started.host.tolist()
        if drawn:
            self.drawn += sum(s is not None for s in sampling)
        elif variant is not None:              # no sampler: those rows are the host's to draw
            tokens = [None if s is not None else t for t, s in zip(tokens, sampling)]
        return logits[:n], tokens


def wanted(device: torch.device, mode: str) -> bool:
    """Does an engine on ``device`` run the fused step in ``mode`` (``MODES``)? On CUDA unless
    "ops" (where Triton imports); on the CPU only in Triton's interpreter when
    TANDEM_GPU_STEP_INTERPRET=1 (how the tests run the whole step without a GPU)."""
    if mode not in MODES:
        raise ValueError(f"gpu_step must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "ops" or (device.type != "cuda" and os.environ.get("TANDEM_GPU_STEP_INTERPRET") != "1"):
        return False      # (a CPU engine never imports triton here)
    from kernels import gpu
    return gpu.available() and (device.type == "cuda" or gpu.interpreting())


def attach(model, kv: torch.Tensor, blocks, mode: str, max_context: int, max_seqs: int,
           block_size: int) -> DecodeGraphs | None:
    """Give ``model`` (a Transformer) its fused step where ``wanted``; with "graphs", return the
    decode graphs (their scratch block taken from ``blocks`` for good). Logs what it chose."""
    if not wanted(model.device, mode):
        return None
    reason = unsupported(model.cfg, block_size)
    if reason:
        log.warning("the fused GPU step cannot run %s (%s): op by op", model.cfg.name, reason)
        return None
    model.gpu = GpuStep(model, max_context)
    if mode != "graphs":
        log.info("GPU step: fused Triton kernels, launched eagerly (precision %s, matmul tiles: %s)",
                 model.gpu.precision, model.gpu.tuning.source)
        return None
    scratch = blocks.allocate(1)
    if scratch is None:
        raise ValueError("no KV block left for the decode graphs' scratch block")
    graphs = DecodeGraphs(model.gpu, kv, max_seqs, math.ceil(max_context / block_size), block_size, scratch[0],
                          capture=model.device.type == "cuda")
    log.info("GPU step: fused Triton kernels, decode steps as CUDA graphs (buckets %s, precision %s, "
             "matmul tiles: %s)", graphs.sizes, model.gpu.precision, model.gpu.tuning.source)
    return graphs
