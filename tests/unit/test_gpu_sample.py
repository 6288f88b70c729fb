"""Token selection on the device (kernels/gpu_sample.py) against the host sampler
(shared/engine/sampler.py), in plain CPU torch: the very ops the decode graph replays on CUDA.
The device's Philox uniform is tested bit for bit in Triton's interpreter
(tests/integration/test_gpu_step.py); here the uniforms come from ``sampler.uniform``.

- the same distribution as the host's ``_filter`` + softmax, bitwise on the CPU, for every mix of
  temperature, top-k, top-p and min-p, and the same token for the same uniform;
- the draws follow that distribution (a chi-square test over a small vocabulary) and never
  leave the top-k / top-p set (its exact size checked against a float64 reference);
- greedy rows return their argmax bitwise, whatever the sampled rows beside them;
- the same (seed, index), the same token; the engine's host sampler takes device-drawn tokens
  without reading their rows back.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kernels import gpu_sample
from kernels.gpu_step import DecodeInputs
from shared.engine import sampler
from shared.engine.sampling import SamplingParams
from shared.engine.sequence import Sequence

V = 64


def _params(rows):
    """Tensors of the rows' (temperature, top_k, top_p, min_p)."""
    t, k, p, m = zip(*rows)
    return (torch.tensor(t, dtype=torch.float32), torch.tensor(k, dtype=torch.int32),
            torch.tensor(p, dtype=torch.float32), torch.tensor(m, dtype=torch.float32))


ROWS = [(1.0, 0, 1.0, 0.0), (0.7, 10, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (0.9, 5, 0.5, 0.0), (1.0, 0, 1.0, 0.05),
        (0.5, 20, 0.95, 0.01), (2.0, 1, 1.0, 0.0), (1.0, V + 5, 0.3, 0.0), (0.8, 0, 0.001, 0.0),
        (1.0, 0, 1e-46, 0.0), (1e-5, 0, 1.0, 0.0)]   # a top_p that is 0 in float32; the least sampled temperature


def _logits(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 3


def test_the_distribution_is_the_host_samplers_bitwise():
    logits = _logits(len(ROWS))
    got = gpu_sample.probs(logits, *_params(ROWS), filtered=True)
    for i, (t, k, p, m) in enumerate(ROWS):
        seq = SimpleNamespace(params=SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m))
        want = sampler._filter(logits[i].clone(), seq).softmax(-1)
        assert torch.equal(got[i], want), ROWS[i]


def test_unfiltered_variant_equals_filtered_where_top_k_and_top_p_are_off():
    rows = [r for r in ROWS if not r[1] and r[2] == 1.0]
    logits = _logits(len(rows), 1)
    a = gpu_sample.probs(logits, *_params(rows), filtered=False)
    b = gpu_sample.probs(logits, *_params(rows), filtered=True)
    assert torch.equal(a, b)


def test_the_same_uniform_draws_the_host_samplers_token():
    logits = _logits(len(ROWS), 2)
    for idx in range(12):
        seeds = [1000 * idx + i for i in range(len(ROWS))]
        u = torch.tensor([sampler.uniform(s, idx) for s in seeds], dtype=torch.float64)
        z = torch.zeros(len(ROWS), dtype=torch.int64)
        got = gpu_sample.select(logits, z, torch.ones(len(ROWS), dtype=torch.int32), *_params(ROWS), u, True).tolist()
        for i, (t, k, p, m) in enumerate(ROWS):
            seq = SimpleNamespace(params=SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m))
            assert got[i] == sampler.draw(sampler._filter(logits[i].clone(), seq).softmax(-1), seeds[i], idx)


def test_a_uniform_at_the_edges_draws_a_kept_token():
    logits = _logits(3, 3)
    rows = [(1.0, 4, 1.0, 0.0)] * 3
    u = torch.tensor([0.0, 0.5, 1.0 - 2**-53], dtype=torch.float64)
    p = gpu_sample.probs(logits, *_params(rows), filtered=True)
    tok = gpu_sample.draw(p, u)
    assert all(p[i, t] > 0 for i, t in enumerate(tok.tolist()))
    assert tok[2] == int(torch.nonzero(p[2] > 0).max())        # the last kept token
    assert tok[0] == int(torch.nonzero(p[0] > 0).min())        # the first kept token


