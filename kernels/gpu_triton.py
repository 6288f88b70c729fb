"""The Triton kernels behind ``kernels.gpu`` and ``kernels.gpu_step`` (imported on first use:
Triton reads TRITON_INTERPRET when a kernel is defined, and its kernels must live at module level).
The Q4_0 matmuls' layout and math are described in kernels/gpu.py, the fused step's in
kernels/gpu_step.py.

Layouts of the step's kernels: activations float32 row-major; Q4_0 weights as llama.cpp's
``block_q4_0`` rows (kernels/q4_0.py), each passed twice, as bytes and as float16 (the scales);
the KV cache one layer's view ``kv[:, layer]`` of the
engine's ``[blocks, layers, 2, block_size, kv_heads, head_dim]`` float16 tensor, addressed through
its strides (the view is not contiguous)."""

from __future__ import annotations

import os

import triton
import triton.language as tl

try:        # programmatic dependent launch (Triton >= 3.4); only a PDL > 0 kernel calls them
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: TANDEM_GPU_PDL stays off (kernels/gpu_step.py)
    gdc_launch_dependents = gdc_wait = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"   # how these kernels were defined


@triton.jit
def _grid_dependency(PDL: tl.constexpr):
    """With programmatic dependent launch (PDL > 0: launched with ``launch_pdl``, sm_90+): wait
    until the previous kernel of the stream has finished and its writes are visible. PDL == 1
    then lets the next kernel start launching at once (its programs sit resident until their own
    wait); PDL == 2 triggers nothing, so the next kernel launches once every program of this one
    has exited (CUDA's implicit trigger), still before this one's completion is flushed. Every
    fused-step kernel does this before it reads or writes anything the kernel before writes, so
    the launch of a kernel overlaps its predecessor's tail and nothing else changes
    (kernels/gpu_step.py ``pdl_mode``)."""
    if PDL > 0:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()


