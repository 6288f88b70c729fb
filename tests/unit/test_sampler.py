"""Sampler arithmetic on hand-made logits (real Sequence objects, no model)."""

from __future__ import annotations

import math

import torch

from shared.engine.sampler import _apply_penalties, _filter, sample
from shared.engine.sampling import SamplingParams
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
