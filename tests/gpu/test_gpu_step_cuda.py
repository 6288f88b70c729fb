"""The fused GPU step (kernels/gpu_step.py) compiled on a CUDA device: every interpreter case of
tests/integration/test_gpu_step.py again on CUDA, graph replay bitwise the eager step, the bundled
model's fused step against its op-by-op step, the engine's greedy tokens through the graphs, and
the launches a replayed decode step costs the host; split sums reduced in the kernel against their
own launches, and programmatic dependent launch against none."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"),
]
pytest.importorskip("triton", reason="triton is not installed")

from bench.gpu import profile_steps  # noqa: E402
from shared.engine.engine import Engine, EngineConfig, run_to_completion  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from tests.integration import test_gpu_step as cases  # noqa: E402

PROMPTS = ["The quick brown fox", "In 1905, Albert Einstein published", "def fibonacci(n):",
           "The largest planet in the solar system is", "Write a haiku about the sea."]


@pytest.mark.parametrize("m", [1, 5, 17, 70])
@pytest.mark.parametrize("n,k", [(100, 96), (64, 512), (576, 576)])
def test_matmul(m, n, k):
    assert cases._matmul_case(m, n, k, False, False, False, "cuda") <= cases.REL


@pytest.mark.parametrize("m", [1, 17, 70])
@pytest.mark.parametrize("norm,silu,residual", [(True, False, False), (False, True, True)])
def test_matmul_in_3xtf32(m, norm, silu, residual):
    """TANDEM_GPU_PRECISION=tf32x3: every M on the tensor cores, three TF32 products a term —
    f32's accuracy (the same bound as the f32 "ieee" dots), not its bits."""
    assert cases._matmul_case(m, 576, 576 if not silu else 1536, norm, silu, residual, "cuda", None, False,
                              "tf32x3") <= cases.REL


@pytest.mark.parametrize("case", [c.values for c in cases.TUNED_TILES])
def test_matmul_with_a_tuned_tile(case):
    from kernels.gpu_tuning import Tile
    m, n, k, norm, silu, residual, tile = case
    assert cases._matmul_case(m, n, k, norm, silu, residual, "cuda", Tile(*tile)) <= cases.REL


def test_gemv_rows_are_the_same_in_any_batch_up_to_16():
    assert cases._gemv_rows_case("cuda") == [True, True]


def test_a_decode_tile_runs_batches_of_up_to_16_rows():
    got = cases._decode_tile_case("cuda")
    assert [same for same, _, _ in got] == [True] * 4
    assert max(err for *_, err in got) <= cases.REL


@pytest.mark.parametrize("norm,silu,residual", [(True, False, False), (False, True, True), (False, False, True)])
def test_matmul_prologues_and_epilogue(norm, silu, residual):
    assert cases._matmul_case(3, 64, 512, norm, silu, residual, "cuda") <= cases.REL


@pytest.mark.parametrize("norm,silu,residual", [(True, False, False), (False, True, True)])
@pytest.mark.parametrize("m", [130, 2048])
@pytest.mark.parametrize("precision", [None, "ieee"])      # (None: CUDA's default, tf32x3)
def test_prefill_matmul_through_cublas(norm, silu, residual, m, precision):
    assert cases._matmul_case(m, 576, 576, norm, silu, residual, "cuda", None, True, precision) <= cases.REL


def test_prefill_matmul_in_3xtf32_through_cublas():
    """The default precision's cuBLAS path: three TF32 products a chunk, against cuBLAS in f32."""
    split_ok, err, same_again, same_uncached, cached, uncached = cases._gemm_3xtf32_case("cuda")
    assert split_ok and err <= cases.REL, err
    assert same_again and same_uncached and cached == (1, 8 * 300 * 96) and uncached == 0


def test_prefill_weights_dequantized_in_one_launch():
    *same, chunked = cases._dequantized_case("cuda")
    assert same == [True, True] and chunked <= 1e-6     # (cuBLAS may sum a chunk's columns otherwise)


def test_whole_step_with_the_prefill_matmuls_through_cublas():
    err, dkv = cases._step_case({}, 280, "cuda", 32)
    assert err <= cases.REL_STEP and dkv <= 2e-3


@pytest.mark.parametrize("bias,qk_norm", [(False, False), (True, False), (False, True)])
def test_rope_and_kv_write(bias, qk_norm):
    dq, dkv = cases._rope_case(bias, qk_norm, "cuda")
    assert dq <= 1e-5 and dkv <= 2e-3


@pytest.mark.parametrize("arch,precision", [({}, None), ({"attn_bias": True}, None), ({"qk_norm": True}, None),
                                            ({}, "ieee")])
