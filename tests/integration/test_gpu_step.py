"""The fused GPU step (kernels/gpu_step.py) in Triton's interpreter, against the op-by-op torch path.

Each kernel on its own (the Q4_0 matmul with its prologues, epilogues and split over K; rope with
the KV write; paged attention for decodes and prefill chunks), then the whole step of a tiny
random model (2 layers, GQA 6/2, head_dim 16), the decode graphs' static buffers with padding
rows, and an engine decoding through them. Triton reads TRITON_INTERPRET when a kernel is
defined, so everything runs in a worker process started with it (as test_kernels_gpu.py).

Tolerances: both sides accumulate in f32 from the same Q4_0 weights and float16 KV; only the
order of summation differs (split K, online softmax, the norm's sum of squares). Measured here:
matmul ≤ 5e-7 of the largest |output|, attention ≤ 1e-6 absolute. The whole step adds float16
rounding: a key or value whose f32 inputs differ in the last bits may round to the neighbouring
float16 (262 of the 92K values a 280-token prefill writes did, by one ulp, ~1e-3 relative), and
attention carries that on: logits ≤ 3e-5 of the largest |logit| measured (1e-6 without such
flips). Bounds: 1e-5 relative (matmul), 1e-5 absolute (attention on values of order 1), 1e-4
relative (the step) and one float16 ulp of the KV. Shifting the attention's block lookup by one slot, or the split's boundary
by one block, fails them by orders of magnitude.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from kernels import q4_0
from tests.triton_interp import speed_up_device_calls

triton = pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")


REL = 1e-5
REL_STEP = 1e-4


def tiny_config(**kw):
    from shared.engine.config import ModelConfig
    d = dict(arch="llama", name="tiny", vocab_size=256, hidden_size=64, n_layers=2, n_heads=6, n_kv_heads=2,
             head_dim=16, ffn_size=128, rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5, max_context=1024,
             tie_embeddings=True, qk_norm=False, attn_bias=False)
    d.update(kw)
    return ModelConfig(**d)


def tiny_weights(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the loader's names (Q4_0 matrices, f32 norms and biases)."""
    g = torch.Generator().manual_seed(seed)

    def mat(n, k, s=0.2):
        return q4_0.quantize(torch.randn(n, k, generator=g) * s)

    def vec(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)
    D, hd = cfg.hidden_size, cfg.head_dim
    w = {"token_embd": mat(cfg.vocab_size, D, 1.0), "output_norm": vec(D)}
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        w |= {p + "attn_norm": vec(D), p + "ffn_norm": vec(D),
              p + "attn_q": mat(cfg.n_heads * hd, D), p + "attn_k": mat(cfg.n_kv_heads * hd, D),
              p + "attn_v": mat(cfg.n_kv_heads * hd, D), p + "attn_output": mat(D, cfg.n_heads * hd),
              p + "ffn_gate": mat(cfg.ffn_size, D), p + "ffn_up": mat(cfg.ffn_size, D),
              p + "ffn_down": mat(D, cfg.ffn_size)}
        if cfg.attn_bias:
            w |= {p + "attn_q_bias": 0.1 * torch.randn(cfg.n_heads * hd, generator=g),
                  p + "attn_k_bias": 0.1 * torch.randn(cfg.n_kv_heads * hd, generator=g),
                  p + "attn_v_bias": 0.1 * torch.randn(cfg.n_kv_heads * hd, generator=g)}
        if cfg.qk_norm:
            w |= {p + "attn_q_norm": vec(hd), p + "attn_k_norm": vec(hd)}
    return w


def tiny_model(device: str = "cpu", **kw):
    from shared.engine.model import Transformer, runtime_weights
    cfg = tiny_config(**kw)
    m = Transformer(cfg, runtime_weights(cfg, tiny_weights(cfg)), torch.device(device), q4_0)
    m.fused = None
    return m


def rel(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max())


# ---- the cases: run in the interpreter's worker here, compiled on CUDA by tests/gpu -----------

def _matmul_case(m, n, k, norm, silu, residual, device="cpu", tile=None, gemm=False, precision=None):
    from kernels.gpu_step import GpuStep, Q4Weight
    from kernels.gpu_tuning import Tuning
    g = torch.Generator().manual_seed(m * 1000 + n)
    model = tiny_model(device)
    st = GpuStep(model, 1024, precision, tuning=Tuning({(n, k): tile}, "test") if tile else None)
    q = q4_0.quantize(torch.randn(n, k, generator=g) * 0.05).to(device)
    x = torch.randn(m, 2 * k if silu else k, generator=g).to(device)
    nw = (torch.rand(k, generator=g) + 0.5).to(device) if norm else None
    out = torch.randn(m, n, generator=g).to(device)
    a = torch.nn.functional.silu(x[:, :k]) * x[:, k:] if silu else x
    if norm:
        a = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + model.cfg.rms_eps) * nw
    want = q4_0.matmul(a, q) + (out if residual else 0)
    got = st.matmul(x, Q4Weight.of(q), out=out if residual else None, norm=nw, silu=silu, residual=residual,
                    gemm=gemm)
    assert not residual or got is out
    return rel(got, want)


def _rope_case(bias, qk_norm, device="cpu"):
    from kernels.gpu_step import GpuStep
    model = tiny_model(device, attn_bias=bias, qk_norm=qk_norm)
    cfg, st = model.cfg, GpuStep(model, 1024)
    g = torch.Generator().manual_seed(3)
    t, nh, nkv, hd = 9, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=g).to(device)
    pos = torch.randint(0, 1000, (t,), generator=g).to(device)
    kv = torch.zeros(12, cfg.n_layers, 2, 16, nkv, hd, dtype=torch.float16, device=device)
    slots = torch.randperm(12 * 16, generator=g)[:t].to(device)
    blk, off = slots // 16, slots % 16
    L = model.layers[1]
    got_q = st.rope_kv(qkv, L, pos, blk, off, kv[:, 1])
    # the reference: forward_ops' own lines
    ref = qkv + L["qkv_bias"] if bias else qkv
    q, k, v = ref.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q, k, v = q.reshape(t, nh, hd), k.reshape(t, nkv, hd), v.reshape(t, nkv, hd)
    if qk_norm:
        q, k = model._norm(q, L["q_norm"]), model._norm(k, L["k_norm"])
    cos, sin = model.cos[pos].unsqueeze(1), model.sin[pos].unsqueeze(1)
    q, k = model._rope(q, cos, sin), model._rope(k, cos, sin)
    want = torch.zeros_like(kv)
    want[blk, 1, 0, off] = k.half()
    want[blk, 1, 1, off] = v.half()
    return (float((got_q - q.reshape(t, -1)).abs().max()), float((kv.float() - want.float()).abs().max()))


