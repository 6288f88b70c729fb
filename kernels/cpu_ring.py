"""The fused CPU step cut at the attention, for ring decode (``forward_cpu.cpp`` ``tq_ring_stage``).

A ring decode step (``shared/ring/session.py``; docs/strategies.md) runs the layers on a
coordinator that holds the weights, and the attention over the session's keys on ring members
that each hold a SEG-aligned token range of its KV:

    x = embed(ids)                                    coordinator
    per layer:  qkv = qkv(layer, x)                   coordinator: norm, q|k|v, bias / norms / rope
                store(layer, qkv, ...)                the member owning the new positions
                parts_m = attend(layer, qkv, ...)     each member: its segments' softmax states
                merge_ffn(layer, x, cat(parts_m))     coordinator: merge in segment order, o-proj, FFN
    logits = head(x)                                  coordinator

or, instead of sending every segment's state, the members fold along the ring in shard order
(``fold``: member 0 folds its states, member 1 folds its own into that running state, ...) and
the coordinator finishes the one state it receives (``merge_ffn(..., folded=True)``). ``attend``
and ``fold`` take a range of kv heads (a head group): the heads are independent, so a member
can pass one group's state on while it attends the next.

Every stage is the same C++ code the fused step runs (``Step::layer_qkv``, ``attend_segment``,
``merge_parts``, ``layer_ffn``, ``head``), and the fused step's attention is already a fold of
fresh per-segment online softmaxes at absolute positions merged in segment order; so when the
members' segments are concatenated in order, the logits are bitwise those of the single-worker
fused step, whatever the number of members and threads.

A part (one segment's state for one kv head) is ``rows * (head_dim + 2)`` floats: the rows'
max, their sum, then their unnormalised output, ``rows = n_tokens * group`` rounded up to 8.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import cpu
from kernels.cpu_forward import FusedForward, _Batch

SEG = 256       # keys per attention segment (forward_cpu.cpp SEG): ring shards are SEG-aligned
MAX_ROWS = 64   # query rows per attention tile (forward_cpu.cpp MAX_ROWS)

EMBED, QKV, STORE, ATTEND, MERGE_FFN, HEAD, FOLD = range(7)


class RingKernels:
    """The stages of a ring decode step for one model (built from its ``FusedForward``)."""

    def __init__(self, fused: FusedForward) -> None:
        self.fused = fused
        cfg = self.cfg = fused.cfg
        self.group = cfg.n_heads // cfg.n_kv_heads
        self.max_tokens = max(1, MAX_ROWS // self.group)   # tokens of one step: one attention tile
        self.qkv_width = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.max_context = fused._model.max_ctx
        self.vocab = fused._model.vocab
        self.threads: int | None = None   # OpenMP threads per stage (None: kernels.cpu.get_num_threads())

    @classmethod
    def of(cls, model) -> "RingKernels | None":
        """The ring stages of a ``Transformer``, or None where it does not run the fused step."""
        return cls(model.fused) if getattr(model, "fused", None) is not None else None

    def part_floats(self, n_tokens: int) -> int:
        """Floats of one part (one segment, one kv head) for a step of ``n_tokens``."""
        return (n_tokens * self.group + 7) // 8 * 8 * (self.cfg.head_dim + 2)

    # ---- coordinator ---------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """The residual stream x [T, hidden] of tokens ``ids`` at positions start.."""
        ids = ids.to(torch.int64).contiguous()
        if ids.dim() != 1 or not 0 <= int(ids.min()) <= int(ids.max()) < self.vocab:
            raise ValueError(f"token ids must be a 1-D tensor of ids in [0, {self.vocab})")
        x = torch.empty(ids.numel(), self.cfg.hidden_size, dtype=torch.float32)
        self._run(EMBED, 0, start, ids.numel(), x=x, ids=ids)
        return x

    def qkv(self, layer: int, x: torch.Tensor, start: int) -> torch.Tensor:
        """Layer ``layer`` up to its attention: q|k|v rows [T, (nh + 2 nkv) hd] (roped)."""
        qkv = torch.empty(x.shape[0], self.qkv_width, dtype=torch.float32)
        self._run(QKV, layer, start, x.shape[0], x=self._x(x), qkv=qkv)
        return qkv

    def merge_ffn(self, layer: int, x: torch.Tensor, qkv: torch.Tensor, start: int, parts: torch.Tensor,
                  folded: bool = False) -> None:
        """Merge ``parts`` [nkv, segments, part] — every segment of keys 0..start+T-1, in order
        (merged in place); ``folded``: one part, the fold of them all (``fold``) — into the
        layer's attention output, then the o-proj, FFN and residual adds into ``x`` (in place)."""
        T = x.shape[0]
        nseg = 1 if folded else -(-(start + T) // SEG)
        self._parts(parts, T, nseg, f"every segment of {start + T} keys" if not folded else "the folded state")
        self._run(MERGE_FFN, layer, start, T, x=self._x(x), qkv=self._qkv(qkv, T), parts=parts, seg_hi=nseg)

    def fold(self, parts: torch.Tensor, start: int, n_tokens: int, heads: tuple[int, int] | None = None) -> torch.Tensor:
        """The left fold of ``parts`` [kv heads, k, part] (consecutive segment states, in order;
        the first may be the running state of the segments before them) of kv heads ``heads``
        (default all): [kv heads, 1, part]. Merged in place; the same merges ``merge_ffn`` would
        run, so folding along the ring is exact."""
        lo, hi = self._heads(heads)
        self._parts(parts, n_tokens, parts.shape[1] if parts.dim() == 3 else -1, "consecutive states", hi - lo)
        if parts.shape[1] > 1:
            self._run(FOLD, 0, start, n_tokens, parts=parts, seg_hi=parts.shape[1], heads=(lo, hi), threads=1)
        return parts[:, :1].contiguous()

    def head(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Logits [1, vocab] of the last row of ``x``."""
        logits = torch.empty(1, self.vocab, dtype=torch.float32)
        rows = torch.tensor([x.shape[0] - 1], dtype=torch.int64)
        self._run(HEAD, 0, start, x.shape[0], x=self._x(x), rows=rows, logits=logits)
        return logits

    # ---- member -----------------------------------------------------------------------------
    def store(self, layer: int, qkv: torch.Tensor, start: int, kv: torch.Tensor, table: torch.Tensor) -> None:
        """Write the k and v rows of ``qkv`` (positions start..) into ``kv`` through ``table``
        (block ids by absolute position: ``table[p // block_size]``)."""
        T = qkv.shape[0]
        self._check_kv(kv, table, start + T)
        self._run(STORE, layer, start, T, qkv=self._qkv(qkv, T), kv=kv, table=table, threads=1)  # 2 nkv rows: no team

    def attend(self, layer: int, qkv: torch.Tensor, start: int, kv: torch.Tensor, table: torch.Tensor,
               seg_lo: int, seg_hi: int, heads: tuple[int, int] | None = None) -> torch.Tensor:
        """Softmax states [kv heads, seg_hi - seg_lo, part] of the q rows of ``qkv`` (positions
        start..start+T-1, causal) over key segments [seg_lo, seg_hi) of ``kv`` (read through
        ``table`` by absolute position; only the segments' entries are read), for kv heads
        ``heads`` = (lo, hi) (default all: a head group at a time pipelines the ring)."""
        T = qkv.shape[0]
        lo, hi = self._heads(heads)
        if not 0 <= seg_lo < seg_hi or seg_lo * SEG >= start + T:
            raise ValueError(f"segments [{seg_lo}, {seg_hi}) hold no key of positions < {start + T}")
        self._check_kv(kv, table, min(seg_hi * SEG, start + T))
        parts = torch.empty(hi - lo, seg_hi - seg_lo, self.part_floats(T), dtype=torch.float32)
        self._run(ATTEND, layer, start, T, qkv=self._qkv(qkv, T), kv=kv, table=table, parts=parts,
                  seg_lo=seg_lo, seg_hi=seg_hi, heads=(lo, hi))
        return parts

    # ---- plumbing ---------------------------------------------------------------------------
    def _x(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1:] != (self.cfg.hidden_size,):
            raise ValueError(f"x must be contiguous float32 [T, {self.cfg.hidden_size}], got {x.dtype} {tuple(x.shape)}")
        return x

    def _qkv(self, qkv: torch.Tensor, T: int) -> torch.Tensor:
        if qkv.dtype != torch.float32 or not qkv.is_contiguous() or qkv.shape != (T, self.qkv_width):
            raise ValueError(f"qkv must be contiguous float32 [{T}, {self.qkv_width}], got {qkv.dtype} {tuple(qkv.shape)}")
        return qkv

    def _heads(self, heads: tuple[int, int] | None) -> tuple[int, int]:
        lo, hi = heads if heads is not None else (0, self.cfg.n_kv_heads)
        if not 0 <= lo < hi <= self.cfg.n_kv_heads:
            raise ValueError(f"kv heads [{lo}, {hi}) outside [0, {self.cfg.n_kv_heads})")
        return int(lo), int(hi)

    def _parts(self, parts: torch.Tensor, T: int, nseg: int, what: str, nkv: int | None = None) -> None:
        want = (self.cfg.n_kv_heads if nkv is None else nkv, nseg, self.part_floats(T))
        if parts.shape != want or parts.dtype != torch.float32 or not parts.is_contiguous():
            raise ValueError(f"parts must be contiguous float32 {want} ({what}), got {parts.dtype} {tuple(parts.shape)}")

    def _check_kv(self, kv: torch.Tensor, table: torch.Tensor, keys: int) -> None:
        cfg = self.cfg
        if (kv.dtype != torch.float16 or not kv.is_contiguous() or kv.device.type != "cpu" or kv.dim() != 6
                or kv.shape[1:3] != (cfg.n_layers, 2) or kv.shape[4:] != (cfg.n_kv_heads, cfg.head_dim)):
            raise ValueError(f"kv must be a contiguous float16 CPU tensor, got {kv.dtype} {tuple(kv.shape)}")
        if table.dtype != torch.int64 or table.dim() != 1 or not table.is_contiguous():
            raise ValueError("table must be a contiguous 1-D int64 tensor")
        if table.numel() * kv.shape[3] < keys or (table.numel() and not 0 <= int(table.min()) <= int(table.max()) < kv.shape[0]):
            raise ValueError(f"the block table must cover {keys} positions with block ids inside the KV cache")

    def _run(self, stage: int, layer: int, start: int, T: int, *, x=None, qkv=None, ids=None, kv=None,
             table=None, parts=None, rows=None, logits=None, seg_lo: int = 0, seg_hi: int = 0,
             heads: tuple[int, int] = (0, 0), threads: int | None = None) -> None:
        if not 1 <= T <= self.max_tokens or start < 0 or start + T > self.max_context:
            raise ValueError(f"a ring step is 1..{self.max_tokens} tokens inside the context of "
                             f"{self.max_context}, got {T} at {start}")
        if not 0 <= layer < self.cfg.n_layers:
            raise ValueError(f"layer {layer} outside [0, {self.cfg.n_layers})")
        chunk = torch.tensor([start, T, 0, 0], dtype=torch.int64)
        ptr = lambda t: None if t is None else t.data_ptr()   # noqa: E731
        batch = _Batch(T, ptr(ids), 1, chunk.data_ptr(), ptr(table), 0 if rows is None else rows.numel(),
                       ptr(rows), ptr(kv), kv.shape[3] if kv is not None else 16, ptr(logits))
        rc = self.fused._lib.tq_ring_stage(ctypes.byref(self.fused._model), ctypes.byref(batch), stage, layer,
                                           ptr(x), ptr(qkv), ptr(parts), seg_lo, seg_hi, heads[0], heads[1],
                                           threads or self.threads or cpu.get_num_threads(),
                                           cpu._isa_arg())
        if rc != 0:
            raise ValueError(f"ring stage {stage} refused the batch ({T} tokens at {start})")
