"""The fast CPU Q4_0 kernels against the torch reference (kernels.q4_0)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from kernels import cpu, dispatch, q4_0

# Relative Frobenius error of the fast matmul vs the f32 reference. The fast path quantizes
# activations to Q8_0 (as llama.cpp does); measured ~0.55 % on Gaussian data, ~0.6 % on the
# bundled model's weights (docs/kernels.md). The bound leaves room for other data.
REL_TOL = 0.012

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # SmolLM2-135M (N, K)

needs_lib = pytest.mark.skipif(not cpu.available(), reason="the C++ kernels did not build here")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@functools.lru_cache(maxsize=8)
def q4(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random Q4_0 weights [n, k] (cached: tests only read them)."""
    g = torch.Generator().manual_seed(seed)
    return q4_0.quantize(torch.randn(n, k, generator=g) * 0.05)


def acts(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g)


def paths() -> list[str]:
    """Instruction-set paths this CPU can run (the best one and every one below it)."""
    best = cpu.isa()
    order = ["scalar", "avx2", "avx512vnni", "amx"]
    return order[: order.index(best) + 1] if best in order else []


@needs_lib
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 7, 16, 64])
def test_matmul_close_to_reference(m, n, k):
    q, x = q4(n, k), acts(m, k)
    assert rel_err(cpu.matmul(x, q), q4_0.matmul(x, q)) < REL_TOL


@needs_lib
@pytest.mark.parametrize("m", [1, 7])
def test_lm_head_shape(m):
    q, x = q4(49152, 576), acts(m, 576)
    out = torch.full((m, 49152), float("nan"))
    got = cpu.matmul(x, q, out=out)
    assert got is out
    assert rel_err(out, q4_0.matmul(x, q)) < REL_TOL


@needs_lib
def test_exact_when_activations_are_q8_0_representable():
    # x = d * int8 with one element per block at +-127, so the Q8_0 quantization is lossless;
    # then the fast result is the exact sum, up to fp32 rounding of the accumulation.
    m, n, k = 5, 96, 576
    g = torch.Generator().manual_seed(3)
    ints = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int64)
    ints[:, ::32] = 127
    x = ints.to(torch.float32) * 0.25
    q = q4(n, k)
    qs, d = cpu.quantize_q8_0(x)
    assert torch.equal(qs.to(torch.int64), ints) and torch.all(d == 0.25)
    exact = (x.double() @ q4_0.dequantize(q).double().T)
    got = cpu.matmul(x, q).double()
    assert torch.allclose(got, exact, rtol=0, atol=1e-5 * float(exact.abs().max()))