def test_decode_attention_rotates_and_writes_the_kv_itself(arch, precision):
    """Compiled, two kernels apart: the rotation's sums may round differently (qwen3's norm reduces
    in another layout), the attention within 1e-5, the KV within a float16 ulp of values ~4. The
    default precision: attn_decode's dot form; "ieee": its sum form."""
    _, d_out, d_kv = cases._attend_rope_case(arch, "cuda", precision)
    print(f"\n[attn_decode with rope vs rope_kv + attn_decode] {arch} {precision}: out {d_out:.1e}, kv {d_kv:.1e}")
    assert d_out <= 1e-5 and d_kv <= 2e-3


@pytest.mark.parametrize("max_context,precision", [(1024, None), (256, None), (1024, "ieee")])
def test_paged_attention(max_context, precision):
    """Against the f32 reference: the decodes' attention in its dot form (3xTF32, the default on
    CUDA) and its sum form (the matmuls in "ieee")."""
    lens = [1, 15, 16, 17, 100, 255, 256] + ([257, 600, 1024] if max_context > 256 else [])
    err, _, counters_zero, dot = cases._attention_case(max_context, lens, [(0, 20), (32, 17), (200, 40)], "cuda",
                                                       "ieee", None, precision)
    print(f"\n[paged attention] decode DOT={dot!r}: max |diff| {err:.1e}")
    assert dot == ("" if precision == "ieee" else "tf32x3")
    assert err <= 1e-5 and counters_zero


@pytest.mark.parametrize("precision,bound", [("ieee", 1e-5), ("tf32", 5e-3), ("fp16", 5e-3), ("tf32x3", 1e-5)])
@pytest.mark.parametrize("tile", [None, (16, 32, 4, 64), (32, 64, 8, 128)])
def test_prefill_attention_split_over_key_segments(precision, bound, tile):
    """Prefill tiles whose keys span several segments (the built-in tile's 256 keys: chunks up to
    1,000 keys), merged by the last segment to finish, against the f32 reference."""
    if tile and precision == "ieee":
        tile = (16, 16) + tile[2:]          # (f32 dots: 16 keys a step, more spill)
    pre = [(0, 300), (256, 256), (700, 300), (40, 217)]
    err, _, counters_zero, _ = cases._attention_case(1024, [17, 600], pre, "cuda", precision, tile)
    assert err <= bound and counters_zero


@pytest.mark.parametrize("arch,long", [({}, 280), ({"attn_bias": True}, 20), ({"qk_norm": True}, 20)])
def test_whole_step_matches_op_by_op(arch, long):
    err, dkv = cases._step_case(arch, long, "cuda")
    assert err <= cases.REL_STEP and dkv <= 2e-3


@pytest.mark.parametrize("gemv", [False, True])
def test_graph_replay_is_bitwise_the_eager_step(gemv):
    err, same_best, dkv_others, scratch_written, bitwise, _ = cases._graphs_case("cuda", gemv)
    assert err <= cases.REL_STEP and same_best and dkv_others <= 2e-3 and scratch_written
    assert bitwise


def test_split_sums_and_segments_reduced_in_kernel_match_their_own_launches():
    """On the GPU the programs of a split arrive in any order: 50 runs of each matmul bitwise the
    split_sum launch's sum, the counters back at zero; attention's merge in attn_decode against
    attn_merge (two kernels: their reductions may be laid out apart, a few ulps)."""
    matmuls, attention, counters_zero = cases._reduce_case("cuda", reps=50)
    print(f"\n[fused vs launched] matmuls bitwise: {matmuls}; attention max |Δ| {attention:.2e}")
    assert matmuls == [True] * 4 and counters_zero and attention <= 1e-6


@pytest.mark.parametrize("mode,gemv", [("1", False), ("1", True), ("exit", False)])   # (exit: no trigger, one case)
def test_programmatic_dependent_launch_changes_no_bit(mode, gemv, monkeypatch):
    """TANDEM_GPU_PDL=1 / exit (sm_90+): the decode step captured and replayed with programmatic
    dependent launch — the next kernel let launch right after each wait, or as each kernel's
    programs exit — gives bitwise the logits of the step without it."""
    from kernels import gpu_step
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    monkeypatch.delenv("TANDEM_GPU_PDL", raising=False)
    *_, plain = cases._graphs_case("cuda", gemv)
    monkeypatch.setenv("TANDEM_GPU_PDL", mode)
    assert gpu_step.pdl_mode(torch.device("cuda")) == gpu_step.PDL_MODES[mode]
    err, same_best, dkv_others, scratch_written, bitwise, pdl = cases._graphs_case("cuda", gemv)
    assert same_best and scratch_written and bitwise
    assert torch.equal(plain, pdl)