def _reference(logits: np.ndarray, t, k, p) -> np.ndarray:
    """The filtered distribution in float64, written from the definitions (not the host's code)."""
    x = logits.astype(np.float64) / t
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(len(x), dtype=bool)
    keep[order[:k or len(x)]] = True
    q = np.exp(x - x.max()) * keep
    q /= q.sum()
    mass = 0.0                            # the top-k mass before token j, in descending order
    for j in order:
        if mass >= p:
            keep[j] = False
        mass += q[j]
    r = np.exp(x - x.max()) * keep
    return r / r.sum()


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 6, 1.0), (1.2, 0, 0.7), (0.9, 8, 0.6)])
def test_draws_follow_the_filtered_distribution(t, k, p):
    """4,000 draws of one row (one seed, indexes 0..3,999) against the float64 reference: a
    chi-square test at p < 1e-4 over the kept tokens, none outside them."""
    n, vs = 4000, 16
    g = torch.Generator().manual_seed(int(t * 10) + k)
    row = torch.randn(vs, generator=g) * 1.5
    want = _reference(row.numpy(), t, k, p)
    u = torch.tensor([sampler.uniform(42, i) for i in range(n)], dtype=torch.float64)
    pt, kt, ppt, mt = _params([(t, k, p, 0.0)] * n)
    tok = gpu_sample.select(row.expand(n, vs), torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.int32),
                            pt, kt, ppt, mt, u, True)
    counts = np.bincount(tok.numpy(), minlength=vs)
    kept = want > 0
    assert counts[~kept].sum() == 0
    if k:
        assert kept.sum() <= k
    expected = want[kept] * n
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    dof = int(kept.sum()) - 1
    # chi-square critical values at p = 1e-4 (dof 1..15)
    crit = [15.1, 18.4, 21.1, 23.5, 25.7, 27.9, 29.9, 31.8, 33.7, 35.6, 37.4, 39.1, 40.8, 42.6, 44.3]
    assert dof == 0 or chi2 < crit[dof - 1], (chi2, dof, counts, expected)


def test_greedy_rows_keep_their_argmax_bitwise():
    logits = _logits(6, 4)
    best = torch.argmax(logits, -1)
    mode = torch.tensor([0, 1, 0, 1, 0, 0], dtype=torch.int32)
    rows = [(1.0, 0, 1.0, 0.0), (0.5, 5, 0.9, 0.0)] * 3
    u = torch.full((6,), 0.99, dtype=torch.float64)
    tok = gpu_sample.select(logits, best, mode, *_params(rows), u, True)
    assert tok.dtype == best.dtype
    assert torch.equal(tok[mode == 0], best[mode == 0])
    # a sampled row's parameters do not reach a greedy row, even absurd ones
    t, k, p, m = _params(rows)
    t[0], t[2] = float("nan"), 0.0
    tok2 = gpu_sample.select(logits, best, mode, t, k, p, m, u, True)
    assert torch.equal(tok2[mode == 0], best[mode == 0])


def test_same_seed_and_index_same_token():
    logits = _logits(1, 5).expand(4, V)
    u = torch.tensor([sampler.uniform(s, i) for s, i in [(9, 3), (9, 3), (9, 4), (10, 3)]], dtype=torch.float64)
    tok = gpu_sample.select(logits, torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.int32),
                            *_params([(1.0, 0, 1.0, 0.0)] * 4), u, False).tolist()
    assert tok[0] == tok[1]
    assert u[0] != u[2] and u[0] != u[3]


def test_seed_halves_are_the_64_bit_pattern():
    for s in [0, 1, 2**31, 2**32 - 1, 2**63 + 5, 2**64 - 1, -1, -2**40]:
        lo, hi = gpu_sample.seed_halves(s)
        assert -2**31 <= lo < 2**31 and -2**31 <= hi < 2**31
        assert ((hi & 0xFFFFFFFF) << 32 | (lo & 0xFFFFFFFF)) == s & (2**64 - 1)