def torch_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 activation quantization in torch: per 32 values d = amax/127, q = round(x/d)."""
    m, k = x.shape
    b = x.reshape(m, k // 32, 32)
    d = b.abs().amax(dim=-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    qs = torch.round(b * inv[..., None]).to(torch.int8)  # round half to even, like the C++
    return qs.reshape(m, k), d


@needs_lib
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512vnni"])
def test_q8_0_quantization_matches_torch_bitwise(isa, monkeypatch):
    if isa not in paths():
        pytest.skip(f"this CPU has no {isa} path")
    x = acts(9, 1536) * 3.0
    x[0, :32] = 0.0  # an all-zero block (scale 0)
    x[1, 5] = 0.5 * (x[1, :32].abs().max())  # ties are rare; check ordinary rounding
    monkeypatch.setattr(cpu, "_isa_choice", cpu._ISA_IDS[isa])
    qs, d = cpu.quantize_q8_0(x)
    qs_t, d_t = torch_q8_0(x)
    assert torch.equal(d, d_t)
    assert torch.equal(qs, qs_t)


@needs_lib
@pytest.mark.parametrize("act", ["q8", "f32"])
def test_every_isa_path_gives_the_same_bits(act):
    q = q4(195, 576)  # 195: a row count that is not a multiple of the 4-row tile
    x = acts(11, 576)
    outs = [cpu.matmul_with(x, q, isa=p, act=act) for p in paths()]
    assert len(outs) >= 1
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@needs_lib
@pytest.mark.parametrize("act", ["q8", "f32"])
@pytest.mark.parametrize("n,k", [(1536, 576), (576, 1536), (195, 576)])
def test_batched_rows_equal_single_rows_for_any_thread_count(n, k, act):
    q, x = q4(n, k), acts(19, k)
    singles = torch.cat([cpu.matmul_with(x[i:i + 1], q, num_threads=1, act=act) for i in range(x.shape[0])])
    for threads in (1, 2, 3, 8):
        for m in (1, 2, 7, 16, 19):
            got = cpu.matmul_with(x[:m], q, num_threads=threads, act=act)
            assert torch.equal(got, singles[:m]), (threads, m)


@needs_lib
def test_gemm_over_several_activation_chunks_equals_single_rows():
    """M large enough that the packed f32 GEMM walks several L2-sized chunks of activation rows."""
    q, x = q4(195, 1536), acts(70, 1536)
    singles = torch.cat([cpu.matmul_with(x[i:i + 1], q, num_threads=1, act="f32") for i in range(x.shape[0])])
    for threads in (1, 2):
        assert torch.equal(cpu.matmul_with(x, q, num_threads=threads, act="f32"), singles)
    assert rel_err(singles, q4_0.matmul(x, q)) < 1e-5


@needs_lib
def test_embedding_is_bitwise_the_reference():
    q = q4(1000, 576)
    ids = torch.tensor([[0, 999, 5], [5, 17, 3]])
    assert torch.equal(cpu.embedding(ids, q), q4_0.embedding(ids, q))
    assert cpu.embedding(torch.tensor([], dtype=torch.int64), q).shape == (0, 576)


def test_empty_batch():
    assert cpu.matmul(torch.empty(0, 576), q4(8, 576)).shape == (0, 8)


@pytest.mark.parametrize("bad,name", [
    (lambda x, q: (x.double(), q, None), "x"),
    (lambda x, q: (x[0], q, None), "x"),
    (lambda x, q: (x.T.contiguous().T, q, None), "x"),
    (lambda x, q: (x[:, :64].contiguous(), q, None), "x width"),
    (lambda x, q: (x, q.to(torch.int8), None), "q"),
    (lambda x, q: (x, q[:, :-1], None), "q"),
    (lambda x, q: (x, q[::2], None), "q"),
    (lambda x, q: (x, q, torch.empty(3, 7)), "out"),
    (lambda x, q: (x, q, torch.empty(3, 8, dtype=torch.float64)), "out"),
])
def test_bad_inputs_raise_value_error(bad, name):
    x, q = acts(3, 576), q4(8, 576)
    with pytest.raises(ValueError, match=name):
        cpu.matmul(*bad(x, q))


def test_bad_embedding_ids_raise_value_error():
    q = q4(8, 576)
    with pytest.raises(ValueError, match="ids"):
        cpu.embedding(torch.tensor([8]), q)
    with pytest.raises(ValueError, match="ids"):
        cpu.embedding(torch.tensor([0.0]), q)
    with pytest.raises(ValueError, match="num_threads"):
        cpu.set_num_threads(0)


@pytest.fixture
def broken_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    cpu.reload()
    yield
    monkeypatch.undo()
    cpu.reload()


def test_the_library_builds_where_a_compiler_exists():
    """Every other kernel test skips when the library is unavailable; where a compiler exists,
    that must not happen silently (a C++ error would turn the whole suite into skips)."""
    import shutil
    if shutil.which(cpu._compiler()) is None:
        pytest.skip(f"no C++ compiler {cpu._compiler()!r} here: the torch reference serves")
    assert cpu.available(), "the C++ kernels did not build or load although a compiler exists (see the warning)"


def test_falls_back_to_reference_when_the_build_fails(broken_compiler, caplog):
    with caplog.at_level(logging.WARNING, logger="kernels.cpu"):
        cpu.reload()
    assert not cpu.available() and cpu.isa() == "reference"
    assert any("torch reference" in r.getMessage() for r in caplog.records)
    assert dispatch.get_ops("cpu") is q4_0
    q, x = q4(64, 576), acts(3, 576)
    assert torch.equal(cpu.matmul(x, q), q4_0.matmul(x, q))
    ids = torch.tensor([1, 2])
    assert torch.equal(cpu.embedding(ids, q), q4_0.embedding(ids, q))


def test_build_is_cached_and_atomic(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path = cpu.library_path()
    assert path.parent == tmp_path and not path.exists()
    try:
        cpu._build(path)
    except RuntimeError as exc:
        pytest.skip(f"no working compiler: {exc}")
    assert path.exists() and [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp left


def test_dispatch(monkeypatch):
    from kernels import gpu
    assert dispatch.get_ops("cuda") is (gpu if gpu.available() else q4_0)   # Triton where a GPU is
    assert dispatch.get_ops("meta") is q4_0
    assert dispatch.get_ops(torch.device("cpu")) is (cpu if cpu.available() else q4_0)
    monkeypatch.setenv("TANDEM_KERNELS", "reference")
    assert dispatch.get_ops("cpu") is q4_0 and dispatch.get_ops("cuda") is q4_0
    monkeypatch.setenv("TANDEM_KERNELS", "fastest")
    with pytest.raises(ValueError, match="TANDEM_KERNELS"):
        dispatch.get_ops("cpu")


@pytest.fixture(scope="module")
def real_weights(bundled_model):
    return bundled_model.weights


@needs_lib
@pytest.mark.parametrize("name", ["blk.0.attn_q", "blk.0.attn_k", "blk.7.ffn_up", "blk.29.ffn_down", "token_embd"])
def test_real_weights_close_to_reference(real_weights, name):
    q = real_weights[name]
    k = q.shape[1] // q4_0.BLOCK_BYTES * q4_0.QK
    for m in (1, 16):
        x = acts(m, k, seed=m)
        assert rel_err(cpu.matmul(x, q), q4_0.matmul(x, q)) < REL_TOL
    ids = torch.tensor([0, 1, q.shape[0] - 1]) if name == "token_embd" else torch.tensor([0])
    assert torch.equal(cpu.embedding(ids, q), q4_0.embedding(ids, q))


# ---------------------------------------------------------------- f32-activation mode

F32_REL_TOL = 1e-5  # no activation rounding: only fp32 summation order differs from the reference


@needs_lib
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 7, 16, 64])
def test_f32_matmul_close_to_reference(m, n, k):
    q, x = q4(n, k), acts(m, k)
    assert rel_err(cpu.matmul_with(x, q, act="f32"), q4_0.matmul(x, q)) < F32_REL_TOL


@needs_lib
def test_act_mode_selection(monkeypatch):
    q, x = q4(64, 576), acts(3, 576)
    f32, q8 = cpu.matmul_with(x, q, act="f32"), cpu.matmul_with(x, q, act="q8")
    assert not torch.equal(f32, q8)
    before = cpu.act()
    monkeypatch.setenv("TANDEM_CPU_ACT", "f32")
    cpu.set_act(None)
    try:
        assert cpu.act() == "f32" and torch.equal(cpu.matmul(x, q), f32)
        assert isinstance(cpu.prepare(q), torch.Tensor)          # only q16 packs
        cpu.set_act("q8")
        assert cpu.act() == "q8" and torch.equal(cpu.matmul(x, q), q8)
        with pytest.raises(ValueError, match="act"):
            cpu.set_act("int4")
        with pytest.raises(ValueError, match="act"):
            cpu.matmul_with(x, q, act="bf16")
        monkeypatch.setenv("TANDEM_CPU_ACT", "q8")
        cpu.set_act(None)
        assert cpu.act() == "q8"
        monkeypatch.delenv("TANDEM_CPU_ACT")
        cpu.set_act(None)
        assert cpu.act() == "q16"  # the default (docs/kernels.md)
        assert torch.equal(cpu.matmul(x, q), f32)                # a row-major tensor runs f32 in q16 mode
        assert isinstance(cpu.prepare(q), cpu.PackedQ4)
        assert torch.equal(cpu.matmul(x, cpu.prepare(q)), cpu.matmul_with(x, cpu.pack(q), act="q8"))  # packed: q16 always
    finally:
        cpu.set_act(before)


# ---------------------------------------------------------------- q16: packed weights, int16 activations

# The kernel sums the exact integer block dots in f32 (one fma per block); the oracle
# (q4_0.matmul_q16) in float64: measured <= 3.7e-7 of the largest output
Q16_ORACLE_TOL = 2e-6
# Against the f32 reference: the int16 rounding of the activations, measured <= 2.3e-5 relative
Q16_REL_TOL = 1e-4


@needs_lib
def test_q16_quantization_is_the_oracles_exactly():
    x = torch.cat([acts(5, 576), torch.zeros(1, 576), acts(1, 576) * 1e-30, acts(1, 576) * 1e30])
    x[0, 5] = 0.5 * x[0, :32].abs().max()        # ties and exact halves take the even side
    xq, d, sums = cpu.quantize_q16(x)
    want_q, want_d = q4_0.quantize_q16(x)
    assert torch.equal(xq, want_q) and torch.equal(d, want_d)
    assert torch.equal(sums, want_q.to(torch.int32).reshape(x.shape[0], -1, 32).sum(-1))
    assert int(xq.abs().max()) == q4_0.Q16_MAX


@needs_lib
@pytest.mark.parametrize("n,k", SHAPES + [(100, 96), (3, 64)])   # N not a multiple of the 16-row group
def test_pack_round_trip_and_packed_embedding(n, k):
    q = q4(n, k)
    p = cpu.pack(q)
    assert p.shape == q.shape and p.numel() == -(-n // 16) * 16 * q.shape[1]
    assert torch.equal(p.unpack(), q)
    ids = torch.tensor([0, n - 1, n // 2])
    assert torch.equal(cpu.embedding(ids, p), q4_0.embedding(ids, q))


@needs_lib
@pytest.mark.parametrize("n,k", SHAPES + [(100, 96)])
@pytest.mark.parametrize("m", [1, 2, 5, 16, 64])
def test_q16_matmul_against_its_oracle_and_the_f32_reference(m, n, k):
    q, x = q4(n, k), acts(m, k)
    got = cpu.matmul(x, cpu.pack(q))
    oracle = q4_0.matmul_q16(x, q)
    assert float((got - oracle).abs().max()) <= Q16_ORACLE_TOL * float(oracle.abs().max())
    assert rel_err(got, q4_0.matmul(x, q)) < Q16_REL_TOL


@needs_lib
def test_q16_same_bits_on_every_path_thread_count_and_batch():
    q, x = q4(576, 1536), acts(37, 1536)
    p = cpu.pack(q)
    want = cpu.matmul_with(x, p, isa="scalar", num_threads=1)
    for isa in paths():
        for t in (1, 2, 3):
            assert torch.equal(cpu.matmul_with(x, p, isa=isa, num_threads=t), want), (isa, t)
    rows = torch.cat([cpu.matmul(x[i:i + 1].contiguous(), p) for i in range(x.shape[0])])
    assert torch.equal(rows, want)   # a row of a batch is that row alone


@needs_lib
def test_q16_largest_products_add_up_exactly_on_every_path():
    """The AVX2 tile adds a block's vpmaddubsw pairs in int16 lanes before it widens them (up to 8
    to a lane: |pair| <= 2 x 15 x 128, 8 of them <= 30,720 < 2^15). Weights of nibble 15 against
    activations quantized to +-Q16_MAX everywhere — sums within 1 % of that bound (bytes of 127), of one sign and mixed —
    give the scalar path's bits (int32 throughout) on every path, at 1, 4 and 5 rows (the AVX2
    tile's widths), and the oracle's values."""
    k = 1536
    block = torch.full((32,), -7 / 8)
    block[0] = 1.0                                   # 31 weights of a block quantize to nibble 15
    q = q4_0.quantize(block.repeat(48, k // 32) * 0.01)
    nibbles = torch.cat([q.reshape(48, k // 32, 18)[..., 2:] & 15, q.reshape(48, k // 32, 18)[..., 2:] >> 4], -1)
    assert float((nibbles == 15).float().mean()) > 0.95
    g = torch.Generator().manual_seed(3)
    x = torch.stack([torch.ones(k), -torch.ones(k), torch.ones(k // 32, 32).mul(torch.tensor([1.0, -1.0]).repeat(
        k // 64)[:, None]).flatten(), torch.randint(0, 2, (k,), generator=g) * 2.0 - 1, torch.ones(k) * 3])
    xq, _ = q4_0.quantize_q16(x)
    assert int(xq.abs().min()) == q4_0.Q16_MAX       # every activation at the largest magnitude
    p = cpu.pack(q)
    for rows in (x[:1], x[:4], x):
        want = cpu.matmul_with(rows, p, isa="scalar", num_threads=1)
        oracle = q4_0.matmul_q16(rows, q)
        assert float((want - oracle).abs().max()) <= Q16_ORACLE_TOL * float(oracle.abs().max())
        for isa in paths():
            assert torch.equal(cpu.matmul_with(rows, p, isa=isa, num_threads=2), want), (isa, rows.shape[0])


@needs_lib
@pytest.mark.parametrize("n,k", [(395, 96), (576, 1536), (291, 32)])
@pytest.mark.parametrize("m", [7, 8, 16, 17, 40])
def test_q16_tile_unit_gives_the_scalar_bits(m, n, k):
    """The AMX path (Intel's tile unit: batches of 8 rows and more, 16 activation rows per tile,
    padding rows, odd block counts, a last group of fewer than 16 rows; a thread with fewer than
    8 groups runs the AVX-512 tiles: 291 rows on 3 threads) against the scalar path."""
    if "amx" not in paths():
        pytest.skip("this CPU (or its OS) has no AMX tile unit")
    q, x = q4(n, k, seed=m), acts(m, k, seed=n)
    p = cpu.pack(q)
    want = cpu.matmul_with(x, p, isa="scalar", num_threads=1)
    for t in (1, 2, 3):
        assert torch.equal(cpu.matmul_with(x, p, isa="amx", num_threads=t), want), t


@needs_lib
@pytest.mark.parametrize("name", ["blk.0.attn_q", "blk.7.ffn_up", "blk.29.ffn_down", "token_embd"])
def test_q16_real_weights(real_weights, name):
    q = real_weights[name]
    k = q.shape[1] // q4_0.BLOCK_BYTES * q4_0.QK
    p = cpu.pack(q)
    for m in (1, 16):
        x = acts(m, k, seed=m)
        assert rel_err(cpu.matmul(x, p), q4_0.matmul(x, q)) < Q16_REL_TOL


def test_an_unknown_isa_name_is_said_and_the_best_path_used(monkeypatch, caplog):
    monkeypatch.setenv("TANDEM_CPU_ISA", "avx512")          # avx512vnni is the name
    assert cpu._isa_from_env() == -1
    assert "ignoring TANDEM_CPU_ISA='avx512'" in caplog.text and "avx512vnni" in caplog.text
    caplog.clear()
    monkeypatch.setenv("TANDEM_CPU_ISA", "AVX2")
    assert cpu._isa_from_env() == 1 and "ignoring" not in caplog.text