def _rope_parts_case(device="cpu"):
    """rope_kv reading q|k|v as split partial sums (matmul_parts) against rope_kv of matmul's
    output (split_sum's sum of the same partials): bitwise the same q and KV."""
    from kernels.gpu_step import GpuStep
    from kernels.gpu_tuning import Tile, Tuning
    model = tiny_model(device, attn_bias=True)
    cfg = model.cfg
    nh, nkv, hd, t = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 5
    n = (nh + 2 * nkv) * hd
    st = GpuStep(model, 1024, tuning=Tuning({(n, cfg.hidden_size): Tile(16, 1, 4, 4)}, "test"))
    g = torch.Generator().manual_seed(4)
    L = st.layers[0]
    x = torch.randn(t, cfg.hidden_size, generator=g).to(device)
    parts = st.matmul_parts(x, L["qkv"], norm=L["attn_norm"])
    summed = st.matmul(x, L["qkv"], norm=L["attn_norm"])
    pos = torch.randint(0, 1000, (t,), generator=g).to(device)
    slots = torch.randperm(12 * 16, generator=g)[:t].to(device)
    blk, off = slots // 16, slots % 16
    kvs = [torch.zeros(12, cfg.n_layers, 2, 16, nkv, hd, dtype=torch.float16, device=device) for _ in range(2)]
    qa = st.rope_kv(parts, L, pos, blk, off, kvs[0][:, 0])
    qb = st.rope_kv(summed, L, pos, blk, off, kvs[1][:, 0])
    return parts.shape[0], bool(torch.equal(qa, qb)), bool(torch.equal(kvs[0], kvs[1]))


