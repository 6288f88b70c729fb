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


@pytest.mark.parametrize("mode,precision,attn", [("graphs", "ieee", "ieee"), ("graphs", "tf32", "ieee"),
                                                 ("graphs", "tf32x3", "ieee"), ("graphs", "ieee", "fp16"),
                                                 ("ops", "ieee", "ieee")])
def test_cpu_and_cuda_hold_the_contract(bundled_model, mode, precision, attn, monkeypatch):
    """tf32: the fused step's matmuls of more than 64 rows (the 512-token text) on the tensor cores;
    tf32x3: every Q4_0 matmul on them, three TF32 passes;
    attn fp16: the prefill's attention in float16 on the tensor cores (TANDEM_GPU_PREFILL_ATTN)."""
    monkeypatch.setenv("TANDEM_GPU_PRECISION", precision)
    monkeypatch.setenv("TANDEM_GPU_PREFILL_ATTN", attn)
    cpu = Engine(bundled_model, EngineConfig(num_kv_blocks=96))
    cuda = Engine(bundled_model, EngineConfig(device="cuda", gpu_step=mode, num_kv_blocks=96))
    got = contract.check(cpu, cuda)
    print(f"\n[contract cpu vs cuda {mode} {precision} attention {attn}]", got)
    for name, figures in got.items():
        assert contract.holds(figures), (name, figures)
