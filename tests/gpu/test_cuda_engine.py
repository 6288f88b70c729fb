"""The engine on CUDA: same Q4_0 bytes as the CPU engine, a request handed over between devices.

Numerics differ between the devices (CPU: q16 activations; CUDA: f32): what holds between them is
the contract of tests/integration/contract.py (tests/gpu/test_contract_cuda.py: teacher-forced
logits, KV continued across devices). Here the hand-off as a request sees it: prefilled on one
device, decoded on the other, the stream whole and the same as an uninterrupted run there up to
the first near-tie.
"""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import Engine, EngineConfig, run_to_completion
from shared.engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"),
]

PROMPTS = ["The quick brown fox", "In 1905, Albert Einstein published", "def fibonacci(n):",
           "The largest planet in the solar system is"]
N = 32


def greedy(n: int = N) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(bundled_model) -> dict[str, Engine]:
    return {dev: Engine(bundled_model, EngineConfig(device=dev, num_kv_blocks=128)) for dev in ("cpu", "cuda")}


def rows(w) -> torch.Tensor:
    """Row-major Q4_0 bytes of a weight (the CPU engine keeps its matrices packed for q16)."""
    from kernels.cpu import PackedQ4
    return w.unpack() if isinstance(w, PackedQ4) else w.cpu()


def test_same_q4_0_bytes_on_cuda(engines):
    cpu_e, cuda_e = engines["cpu"], engines["cuda"]
    assert cuda_e.model.embed.device.type == "cuda" and cuda_e.model.embed.dtype == torch.uint8
    assert torch.equal(rows(cuda_e.model.embed), rows(cpu_e.model.embed))
    for a, b in zip(cpu_e.model.layers, cuda_e.model.layers):
        for k in ("qkv", "o", "gate_up", "down"):
            assert torch.equal(rows(a[k]), rows(b[k])), k


@pytest.mark.parametrize("src,dst", [("cpu", "cuda"), ("cuda", "cpu")])
def test_export_import_across_devices(engines, src, dst):
    tok = engines[src].tokenizer
    ids = tok.encode(PROMPTS[1])
    reference = run_to_completion(engines[dst], {"ref": (ids, greedy())})["ref"].token_ids

    # prefill on the source device (parks the sequence), hand the KV to the other device
    engines[src].add("h", ids, greedy(), prefill_only=True)
    first = []
    while engines[src].has_work():
        for out in engines[src].step():
            first += out.token_ids
    blob = engines[src].export_kv("h")
    engines[dst].import_kv("h", blob)
    rest = []
    while engines[dst].has_work():
        for out in engines[dst].step():
            if out.request_id == "h":
                rest += out.token_ids
    got = first + rest
    assert len(got) == N
    # the first token was sampled on the source; the rest continue on dst from src's KV
    first = next((i for i, (x, y) in enumerate(zip(got, reference)) if x != y), N)
    print(f"\n[hand-off {src}->{dst}] the same as an uninterrupted {dst} run for {first} of {N} tokens")
    assert first >= 8
