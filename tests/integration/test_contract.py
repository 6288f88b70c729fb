"""The CPU↔GPU numerics contract (tests/integration/contract.py) on this machine: the CPU engine's
kernels (q16) against the f32 torch reference, which is what the CUDA engine computes (f32
activations, same Q4_0 bytes). tests/gpu/test_contract_cuda.py checks CPU against CUDA itself."""

from __future__ import annotations

import pytest

from shared.engine.engine import Engine, EngineConfig
from tests.integration import contract


@pytest.fixture(scope="module")
def engines(bundled_model):
    fast = Engine(bundled_model, EngineConfig(num_kv_blocks=96))
    mp = pytest.MonkeyPatch()
    mp.setenv("TANDEM_KERNELS", "reference")
    try:
        ref = Engine(bundled_model, EngineConfig(num_kv_blocks=96))
    finally:
        mp.undo()
    assert fast.model.ops is not ref.model.ops
    ids = contract.text_ids(fast.tokenizer)
    return fast, ref, fast.prompt_logits(ids), ref.prompt_logits(ids)


def test_cpu_kernels_hold_the_contract_against_the_f32_reference(engines):
    got = contract.check(*engines)
    print("\n[contract cpu vs reference]", got)
    for name, figures in got.items():
        assert contract.holds(figures), (name, figures)


def test_the_contract_fails_a_broken_side(engines):
    """The check is not vacuous: logits of the text shifted by one position break it."""
    _, _, la, lb = engines
    assert contract.holds(contract.compare(la, lb))
    assert not contract.holds(contract.compare(la[1:], lb[:-1]))
    assert not contract.holds(contract.compare(la + 0.1, lb))
