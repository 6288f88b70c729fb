"""The Q4_0 Triton kernels compiled on a CUDA device: against the torch reference per model shape
and M, and the engine on CUDA through them against the engine on the reference path (greedy
tokens identical for 128 tokens on 8 prompts). tests/integration/test_kernels_gpu.py runs the
same kernels in Triton's interpreter where no GPU exists."""

from __future__ import annotations

import pytest
import torch

from kernels import dispatch, q4_0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"),
]
triton = pytest.importorskip("triton", reason="triton is not installed")

from kernels import gpu  # noqa: E402
from shared.engine.engine import Engine, EngineConfig, run_to_completion  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]   # SmolLM2-135M (N, K)
PROMPTS = ["The quick brown fox", "In 1905, Albert Einstein published", "def fibonacci(n):",
           "The largest planet in the solar system is", "Write a haiku about the sea.",
           "Three reasons to learn Rust:", "Once upon a time, in a small village,", "SELECT name FROM"]


def test_dispatch_picks_the_triton_kernels():
    assert dispatch.get_ops("cuda") is gpu and "triton" in dispatch.describe("cuda")


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 4, 8, 9, 64, 512, 600])
def test_matmul_close_to_reference(m, n, k):
    g = torch.Generator().manual_seed(0)
    q = q4_0.quantize(torch.randn(n, k, generator=g) * 0.05).cuda()
    x = torch.randn(m, k, generator=g).cuda()
    want = q4_0.matmul(x, q)
    got = gpu.matmul(x, q)
    torch.cuda.synchronize()
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_engine_greedy_tokens_match_the_reference_path(bundled_model, monkeypatch):
    greedy = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    fast = Engine(bundled_model, EngineConfig(device="cuda", num_kv_blocks=512))
    assert fast.model.ops is gpu
    monkeypatch.setenv("TANDEM_KERNELS", "reference")
    ref = Engine(bundled_model, EngineConfig(device="cuda", num_kv_blocks=512))
    assert ref.model.ops is q4_0
    reqs = {f"p{i}": (fast.tokenizer.encode(p), greedy) for i, p in enumerate(PROMPTS)}
    a, b = run_to_completion(fast, reqs), run_to_completion(ref, reqs)
    assert {r: a[r].token_ids for r in reqs} == {r: b[r].token_ids for r in reqs}
