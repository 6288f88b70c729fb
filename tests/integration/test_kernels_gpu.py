"""The Q4_0 GPU kernels (kernels/gpu.py, Triton) against the torch reference.

Here they run in Triton's interpreter on the CPU (TRITON_INTERPRET=1): the same kernel code,
indexing and masks as on a GPU, executed with numpy — so the GEMV and GEMM paths are checked on
machines without one. Triton reads the setting when it is first imported, so the kernels run
in a worker process started with it. tests/gpu/test_kernels_cuda.py runs them compiled on a
CUDA device.

Tolerance: both sides compute in f32 with exact weights ``(nibble - 8) * d``; only the summation
order differs (the reference: torch's matmul over the dequantized rows). Measured here:
max |diff| <= 2e-6 of the largest |output| on random and real weights; the bound is 1e-5.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from kernels import gpu, q4_0
from tests.triton_interp import speed_up_device_calls

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

REL_TOL = 1e-5
SPLIT = 8  # GEMV up to this M in these tests, GEMM above: both kernels on small shapes (the
           # interpreter is slow; the product's GEMV_MAX_M is larger, tested by its own case below)


def _interpreted(x: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None, gemv_max_m: int):
    """In the worker: (result, out is result) or the ValueError raised."""
    assert os.environ["TRITON_INTERPRET"] == "1" and gpu.interpreting()
    gpu.GEMV_MAX_M = gemv_max_m
    try:
        got = gpu.matmul(x, q, out)
    except ValueError as e:
        return e
    return got, got is out


@pytest.fixture(scope="module")
def interp():
    """matmul(x, q, out=None) run by kernels.gpu in Triton's interpreter, in a worker process."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=speed_up_device_calls)
        pool.submit(os.getpid).result()          # started now, with the setting
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old

    def run(x, q, out=None, gemv_max_m=SPLIT):
        r = pool.submit(_interpreted, x, q, out, gemv_max_m).result()
        if isinstance(r, ValueError):
            raise r
        return r
    with pool:
        yield run


def check(interp, x: torch.Tensor, q: torch.Tensor, gemv_max_m: int = SPLIT) -> None:
    want = q4_0.matmul(x, q)
    got, _ = interp(x, q, gemv_max_m=gemv_max_m)
    assert got.shape == want.shape and got.dtype == torch.float32
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= REL_TOL * scale, float((got - want).abs().max()) / scale


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return q4_0.quantize(torch.randn(n, k, generator=g) * 0.05)


def acts(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


# GEMV for M <= SPLIT, GEMM above; N not a multiple of the 64-row tile; K of 3 blocks (not
# a multiple of BLOCK_B = 4), of 18 (576) and of 48 (1536)
@pytest.mark.parametrize("m", [1, 3, SPLIT, SPLIT + 1, 40, 70])
@pytest.mark.parametrize("n,k", [(192, 576), (100, 1536), (64, 96)])
def test_random_weights_gemv_and_gemm(interp, m, n, k):
    check(interp, acts(m, k), weights(n, k))


def test_product_split_runs_gemv_on_a_batch(interp):
    """With the product's GEMV_MAX_M a 70-row batch is GEMV programs (one per activation row)."""
    assert gpu.GEMV_MAX_M >= 70
    check(interp, acts(70, 96), weights(100, 96), gemv_max_m=gpu.GEMV_MAX_M)


@pytest.mark.parametrize("name", ["blk.0.attn_q", "blk.0.ffn_down", "blk.29.ffn_gate"])
@pytest.mark.parametrize("m", [1, 20])
def test_real_weights(interp, bundled_model, name, m):
    q = bundled_model.weights[name]
    k = q.shape[1] // q4_0.BLOCK_BYTES * q4_0.QK
    check(interp, acts(m, k) * 0.5, q)


def test_out_argument_and_empty_inputs(interp):
    q, x = weights(70, 96), acts(2, 96)
    got, same = interp(x, q, torch.full((2, 70), float("nan")))
    assert same and not got.isnan().any()
    assert interp(acts(0, 96), q)[0].shape == (0, 70)


def test_bad_arguments_raise_value_error(interp):
    q, x = weights(64, 96), acts(2, 96)
    with pytest.raises(ValueError, match="does not match"):
        interp(acts(2, 64), q)
    with pytest.raises(ValueError, match="float32"):
        interp(x.double(), q)
    with pytest.raises(ValueError, match="uint8"):
        interp(x, q.float())
    with pytest.raises(ValueError, match="out must be"):
        interp(x, q, torch.empty(2, 63))


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a CUDA device exists: dispatch is tested in tests/gpu")
    with pytest.raises(ValueError, match="CUDA tensors"):
        gpu.matmul(acts(1, 96), weights(64, 96))
    assert not gpu.available()