def test_weights_fetched_a_step_ahead_change_no_bit():
    """TANDEM_GPU_PREFETCH (each K step's Q4_0 bytes fetched during the step before) compiled
    for the card: qmatmul and qgemv with "1" and "auto" bitwise "0" (fetched at use)."""
    assert cases._prefetch_case("cuda") == [True] * 5


@pytest.fixture(scope="module")
def cuda_engines(bundled_model):
    return {mode: Engine(bundled_model, EngineConfig(device="cuda", gpu_step=mode, num_kv_blocks=512,
                                                     max_num_seqs=16))
            for mode in ("graphs", "fused", "ops")}


def test_engine_modes(cuda_engines):
    g, f, o = (cuda_engines[m] for m in ("graphs", "fused", "ops"))
    assert g.graphs is not None and g.model.gpu is not None
    g.warm_up()                                   # every bucket captured before a request
    assert sorted(g.graphs.graphs) == g.graphs.sizes == [1, 2, 4, 8, 16]
    assert f.graphs is None and f.model.gpu is not None
    assert o.graphs is None and o.model.gpu is None


def test_greedy_tokens_graphs_equal_fused_and_close_to_ops(cuda_engines):
    """Graphs and eager fused run the same kernels on the same rows: the same tokens. The op-by-op
    path sums in other orders: the same tokens up to the first near-tie."""
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    tok = cuda_engines["graphs"].tokenizer
    reqs = {f"p{i}": (tok.encode(p), greedy) for i, p in enumerate(PROMPTS)}
    got = {m: {r: o.token_ids for r, o in run_to_completion(e, reqs).items()} for m, e in cuda_engines.items()}
    assert cuda_engines["graphs"].graphs.replays > 0
    assert got["graphs"] == got["fused"]
    for r in reqs:
        a, b = got["graphs"][r], got["ops"][r]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"\n[graphs vs ops] {r}: same for {first} of {len(a)} tokens")
        assert first >= 16


def test_decode_steps_launched_ahead_give_the_graphs_outputs(cuda_engines, bundled_model, monkeypatch):
    """TANDEM_GPU_AHEAD=1 on CUDA: the next step launched before this one's tokens are read (ids
    fed on the device; the tokens through pinned buffers and events) gives each request the
    tokens, text and logprobs of the graphs stepped one after another — greedy, seeded device
    draws, and a logprobs row (the host's: its steps wait for the tokens)."""
    monkeypatch.setenv("TANDEM_GPU_AHEAD", "1")
    ahead = Engine(bundled_model, EngineConfig(device="cuda", num_kv_blocks=512, max_num_seqs=16))
    assert ahead.graphs.ahead
    tok = ahead.tokenizer
    reqs = {f"g{i}": (tok.encode(p), SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(PROMPTS)}
    reqs.update({f"s{i}": (tok.encode(p), SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=i,
                                                          ignore_eos=True)) for i, p in enumerate(PROMPTS[:3])})
    reqs["lp"] = (tok.encode(PROMPTS[0]), SamplingParams(max_tokens=12, temperature=0.0, logprobs=True,
                                                         top_logprobs=2, ignore_eos=True))
    fed = []
    feed = ahead._feed
    ahead._feed = lambda *a: (lambda out: (fed.append(out is not None), out)[1])(feed(*a))
    got = {m: {r: (o.token_ids, o.text, [lp.logprob for lp in o.logprobs]) for r, o in run_to_completion(e, reqs).items()}
           for m, e in (("graphs", cuda_engines["graphs"]), ("ahead", ahead))}
    assert got["ahead"] == got["graphs"]
    assert sum(fed) >= 20 and not all(fed), fed     # fed from the device, and waited while the logprobs row ran


def test_bundled_model_fused_step_matches_op_by_op(cuda_engines):
    """prompt_logits through the fused prefill path against the op-by-op path, on the real model."""
    f, o = cuda_engines["fused"], cuda_engines["ops"]
    ids = f.tokenizer.encode("The printing press changed how knowledge moved through Europe. " * 20)[:300]
    a, b = f.prompt_logits(ids), o.prompt_logits(ids)
    rel = float((a - b).abs().max() / b.abs().max())
    print(f"\n[fused vs ops, bundled model, 300 tokens] max |Δ| / max |logit| = {rel:.2e}")
    assert rel <= 1e-3


