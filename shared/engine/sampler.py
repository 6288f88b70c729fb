"""Token selection: penalties, temperature, top-k / top-p / min-p, seeded sampling, logprobs.

Each sequence is processed on its own row. Random draws are **position-keyed**: the uniform
number behind output token ``i`` comes from a counter-based generator (Philox) keyed by the
request's seed with counter ``i`` (``draw``), so it does not depend on what ran before in
this process — a request moved to another worker, or resumed after its worker died, draws
exactly what it would have drawn where it started, and whatever it is batched with. Logprobs
are those of the model's raw distribution (before penalties and temperature), as vLLM reports.
"""

from __future__ import annotations

import numpy as np
import torch

from shared.engine import grammar
from shared.engine.sampling import TokenLogprob
from shared.engine.sequence import Sequence


def _apply_penalties(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.int64, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
        out = torch.tensor(seq.output_token_ids, dtype=torch.int64, device=row.device)
        counts = torch.bincount(out, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
        row -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty
    return row


def _filter(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Temperature-scaled logits with the top-k / top-p / min-p cut tokens at -inf."""
    p = seq.params
    # (a logit a tiny repetition_penalty divided past float32's range is +inf, and a softmax with
    # one is NaN: the largest finite value keeps it the most likely, and changes no finite logit)
    row = (row / p.temperature).clamp(max=torch.finfo(row.dtype).max)
    if p.top_k and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        row = _top_p(row, p.top_p)
    if p.min_p > 0:
        probs = row.softmax(-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return row


TOP_P_SPAN = 8.0   # ``_top_p`` sorts the logits within this of the best first (1.5x wider while short)


def _top_p(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """``row`` with the tokens past the nucleus at -inf. In descending order of logit (ties by
    token index: a stable sort's order, as the GPU's samplers'), a token is dropped when the mass
    before it already reaches ``top_p``; the best token always stays (a top_p under float32's
    least positive value, 1e-46, compares as 0 and would drop it).

    Only the best tokens are sorted: the logits within ``TOP_P_SPAN`` of the largest (a span 1.5x
    wider each time their mass falls short of top_p; past 64, the whole row) — then every token
    past them has at least that mass before it, dropped as a full sort would drop it, and the
    candidates' order and running sums (float64, rounded to float32 at each step: torch's CPU
    cumsum) are the full sort's first ones: the same tokens, bit for bit (tests/unit/
    test_sampler.py). A full sort of the bundled model's 49,152 logits took ~5 ms on one core
    of a 2-vCPU AMD EPYC (AVX2); this ~0.17 ms at T <= 1 (`tandem bench sampler`,
    docs/benchmarks.md "The host sampler's top-p")."""
    probs = row.softmax(-1).numpy()
    x = row.numpy()
    top = np.float32(top_p)
    span = TOP_P_SPAN
    best = x.max()
    if np.isnan(best):      # no order to cut (a NaN logit): the draw says so, as for any such row
        return row
    while True:
        cand = np.flatnonzero(x >= best - span) if np.isfinite(span) else np.arange(x.shape[0])
        cand = cand[torch.sort(torch.from_numpy(x[cand]), descending=True, stable=True).indices.numpy()]
        ps = probs[cand]
        run = np.cumsum(ps, dtype=np.float64).astype(np.float32)
        if cand.shape[0] == x.shape[0] or run[-1] >= top:
            break
        span = 1.5 * span if span < 64 else np.inf
    drop = (run - ps) >= top
    drop[0] = False
    keep = torch.from_numpy(cand[~drop])
    return torch.full_like(row, float("-inf")).index_copy_(0, keep, row[keep])


_SEED_MASK = (1 << 64) - 1


def uniform(seed: int, index: int) -> float:
    """The uniform number in [0, 1) of draw ``index`` of a request seeded ``seed`` (Philox-4x64
    keyed by the seed, counter = index): the same on every machine and in every process."""
    return float(np.random.Generator(np.random.Philox(key=seed & _SEED_MASK, counter=index)).random())


def draw(probs: torch.Tensor, seed: int, index: int) -> int:
    """Sample a token from ``probs`` [vocab] (need not sum exactly to 1) by inverse CDF with the
    ``uniform(seed, index)`` number. A token of probability 0 is never drawn."""
    probs = probs if probs.device.type == "cpu" else probs.cpu()
    # the running sum in float64, in token order: torch's CPU cumsum adds as numpy's does (the
    # same bits), ~4x faster on this machine's cores
    cdf = probs.cumsum(0, dtype=torch.float64).numpy()
    p = probs.numpy()
    if not cdf[-1] > 0:   # (NaN too) a row with no token to draw: its request fails, not the step
        raise ValueError(f"no token has a positive probability (total {cdf[-1]}): the row's logits, "
                         "penalties and filters left nothing to draw")
    tok = int(np.searchsorted(cdf, uniform(seed, index) * cdf[-1], side="right"))
    if tok >= len(p) or p[tok] <= 0:  # u * total rounded up to the total: the last possible token
        tok = int(np.flatnonzero(p > 0)[-1])
    return tok


NATIVE = True   # sampled rows through the compiled draw where the kernels library loads (the bench turns it off)


def _native():
    """The compiled kernels library with ``tq_sample_rows``, or None (no compiler: the torch path)."""
    if not NATIVE:
        return None
    from kernels import cpu
    return cpu._library()


def draw_rows(rows: list[torch.Tensor], seqs: list[Sequence], lib, weights: torch.Tensor | None = None
              ) -> list[int | Exception]:
    """Each sampled row's token (float32 CPU rows of one vocabulary: the logits after the grammar
    mask and penalties) by kernels/sample_cpu.cpp — temperature, top-k, top-p, min-p and the draw
    by ``uniform(seed, index)``, the procedure of ``_filter`` and ``draw`` with float64 sums and the
    kernels' fixed exp: one call for the step's rows, spread over the kernel threads (4-7x the
    torch ops a row at T <= 1; docs/benchmarks.md "The compiled draw"). A row that cannot be
    drawn gets its exception. ``weights`` [rows, vocab]: each row's kept weights (tests)."""
    from kernels import cpu
    n, v = len(rows), rows[0].shape[0]
    rows = [r if r.dtype == torch.float32 and r.is_contiguous() else r.float().contiguous() for r in rows]
    ptrs = np.array([r.data_ptr() for r in rows], dtype=np.uint64)
    ps = [s.params for s in seqs]
    temp = np.array([p.temperature for p in ps], dtype=np.float32)
    top_k = np.array([p.top_k if p.top_k and p.top_k < v else 0 for p in ps], dtype=np.int32)
    top_p = np.array([p.top_p for p in ps], dtype=np.float32)
    min_p = np.array([p.min_p for p in ps], dtype=np.float32)
    seed = np.array([s.seed & _SEED_MASK for s in seqs], dtype=np.uint64)
    index = np.array([s.num_output_tokens for s in seqs], dtype=np.int64)
    out = np.empty(n, dtype=np.int32)
    lib.tq_sample_rows(ptrs.ctypes.data, n, v, temp.ctypes.data, top_k.ctypes.data, top_p.ctypes.data,
                       min_p.ctypes.data, seed.ctypes.data, index.ctypes.data, out.ctypes.data,
                       None if weights is None else weights.data_ptr(), cpu.get_num_threads())
    return [int(t) if t >= 0 else ValueError(
        "no token has a positive probability: a logit of the row is NaN" if t == -2 else
        "no token has a positive probability: the row's logits, penalties and filters left nothing to draw")
        for t in out]


def _argmax(row: torch.Tensor) -> int:
    # numpy's argmax on a CPU row: ~3 us for 49k logits, torch's ~44 us (1 thread)
    return int(row.numpy().argmax()) if row.device.type == "cpu" else int(torch.argmax(row))


def _bias(bits, row: torch.Tensor) -> torch.Tensor:
    b = grammar.mask_bias(bits, row.shape[0])
    return b if row.device.type == "cpu" else b.to(row.device, non_blocking=True)


def needs_mask(seq: Sequence) -> bool:
    """Does a constrained row need its grammar mask before sampling? Yes when it samples from
    (or reports) the whole distribution; a greedy row only when its best token is banned."""
    p = seq.params
    return not p.greedy or bool(p.logprobs or p.top_logprobs)


def plain(seq: Sequence) -> bool:
    """Nothing reads its row but the choice itself: no penalties, no grammar, no logprobs (a
    token the decode graph chose for it is its token)."""
    p = seq.params
    return (seq.matcher is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and not p.logprobs and not p.top_logprobs)


def on_device(seq: Sequence) -> bool:
    """May the decode graph draw this sampled row's token (kernels/gpu_sample.py: temperature,
    top-k / top-p / min-p, the same seeded uniform as ``draw``)? Only where nothing else needs
    its row on the host."""
    return not seq.params.greedy and plain(seq)


def sample(logits: torch.Tensor, seqs: list[Sequence], best: list[int] | None = None,
           failed: dict[int, Exception] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """One next token per row of ``logits`` [S, vocab] (float32), for ``seqs`` in row order.
    ``best``: tokens chosen already on the GPU, in the decode graph: a greedy row's argmax (a
    greedy row without penalties takes it instead of reading its row back), an ``on_device``
    row's draw (taken as is), None for a sampled row the host draws. On a GPU the rows that are
    read (all of them without ``best``) come to the host in one copy. The sampled rows the host
    draws go to ``draw_rows`` together. ``failed``: a row whose choice raises gets token -1 and
    its exception there (row -> exception), so one request's failure is its own, not its
    batch's; without it the exception goes up."""
    n = len(seqs)
    tokens: list[int] = [-1] * n
    lps: list[TokenLogprob | None] = [None] * n
    host: dict[int, torch.Tensor] = {}
    # rows the graph chose (its argmax, a device draw) that nothing else reads: taken as they are
    chosen = [best is not None and best[i] is not None and plain(s) for i, s in enumerate(seqs)]
    if logits.device.type != "cpu":   # the rows read on the host, in one device-to-host copy
        need = [i for i, c in enumerate(chosen) if not c]
        if need:
            host = dict(zip(need, logits[need].cpu()))
    lib = _native()
    drawn: list[tuple[int, torch.Tensor, torch.Tensor]] = []   # (row index, raw row, row to draw from)

    def fail(i: int, e: Exception) -> None:
        if failed is None:
            raise e
        failed[i], tokens[i], lps[i] = e, -1, None

    for i, seq in enumerate(seqs):
        if chosen[i]:                        # (its row is never touched: no view of it is made)
            tokens[i] = best[i]
            continue
        row = host[i] if i in host else logits[i]
        try:
            if lib is not None and not seq.params.greedy:
                drawn.append((i, *_sampled_rows(row, seq)))
                continue
            tokens[i], lps[i] = _choose(row, seq, None if best is None else best[i])
        except Exception as e:
            fail(i, e)
    if drawn:
        for (i, raw, _), tok in zip(drawn, draw_rows([r for _, _, r in drawn], [seqs[i] for i, _, _ in drawn], lib)):
            if isinstance(tok, Exception):
                fail(i, tok)
            else:
                tokens[i], lps[i] = tok, _logprob(raw, seqs[i].params, tok)
    return tokens, lps


def _sampled_rows(row: torch.Tensor, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, row) of a sampled row: raw with its grammar's mask (the whole distribution counts),
    row that with the penalties too (a copy where they apply)."""
    if seq.matcher is not None:
        row = row + _bias(seq.matcher.mask(), row)
    p = seq.params
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
        return row, _apply_penalties(row.clone(), seq)
    return row, row


def _logprob(raw: torch.Tensor, p, tok: int) -> TokenLogprob | None:
    """The chosen token's logprob (and the top ones) in the raw distribution, where asked."""
    if not (p.logprobs or p.top_logprobs):
        return None
    logp = raw.float().log_softmax(-1)
    top = []
    if p.top_logprobs:
        v, ids = torch.topk(logp, p.top_logprobs)
        top = list(zip(ids.tolist(), v.tolist()))
    return TokenLogprob(tok, float(logp[tok]), top)


def _choose(row: torch.Tensor, seq: Sequence, best: int | None) -> tuple[int, TokenLogprob | None]:
    """``sample``'s choice for one row the host reads (``best``: the graph's argmax, or None): a
    greedy row, or (without the compiled draw) a sampled one."""
    p = seq.params
    if not p.greedy:
        raw, row = _sampled_rows(row, seq)
        tok = draw(_filter(row, seq).softmax(-1), seq.seed, seq.num_output_tokens)
        return tok, _logprob(raw, p, tok)
    m = seq.matcher  # the grammar's state, or None
    if m is not None and needs_mask(seq):
        row = row + _bias(m.mask(), row)   # logprobs: the whole distribution counts
        m = None
    raw = row
    penalised = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
    if penalised:
        row = _apply_penalties(row.clone(), seq)
    tok = best if best is not None and not penalised else _argmax(row)
    if m is not None and not m.allows(tok):
        # greedy under a grammar: only when the best token is banned does the row need
        # the mask (most steps of a JSON string do not; the check costs ~2 us, a mask 3-80)
        tok = _argmax(row + _bias(m.mask(), row))
    return tok, _logprob(raw, p, tok)