def _attend_rope_case(arch_kw, device="cpu", precision=None):
    """Decode entries through ``attend`` with ``rope`` (attn_decode rotating q and writing the
    token's KV from q|k|v's split partials) against ``rope_kv`` then ``attend``: the largest
    difference of the attention's output and of the KV cache. Contexts of one segment and of
    several (the token's KV written by the last segment's program), a block boundary.
    ``precision``: the step's (tf32x3: attn_decode's dot form)."""
    from kernels.gpu_step import GpuStep, PagedBatch
    from kernels.gpu_tuning import Tile, Tuning
    from shared.engine.model import AttnChunk
    model = tiny_model(device, max_context=1024, **arch_kw)
    cfg = model.cfg
    n = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    st = GpuStep(model, 1024, precision, tuning=Tuning({(n, cfg.hidden_size): Tile(16, 1, 4, 2)}, "test"))
    g = torch.Generator().manual_seed(6)
    lens = [5, 16, 17, 256, 600]
    x = torch.randn(len(lens), cfg.hidden_size, generator=g).to(device)
    L = st.layers[1]
    parts = st.matmul_parts(x, L["qkv"], norm=L["attn_norm"])
    kv = torch.randn(240, cfg.n_layers, 2, 16, cfg.n_kv_heads, cfg.head_dim, generator=g).half().to(device)
    chunks = [AttnChunk(m - 1, 1, i, None, list(range(i * 48, i * 48 + -(-m // 16)))) for i, m in enumerate(lens)]
    pb = PagedBatch.of(chunks, model.device)
    pos = torch.tensor([m - 1 for m in lens], device=device)
    blk = torch.tensor([c.block_ids[(m - 1) // 16] for c, m in zip(chunks, lens)], device=device)
    fused_kv = kv.clone()
    want = st.attend(st.rope_kv(parts, L, pos, blk, pos % 16, kv[:, 1]), kv[:, 1], pb)
    got = st.attend(parts, fused_kv[:, 1], pb, (L, pos, blk, pos % 16))
    return parts.shape[0], float((got - want).abs().max()), float((fused_kv.float() - kv.float()).abs().max())


def _attention_case(max_context, lens_dec, chunks_pre, device="cpu", prefill_attn="ieee", tile=None,
                    precision=None):
    """``prefill_attn``: TANDEM_GPU_PREFILL_ATTN's setting; ``tile``: attn_prefill's
    (block_q, block_k, warps, seg), else the built-in one; ``precision``: the step's (tf32x3:
    attn_decode's dot form). (largest |diff|, decode segments, the arrival counters left at zero,
    attn_decode's DOT)."""
    from kernels.gpu_step import GpuStep, PagedBatch
    from kernels.gpu_tuning import PrefillTile
    from shared.engine.model import AttnChunk, StepContext
    model = tiny_model(device, max_context=max_context)
    cfg, st = model.cfg, GpuStep(model, max_context, precision)
    st.prefill_attn = prefill_attn
    if tile:
        st.tuning.prefill[prefill_attn] = PrefillTile(*tile)
    g = torch.Generator().manual_seed(len(lens_dec) * 7 + max_context)
    nblocks = 200
    kv = (torch.randn(nblocks, cfg.n_layers, 2, 16, cfg.n_kv_heads, cfg.head_dim, generator=g)).half().to(device)
    free = torch.randperm(nblocks, generator=g).tolist()
    chunks, off = [], 0
    for start, n in [(L - 1, 1) for L in lens_dec] + chunks_pre:
        nb = -(-(start + n) // 16)
        ids, free = free[:nb], free[nb:]
        chunks.append(AttnChunk(start, n, off, torch.tensor(ids, device=device), ids))
        off += n
    q = torch.randn(off, cfg.n_heads * cfg.head_dim, generator=g).to(device)
    layer_kv = kv[:, 1]                   # not contiguous
    got = st.attend(q, layer_kv, PagedBatch.of(chunks, model.device))
    z = torch.zeros(off, device=device)
    ctx = StepContext(z, z, z, chunks, z[:0])
    want = model._attention(q.view(off, cfg.n_heads, cfg.head_dim), layer_kv, ctx)
    return float((got - want).abs().max()), st.nseg, not st.counters.any(), st.decode_dot


def _reduce_case(device="cpu", reps=1):
    """The split-K sums and attention's segments added by each launch's last program ("fused")
    against their launches of their own (``split_sum``, ``attn_merge``): bitwise equal, for
    ``qmatmul`` and ``qgemv`` tiles with the residual, SiLU and norm (the last also ``reps`` times
    over: whichever split arrives last, the same bits); attention's largest difference; the
    counters left at zero."""
    from kernels.gpu_step import GpuStep, PagedBatch, Q4Weight
    from kernels.gpu_tuning import Tile, Tuning
    from shared.engine.model import AttnChunk
    g = torch.Generator().manual_seed(8)
    model = tiny_model(device, max_context=1024)
    cases = [(5, 100, 192, Tile(16, 1, 4, 6), True, False), (17, 64, 512, Tile(32, 1, 8, 8), False, True),
             (3, 100, 96, Tile(32, 1, 4, 3, 0, 4), True, False), (1, 64, 512, Tile(32, 2, 4, 5, 0, 16), False, True)]
    same = []
    for m, n, k, tile, norm, silu in cases:
        st = GpuStep(model, 1024, tuning=Tuning({(n, k): tile}, "test"))
        q = Q4Weight.of(q4_0.quantize(torch.randn(n, k, generator=g) * 0.05).to(device))
        x = torch.randn(m, 2 * k if silu else k, generator=g).to(device)
        nw = (torch.rand(k, generator=g) + 0.5).to(device) if norm else None
        res = torch.randn(m, n, generator=g).to(device)
        fused = [st.matmul(x, q, out=res.clone(), norm=nw, silu=silu, residual=True) for _ in range(reps)]
        counters, st.counters = st.counters, None
        launched = st.matmul(x, q, out=res.clone(), norm=nw, silu=silu, residual=True)
        same.append(all(torch.equal(f, launched) for f in fused) and not counters.any())
    st = GpuStep(model, 1024)
    kv = torch.randn(320, 2, 2, 16, model.cfg.n_kv_heads, model.cfg.head_dim, generator=g).half().to(device)
    chunks = [AttnChunk(L - 1, 1, i, None, list(range(i * 64, i * 64 + -(-L // 16))))
              for i, L in enumerate([5, 256, 257, 700, 1024])]
    qa = torch.randn(5, model.cfg.n_heads * model.cfg.head_dim, generator=g).to(device)
    pb = PagedBatch.of(chunks, model.device)
    fused = st.attend(qa, kv[:, 1], pb)
    counters, st.counters = st.counters, None
    launched = st.attend(qa, kv[:, 1], pb)
    return same, float((fused - launched).abs().max()), not counters.any()


def _step_context(model, plan, device="cpu"):
    """(ids, StepContext) of a flat batch: ``plan`` = [(token ids of the sequence, start, n, its
    block table)]."""
    from shared.engine.model import AttnChunk, StepContext
    ids, pos, sblk, chunks, rows = [], [], [], [], []
    for toks, start, n, table in plan:
        table = table[:-(-(start + n) // 16)]
        chunks.append(AttnChunk(start, n, len(ids), torch.tensor(table, device=device), table))
        for p in range(start, start + n):
            ids.append(toks[p])
            pos.append(p)
            sblk.append(table[p // 16])
        rows.append(len(ids) - 1)
    p = torch.tensor(pos, device=device)
    return (torch.tensor(ids, device=device),
            StepContext(p, torch.tensor(sblk, device=device), p % 16, chunks, torch.tensor(rows, device=device)))


def _tables(n: int, per: int = 20) -> list[list[int]]:
    """Block tables of ``n`` sequences, ``per`` blocks each, interleaved (not in order)."""
    return [list(range(i, n * per, n)) for i in range(n)]


def _step_case(arch_kw, long: int, device="cpu", gemm_rows=None):
    """``gemm_rows``: the step's setting (None: the default, which no step here reaches)."""
    from kernels.gpu_step import GpuStep
    model = tiny_model(device, **arch_kw)
    cfg = model.cfg
    st = GpuStep(model, cfg.max_context)
    if gemm_rows is not None:
        st.gemm_rows = gemm_rows
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, cfg.vocab_size, (300,), generator=g).tolist() for _ in range(4)]
    kv0 = torch.zeros(120, cfg.n_layers, 2, 16, cfg.n_kv_heads, cfg.head_dim, dtype=torch.float16, device=device)
    t = _tables(4)
    errs = []
    # the long sequence's prompt through the reference only (the interpreter is slow): its decode
    # in step 1 reads past one key segment when ``long`` > 256
    ids, ctx = _step_context(model, [(seqs[1], 0, long, t[1])], device)
    model.forward_ops(ids, ctx, kv0)
    # step 0: prefill chunks and a decode; step 1: a chunk after step 0's prefix, decodes
    plan0 = [(seqs[0], 0, 40, t[0]), (seqs[2], 0, 17, t[2]), (seqs[3], 0, 1, t[3])]
    plan1 = [(seqs[0], 40, 30, t[0]), (seqs[1], long, 1, t[1]), (seqs[2], 17, 1, t[2]), (seqs[3], 1, 1, t[3])]
    kv_ref, kv_got = kv0.clone(), kv0.clone()
    for plan in (plan0, plan1):
        ids, ctx = _step_context(model, plan, device)
        want = model.forward_ops(ids, ctx, kv_ref)
        got = st.forward(ids, ctx, kv_got)
        errs.append(rel(got, want))
    return max(errs), float((kv_got.float() - kv_ref.float()).abs().max())


class GemvEverywhere:
    """A tuning whose every tile sends decode batches of up to 16 rows through ``qgemv``."""
    source = "test: qgemv everywhere"

    def tile(self, n, k, m):
        import dataclasses
        from kernels.gpu_tuning import rule
        return dataclasses.replace(rule(n, k), gemv=16, norm_w=64)


def _graphs_case(device="cpu", gemv=False, arch_kw=None, precision=None):
    """Logits error vs the op-by-op path, greedy tokens equal, other KV untouched, the scratch block
    written; (on CUDA) whether a graph replay gives bitwise the eager step's logits; the last
    logits. ``arch_kw``: the tiny model's variant (bias, qk norm). ``gemv``:
    every matmul of the decode step through ``qgemv``. ``precision``: the step's."""
    from kernels.gpu_step import DecodeGraphs, GpuStep
    model = tiny_model(device, **(arch_kw or {}))
    cfg = model.cfg
    st = GpuStep(model, cfg.max_context, precision, tuning=GemvEverywhere() if gemv else None)
    g = torch.Generator().manual_seed(9)
    seqs = [torch.randint(0, cfg.vocab_size, (300,), generator=g).tolist() for _ in range(3)]
    kv = torch.zeros(80, cfg.n_layers, 2, 16, cfg.n_kv_heads, cfg.head_dim, dtype=torch.float16, device=device)
    t = _tables(3, 26)                                               # blocks 0..77; 79: scratch
    plan0 = [(seqs[0], 0, 20, t[0]), (seqs[1], 0, 270, t[1]), (seqs[2], 0, 33, t[2])]
    ids, ctx = _step_context(model, plan0, device)
    model.forward_ops(ids, ctx, kv)                                  # the prompts' KV
    plan1 = [(seqs[0], 20, 1, t[0]), (seqs[1], 270, 1, t[1]), (seqs[2], 33, 1, t[2])]
    ids, ctx = _step_context(model, plan1, device)
    kv_before, kv_ref = kv.clone(), kv.clone()
    want = model.forward_ops(ids, ctx, kv_ref)
    tables = [c.block_ids for c in ctx.chunks]
    out = []
    for capture in ([False, True] if device != "cpu" else [False]):
        kv.copy_(kv_before)
        graphs = DecodeGraphs(st, kv, max_seqs=6, width=64, block_size=16, scratch_block=79, capture=capture)
        for _ in range(1 + capture):        # a graph: captured by the first run, replayed by the second
            kv.copy_(kv_before)
            logits, best = graphs.run(ids.tolist(), [c.start for c in ctx.chunks], tables)   # bucket 4: one padding row
        assert graphs.sizes == [1, 2, 4, 6] and logits.shape == want.shape
        assert graphs.replays == 2 * capture
        out.append(logits.clone())
    others = torch.ones(80, dtype=torch.bool)
    others[79] = False
    return (rel(out[0], want), best == torch.argmax(want, -1).tolist(),
            float((kv[others].float() - kv_ref[others].float()).abs().max()), bool(kv[79].abs().sum() > 0),
            torch.equal(out[0], out[-1]), out[-1].cpu())


# every off-by-default decode setting at once (`tandem bench gpu --modes graphs-all`; PDL is CUDA's only)
ALL_SETTINGS = {"TANDEM_GPU_AHEAD": "1", "TANDEM_GPU_PDL": "1", "TANDEM_GPU_PRECISION": "tf32x3",
                "TANDEM_GPU_PREFETCH": "1"}


def _engine_case(settings=None):
    """Greedy and seeded sampled requests through the decode graphs (with ``settings`` in the
    environment while the engine is built) and op by op: each one's tokens."""
    from shared.engine.engine import Engine, EngineConfig, run_to_completion
    from shared.engine.loader import LoadedModel
    from shared.engine.model_files import load_tokenizer
    from shared.engine.sampling import SamplingParams
    tok, _ = load_tokenizer()
    cfg = tiny_config(max_context=512, n_layers=1)   # the interpreter's time is per launch: one layer
    out, graphs = {}, None
    prompts = {f"p{i}": ([1 + 37 * i + j for j in range(5 + 13 * i)],
                         SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for i in range(2)}
    # rows drawn in the graphs' sampler (kernels/gpu_sample.py), beside the greedy ones; the ops
    # engine draws them on the host with the same seeded uniforms
    prompts["s0"] = ([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=6, temperature=0.8, top_k=20, top_p=0.9,
                                                                seed=7, ignore_eos=True))
    prompts["s1"] = ([2, 7, 1, 8, 2, 8], SamplingParams(max_tokens=6, temperature=1.3, min_p=0.02, seed=11,
                                                         ignore_eos=True))
    for mode in ("graphs", "ops"):
        saved = dict(os.environ)
        os.environ.update((settings or {}) if mode == "graphs" else {})
        try:
            e = Engine(LoadedModel(cfg, tiny_weights(cfg), tok, "tiny", "tiny"),
                       EngineConfig(num_kv_blocks=64, max_num_seqs=4, step_tokens=64, gpu_step=mode))
        finally:
            os.environ.clear()
            os.environ.update(saved)
        res = run_to_completion(e, prompts)
        out[mode] = {r: res[r].token_ids for r in prompts}
        if mode == "graphs":
            g, st = e.graphs, e.model.gpu
            graphs = (g is not None, g.steps if g else 0, g.drawn if g else 0,
                      (g.ahead, st.precision, st.prefetch) if g else None)
    return out, graphs


def _ahead_case():
    """The same requests through the decode graphs stepped one after another and launched ahead
    (TANDEM_GPU_AHEAD=1): each request's (tokens, text, finish reason), with an abort while a step
    is in flight and an arrival mid-run; and, per mode, the steps collected ahead and the rows
    whose text waited for the next launch."""
    from shared.engine.engine import Completion, Engine, EngineConfig, run_to_completion
    from shared.engine.loader import LoadedModel
    from shared.engine.model_files import load_tokenizer
    from shared.engine.sampling import SamplingParams as SP
    tok, _ = load_tokenizer()
    cfg = tiny_config(max_context=512, n_layers=1)
    weights = tiny_weights(cfg)

    def engine(ahead: bool) -> Engine:
        os.environ["TANDEM_GPU_AHEAD"] = "1" if ahead else "0"
        try:
            return Engine(LoadedModel(cfg, weights, tok, "tiny", "tiny"),
                          EngineConfig(num_kv_blocks=64, max_num_seqs=10, step_tokens=64, gpu_step="graphs"))
        finally:
            del os.environ["TANDEM_GPU_AHEAD"]

    prompt = [5, 17, 29, 41, 53, 65, 77]
    probe = run_to_completion(engine(False), {"p": (prompt, SP(max_tokens=8, temperature=0.0, ignore_eos=True))})["p"]
    stop_str = probe.text[len(probe.text) // 2:][:2]         # met mid-run: a stop string ends it there
    requests = {
        "greedy": (prompt, SP(max_tokens=8, temperature=0.0, ignore_eos=True)),
        "stop-token": (prompt, SP(max_tokens=8, temperature=0.0, stop_token_ids=[probe.token_ids[3]])),
        "stop-string": (prompt, SP(max_tokens=8, temperature=0.0, stop=[stop_str], ignore_eos=True)),
        "sampled": ([3, 1, 4, 1, 5, 9, 2, 6], SP(max_tokens=8, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)),
        "short": ([2, 7, 1, 8], SP(max_tokens=2, temperature=0.0, ignore_eos=True)),
        "aborted": ([9, 9, 8, 2, 4], SP(max_tokens=8, temperature=0.0, ignore_eos=True)),
        # the host reads these rows (logprobs, a penalty): while they run, the next step waits
        # for the tokens (``_collect``); after, it goes out before them (``_feed``)
        "logprobs": ([6, 5, 4], SP(max_tokens=3, temperature=0.0, logprobs=True, top_logprobs=2, ignore_eos=True)),
        "penalty": ([7, 7, 7, 1], SP(max_tokens=4, temperature=0.0, repetition_penalty=1.3, ignore_eos=True))}
    out, counts = {}, {}
    for ahead in (False, True):
        e = engine(ahead)
        n = {"fed": 0, "collected": 0}
        collect, feed = e._collect, e._feed

        def counted(*a, collect=collect, n=n):
            n["collected"] += 1
            return collect(*a)

        def fed(*a, feed=feed, n=n):
            outs = feed(*a)
            n["fed"] += outs is not None
            return outs
        e._collect, e._feed = counted, fed
        for rid, (ids, p) in requests.items():
            e.add(rid, ids, p)
        done, calls = {}, 0
        while e.has_work():
            for o in e.step():
                done.setdefault(o.request_id, Completion(o.request_id)).add(o)
            calls += 1
            if calls == 5:      # (the host's rows are done) launched ahead: a step is in flight, with this row
                assert (e._ahead is not None) == ahead
                assert e.abort("aborted")
            if calls == 6:      # the next step is out already: it joins the one after
                assert (e._ahead is not None) == ahead
                e.add("late", [4, 4, 4, 11, 12, 13], SP(max_tokens=5, temperature=0.0, ignore_eos=True))
        out[ahead] = {r: (c.token_ids, c.text, c.finish_reason, [lp.logprob for lp in c.logprobs])
                      for r, c in done.items()}
        counts[ahead] = n
    return out, counts


def _ahead_pressure_case(swap_bytes: int):
    """Greedy sequences that outgrow a small KV cache, stepped and launched ahead: each request's
    tokens, the preemptions, and (ahead) those made while a step was in flight — by the schedule of
    the step launched ahead, its victims' last token still a placeholder."""
    from shared.engine.engine import PLACEHOLDER, Completion, Engine, EngineConfig
    from shared.engine.loader import LoadedModel
    from shared.engine.model_files import load_tokenizer
    from shared.engine.sampling import SamplingParams as SP
    tok, _ = load_tokenizer()
    cfg = tiny_config(max_context=512, n_layers=1)
    weights = tiny_weights(cfg)
    out = {}
    for ahead in (False, True):
        os.environ["TANDEM_GPU_AHEAD"] = "1" if ahead else "0"
        try:      # 5 sequences of 6 + 10 tokens need 4 blocks of 4 each, 20 in all: 11 are free (one is scratch)
            e = Engine(LoadedModel(cfg, weights, tok, "tiny", "tiny"),
                       EngineConfig(num_kv_blocks=12, block_size=4, max_num_seqs=8, step_tokens=128,
                                    gpu_step="graphs", swap_bytes=swap_bytes, enable_prefix_caching=False))
        finally:
            del os.environ["TANDEM_GPU_AHEAD"]
        n = {"preempted": 0, "in_flight": 0, "fed": 0}
        preempt, feed = e.scheduler._preempt, e._feed

        def counted(seq, preempt=preempt, n=n, e=e):
            n["preempted"] += 1
            n["in_flight"] += e.graphs.ahead and PLACEHOLDER in seq.token_ids
            return preempt(seq)

        def fed(*a, feed=feed, n=n, e=e):
            outs = feed(*a)
            n["fed"] += e._ahead is not None
            return outs
        e.scheduler._preempt, e._feed = counted, fed
        for i in range(5):
            e.add(f"r{i}", [(7 * i + j) % 50 + 3 for j in range(6)], SP(max_tokens=10, temperature=0.0, ignore_eos=True))
        done = {}
        while e.has_work():
            for o in e.step():
                done.setdefault(o.request_id, Completion(o.request_id)).add(o)
            assert not any(PLACEHOLDER in s.token_ids for s in e.seqs.values())
        out[ahead] = ({r: (c.token_ids, c.text, c.finish_reason) for r, c in done.items()}, n)
    return out


def _philox_case(pairs):
    """The device's uniform of each (seed, index) (kernels/gpu_sample.uniforms)."""
    from kernels.gpu_sample import seed_halves, uniforms
    halves = [seed_halves(s) for s, _ in pairs]
    out = torch.empty(len(pairs), dtype=torch.float64)
    uniforms(torch.tensor([h[0] for h in halves], dtype=torch.int32), torch.tensor([h[1] for h in halves], dtype=torch.int32),
             torch.tensor([c for _, c in pairs], dtype=torch.int32), out)
    return out.tolist()


def _call(fn, *args):
    assert os.environ["TRITON_INTERPRET"] == "1"
    return fn(*args)


@pytest.fixture(scope="module")
def interp():
    """fn(*args) run in a worker process started with TRITON_INTERPRET=1 (and the engine's GPU
    step allowed on the CPU, TANDEM_GPU_STEP_INTERPRET=1; the reference Q4_0 kernels)."""
    env = {"TRITON_INTERPRET": "1", "TANDEM_GPU_STEP_INTERPRET": "1", "TANDEM_KERNELS": "reference"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=speed_up_device_calls)
        pool.submit(os.getpid).result()          # started now, with the settings
    finally:
        for k, v in old.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    with pool:
        yield lambda fn, *args: pool.submit(_call, fn, *args).result()


# The default lane keeps what an H200 runs with no setting changed (and each kernel once); the
# variants off by default or measured slower there go to the slow lane (`-m slow`): on a 2-vCPU
# AVX2 Xeon this module took 433 s of a 25-minute default run (2026-11-30).
SLOW = pytest.mark.slow


# M: one tile, two M tiles, past 64 rows (tf32 would apply there if chosen; ieee here);
# N x K: a split over K of 3 one-block steps (N: 7 tiles), of 16 (4 tiles), of 4 splits of 5 blocks
# (36 tiles; its M tiles are the other shapes': one and two rows of it, the interpreter is slow)
@pytest.mark.parametrize("m,n,k", [(m, n, k) for n, k in [(100, 96), (64, 512)] for m in (1, 5, 17, 70)]
                         + [(1, 576, 576), pytest.param(5, 576, 576, marks=SLOW)])
def test_matmul(interp, m, n, k):
    assert interp(_matmul_case, m, n, k, False, False, False) <= REL


@pytest.mark.parametrize("norm,silu,residual", [(True, False, False), (False, True, True), (False, False, True)])
@pytest.mark.parametrize("n,k", [(100, 96), (64, 512)])
def test_matmul_prologues_and_epilogue(interp, norm, silu, residual, n, k):
    assert interp(_matmul_case, 3, n, k, norm, silu, residual) <= REL


@pytest.mark.parametrize("m", [1, 17, 70])
def test_matmul_in_3xtf32(interp, m):
    """TANDEM_GPU_PRECISION=tf32x3 at every M (the interpreter computes the three TF32 products
    in f32: the code path here, the accuracy on CUDA in tests/gpu)."""
    assert interp(_matmul_case, m, 100, 96, True, False, True, "cpu", None, False, "tf32x3") <= REL


@pytest.mark.parametrize("norm,silu,residual", [(True, False, False), (False, True, True)])
def test_prefill_matmul_through_torch(interp, norm, silu, residual):
    """A prefill step's matmuls as dequantized weights through torch.matmul (``GpuStep.gemm``)."""
    assert interp(_matmul_case, 130, 100, 192, norm, silu, residual, "cpu", None, True) <= REL


def _gemm_3xtf32_case(device="cpu"):
    """``GpuStep.gemm`` in tf32x3 (three products a chunk of split operands) against the f32 path
    ("ieee"), over chunks of 64 rows; ``split_tf32``'s parts; the weights' split cached within
    TANDEM_GPU_GEMM_CACHE_MB, made again past it."""
    from kernels import gpu_step
    from kernels.gpu_step import GpuStep, Q4Weight, split_tf32
    g = torch.Generator().manual_seed(5)
    w = Q4Weight.of(q4_0.quantize(torch.randn(300, 96, generator=g) * 0.05).to(device))
    x = torch.randn(130, 96, generator=g).to(device)
    hi, lo = split_tf32(x)
    split_ok = bool((hi.view(torch.int32) & 0x1FFF).eq(0).all()) and torch.equal(hi + lo, x) \
        and float((lo.abs() / x.abs().clamp_min(1e-30)).max()) < 2.0 ** -10
    old = gpu_step.GEMM_CHUNK
    gpu_step.GEMM_CHUNK = 64
    try:
        ieee = GpuStep(tiny_model(device), 1024, "ieee").gemm(x, w)
        st = GpuStep(tiny_model(device), 1024, "tf32x3")
        first, again = st.gemm(x, w), st.gemm(x, w)
        cached = (len(st._split), st._split_bytes)
        os.environ["TANDEM_GPU_GEMM_CACHE_MB"] = "0"
        try:
            uncached = GpuStep(tiny_model(device), 1024, "tf32x3")
        finally:
            del os.environ["TANDEM_GPU_GEMM_CACHE_MB"]
        none = uncached.gemm(x, w)
    finally:
        gpu_step.GEMM_CHUNK = old
    return split_ok, rel(first, ieee), torch.equal(first, again), torch.equal(first, none), cached, len(uncached._split)


def test_prefill_matmul_in_3xtf32_through_torch(interp):
    """The prefill's cuBLAS path at the decode kernels' precision: on CUDA three TF32 products
    (f32's accuracy at the tensor cores' rate; tests/gpu measures it against f64); here, where
    torch computes them in f32, within f32's rounding of the one-product path."""
    split_ok, err, same_again, same_uncached, cached, uncached = interp(_gemm_3xtf32_case)
    assert split_ok
    assert err <= 1e-6, err
    assert same_again and same_uncached
    assert cached == (1, 8 * 300 * 96) and uncached == 0


def _dequantized_case(device="cpu"):
    """``GpuStep.dequantized`` (the ``embed`` kernel over a weight's rows) against
    ``q4_0.dequantize``: whole, a slice of rows, and ``gemm`` over chunks of 64 rows against one."""
    from kernels import gpu_step
    from kernels.gpu_step import GpuStep, Q4Weight
    g = torch.Generator().manual_seed(3)
    st = GpuStep(tiny_model(device), 1024)
    w = Q4Weight.of(q4_0.quantize(torch.randn(300, 96, generator=g)).to(device))
    ref = q4_0.dequantize(w.q)
    same = [torch.equal(st.dequantized(w, 0, 300), ref), torch.equal(st.dequantized(w, 100, 250), ref[100:250])]
    x = torch.randn(130, 96, generator=g).to(device)
    whole = st.gemm(x, w)
    gpu_step.GEMM_CHUNK = 64
    try:
        chunked = st.gemm(x, w)
    finally:
        gpu_step.GEMM_CHUNK = 4096
    return same + [float((chunked - whole).abs().max() / whole.abs().max())]


def test_prefill_weights_dequantized_in_one_launch_are_the_reference_s(interp):
    *same, chunked = interp(_dequantized_case)
    assert same == [True, True] and chunked == 0.0


# tuned tiles (kernels/gpu_tuning.py): the H200 table's kinds (64 rows a program, 4 warps, K split
# into one-block steps; 32 rows, 8 splits), two blocks a K step with a ragged last split, and the
# RMSNorm prologue 256 values a step (past K: masked) or 64 (three steps)
TUNED_TILES = [pytest.param(*c, id=f"m{c[0]}-{c[1]}x{c[2]}-{'-'.join(map(str, c[6]))}") for c in [
    (1, 100, 96, True, False, False, (64, 1, 4, 18)),
    (17, 64, 512, False, True, True, (32, 1, 8, 8)),
    (3, 100, 96 * 2, True, False, True, (16, 2, 4, 2)),
    (5, 100, 96, True, False, False, (64, 1, 4, 3, 256)),
    (2, 64, 192, True, False, True, (32, 1, 8, 6, 64)),
    # qgemv (no tl.dot) for decode rows: one row, a ragged 3 of 4, 16 with SiLU and the residual,
    # the norm over 256 values a step, a split over K with two blocks a step
    (1, 100, 96, True, False, False, (64, 2, 4, 1, 256, 16)),
    (3, 100, 192, True, False, True, (32, 2, 4, 2, 0, 4)),
    (16, 64, 512, False, True, True, (32, 4, 4, 3, 0, 16)),
    (5, 576, 96, False, False, False, (128, 1, 4, 1, 0, 8))]]


@pytest.mark.parametrize("m,n,k,norm,silu,residual,tile", TUNED_TILES)
def test_matmul_with_a_tuned_tile(interp, m, n, k, norm, silu, residual, tile):
    from kernels.gpu_tuning import Tile
    assert interp(_matmul_case, m, n, k, norm, silu, residual, "cpu", Tile(*tile)) <= REL


def _gemv_rows_case(device="cpu"):
    """qgemv's rows in a batch of 1, 3 and 16 (BLOCK_M 1, 4, 16) against the same rows alone."""
    from kernels.gpu_step import GpuStep, Q4Weight
    from kernels.gpu_tuning import Tile, Tuning
    g = torch.Generator().manual_seed(5)
    model = tiny_model(device)
    n, k = 100, 192
    st = GpuStep(model, 1024, tuning=Tuning({(n, k): Tile(32, 2, 4, 2, 0, 16)}, "test"))
    q = Q4Weight.of(q4_0.quantize(torch.randn(n, k, generator=g) * 0.05).to(device))
    x = torch.randn(16, k, generator=g).to(device)
    nw = (torch.rand(k, generator=g) + 0.5).to(device)
    full = st.matmul(x, q, norm=nw)
    return [bool(torch.equal(st.matmul(x[:m], q, norm=nw), full[:m])) for m in (1, 3)]


def test_gemv_rows_are_the_same_in_any_batch_up_to_16(interp):
    assert interp(_gemv_rows_case) == [True, True]


def _decode_tile_case(device="cpu"):
    """A shape with a ``decode`` tile (qgemv) beside its main tile (qmatmul, K split otherwise):
    batches of 1, 3 and 16 rows are the decode tile's bits, 17 rows the main tile's, both within
    the reference's bound."""
    from kernels.gpu_step import GpuStep, Q4Weight
    from kernels.gpu_tuning import Tile, Tuning
    g = torch.Generator().manual_seed(6)
    model = tiny_model(device)
    n, k = 100, 192
    main, dec = Tile(16, 1, 4, 3), Tile(32, 2, 4, 2, 0, 16)
    both = GpuStep(model, 1024, tuning=Tuning({(n, k): main}, "test", {(n, k): dec}))
    only_main = GpuStep(model, 1024, tuning=Tuning({(n, k): main}, "test"))
    only_dec = GpuStep(model, 1024, tuning=Tuning({(n, k): dec}, "test"))
    w = q4_0.quantize(torch.randn(n, k, generator=g) * 0.05).to(device)
    q = Q4Weight.of(w)
    x = torch.randn(17, k, generator=g).to(device)
    nw = (torch.rand(k, generator=g) + 0.5).to(device)
    ref = q4_0.matmul(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.cfg.rms_eps) * nw, w)
    out = []
    for m in (1, 3, 16, 17):
        got = both.matmul(x[:m], q, norm=nw)
        want = (only_dec if m <= 16 else only_main).matmul(x[:m], q, norm=nw)
        other = (only_main if m <= 16 else only_dec).matmul(x[:m], q, norm=nw)
        err = rel(got, ref[:m])
        out.append((bool(torch.equal(got, want)), bool(torch.equal(got, other)), err))
    return out


def test_a_decode_tile_runs_batches_of_up_to_16_rows(interp):
    got = interp(_decode_tile_case)
    assert [same for same, _, _ in got] == [True] * 4
    assert not any(other for _, other, _ in got)     # (the two tiles' bits differ: the test can tell them apart)
    assert max(err for *_, err in got) <= REL


def _prefetch_case(device="cpu"):
    """The matmuls with each K step's weight bytes fetched during the step before (``PREFETCH``:
    TANDEM_GPU_PREFETCH "1", and "auto") against fetched at use ("0"): qmatmul at 16 and 32 rows
    (64: never prefetched), split and not, qgemv; several K steps a program. Bitwise, or not."""
    from kernels.gpu_step import GpuStep, Q4Weight
    from kernels.gpu_tuning import Tile, Tuning
    g = torch.Generator().manual_seed(11)
    model = tiny_model(device)
    n, k = 100, 192
    out = []
    for m, tile, norm, silu in [(1, Tile(16, 1, 4, 1), True, False), (17, Tile(32, 1, 4, 2), True, False),
                                (5, Tile(16, 2, 4, 1), False, True), (3, Tile(32, 1, 4, 2, 0, 4), True, False),
                                (40, Tile(16, 1, 4, 1), True, False)]:
        st = GpuStep(model, 1024, tuning=Tuning({(n, k): tile}, "test"))
        q = Q4Weight.of(q4_0.quantize(torch.randn(n, k, generator=g) * 0.05).to(device))
        x = torch.randn(m, 2 * k if silu else k, generator=g).to(device)
        nw = (torch.rand(k, generator=g) + 0.5).to(device) if norm else None
        got = {}
        for mode in ("0", "1", "auto"):
            st.prefetch = mode
            got[mode] = st.matmul(x, q, norm=nw, silu=silu)
        out.append(bool(torch.equal(got["0"], got["1"]) and torch.equal(got["0"], got["auto"])))
    return out


def test_weights_fetched_a_step_ahead_give_the_same_bits(interp):
    assert interp(_prefetch_case) == [True] * 5


@pytest.mark.parametrize("bias,qk_norm", [(False, False), (True, False), (False, True)])
def test_rope_and_kv_write(interp, bias, qk_norm):
    dq, dkv = interp(_rope_case, bias, qk_norm)
    assert dq <= 1e-5 and dkv <= 2e-3     # float16 KV: half an ulp of values up to ~4


# decode entries at block boundaries and across the segments of SEG = 256 keys; prefill chunks
# from 0, after a cached prefix, across a block boundary; with and without the segment split
def test_rope_kv_adds_the_split_partials_as_split_sum_does(interp):
    splits, same_q, same_kv = interp(_rope_parts_case)
    assert splits == 2 and same_q and same_kv           # (K = 64: two Q4_0 blocks, two splits)


# (qwen2's bias and qwen3's norms: test_rope_and_kv_write in the default lane, these in the slow one)
@pytest.mark.parametrize("arch,precision", [({}, None), pytest.param({"attn_bias": True}, None, marks=SLOW),
                                            pytest.param({"qk_norm": True}, None, marks=SLOW), ({}, "tf32x3")])
def test_decode_attention_rotates_and_writes_the_kv_itself(interp, arch, precision):
    """(The token's own key comes from registers where its program's key step meets its slot: the
    step's load is asked for before the store, so without that the first step of a short context
    reads the slot stale.)"""
    splits, d_out, d_kv = interp(_attend_rope_case, arch, "cpu", precision)
    assert splits == 2 and d_out == 0.0 and d_kv == 0.0     # the interpreter: the same sums, the same bits


@pytest.mark.parametrize("max_context,precision", [pytest.param(1024, None, marks=SLOW), (256, None), (1024, "tf32x3")])
def test_paged_attention(interp, max_context, precision):
    """Decodes and prefill chunks against the reference; with the step's matmuls in 3xTF32, the
    decodes' attention as ``tl.dot``s (the interpreter computes them in f32: the code path here,
    the accuracy on CUDA in tests/gpu)."""
    lens = [1, 15, 16, 17, 100, 255, 256] + ([257, 600, 1024] if max_context > 256 else [])
    pre = [(0, 20), (32, 17), (200, 40)]
    err, nseg, counters_zero, dot = interp(_attention_case, max_context, lens, pre, "cpu", "ieee", None, precision)
    assert nseg == max_context // 256 and dot == ("tf32x3" if precision else "")
    assert err <= 1e-5 and counters_zero


@pytest.mark.parametrize("precision,bound", [("ieee", 1e-5), pytest.param("fp16", 5e-3, marks=SLOW)])
def test_prefill_attention_split_over_key_segments(interp, precision, bound):
    """A prefill tile whose keys span several segments (``seg`` 32 keys here, 256 by default):
    each segment a program, the last to finish merging them in order — chunks from 0, after a
    cached prefix, ending inside a segment and on its boundary, one token past it, beside
    decodes; the counters left at zero for the next launch."""
    pre = [(0, 70), (96, 64), (150, 33), (40, 1 + 32)]
    err, _, counters_zero, _ = interp(_attention_case, 1024, [17, 300], pre, "cpu", precision, (16, 16, 4, 32))
    assert err <= bound and counters_zero


@pytest.mark.parametrize("precision,bound", [("tf32", 1e-5), ("fp16", 5e-3), ("tf32x3", 1e-5)])
def test_prefill_attention_on_the_tensor_cores(interp, precision, bound):
    """TANDEM_GPU_PREFILL_ATTN: the prefill chunks' dots in TF32 or float16 (q and the softmax
    weights rounded to float16; the cache is float16 already) against the f32 reference; the
    decodes beside them stay f32. (The interpreter computes TF32 dots in f32: its bound is f32's;
    on CUDA tests/gpu bounds both.)"""
    err, _, _, _ = interp(_attention_case, 1024, [17, 300], [(0, 20), (32, 17), (200, 40)], "cpu", precision)
    assert err <= bound


def test_split_sums_and_segments_reduced_in_kernel_are_bitwise_their_own_launches(interp):
    matmuls, attention, counters_zero = interp(_reduce_case)
    assert matmuls == [True] * 4 and attention == 0.0 and counters_zero


# llama's layer; the qwen2 / qwen3 variants differ only in rope_kv (tested above on its own; their
# whole step runs compiled in tests/gpu, where it is fast)
def test_whole_step_matches_op_by_op(interp):
    err, dkv = interp(_step_case, {}, 280)
    assert err <= REL_STEP and dkv <= 2e-3


def test_whole_step_with_the_prefill_matmuls_through_torch(interp):
    """The same steps with ``gemm_rows`` 32: step 0 (58 rows, prefill chunks) runs its matmuls
    through torch.matmul, step 1 (33 rows) through the kernels."""
    err, dkv = interp(_step_case, {}, 20, "cpu", 32)
    assert err <= REL_STEP and dkv <= 2e-3


# the decode step rotates q and writes the token's KV in attn_decode (no rope_kv): llama's layer,
# and the qwen2 / qwen3 variants (bias, per-head norm) there too
# (qgemv is off by default; qwen2/qwen3's variants: the slow lane)
@pytest.mark.parametrize("gemv,arch,precision", [(False, {}, None),
                                                 pytest.param(True, {}, None, marks=SLOW),
                                                 pytest.param(False, {"attn_bias": True}, None, marks=SLOW),
                                                 pytest.param(False, {"qk_norm": True}, None, marks=SLOW),
                                                 (False, {}, "tf32x3")])
def test_decode_buffers_with_padding_rows(interp, gemv, arch, precision):
    err, same_best, dkv_others, scratch_written, *_ = interp(_graphs_case, "cpu", gemv, arch, precision)
    assert err <= REL_STEP and same_best
    assert dkv_others <= 2e-3          # the real rows' KV as the reference wrote it, nothing else touched
    assert scratch_written             # the padding row wrote its KV into the scratch block


def test_philox_uniforms_are_the_host_samplers_bit_for_bit(interp):
    """The device's uniform is numpy's Philox draw (sampler.uniform), for seeds across the 64-bit
    range (the sign bit, all ones, negative Python ints), indexes 0 to 2**31 - 1, more rows than
    one program's block."""
    from shared.engine.sampler import uniform
    seeds = [0, 1, 12345, 2**31, 2**32 + 7, 2**63 - 1, 2**63 + 5, 2**64 - 1, -3, 987654321987654321]
    idx = [0, 1, 2, 7, 1000, 65537, 2**31 - 1]
    pairs = [(s, c) for s in seeds for c in idx]
    got = interp(_philox_case, pairs)
    assert got == [uniform(s, c) for s, c in pairs]


def test_decode_steps_launched_ahead_give_the_same_outputs(interp):
    """TANDEM_GPU_AHEAD=1: the engine launches the next decode step before it reads this one's
    tokens (its ids fed from them on the device) and makes this one's text meanwhile, or — while
    the host chooses some row's token — reads and completes the step first: each request's tokens, text, logprobs and
    finish are those of steps one after another (stop token, stop string, max_tokens, a seeded
    draw, logprobs, a penalty, an abort with a step in flight, an arrival while one is out)."""
    out, counts = interp(_ahead_case)
    assert out[True] == out[False]
    finish = {r: f for r, (_, _, f, _) in out[False].items()}
    assert finish == {"greedy": "length", "stop-token": "stop", "stop-string": "stop", "sampled": "length",
                      "short": "length", "aborted": "abort", "late": "length", "logprobs": "length",
                      "penalty": "length"}, finish
    assert len(out[False]["stop-token"][0]) == 3 and len(out[False]["aborted"][0]) == 5   # (a stop token is not shown)
    assert len(out[False]["logprobs"][3]) == 3
    assert counts[False] == {"fed": 0, "collected": 0}
    # both ways ahead: tokens read first while the host's rows ran, the next step fed from the device after
    assert counts[True]["collected"] >= 2 and counts[True]["fed"] >= 3, counts


@pytest.mark.parametrize("swap_bytes", [pytest.param(256 << 20, marks=pytest.mark.slow),
                                        pytest.param(0, marks=pytest.mark.slow)],
                         ids=["swapped", "recomputed"])   # 39 s: the slow lane
def test_decode_steps_launched_ahead_under_kv_pressure(interp, swap_bytes):
    """The step launched ahead is scheduled while this one's tokens are placeholders: where that
    schedule could preempt a sequence (too few free blocks for the next slots), the step is read
    first and the next one scheduled after, so no sequence is preempted on the account of one this
    step ends; the preemptions the cache forces (swapped out, or dropped to recompute) come where
    steps one after another make them, and every request ends with the same tokens."""
    out = interp(_ahead_pressure_case, swap_bytes)
    print(f"preemptions stepped {out[False][1]}, launched ahead {out[True][1]}")
    (stepped, n0), (ahead, n1) = out[False], out[True]
    assert ahead == stepped
    assert len(stepped) == 5 and all(len(t) == 10 and f == "length" for t, _, f in stepped.values())
    assert n0["preempted"] >= 2 and n1["preempted"] == n0["preempted"], (n0, n1)
    assert n1["in_flight"] == 0 and n1["fed"] >= 3, n1   # none with a step out; launched ahead where it fit


@pytest.mark.parametrize("settings", [None, ALL_SETTINGS], ids=["default", "all-settings"])
def test_engine_decodes_through_the_graph_buffers(interp, settings):
    """The decode graphs' engine gives the op-by-op engine's tokens — with the default settings,
    and with ahead, 3xTF32 and prefetch everywhere at once (what `bench gpu`'s graphs-all runs
    but PDL, CUDA's only; the interpreter computes TF32 in f32)."""
    out, (has_graphs, steps, drawn, taken) = interp(_engine_case, settings)
    assert has_graphs and steps > 0
    assert taken == ((True, "tf32x3", "1") if settings else (False, "ieee", "auto"))
    assert drawn >= 8                   # the sampled rows' decode tokens were drawn in the graphs' sampler
    assert out["graphs"] == out["ops"]  # greedy and seeded sampled rows alike
