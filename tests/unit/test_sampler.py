"""Sampler arithmetic on hand-made logits (real Sequence objects, no model)."""

from __future__ import annotations

import math

import torch

import pytest

from shared.engine.sampler import _apply_penalties, _filter, sample
from shared.engine.sampling import GREEDY_BELOW, SamplingParams
from shared.engine.sequence import Sequence


def seq(prompt, output=(), **kw) -> Sequence:
    s = Sequence("r", list(prompt), SamplingParams(**kw))
    s.token_ids += list(output)
    return s


def test_repetition_penalty_divides_positive_multiplies_negative():
    row = torch.tensor([2.0, -2.0, 1.0, 3.0])
    out = _apply_penalties(row.clone(), seq([0, 1], repetition_penalty=2.0))
    assert out.tolist() == [1.0, -4.0, 1.0, 3.0]


def test_frequency_and_presence_penalties_count_output_only():
    row = torch.zeros(4)
    out = _apply_penalties(row.clone(), seq([3], [1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25))
    assert out.tolist() == [0.0, -1.25, -0.75, 0.0]


def test_top_k_top_p_min_p_masks():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isinf(_filter(row, seq([0], temperature=1.0, top_k=2))).tolist() == [False, False, True, True]
    assert torch.isinf(_filter(row, seq([0], temperature=1.0, top_p=0.7))).tolist() == [False, False, True, True]
    assert torch.isinf(_filter(row, seq([0], temperature=1.0, top_p=0.5))).tolist() == [False, True, True, True]
    assert torch.isinf(_filter(row, seq([0], temperature=1.0, min_p=0.4))).tolist() == [False, False, True, True]


@pytest.mark.parametrize("ties", [False, True])
def test_top_p_sorts_only_its_candidates_and_drops_what_a_full_sort_drops(ties):
    """``_top_p`` sorts the best 64 tokens (4x more while their mass is short of top_p), not the
    row: the same tokens kept as a stable sort of the whole row keeps — flat rows whose nucleus
    needs thousands of candidates, peaked ones that need one, rows with many equal logits (ties
    by token index), top_p from 1e-46 to 0.999999, rows with tokens already at -inf (top-k)."""
    from bench.sampler import full_sort     # the definition: a stable sort of the whole row
    from shared.engine.sampler import _top_p
    g = torch.Generator().manual_seed(3)
    for scale in (0.01, 1.0, 3.0, 30.0):
        for top_p in (1e-46, 0.001, 0.3, 0.9, 0.95, 0.999999):
            row = torch.randn(5000, generator=g) * scale
            if ties:
                row = (row * 2).round() / 2
            row[torch.randperm(5000, generator=g)[:100]] = float("-inf")
            assert torch.equal(_top_p(row.clone(), top_p), full_sort(row, top_p)), (scale, top_p)


def test_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    toks, lps = sample(logits, [seq([0], temperature=0, logprobs=True, top_logprobs=2)])
    assert toks == [1]
    expect = 2.0 - math.log(1 + math.exp(2) + math.exp(1))
    assert abs(lps[0].logprob - expect) < 1e-6
    assert [t for t, _ in lps[0].top] == [1, 2]


def test_seeded_sampling_reproducible():
    logits = torch.randn(1, 100)
    a = [sample(logits, [seq([0], temperature=1.0, seed=7)])[0][0] for _ in range(3)]
    assert len(set(a)) == 1
    draws = {sample(logits, [seq([0], temperature=1.0, seed=s)])[0][0] for s in range(20)}
    assert len(draws) > 1


def test_precomputed_argmax_serves_plain_greedy_rows_only():
    """``best`` (the decode graph's argmax on the GPU) is taken by plain greedy rows; a row with a
    penalty reads its own logits."""
    logits = torch.tensor([[0.0, 1.0, 5.0], [0.0, 1.0, 5.0], [0.0, 1.0, 5.0]])
    seqs = [seq([0], temperature=0.0), seq([2], temperature=0.0, repetition_penalty=100.0),
            seq([0], temperature=0.0, logprobs=True)]
    tokens, lps = sample(logits, seqs, best=[0, 0, 2])
    assert tokens == [0, 1, 2]          # row 0 trusts best (even where it is not the row's argmax)
    assert lps[0] is None and lps[2] is not None and lps[2].token_id == 2


def test_extreme_but_valid_parameters_still_choose_a_token():
    """Values every check lets through, at float32's edges: a temperature of 1e-38 (the logits
    divided by it were +-inf, the softmax NaN), a top_p of 1e-46 (0 in float32: every token was
    dropped), a repetition_penalty of 1e-38 (a seen token's logit +inf). Each made ``draw`` index
    an empty array, and the step failed for every request in it."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0]])
    assert SamplingParams(temperature=GREEDY_BELOW / 2).greedy and not SamplingParams(temperature=GREEDY_BELOW).greedy
    for kw in ({"temperature": 1e-38}, {"temperature": 1e-300}, {"top_p": 1e-46}, {"top_p": 5e-324}):
        for s in range(5):
            assert sample(logits.clone(), [seq([0], seed=s, **kw)])[0] == [1], kw   # the best token, always
    # a seen token's logit over float32's range stays the most likely, and finite logits keep their odds
    for s in range(5):
        assert sample(logits.clone(), [seq([3], seed=s, repetition_penalty=1e-39)])[0] == [3]
    row = _filter(_apply_penalties(logits[0].clone(), seq([3], repetition_penalty=1e-39)), seq([0]))
    assert row.isfinite().all() and row[3] == torch.finfo(torch.float32).max


def test_a_row_that_cannot_be_chosen_fails_alone():
    """With ``failed``, a row whose choice raises gets its exception there; the other rows are
    chosen as before. Without it the exception goes up."""
    logits = torch.tensor([[0.0, 1.0, 5.0], [float("nan")] * 3, [0.0, 4.0, 1.0], [1.0, float("nan"), 2.0]])
    rows = [seq([0], temperature=1.0, seed=1), seq([0], temperature=1.0, seed=1), seq([0], temperature=0),
            seq([0], temperature=1.0, top_p=0.9, seed=1)]
    failed = {}
    toks, lps = sample(logits, rows, failed=failed)
    assert list(failed) == [1, 3] and "no token has a positive probability" in str(failed[1])
    assert "no token has a positive probability" in str(failed[3])   # (top-p's cut too: not an IndexError)
    assert toks[0] == sample(logits[:1], rows[:1])[0][0] and toks[2] == 1 and toks[1] == -1
    with pytest.raises(ValueError, match="positive probability"):
        sample(logits, rows)


def _compiled():
    from kernels import cpu
    lib = cpu._library()
    if lib is None:
        pytest.skip("no compiled kernels (no C++ compiler)")
    return lib


def _rows(vocab: int) -> list[torch.Tensor]:
    """Logit rows of every shape a sampler meets: peaked and flat, on a 0.5 grid (ties at every
    edge), with banned (-inf) tokens, one huge logit."""
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(vocab, generator=g) * s for s in (0.5, 1.0, 3.0, 8.0)]
    rows.append((torch.randn(vocab, generator=g) * 4).mul(2).round().div(2))
    banned = torch.randn(vocab, generator=g) * 3
    banned[torch.rand(vocab, generator=g) < 0.5] = float("-inf")
    rows.append(banned)
    huge = torch.randn(vocab, generator=g)
    huge[3] = 1e30
    rows.append(huge)
    return rows


@pytest.mark.parametrize("vocab", [64, 5000])
def test_the_compiled_draw_keeps_and_draws_what_the_torch_ops_do(vocab):
    """``draw_rows`` (kernels/sample_cpu.cpp) against the torch path (``_filter`` then ``draw``):
    the same kept tokens (but those e^-87 below the best, which it never draws) and the same draw, for every mix of temperature, top-k, top-p and min-p.
    Its exp and float64 sums round differently from torch's softmax, so a token could differ only
    where u falls within that rounding of a CDF edge or a mass sits on top-p's cut (none here)."""
    from shared.engine.sampler import draw, draw_rows
    lib = _compiled()
    rows = _rows(vocab)
    n = 0
    for temp in (0.5, 0.8, 1.0, 1.3):
        for top_p in (1.0, 0.95, 0.5):
            for top_k in (0, 40):
                for min_p in (0.0, 0.05):
                    seqs = [seq([0], output=[1] * (r + top_k), temperature=temp, top_p=top_p, top_k=top_k,
                                min_p=min_p, seed=100 * r + int(temp * 10)) for r in range(len(rows))]
                    weights = torch.empty(len(rows), vocab)
                    toks = draw_rows(rows, seqs, lib, weights)
                    for row, s, w, tok in zip(rows, seqs, weights, toks):
                        kept = _filter(row, s)   # (a token e^-87 below the best has weight 0 there: < 1e-38)
                        assert torch.equal(w > 0, kept.isfinite() & (kept - kept.max() >= -87)), (temp, top_p, top_k, min_p)
                        assert tok == draw(kept.softmax(-1), s.seed, s.num_output_tokens), (temp, top_p, top_k, min_p)
                        n += 1
    assert n == 4 * 3 * 2 * 2 * len(rows)


def test_the_compiled_draw_depends_on_the_row_alone():
    """A row draws the same token alone or in a batch, on one thread or two, and its uniform
    number is numpy's Philox (``uniform``) bit for bit."""
    from kernels import cpu
    from shared.engine.sampler import draw_rows, uniform
    lib = _compiled()
    for s_, i in ((0, 0), (1, 5), (2**63 + 5, 7), (2**64 - 1, 2**31 + 3), (987654321987, 1000)):
        assert lib.tq_philox_uniform(s_, i) == uniform(s_, i)
    rows = _rows(2000)
    seqs = [seq([0], output=[2] * r, temperature=0.9, top_p=0.9, seed=r) for r in range(len(rows))]
    threads = cpu.get_num_threads()
    try:
        cpu.set_num_threads(1)
        alone = [draw_rows([r], [s], lib)[0] for r, s in zip(rows, seqs)]
        cpu.set_num_threads(2)
        assert draw_rows(rows, seqs, lib) == alone
    finally:
        cpu.set_num_threads(threads)


def test_sample_falls_back_to_the_torch_ops_without_the_compiled_draw(monkeypatch):
    """Where no library loads the same rows go through ``_filter`` and ``draw``: the same tokens."""
    from shared.engine import sampler
    _compiled()
    rows = _rows(3000)
    logits = torch.stack(rows)
    seqs = [seq([0], output=[3] * r, temperature=1.1, top_p=0.95, min_p=0.01, seed=40 + r) for r in range(len(rows))]
    native = sample(logits, seqs)[0]
    monkeypatch.setattr(sampler, "NATIVE", False)
    assert sample(logits, seqs)[0] == native