def test_decode_inputs_carry_the_sampling_rows():
    inp = DecodeInputs(cap=8, width=4, scratch_block=99, device="cpu")
    assert inp.fill([1, 2], [0, 0], [[1], [2]], 16, 2) is None                  # nothing drawn
    v = inp.fill([1, 2, 3], [5, 6, 7], [[1], [2], [3]], 16, 4,
                 [None, (0.7, 0, 1.0, 0.05, 2**63 + 1, 17), None])
    assert v is False                                                            # no top-k / top-p
    a = inp.sample_args(4)
    assert a["mode"].tolist() == [0, 1, 0, 0] and a["counter"].tolist() == [0, 17, 0, 0]
    assert a["temp"].dtype == torch.float32 and a["temp"].tolist() == pytest.approx([1.0, 0.7, 1.0, 1.0])
    assert a["min_p"].tolist() == pytest.approx([0, 0.05, 0, 0]) and a["top_p"].tolist() == [1.0] * 4
    assert (a["seed_lo"][1].item(), a["seed_hi"][1].item()) == gpu_sample.seed_halves(2**63 + 1)
    assert inp.fill([1], [0], [[1]], 16, 1, [(1.0, 40, 1.0, 0.0, 3, 0)]) is True
    assert inp.fill([1], [0], [[1]], 16, 1, [(1.0, 0, 0.9, 0.0, 3, 0)]) is True
    assert inp.fill([1], [0], [[1]], 16, 1, [(1.0, 10**12, 1.0, 0.0, 3, 0)]) is True      # top-k past int32
    assert inp.sample_args(1)["top_k"].item() == 1 << 30
    with pytest.raises(ValueError, match="temperature > 0"):
        inp.fill([1], [0], [[1]], 16, 1, [(0.0, 0, 1.0, 0.0, 3, 0)])


def _seq(**kw):
    return Sequence("r", [1, 2, 3], SamplingParams(**kw))


def test_the_host_sampler_takes_device_draws_without_reading_their_rows():
    """sample(best=...): a drawn row's token is taken as is (its logits row is never read: NaN
    here); a sampled row the host must see (logprobs) is drawn on the host (best None)."""
    logits = _logits(3, 6)
    logits[1] = float("nan")
    seqs = [_seq(temperature=0.0), _seq(temperature=0.9, seed=5), _seq(temperature=0.9, seed=5, logprobs=True)]
    assert [sampler.on_device(s) for s in seqs] == [False, True, False]
    best = [int(torch.argmax(logits[0])), 17, None]
    tokens, lps = sampler.sample(logits, seqs, best)
    assert tokens[:2] == best[:2] and lps[1] is None
    assert tokens[2] == sampler.draw(sampler._filter(logits[2].clone(), seqs[2]).softmax(-1), 5, 0)
    assert lps[2] is not None


class _FakeStep:
    """Stands for GpuStep in DecodeGraphs: fixed logits per row (its token id picks the row)."""
    device = torch.device("cpu")

    def __init__(self, logits):
        self.logits = logits

    def decode(self, ids, *args):
        return self.logits[ids.long()]


def _chunk(tok, params, out_tokens=0):
    seq = Sequence("r", [tok], params)
    seq.token_ids += [tok] * out_tokens
    seq.num_prompt_tokens = 1
    seq.block_table = [0]
    return SimpleNamespace(num_tokens=1, sample=True, start=len(seq.token_ids) - 1, seq=seq)


def test_decode_graphs_draw_sampled_rows_and_leave_the_rest(monkeypatch):
    """A decode-only step through DecodeGraphs (eager, a stand-in step): greedy rows their argmax,
    sampled rows the device draw — the host sampler's token with the same uniform — rows with
    logprobs None (the host's), and rows of a variant that could not be captured None too."""
    from kernels import gpu_step

    def uniforms(lo, hi, ctr, out):     # the Philox kernel is tested in the interpreter
        seeds = [(int(h) & 0xFFFFFFFF) << 32 | (int(l) & 0xFFFFFFFF) for l, h in zip(lo, hi)]
        out.copy_(torch.tensor([sampler.uniform(s, int(c)) for s, c in zip(seeds, ctr)], dtype=torch.float64))
        return out
    monkeypatch.setattr(gpu_sample, "uniforms", uniforms)
    logits = _logits(8, 7)
    g = gpu_step.DecodeGraphs(_FakeStep(logits), torch.zeros(1), max_seqs=8, width=4, block_size=16,
                              scratch_block=0, capture=False)
    plain = SamplingParams(temperature=0.9, seed=3)
    nucleus = SamplingParams(temperature=0.7, top_p=0.8, seed=4)
    chunks = [_chunk(0, SamplingParams(temperature=0.0)), _chunk(1, plain, 5), _chunk(2, nucleus, 2),
              _chunk(3, SamplingParams(temperature=0.9, seed=5, logprobs=True))]
    _, toks = g.try_step(chunks)
    want = [int(torch.argmax(logits[0]))]
    for c in chunks[1:3]:
        row = sampler._filter(logits[c.seq.token_ids[-1]].clone(), c.seq).softmax(-1)
        want.append(sampler.draw(row, c.seq.seed, c.seq.num_output_tokens))
    assert toks == want + [None] and g.drawn == 2
    g.variants[True] = False                        # top-k / top-p could not be captured: the host's
    _, toks = g.try_step(chunks)
    assert toks == [want[0], want[1], None, None] and g.drawn == 3