@triton.jit
def _half(lo, hi):
    """An fp16 from its two bytes (little endian), as f32."""
    return (lo.to(tl.uint16) | (hi.to(tl.uint16) << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale(q_ptr, off, mask):
    """The fp16 block scale at byte offsets ``off``, as f32."""
    return _half(tl.load(q_ptr + off, mask=mask, other=0), tl.load(q_ptr + off + 1, mask=mask, other=0))


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

# ---- the fused step (kernels/gpu_step.py) ------------------------------------------------------

@triton.jit
def embed(ids_ptr, q_ptr, out_ptr, K, row_bytes, stride_o, BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    """Row ``ids[t]`` of a Q4_0 table, dequantized: one program per token."""
    _grid_dependency(PDL)
    _embed_row(tl.program_id(0).to(tl.int64), ids_ptr, q_ptr, out_ptr, K, row_bytes, stride_o, BLOCK_B)


@triton.jit
def _embed_row(t, ids_ptr, q_ptr, out_ptr, K, row_bytes, stride_o, BLOCK_B: tl.constexpr):
    """``embed``'s token ``t``."""
    tok = tl.load(ids_ptr + t).to(tl.int64)
    b = tl.arange(0, BLOCK_B)
    j = tl.arange(0, 16)
    nb = K // 32
    for kb in range(0, nb, BLOCK_B):
        blk = kb + b                                            # [BB]
        ok = blk < nb
        base = tok * row_bytes + blk * 18
        d = _scale(q_ptr, base, ok)                             # [BB]
        qs = tl.load(q_ptr + base[:, None] + 2 + j[None, :], mask=ok[:, None], other=0)   # [BB, 16]
        k = blk[:, None] * 32 + j[None, :]
        tl.store(out_ptr + t * stride_o + k, ((qs & 15).to(tl.int32) - 8).to(tl.float32) * d[:, None],
                 mask=ok[:, None])
        tl.store(out_ptr + t * stride_o + k + 16, ((qs >> 4).to(tl.int32) - 8).to(tl.float32) * d[:, None],
                 mask=ok[:, None])


@triton.jit
def _last_arrival(cnt_ptr, expected):
    """Is this program the last of ``expected`` to arrive at counter ``cnt_ptr``? The counter is
    left at 0 by that last one (ready for the next launch or replay). The CTA barrier, then one
    thread's acq_rel atomic at GPU scope (its result shared through shared memory and a second
    barrier) order every thread's stores before it and the last program's loads after every
    other program's stores: CUTLASS's split-K semaphore, without its spin (nobody waits)."""
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    last = done == expected - 1
    if last:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _store_tile(out_ptr, part_ptr, cnt_ptr, acc, m, n, ok, M, N, stride_om, split, splits, tile,
                SPLIT: tl.constexpr, FIXUP: tl.constexpr, RESIDUAL: tl.constexpr):
    """A matmul's [rows m, columns n] tile into ``out`` (+= with RESIDUAL). SPLIT: this program's
    partial sum goes to split ``split`` of ``part`` ([splits, M, N]); with FIXUP the last of the
    ``splits`` programs of tile ``tile`` to finish adds the splits up in split order from zero —
    ``split_sum``'s sum, bit for bit, without a launch of its own — else ``split_sum`` (or a
    consumer reading the partials, ``rope_kv``) does."""
    if SPLIT:
        pn = m[:, None] * N + n[None, :]
        tl.store(part_ptr + split.to(tl.int64) * M * N + pn, acc, mask=ok)
        if FIXUP:
            if _last_arrival(cnt_ptr + tile, splits):
                # the residual and the partials asked for together, 8 partials at a time for a
                # decode's tile (its 8-18 splits: one to three round trips; the loop as compiled
                # unrolled by 4, the residual after it: up to six), added in split order
                o = out_ptr + m[:, None] * stride_om + n[None, :]
                if RESIDUAL:
                    res = tl.load(o, mask=ok, other=0.0)
                acc = tl.zeros_like(acc)
                if acc.shape[0] <= 16:
                    for s0 in range(0, splits, 8):
                        for u in tl.static_range(8):      # (past the last split: -0.0, which adds nothing)
                            there = tl.full(ok.shape, s0 + u, tl.int32) < splits
                            acc += tl.load(part_ptr + (s0 + u) * M * N + pn, mask=ok & there,
                                           other=-0.0, cache_modifier=".cg")
                else:      # (a 64-row tile's 8 partials held at once: 256 registers a thread)
                    for s in range(splits):
                        acc += tl.load(part_ptr + s * M * N + pn, mask=ok, other=0.0, cache_modifier=".cg")
                if RESIDUAL:
                    acc = res + acc
                tl.store(o, acc, mask=ok)
    else:
        o = out_ptr + m[:, None] * stride_om + n[None, :]
        if RESIDUAL:
            acc = tl.load(o, mask=ok, other=0.0) + acc
        tl.store(o, acc, mask=ok)


@triton.jit
def _squares(x_ptr, m, m_ok, stride_xm, k0, K, NORM_W: tl.constexpr):
    """Rows m's squares of x[m, k0:k0 + NORM_W] (past K: 0)."""
    kk = k0 + tl.arange(0, NORM_W)
    xv = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
    return xv * xv


@triton.jit
def _rstd(x_ptr, m, m_ok, stride_xm, eps, K: tl.constexpr, NORM_W: tl.constexpr, BLOCK_M: tl.constexpr,
          NORM: tl.constexpr):
    """Rows m's 1 / RMS over all of K (NORM_W values a step), whatever part of K the program
    reduces; ones without NORM. The steps' squares are added element-wise and reduced once a row:
    no step's loads wait for the one before (a reduction a step — shuffles on its loads' values —
    let ptxas issue the loads in batches between them: three and more dependent rounds, sm_90)."""
    rstd = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if NORM:
        ss = tl.zeros([BLOCK_M, NORM_W], dtype=tl.float32)
        if BLOCK_M <= 16:   # unrolled: the steps' loads in flight together (past 16 rows they spill)
            for k0 in tl.static_range(0, K, NORM_W):
                ss += _squares(x_ptr, m, m_ok, stride_xm, k0, K, NORM_W)
        else:               # the same steps in the same order: the same bits
            for k0 in tl.range(0, K, NORM_W, loop_unroll_factor=6):
                ss += _squares(x_ptr, m, m_ok, stride_xm, k0, K, NORM_W)
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps)
    return rstd


@triton.jit
def _q4_fetch_tile(q_ptr, d_ptr, n, n_ok, N, nb, kb, kb1, t, BLOCK_B: tl.constexpr):
    """``qmatmul``'s weight tile of K step ``kb`` for rows n of a Q4_0 matrix [N, nb blocks],
    fetched raw: the quant bytes [BN, T] (column t: block kb + t // 16's, below kb1, byte t % 16)
    and their blocks' fp16 scales (``d_ptr``: the same bytes as float16) — [BN, 1] with one
    block a step (one load a row, broadcast over its quants), else [BN, T]. Nothing computes on
    them here, so a K step's fetch can be issued a step ahead of its use (``_q4_values``)."""
    if BLOCK_B == 1:
        blk = kb + tl.zeros([1], dtype=tl.int32)                     # [1]
    else:
        blk = kb + t // 16                                           # [T]
    ok = n_ok[:, None] & (blk < kb1)[None, :]                        # the quants' mask too (broadcast)
    row = n[:, None] * (nb * 18)
    d = tl.load(d_ptr + (row + blk[None, :] * 18) // 2, mask=ok, other=0.0)
    qs = tl.load(q_ptr + row + (kb * 18 + (t // 16) * 18 + 2 + t % 16)[None, :], mask=ok, other=0)
    return d, qs


@triton.jit
def _q4_fetch3(q_ptr, d_ptr, n, n_ok, N, nb, blk, kb1):
    """``qgemv``'s weight tile: blocks ``blk`` [BB] (below kb1) of Q4_0 rows n, fetched (scales
    [BN, BB, 1], quant bytes [BN, BB, 16]). The address sums are
    ``_q4_fetch_tile``'s grouped for this tile's shape. Not shared: one helper for both (three
    groupings tried, 2026-11-29, sm_90, Triton 3.9) changed the registers of 23-82 of the ~200
    variants, both ways, qgemv's up to 2x — a codegen change to time on a GPU, not a tidy-up."""
    j = tl.arange(0, 16)[None, None, :]
    ok = (n_ok[:, None] & (blk < kb1)[None, :])[:, :, None]
    base = (n[:, None] * (nb * 18) + blk[None, :] * 18)[:, :, None]
    d = tl.load(d_ptr + base // 2, mask=ok, other=0.0)
    qs = tl.load(q_ptr + base + 2 + j, mask=ok, other=0)
    return d, qs


@triton.jit
def _q4_values(d, qs):
    """Fetched Q4_0 values (``_q4_fetch_tile``) dequantized: (low nibbles, high nibbles)
    ``(q - 8) * d`` in float32, the scales broadcast over the quant bytes."""
    d = d.to(tl.float32)
    return ((qs & 15).to(tl.int32) - 8).to(tl.float32) * d, ((qs >> 4).to(tl.int32) - 8).to(tl.float32) * d


@triton.jit
def _q4_ints(qs):
    """Fetched Q4_0 quant bytes as their values before the scale: (low, high nibbles) ``q - 8``,
    float32 (small integers: exact in TF32)."""
    return ((qs & 15).to(tl.int32) - 8).to(tl.float32), ((qs >> 4).to(tl.int32) - 8).to(tl.float32)


@triton.jit
def _tf32_parts(x):
    """x as (its TF32 part, the rest): the part its top 19 bits (what a TF32 tensor-core operand
    keeps), the rest exact in f32 and within TF32's rounding of it."""
    big = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    return big, x - big


@triton.jit
def _dot_step(acc, x_ptr, nw_ptr, m, m_ok, stride_xm, rstd, kb, kb1, t, w_lo, w_hi, K: tl.constexpr,
              NORM: tl.constexpr, SILU: tl.constexpr, PRECISION: tl.constexpr, d=None):
    """``acc`` plus K step ``kb``'s activations (SiLU·up, RMS-normed) times its weight tile. With
    ``d`` (one Q4_0 block a step, "tf32x3"): w_lo / w_hi are the block's integers ``q - 8``
    (``_q4_ints``, exact in TF32) and d [BN, 1] its scales, applied to the step's sums: the
    activations split in two TF32 parts, two tensor-core passes a half (3xTF32's three, the third
    the weights' remainder — none here) and f32's accuracy."""
    blk = kb + t // 16                                               # [T]
    t_ok = blk < kb1
    k_lo = blk * 32 + t % 16                                         # [T]
    x_ok = m_ok[:, None] & t_ok[None, :]
    xo = m[:, None] * stride_xm + k_lo[None, :]
    if SILU:
        g_lo = tl.load(x_ptr + xo, mask=x_ok, other=0.0)
        g_hi = tl.load(x_ptr + xo + 16, mask=x_ok, other=0.0)
        u_lo = tl.load(x_ptr + xo + K, mask=x_ok, other=0.0)
        u_hi = tl.load(x_ptr + xo + K + 16, mask=x_ok, other=0.0)
        x_lo = g_lo * tl.sigmoid(g_lo) * u_lo
        x_hi = g_hi * tl.sigmoid(g_hi) * u_hi
    else:
        x_lo = tl.load(x_ptr + xo, mask=x_ok, other=0.0)             # [BM, T]
        x_hi = tl.load(x_ptr + xo + 16, mask=x_ok, other=0.0)
    if NORM:
        w_lo_n = tl.load(nw_ptr + k_lo, mask=t_ok, other=0.0)
        w_hi_n = tl.load(nw_ptr + k_lo + 16, mask=t_ok, other=0.0)
        x_lo = x_lo * rstd[:, None] * w_lo_n[None, :]
        x_hi = x_hi * rstd[:, None] * w_hi_n[None, :]
    if d is not None:
        b_lo, s_lo = _tf32_parts(x_lo)
        b_hi, s_hi = _tf32_parts(x_hi)
        step = tl.dot(b_lo, tl.trans(w_lo), input_precision="tf32")
        step = tl.dot(s_lo, tl.trans(w_lo), step, input_precision="tf32")
        step = tl.dot(b_hi, tl.trans(w_hi), step, input_precision="tf32")
        step = tl.dot(s_hi, tl.trans(w_hi), step, input_precision="tf32")
        return acc + step * tl.trans(d.to(tl.float32))
    acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision=PRECISION)
    return tl.dot(x_hi, tl.trans(w_hi), acc, input_precision=PRECISION)


@triton.jit
def _fetched_step(acc, x_ptr, nw_ptr, m, m_ok, stride_xm, rstd, kb, kb1, t, d, qs, K: tl.constexpr,
                  NORM: tl.constexpr, SILU: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr):
    """``_dot_step`` over a fetched weight tile (``_q4_fetch_tile``): its values dequantized, or
    (SCALED) its integers with the scales applied to the step's sums."""
    if SCALED:
        w_lo, w_hi = _q4_ints(qs)
        return _dot_step(acc, x_ptr, nw_ptr, m, m_ok, stride_xm, rstd, kb, kb1, t, w_lo, w_hi, K, NORM, SILU,
                         PRECISION, d)
    w_lo, w_hi = _q4_values(d, qs)
    return _dot_step(acc, x_ptr, nw_ptr, m, m_ok, stride_xm, rstd, kb, kb1, t, w_lo, w_hi, K, NORM, SILU, PRECISION)


@triton.jit
def _k_range(SPLIT: tl.constexpr, blocks_per_split, nb, split):
    """The Q4_0 blocks [kb0, kb1) of K a matmul program covers: split ``split``'s (SPLIT), else
    all ``nb``."""
    kb0 = 0
    kb1 = nb
    if SPLIT:
        kb0 = split * blocks_per_split
        kb1 = tl.minimum(kb0 + blocks_per_split, nb)
    return kb0, kb1


@triton.jit
def qmatmul(x_ptr, q_ptr, d_ptr, out_ptr, nw_ptr, part_ptr, cnt_ptr, M, N, stride_xm, stride_om, eps,
            blocks_per_split, K: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
            NORM: tl.constexpr, SILU: tl.constexpr, RESIDUAL: tl.constexpr, SPLIT: tl.constexpr,
            FIXUP: tl.constexpr, PRECISION: tl.constexpr, NORM_W: tl.constexpr, PDL: tl.constexpr,
            PREFETCH: tl.constexpr):
    """out[m, n] (+)= sum_k a[m, k] * W[n, k] for a BLOCK_M x BLOCK_N tile, every weight block read
    once for all BLOCK_M activation rows. ``a``: x (SILU=False) or silu(x[:, :K]) * x[:, K:]
    (SILU); times rsqrt(mean(x^2) + eps) * nw (NORM: RMSNorm in the prologue). RESIDUAL: out +=.
    SPLIT: this program covers blocks [s * blocks_per_split, (s + 1) * blocks_per_split) of K
    (s = program_id(2)); its partial sum goes to ``part`` (``_store_tile``: FIXUP, the tile's last
    split adds them into ``out``; else ``split_sum`` or the consumer does). PREFETCH (programs of
    more than one K step, up to 32 rows: ``prefetch``): each step's weight bytes are fetched
    during the step before; else at use, one set of them held at a time (fewer registers).
    The weights: Q4_0 bytes ``q`` [N, K/32*18] (``block_q4_0`` rows) and the same bytes as float16
    ``d`` (their scales)."""
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits, tile = tl.num_programs(2), pid_m * tl.num_programs(0) + pid_n    # (tile: its arrival counter)
    m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)      # [BM]
    n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)      # [BN]
    t = tl.arange(0, BLOCK_B * 16)                                   # [T]: block t // 16, byte t % 16
    # one Q4_0 block a K step in 3xTF32: its scales applied to the step's sums (``_dot_step``'s d)
    SCALED: tl.constexpr = BLOCK_B == 1 and PRECISION == "tf32x3"
    m_ok = m < M
    n_ok = n < N
    kb0, kb1 = _k_range(SPLIT, blocks_per_split, K // 32, split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BLOCK_M <= 16 and PDL == 0:
        # the norm's loads first, the first K step's weight bytes right after: both asked for before
        # either is used (the other way round the weights' layout conversion — a CTA barrier —
        # came between them: a round trip more, sm_90's SASS)
        rstd = _rstd(x_ptr, m, m_ok, stride_xm, eps, K, NORM_W, BLOCK_M, NORM)
        d, qs = _q4_fetch_tile(q_ptr, d_ptr, n, n_ok, N, K // 32, kb0, kb1, t, BLOCK_B)
    elif BLOCK_M <= 16:
        # the first K step's weight bytes before the wait on the previous kernel: weights never
        # change, so under PDL these loads overlap its tail (one block a split: all of this
        # program's); past 16 rows, held across the norm's prologue, they spilled
        d, qs = _q4_fetch_tile(q_ptr, d_ptr, n, n_ok, N, K // 32, kb0, kb1, t, BLOCK_B)
        _grid_dependency(PDL)
        rstd = _rstd(x_ptr, m, m_ok, stride_xm, eps, K, NORM_W, BLOCK_M, NORM)
    else:
        _grid_dependency(PDL)
        rstd = _rstd(x_ptr, m, m_ok, stride_xm, eps, K, NORM_W, BLOCK_M, NORM)
        if PREFETCH:
            d, qs = _q4_fetch_tile(q_ptr, d_ptr, n, n_ok, N, K // 32, kb0, kb1, t, BLOCK_B)
    kb_first = kb0
    if not PREFETCH:
        if BLOCK_M <= 16:   # the step fetched before the wait
            acc = _fetched_step(acc, x_ptr, nw_ptr, m, m_ok, stride_xm, rstd, kb0, kb1, t, d, qs, K, NORM, SILU,
                                PRECISION, SCALED)
            kb_first = kb0 + BLOCK_B
    for kb in range(kb_first, kb1, BLOCK_B):     # the steps in order whichever way: the same bits
        if PREFETCH:    # this step's bytes came during the step before; the next one's now go out
            u_d, u_qs = d, qs
            d, qs = _q4_fetch_tile(q_ptr, d_ptr, n, n_ok, N, K // 32, kb + BLOCK_B, kb1, t, BLOCK_B)
        else:           # fetched at use: one set of them held at a time
            u_d, u_qs = _q4_fetch_tile(q_ptr, d_ptr, n, n_ok, N, K // 32, kb, kb1, t, BLOCK_B)
        acc = _fetched_step(acc, x_ptr, nw_ptr, m, m_ok, stride_xm, rstd, kb, kb1, t, u_d, u_qs, K, NORM, SILU,
                            PRECISION, SCALED)
    _store_tile(out_ptr, part_ptr, cnt_ptr, acc, m, n, m_ok[:, None] & n_ok[None, :], M, N, stride_om, split, splits,
                tile, SPLIT, FIXUP, RESIDUAL)


@triton.jit
def _gemv_step(acc, x_ptr, nw_ptr, M, stride_xm, rows, blk, kb1, w_lo, w_hi, K: tl.constexpr,
               BLOCK_M: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr):
    """``acc`` [BLOCK_M, BN] plus each row's products with blocks ``blk``'s weight tile (rows past M
    read nothing; NORM: times the norm's weight, the row's rstd comes after the loop)."""
    j = tl.arange(0, 16)
    b_ok = blk < kb1
    k_lo = blk[:, None] * 32 + j[None, :]                            # [BB, 16]
    if NORM:
        nw_lo = tl.load(nw_ptr + k_lo, mask=b_ok[:, None], other=0.0)
        nw_hi = tl.load(nw_ptr + k_lo + 16, mask=b_ok[:, None], other=0.0)
    for r in tl.static_range(BLOCK_M):
        xm = (blk < kb1 * (M > r))[:, None]                          # [BB, 1]: rows past M read nothing
        xo = r * stride_xm + k_lo
        if SILU:
            g_lo = tl.load(x_ptr + xo, mask=xm, other=0.0)
            g_hi = tl.load(x_ptr + xo + 16, mask=xm, other=0.0)
            x_lo = g_lo * tl.sigmoid(g_lo) * tl.load(x_ptr + xo + K, mask=xm, other=0.0)
            x_hi = g_hi * tl.sigmoid(g_hi) * tl.load(x_ptr + xo + K + 16, mask=xm, other=0.0)
        else:
            x_lo = tl.load(x_ptr + xo, mask=xm, other=0.0)           # [BB, 16]
            x_hi = tl.load(x_ptr + xo + 16, mask=xm, other=0.0)
        if NORM:
            x_lo = x_lo * nw_lo
            x_hi = x_hi * nw_hi
        part = w_lo * x_lo[None, :, :] + w_hi * x_hi[None, :, :]
        c = tl.sum(tl.sum(part, axis=2), axis=1)                     # [BN]
        acc = tl.where((rows == r)[:, None], acc + c[None, :], acc)
    return acc


@triton.jit
def qgemv(x_ptr, q_ptr, d_ptr, out_ptr, nw_ptr, part_ptr, cnt_ptr, M, N, stride_xm, stride_om, eps,
          blocks_per_split, K: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
          NORM: tl.constexpr, SILU: tl.constexpr, RESIDUAL: tl.constexpr, SPLIT: tl.constexpr,
          FIXUP: tl.constexpr, NORM_W: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """``qmatmul``'s contract for a few rows (M <= BLOCK_M <= 16: decode) without ``tl.dot``: each
    K step dequantizes a [BLOCK_N, BLOCK_B, 16] weight tile once into registers, and each of the
    BLOCK_M rows (unrolled; rows >= M masked) reduces its products with it in-register. A row's
    sum runs in the same order whatever BLOCK_M, so rows are batch-invariant up to 16."""
    pid_n, split, splits = tl.program_id(0), tl.program_id(2), tl.num_programs(2)
    tile = tl.program_id(1) * tl.num_programs(0) + pid_n                     # (its arrival counter)
    n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)      # [BN]
    n_ok = n < N
    b = tl.arange(0, BLOCK_B)
    rows = tl.arange(0, BLOCK_M)
    kb0, kb1 = _k_range(SPLIT, blocks_per_split, K // 32, split)
    # the first K step's weight bytes before the wait on the previous kernel (as in qmatmul)
    d, qs = _q4_fetch3(q_ptr, d_ptr, n, n_ok, N, K // 32, kb0 + b, kb1)
    _grid_dependency(PDL)
    if NORM:   # RMSNorm is one factor a row: sum(x * rstd * nw * w) = rstd * sum(x * nw * w); each row's
        # RMS on its own (a [NORM_W] reduction: the same order whatever BLOCK_M). Its loads go out
        # with the first weight tile's and it is one reduction a row: every step's squares added
        # element-wise first (a reduction a step, after the loop, was that many more round trips and
        # CTA barriers at each program's end: sm_90's SASS, 2026-11-30)
        rstd = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        for r in tl.static_range(BLOCK_M):
            sq = tl.zeros([NORM_W], dtype=tl.float32)
            for k0 in tl.static_range(0, K, NORM_W):
                kk = k0 + tl.arange(0, NORM_W)
                xv = tl.load(x_ptr + r * stride_xm + kk, mask=kk < K * (M > r), other=0.0)   # row r < M
                sq += xv * xv
            rstd = tl.where(rows == r, 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps), rstd)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_lo, w_hi = _q4_values(d, qs)
    if PREFETCH:
        d, qs = _q4_fetch3(q_ptr, d_ptr, n, n_ok, N, K // 32, kb0 + BLOCK_B + b, kb1)
    acc = _gemv_step(acc, x_ptr, nw_ptr, M, stride_xm, rows, kb0 + b, kb1, w_lo, w_hi, K, BLOCK_M, NORM, SILU)
    for kb in range(kb0 + BLOCK_B, kb1, BLOCK_B):
        if PREFETCH:    # this step's bytes came during the step before; the next one's now go out
            w_lo, w_hi = _q4_values(d, qs)
            d, qs = _q4_fetch3(q_ptr, d_ptr, n, n_ok, N, K // 32, kb + BLOCK_B + b, kb1)
        else:
            f_d, f_qs = _q4_fetch3(q_ptr, d_ptr, n, n_ok, N, K // 32, kb + b, kb1)
            w_lo, w_hi = _q4_values(f_d, f_qs)
        acc = _gemv_step(acc, x_ptr, nw_ptr, M, stride_xm, rows, kb + b, kb1, w_lo, w_hi, K, BLOCK_M, NORM, SILU)
    if NORM:
        acc = acc * rstd[:, None]
    _store_tile(out_ptr, part_ptr, cnt_ptr, acc, rows.to(tl.int64), n, (rows < M)[:, None] & n_ok[None, :], M, N,
                stride_om, split, splits, tile, SPLIT, FIXUP, RESIDUAL)


@triton.jit
def split_sum(part_ptr, out_ptr, M, N, stride_om, SPLITS: tl.constexpr, RESIDUAL: tl.constexpr,
              BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[m, n] (+)= the SPLITS partial sums of ``qmatmul``, added in split order (deterministic)."""
    _grid_dependency(PDL)
    m = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(part_ptr + s * M * N + m * N + n, mask=ok, other=0.0)
    o = out_ptr + m * stride_om + n
    if RESIDUAL:
        acc = tl.load(o, mask=ok, other=0.0) + acc
    tl.store(o, acc, mask=ok)


@triton.jit
def _split_parts(ptr, split_stride, SPLITS: tl.constexpr, mask=None):
    """Values at ``ptr`` of a matmul's output, from its SPLITS partial sums added in split order
    from zero — ``split_sum``'s sum, bit for bit (SPLITS = 1: the output itself); 0 where not
    ``mask``."""
    if SPLITS == 1:
        return _load0(ptr, mask)
    acc = tl.zeros_like(_load0(ptr, mask))
    for s in tl.static_range(SPLITS):
        acc += _load0(ptr + s * split_stride, mask)
    return acc


@triton.jit
def _load0(ptr, mask):
    """``tl.load(ptr)``, 0 where not ``mask`` (None: everywhere loaded)."""
    if mask is None:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=mask, other=0.0)
    return v


@triton.jit
def _rotate(x1, x2, c, s):
    """Rotate-half rotary embedding of the halves (x1, x2) by (cos, sin)."""
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _qk_norm(x1, x2, w_ptr, i, eps, HD: tl.constexpr):
    """Per-head RMSNorm (qwen3) of one head's halves [HALF], weight ``w_ptr``."""
    r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HD + eps)
    return x1 * r * tl.load(w_ptr + i), x2 * r * tl.load(w_ptr + HD // 2 + i)


@triton.jit
def _head_halves(row, col, bias_ptr, split_stride, HD: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SPLITS: tl.constexpr, mask=None):
    """The two halves of the projection's head at column ``col`` of a token's row, bias added
    (zeros where not ``mask``: nothing read)."""
    HALF: tl.constexpr = HD // 2
    i = tl.arange(0, HALF)
    x1 = _split_parts(row + col + i, split_stride, SPLITS, mask)
    x2 = _split_parts(row + col + HALF + i, split_stride, SPLITS, mask)
    if HAS_BIAS:
        x1 += _load0(bias_ptr + col + i, mask)
        x2 += _load0(bias_ptr + col + HALF + i, mask)
    return x1, x2


@triton.jit
def _rope_kv_head(row, kvh, bias_ptr, kn_ptr, cos_ptr, sin_ptr, pos, slot_ptr, s_kv, split_stride, eps,
                  NH: tl.constexpr, NKV, HD: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
                  SPLITS: tl.constexpr, mask):
    """kv head ``kvh`` of a token (its q|k|v row ``row``): the rotated key and the value, float16,
    at ``slot_ptr`` (the key) and ``slot_ptr + s_kv`` (the value); returned too ([HD, 2]: key, value). Where not ``mask`` (a scalar): nothing read or written.
    Every load is asked for before the first store (a store may alias a later load's address, so
    nothing moves a load past it)."""
    HALF: tl.constexpr = HD // 2
    i = tl.arange(0, HALF)
    d = tl.arange(0, HD)
    i_ok = i < HALF * mask         # the mask as blocks (Triton's interpreter takes no scalar mask, nor an
    d_ok = d < HD * mask           # ``&`` of two as one)
    x1, x2 = _head_halves(row, (NH + kvh) * HD, bias_ptr, split_stride, HD, HAS_BIAS, SPLITS, i_ok)
    vcol = (NH + NKV) * HD + kvh * HD
    v = _split_parts(row + vcol + d, split_stride, SPLITS, d_ok)
    if HAS_BIAS:
        v += _load0(bias_ptr + vcol + d, d_ok)
    if QK_NORM:
        x1, x2 = _qk_norm(x1, x2, kn_ptr, i, eps, HD)
    r1, r2 = _rotate(x1, x2, tl.load(cos_ptr + pos * HALF + i), tl.load(sin_ptr + pos * HALF + i))
    k1, k2, vh = r1.to(tl.float16), r2.to(tl.float16), v.to(tl.float16)
    tl.store(slot_ptr + i, k1, mask=i_ok)
    tl.store(slot_ptr + HALF + i, k2, mask=i_ok)
    tl.store(slot_ptr + s_kv + d, vh, mask=d_ok)
    key = tl.reshape(tl.permute(tl.join(k1, k2), (1, 0)), (HD,))
    return tl.join(key, vh)


@triton.jit
def rope_kv(qkv_ptr, bias_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, sblk_ptr, soff_ptr, q_ptr, kv_ptr,
            stride_qkv, stride_q, s_blk, s_kv, s_slot, s_head, eps, split_stride,
            NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
            HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    """One (token, kv head) of the q|k|v projection: bias, per-head RMSNorm (qwen3), rotary embedding
    (rotate-half) of the kv head's GROUP query heads, to q (``_rope_group``, as ``attn_decode``
    rotates a decode's), and of its key: the key and the value into the KV cache at the token's
    slot (float16). SPLITS > 1: q|k|v is the projection's split partial sums ([SPLITS, tokens, N],
    ``split_stride`` apart), added here as they are read (no ``split_sum``)."""
    _grid_dependency(PDL)
    tok = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    row = qkv_ptr + tok * stride_qkv
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    g = tl.arange(0, GROUP_P)
    g_ok = g < GROUP
    heads = kvh * GROUP + g
    q = _rope_group(row, heads, g_ok, bias_ptr, qn_ptr, cos_ptr, sin_ptr, pos, split_stride, eps, HD, HAS_BIAS,
                    QK_NORM, SPLITS)
    d = tl.arange(0, HD)
    tl.store(q_ptr + tok * stride_q + heads[:, None] * HD + d[None, :], q, mask=g_ok[:, None])
    slot = (tl.load(sblk_ptr + tok).to(tl.int64) * s_blk + tl.load(soff_ptr + tok).to(tl.int64) * s_slot
            + kvh * s_head)
    _rope_kv_head(row, kvh, bias_ptr, kn_ptr, cos_ptr, sin_ptr, pos, kv_ptr + slot, s_kv, split_stride, eps,
                  NH, NKV, HD, HAS_BIAS, QK_NORM, SPLITS, kvh >= 0)


@triton.jit
def _rope_group(row, heads, g_ok, bias_ptr, qn_ptr, cos_ptr, sin_ptr, pos, split_stride, eps,
                HD: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, SPLITS: tl.constexpr):
    """A kv head's group of query heads of a token (its q|k|v row ``row``), rotated as ``rope_kv``
    rotates each: [GROUP_P, HD] (rows past the group: zeros)."""
    HALF: tl.constexpr = HD // 2
    i = tl.arange(0, HALF)
    col = heads[:, None] * HD + i[None, :]                                    # [GP, HALF]
    ok = g_ok[:, None]
    x1 = _split_parts(row + col, split_stride, SPLITS, ok)
    x2 = _split_parts(row + col + HALF, split_stride, SPLITS, ok)
    if HAS_BIAS:
        x1 += tl.load(bias_ptr + col, mask=ok, other=0.0)
        x2 += tl.load(bias_ptr + col + HALF, mask=ok, other=0.0)
    if QK_NORM:
        r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HD + eps)
        x1 = x1 * r[:, None] * tl.load(qn_ptr + i)[None, :]
        x2 = x2 * r[:, None] * tl.load(qn_ptr + HALF + i)[None, :]
    r1, r2 = _rotate(x1, x2, tl.load(cos_ptr + pos * HALF + i)[None, :], tl.load(sin_ptr + pos * HALF + i)[None, :])
    return tl.reshape(tl.permute(tl.join(r1, r2), (0, 2, 1)), (r1.shape[0], HD))


@triton.jit
def _merge_segments(po_ptr, pml_ptr, base0, nused, NSEG_P: tl.constexpr, HD: tl.constexpr,
                    CACHE: tl.constexpr):
    """The first ``nused`` segments' partials of one (entry, query head) at ``base0`` merged, in
    segment order: sum_j w_j acc_j / sum_j w_j l_j with w_j = exp(m_j - max m)."""
    j = tl.arange(0, NSEG_P)
    ok = j < nused
    base = base0 + j
    m = tl.load(pml_ptr + base * 2, mask=ok, other=float("-inf"), cache_modifier=CACHE)
    lsum = tl.load(pml_ptr + base * 2 + 1, mask=ok, other=0.0, cache_modifier=CACHE)
    mx = tl.max(m, axis=0)
    w = tl.where(ok, tl.exp(m - mx), 0.0)
    d = tl.arange(0, HD)
    o = tl.load(po_ptr + base[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0, cache_modifier=CACHE)
    return tl.sum(o * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)


@triton.jit
def attn_decode(q_ptr, kv_ptr, bt_ptr, lens_ptr, rows_ptr, out_ptr, po_ptr, pml_ptr, cnt_ptr,
                stride_q, stride_o, stride_bt, s_blk, s_kv, s_slot, s_head, scale,
                bias_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, sblk_ptr, soff_ptr, split_stride, eps,
                SEG: tl.constexpr, NSEG: tl.constexpr, NSEG_P: tl.constexpr, GROUP: tl.constexpr,
                GROUP_P: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT: tl.constexpr, FIXUP: tl.constexpr, ROPE: tl.constexpr, NH: tl.constexpr,
                HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr,
                DOT: tl.constexpr):
    """One query token against its whole context, for the GROUP query heads of one kv head, over the
    keys of one segment [seg * SEG, (seg + 1) * SEG) read in place through the block table, with
    an online softmax. Entry e = program_id(0): its token is row rows[e] of q, its context
    lens[e] keys, its blocks bt[e]. SPLIT (the context may span segments): each segment's
    unnormalised (acc, max, sum) go to the partials, merged in segment order by the last segment
    of (entry, kv head) to finish (FIXUP; a context of one segment writes its result at once) or
    by ``attn_merge``; else (one segment) the result goes to out.

    ROPE (decode-only steps): ``q_ptr`` is the q|k|v projection instead (its SPLITS partial sums,
    ``split_stride`` apart, as ``rope_kv`` reads them) and this kernel does ``rope_kv``'s work for
    its token: the group's query heads rotated (bias, per-head norm) at position pos[row], and —
    in the program of the segment holding the token itself — the kv head's rotated key and its
    value written into the token's KV slot (and used from registers where a key step meets it).

    DOT (an input precision, "ieee" or "tf32x3"): the scores and the values' weighted sum as
    ``tl.dot``s, the group's rows padded to GROUP_P >= 16 (tl.dot's least); "": as broadcast
    products reduced with ``tl.sum`` (GROUP_P rows: a power of two >= GROUP)."""
    _grid_dependency(PDL)
    e, kvh, seg, nkv = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2), tl.num_programs(1)
    L = tl.load(lens_ptr + e)
    row = tl.load(rows_ptr + e).to(tl.int64)     # (asked for here; LLVM sinks it below the length check)
    lo = seg * SEG
    if lo < L:
        hi = tl.minimum(lo + SEG, L)
        # the segment's block ids in one load, first (with q's): a key step then waits on one round
        # trip (its K and V), not two (the table, then K and V)
        NB: tl.constexpr = SEG // BS
        j = tl.arange(0, NB)
        seg_blocks = tl.load(bt_ptr + e * stride_bt + lo // BS + j, mask=lo + j * BS < hi, other=0)   # [NB]
        g = tl.arange(0, GROUP_P)
        g_ok = g < GROUP
        d = tl.arange(0, HD)
        heads = kvh * GROUP + g                                                   # [GP]
        kk0 = tl.arange(0, BLOCK_K)
        head = kvh * s_head
        # the first key step's keys and values asked for now, with q's loads (each step's come a
        # step ahead of their use, ``_kv_step``)
        slot, kv2 = _kv_step(kv_ptr, seg_blocks, j, lo, lo, hi, kk0, d, head, s_blk, s_kv, s_slot, BS)
        if ROPE:
            pos = tl.load(pos_ptr + row).to(tl.int64)
            q = _rope_group(q_ptr + row * stride_q, heads, g_ok, bias_ptr, qn_ptr, cos_ptr, sin_ptr, pos,
                            split_stride, eps, HD, HAS_BIAS, QK_NORM, SPLITS)
            # the token's own key and value, written by the program of the segment holding it; that
            # program uses them from its registers where its key steps meet their slot (what it
            # stored, bit for bit) — so no step's loads wait for the store (a CTA barrier and a
            # round trip before every key of the context, until 2026-12-01)
            own = seg == (L - 1) // SEG
            own_slot = (tl.load(sblk_ptr + row).to(tl.int64) * s_blk + tl.load(soff_ptr + row).to(tl.int64) * s_slot
                        + head)
            own_kv = _rope_kv_head(q_ptr + row * stride_q, kvh, bias_ptr, kn_ptr, cos_ptr, sin_ptr, pos,
                                   kv_ptr + own_slot, s_kv, split_stride, eps, NH, nkv, HD, HAS_BIAS, QK_NORM, SPLITS,
                                   own)                                           # [HD, 2]
        else:
            q = tl.load(q_ptr + row * stride_q + heads[:, None] * HD + d[None, :], mask=g_ok[:, None], other=0.0)
        if DOT != "":
            q = q * scale      # (once, not a step's scores each)
        m_i = tl.full([GROUP_P], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_P], dtype=tl.float32)
        acc = tl.zeros([GROUP_P, HD], dtype=tl.float32)
        for k0 in range(lo, hi, BLOCK_K):
            k_ok = k0 + kk0 < hi
            cur = kv2
            if ROPE:
                cur = tl.where((k_ok & own & (slot == own_slot))[:, None, None], own_kv[None, :, :], cur)
            slot, kv2 = _kv_step(kv_ptr, seg_blocks, j, lo, k0 + BLOCK_K, hi, kk0, d, head, s_blk, s_kv, s_slot, BS)
            k, v = tl.split(cur.to(tl.float32))
            if DOT != "":
                sc = tl.dot(q, tl.trans(k), input_precision=DOT)                                # [GP, BK]
            else:
                sc = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
            sc = tl.where(k_ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if DOT != "":
                acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT)
            else:
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        nused = (L + SEG - 1) // SEG
        if SPLIT:
            partial = nused > 1 if FIXUP else nused > 0
        else:
            partial = nused < 0
        if partial:
            # partials: po [E, NH, NSEG, HD], pml [E, NH, NSEG, 2] (max, sum)
            nh = GROUP * nkv
            base = (e * nh + heads) * NSEG + seg                                      # [GP]
            tl.store(po_ptr + base[:, None] * HD + d[None, :], acc, mask=g_ok[:, None])
            tl.store(pml_ptr + base * 2, m_i, mask=g_ok)
            tl.store(pml_ptr + base * 2 + 1, l_i, mask=g_ok)
            if FIXUP:
                if _last_arrival(cnt_ptr + e * nkv + kvh, nused):
                    for gi in tl.static_range(GROUP):
                        h = kvh * GROUP + gi
                        res = _merge_segments(po_ptr, pml_ptr, (e * nh + h) * NSEG, nused, NSEG_P, HD, ".cg")
                        tl.store(out_ptr + row * stride_o + h * HD + d, res)
        else:
            tl.store(out_ptr + row * stride_o + heads[:, None] * HD + d[None, :], acc / l_i[:, None],
                     mask=g_ok[:, None])


@triton.jit
def _kv_step(kv_ptr, seg_blocks, j, lo, k0, hi, kk0, d, head, s_blk, s_kv, s_slot, BS: tl.constexpr):
    """A decode key step's slots [BK] (keys k0 + kk0 of the segment from ``lo``, through its block
    ids) and their keys and values, float16 [BK, HD, 2], in one load (two were issued one after
    the other, the keys' layout conversion — a CTA barrier — between); past ``hi``: zeros, no read."""
    kk = k0 + kk0
    blk = tl.sum(tl.where(((kk - lo) // BS)[:, None] == j[None, :], seg_blocks[None, :], 0), axis=1)
    slot = blk.to(tl.int64) * s_blk + (kk % BS).to(tl.int64) * s_slot + head                   # [BK]
    kv2 = tl.load(kv_ptr + slot[:, None, None] + d[None, :, None] + (tl.arange(0, 2) * s_kv)[None, None, :],
                  mask=(kk < hi)[:, None, None], other=0.0)
    return slot, kv2


@triton.jit
def attn_merge(po_ptr, pml_ptr, lens_ptr, rows_ptr, out_ptr, stride_o,
               SEG: tl.constexpr, NSEG: tl.constexpr, NSEG_P: tl.constexpr, HD: tl.constexpr, PDL: tl.constexpr):
    """``attn_decode``'s segments of one (entry, query head) merged in a launch of their own
    (TANDEM_GPU_REDUCE=launch)."""
    _grid_dependency(PDL)
    e = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    L = tl.load(lens_ptr + e)
    res = _merge_segments(po_ptr, pml_ptr, (e * tl.num_programs(1) + h) * NSEG, (L + SEG - 1) // SEG, NSEG_P, HD, "")
    row = tl.load(rows_ptr + e).to(tl.int64)
    tl.store(out_ptr + row * stride_o + h * HD + tl.arange(0, HD), res)


@triton.jit
def attn_prefill(q_ptr, kv_ptr, bt_ptr, starts_ptr, qlens_ptr, offs_ptr, out_ptr, po_ptr, pml_ptr, cnt_ptr,
                 stride_q, stride_bt, s_blk, s_kv, s_slot, s_head, scale, NSEG,
                 GROUP: tl.constexpr, GROUP_P: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
                 BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, PSEG: tl.constexpr, PRECISION: tl.constexpr,
                 PDL: tl.constexpr):
    """Causal attention of BLOCK_Q query tokens of chunk c = program_id(0) (its tokens at rows
    offs[c]..., positions starts[c]...) for the GROUP query heads of one kv head, against the keys
    up to each token's own position, read in place through the chunk's block table: rows of the
    tile are (token, head) pairs, scores and values through ``tl.dot``, online softmax.
    PRECISION: the dots' — "ieee" / "tf32" / "tf32x3" (f32 operands), or "fp16": q and the softmax weights
    rounded to float16 to meet the cache's float16 keys and values on the tensor cores (float32
    sums either way).

    PSEG > 0 splits the keys: program_id(2) = query tile * NSEG + segment, a program taking keys
    [seg * PSEG, (seg + 1) * PSEG) of its tile's (a long context's tile is then NSEG programs,
    not one: a 512-token chunk after 1,536 cached tokens is 96 programs over 3 kv heads without
    the split, under one an SM of an H200, each walking 2,048 keys). A tile whose keys span one
    segment writes its result at once; else each segment's unnormalised (acc, max, sum) go to the
    partials (po [tile, NSEG, rows, HD], pml [tile, NSEG, rows, 2]) and the last of the tile's
    segments to finish (counter ``cnt[tile]``, left at 0) merges them in segment order."""
    _grid_dependency(PDL)
    c = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    qt = tl.program_id(2) // NSEG
    seg = tl.program_id(2) % NSEG
    n = tl.load(qlens_ptr + c)
    start = tl.load(starts_ptr + c)
    hi = tl.minimum(start + (qt + 1) * BLOCK_Q, start + n)    # keys past the tile's last token: none
    if PSEG > 0:
        lo = seg * PSEG
        top = tl.minimum(lo + PSEG, hi)
        nused = (hi + PSEG - 1) // PSEG
    else:
        lo = 0
        top = hi
        nused = 1
    if (qt * BLOCK_Q < n) & (lo < hi):
        R: tl.constexpr = BLOCK_Q * GROUP_P
        off = tl.load(offs_ptr + c).to(tl.int64)
        r = tl.arange(0, R)
        i = qt * BLOCK_Q + r // GROUP_P                       # token index inside the chunk
        g = r % GROUP_P
        r_ok = (i < n) & (g < GROUP)
        qpos = start + i                                      # [R]
        heads = kvh * GROUP + g
        d = tl.arange(0, HD)
        qaddr = (off + i.to(tl.int64))[:, None] * stride_q + heads[:, None] * HD + d[None, :]
        q = tl.load(q_ptr + qaddr, mask=r_ok[:, None], other=0.0)
        if PRECISION == "fp16":
            q = q.to(tl.float16)
        m_i = tl.full([R], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([R], dtype=tl.float32)
        acc = tl.zeros([R, HD], dtype=tl.float32)
        kk0 = tl.arange(0, BLOCK_K)
        for k0 in range(lo, top, BLOCK_K):
            kk = k0 + kk0
            k_ok = kk < top
            blk = tl.load(bt_ptr + c * stride_bt + kk // BS, mask=k_ok, other=0).to(tl.int64)
            slot = blk * s_blk + (kk % BS).to(tl.int64) * s_slot + kvh * s_head
            k = tl.load(kv_ptr + slot[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)
            v = tl.load(kv_ptr + s_kv + slot[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)   # (with k)
            if PRECISION == "fp16":
                sc = tl.dot(q, tl.trans(k)) * scale                                              # [R, BK]
            else:
                sc = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
            ok = k_ok[None, :] & (kk[None, :] <= qpos[:, None])
            sc = tl.where(ok, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row with no key yet (padding)
            p = tl.exp(sc - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if PRECISION == "fp16":
                acc = tl.dot(p.to(tl.float16), v, acc * alpha[:, None])
            else:
                acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new
        if nused > 1:
            tile = (c * tl.num_programs(1) + kvh) * (tl.num_programs(2) // NSEG) + qt
            base = (tile * NSEG + seg) * R + r                                        # [R]
            tl.store(po_ptr + base[:, None] * HD + d[None, :], acc)
            tl.store(pml_ptr + base * 2, m_i)
            tl.store(pml_ptr + base * 2 + 1, l_i)
            if _last_arrival(cnt_ptr + tile, nused):
                # every segment's partials (this one's too, as stored), in segment order
                m_i = tl.full([R], float("-inf"), dtype=tl.float32)
                l_i = tl.zeros([R], dtype=tl.float32)
                acc = tl.zeros([R, HD], dtype=tl.float32)
                for j in range(0, nused):
                    b = (tile * NSEG + j) * R + r
                    mj = tl.load(pml_ptr + b * 2, cache_modifier=".cg")
                    lj = tl.load(pml_ptr + b * 2 + 1, cache_modifier=".cg")
                    oj = tl.load(po_ptr + b[:, None] * HD + d[None, :], cache_modifier=".cg")
                    m_new = tl.maximum(m_i, mj)
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp(m_i - m_safe)
                    w = tl.exp(mj - m_safe)
                    l_i = l_i * alpha + lj * w
                    acc = acc * alpha[:, None] + oj * w[:, None]
                    m_i = m_new
                l_i = tl.where(r_ok, l_i, 1.0)
                tl.store(out_ptr + qaddr, acc / l_i[:, None], mask=r_ok[:, None])
        else:
            l_i = tl.where(r_ok, l_i, 1.0)
            tl.store(out_ptr + qaddr, acc / l_i[:, None], mask=r_ok[:, None])


# ---- token selection on the device (kernels/gpu_sample.py) ---------------------------------------

@triton.jit
def _mulhilo64(a_hi, a_lo, b):
    """(high, low) 64-bit halves of the 128-bit product a * b, a = a_hi * 2**32 + a_lo (32-bit
    halves held in uint64), from 32 x 32 -> 64-bit products: no 64-bit mulhi needed."""
    b_lo = b & 0xFFFFFFFF
    b_hi = b >> 32
    ll = a_lo * b_lo
    hl = a_hi * b_lo
    lh = a_lo * b_hi
    hh = a_hi * b_hi
    cross = (ll >> 32) + (hl & 0xFFFFFFFF) + lh           # <= 2**64 - 1: no carry lost
    return (hl >> 32) + (cross >> 32) + hh, (cross << 32) | (ll & 0xFFFFFFFF)


@triton.jit
def philox_uniform(seed_lo_ptr, seed_hi_ptr, ctr_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """u[i] in [0, 1): numpy's ``Generator(Philox(key=seed, counter=ctr)).random()`` for row i —
    Philox-4x64-10 of counter (ctr + 1, 0, 0, 0) under key (seed, 0), its first word's top 53
    bits over 2**53 (shared/engine/sampler.py ``uniform``: the host's draw, bit for bit). Seeds
    as two int32 halves (the 64-bit pattern), counters int32 >= 0."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    lo = tl.load(seed_lo_ptr + i, mask=ok, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    hi = tl.load(seed_hi_ptr + i, mask=ok, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    k0 = (hi << 32) | lo
    k1 = tl.zeros([BLOCK], dtype=tl.uint64)
    c0 = tl.load(ctr_ptr + i, mask=ok, other=0).to(tl.uint64) + 1
    c1 = tl.zeros([BLOCK], dtype=tl.uint64)
    c2 = tl.zeros([BLOCK], dtype=tl.uint64)
    c3 = tl.zeros([BLOCK], dtype=tl.uint64)
    for r in tl.static_range(10):
        if r > 0:                                           # the key schedule (Weyl constants)
            k0 = k0 + 0x9E3779B97F4A7C15
            k1 = k1 + 0xBB67AE8584CAA73B
        hi0, lo0 = _mulhilo64(c0 * 0 + 0xD2E7470E, c0 * 0 + 0xE14C6C93, c0)
        hi1, lo1 = _mulhilo64(c0 * 0 + 0xCA5A8263, c0 * 0 + 0x95121157, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    u = (c0 >> 11).to(tl.float64) * (1.0 / 9007199254740992.0)
    tl.store(out_ptr + i, u, mask=ok)
