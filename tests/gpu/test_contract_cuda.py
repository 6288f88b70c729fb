"""The CPU↔GPU numerics contract (tests/integration/contract.py) between the CPU engine and the
CUDA engine (the fused step, decode as CUDA graphs): teacher-forced logits of one 512-token text,
and KV exported on either device continued on the other. Replaces the greedy-agreement rate."""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import Engine, EngineConfig
from tests.integration import contract

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"),
]


@pytest.mark.parametrize("mode,precision", [("graphs", "ieee"), ("graphs", "tf32"), ("ops", "ieee")])
def test_cpu_and_cuda_hold_the_contract(bundled_model, mode, precision, monkeypatch):
    """tf32: the fused step's matmuls of more than 64 rows (the 512-token text) on the tensor cores."""
    monkeypatch.setenv("TANDEM_GPU_PRECISION", precision)
    cpu = Engine(bundled_model, EngineConfig(num_kv_blocks=96))
    cuda = Engine(bundled_model, EngineConfig(device="cuda", gpu_step=mode, num_kv_blocks=96))
    got = contract.check(cpu, cuda)
    print(f"\n[contract cpu vs cuda {mode} {precision}]", got)
    for name, figures in got.items():
        assert contract.holds(figures), (name, figures)