@pytest.mark.parametrize("seqs", [1, 16])
def test_a_replayed_decode_step_launches_at_most_200_kernels(cuda_engines, seqs):
    figures = profile_steps(cuda_engines["graphs"], seqs)
    print(f"\n[graphs, {seqs} seqs] {figures}")
    assert figures["launches"] <= 200


def test_a_prefill_is_profiled_by_kernel(cuda_engines):
    """`tandem bench gpu`'s prefill profile (what bounds the 2,048-token prefill target)."""
    from bench.gpu import profile_prefill
    figures = profile_prefill(cuda_engines["graphs"], 300)
    print(f"\n[graphs, prefill of 300 tokens] {figures}")
    assert figures["kernels"] > 0 and figures["gpu_busy_us"] > 0 and figures["by_kernel_us"]
    assert not cuda_engines["graphs"].has_work()


def test_device_sampler_on_cuda_against_the_host_sampler():
    """The graphs' sampler (kernels/gpu_sample.py) on CUDA: the Philox uniforms bit for bit the
    host's, and the tokens the host sampler draws from the same logits with them — all but a
    draw whose uniform falls within float rounding of a CDF boundary (none expected in 256)."""
    from kernels import gpu_sample
    from shared.engine import sampler
    from types import SimpleNamespace
    b, v = 256, 49152
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, v, generator=g) * 4
    rows = [(0.8, 0, 0.95, 0.0), (1.0, 40, 1.0, 0.0), (0.7, 0, 1.0, 0.05), (1.2, 100, 0.9, 0.0)] * (b // 4)
    seeds, idx = [2**63 + 17 * i for i in range(b)], [3 * i for i in range(b)]
    halves = [gpu_sample.seed_halves(s) for s in seeds]
    dev = lambda x, t: torch.tensor(x, dtype=t, device="cuda")  # noqa: E731
    u = gpu_sample.uniforms(dev([h[0] for h in halves], torch.int32), dev([h[1] for h in halves], torch.int32),
                            dev(idx, torch.int32), torch.empty(b, dtype=torch.float64, device="cuda"))
    assert u.cpu().tolist() == [sampler.uniform(s, i) for s, i in zip(seeds, idx)]
    t, k, p, m = (dev([r[j] for r in rows], ty) for j, ty in enumerate((torch.float32, torch.int32, torch.float32,
                                                                         torch.float32)))
    tok = gpu_sample.select(logits.cuda(), torch.zeros(b, dtype=torch.int64, device="cuda"),
                            torch.ones(b, dtype=torch.int32, device="cuda"), t, k, p, m, u, True).cpu().tolist()
    host = [sampler.draw(sampler._filter(logits[i].clone(), SimpleNamespace(params=SamplingParams(
        temperature=r[0], top_k=r[1], top_p=r[2], min_p=r[3]))).softmax(-1), seeds[i], idx[i])
        for i, r in enumerate(rows)]
    same = sum(a == h for a, h in zip(tok, host))
    print(f"\n[sampler] device draws equal to the host's: {same} of {b}")
    assert same >= b - 2


def test_sampled_tokens_graphs_equal_fused(cuda_engines):
    """Seeded sampled requests beside greedy ones: the graphs draw them on the device, the eager
    fused engine on the host, from the same logits and uniforms — the same tokens up to a draw
    within float rounding of a CDF boundary (then the streams part)."""
    tok = cuda_engines["graphs"].tokenizer
    reqs = {f"g{i}": (tok.encode(p), SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(PROMPTS[:2])}
    reqs |= {f"s{i}": (tok.encode(p), SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, top_k=50 * i,
                                                      seed=100 + i, ignore_eos=True))
             for i, p in enumerate(PROMPTS)}
    g = cuda_engines["graphs"]
    drawn = g.graphs.drawn
    got = {m: {r: o.token_ids for r, o in run_to_completion(cuda_engines[m], reqs).items()} for m in ("graphs", "fused")}
    assert g.graphs.drawn - drawn >= 5 * 30          # 47 decode tokens each, most in decode-only steps
    assert g.graphs.variants == {False: True, True: True} and g.graphs.samplers    # both captured
    for r in reqs:
        a, b = got["graphs"][r], got["fused"][r]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"\n[sampled graphs vs fused] {r}: same for {first} of {len(a)} tokens")
        assert first == len(a) if r.startswith("g") else first >= 24


def test_a_sampled_decode_step_is_one_replay(cuda_engines):
    from bench.gpu import SAMPLED
    figures = profile_steps(cuda_engines["graphs"], 16, sampled=SAMPLED)
    print(f"\n[graphs, 16 seqs, sampled {SAMPLED}] {figures}")
    assert figures["launches"] <= 200
