"""Every kernel variant the fused GPU step launches for the bundled model compiles for Hopper
(sm_90: H100 / H200) here, without a GPU, and keeps its registers: ptxas (Triton's own) reports at
most ``SPILL_OK`` bytes spilled for any of them (a few registers' worth; the tile shapes this
guards against spilled kilobytes).

The variants are not listed by hand: the step runs once on the CPU with the kernels replaced by
a recorder, over the launches a real engine makes — a mixed step (a prefill chunk, a chunk after
a cached prefix, decodes) and decode steps at every M tile (1, 2, 3, 8, 16, 17, 40 rows), f32 "ieee", TF32 and 3xTF32,
with the built-in matmul tiles, each table in kernels/tuning/ (kernels/gpu_tuning.py) and
``qgemv`` tiles at every decode BLOCK_M, split sums and attention segments reduced in the kernel
(the default) and by launches of their own (TANDEM_GPU_REDUCE=launch; f32, the H200's tiles), launched
with programmatic dependent launch (TANDEM_GPU_PDL=1, f32; TANDEM_GPU_PDL=exit, 3xTF32: each kernel's
``griddepcontrol.wait`` comes before its first global store or atomic, and before every load but
the matmuls' first weight tile; ``launch_dependents`` right after it under "1", nowhere under "exit"),
``rope_kv`` and ``attn_decode`` for qwen2's q|k|v bias and qwen3's per-head norms, and the
decode graphs' Philox uniforms (kernels/gpu_sample.py)
— and each distinct variant is compiled ahead of time with
``triton.compile(..., target=GPUTarget("cuda", 90, 32))`` as Triton's JIT specializes it on a
device: each argument's type, its 16-byte alignment (a pointer) or divisibility by 16 (an
integer), an integer 1 as a constant (``native_specialize_impl``, Triton's own). Compiled without
that specialization, the f32 prefill attention's 16 x 32 tile used 146 registers; as the JIT
compiles it, 255 and 648 B spilled (its tile is 16 x 16 since). A tile shape that spills (as 4
Q4_0 blocks a K step with 4 warps did: 6.7 KB a thread at 64 rows) fails here, not on a lent GPU.
The variants compile in a process per core (the slow lane, and ``scripts/gpu-check prepare``);
the default lane compiles one of each kind that an H200 launches with no setting changed.
The same recording counts a decode step's launches (152: five a layer, the embedding, the lm head).
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import re
import subprocess
import warnings
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")
from triton._C.libtriton import native_specialize_impl as specialize  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

from kernels import gpu_sample, gpu_step, gpu_tuning  # noqa: E402
from shared.engine.model import AttnChunk, StepContext, Transformer  # noqa: E402

SPILL_OK = 16       # bytes (bench/gpu_tune.py drops a tile past the same bound)


class Recorder:
    """Stands for kernels.gpu_triton: ``kern.NAME[grid](*args, **constexprs)`` records the launch."""

    def __init__(self):
        from kernels import gpu_triton
        self.real = gpu_triton
        self.launches: dict[tuple, tuple] = {}
        self.default = False            # recording what an H200 launches with no setting changed
        self.defaults: set[tuple] = set()

    def __getattr__(self, name):
        fn = getattr(self.real, name)

        def launcher(grid):
            def launch(*args, num_warps=4, launch_pdl=False, **consts):
                names = [n for n in fn.arg_names if n not in consts]
                kept = {p.name for p in fn.params if p.do_not_specialize}     # @triton.jit(do_not_specialize=...)
                sig, aligned = {}, []
                for n, a in zip(names, args):   # as the JIT specializes them (the tensors here are the
                    # CPU's, their offsets those of the device's: the same 16-byte alignment)
                    ty, spec = specialize(BaseBackend, a, False, n not in kept, True)
                    if ty == "constexpr":       # an integer 1: compiled as a constant
                        consts = consts | {n: spec}
                    elif spec == "D":           # a 16-byte aligned pointer, an integer divisible by 16
                        aligned.append(n)
                    sig[n] = ty
                sig |= {n: "constexpr" for n in consts}
                key = (name, tuple(sorted(sig.items())), tuple(sorted(consts.items())), tuple(aligned), num_warps,
                       launch_pdl)
                self.launches[key] = (fn, sig, consts, tuple(aligned), num_warps, launch_pdl)
                if self.default:
                    self.defaults.add(key)
            return launch
        return _Indexable(launcher)


class _Indexable:
    def __init__(self, f):
        self.f = f

    def __getitem__(self, grid):
        return self.f(grid)


def bundled_shapes_model(bias: bool = False, qk_norm: bool = False) -> Transformer:
    """A Transformer of the bundled model's shapes on the CPU, weights left empty (nothing computes);
    ``bias`` / ``qk_norm``: with qwen2's q|k|v bias / qwen3's per-head norms besides."""
    from shared.engine.model_files import load_tokenizer
    _, cfg = load_tokenizer()
    D, hd, F = cfg.hidden_size, cfg.head_dim, cfg.ffn_size

    def q(n, k):
        return torch.zeros(n, k // 32 * 18, dtype=torch.uint8)
    w = {"output": q(cfg.vocab_size, D), "output_norm": torch.ones(D)}
    w["embed"] = w["output"]
    for i in range(cfg.n_layers):
        w |= {f"blk.{i}.attn_norm": torch.ones(D), f"blk.{i}.ffn_norm": torch.ones(D),
              f"blk.{i}.qkv": q((cfg.n_heads + 2 * cfg.n_kv_heads) * hd, D), f"blk.{i}.o": q(D, cfg.n_heads * hd),
              f"blk.{i}.gate_up": q(2 * F, D), f"blk.{i}.down": q(D, F)}
        if bias:
            w[f"blk.{i}.qkv_bias"] = torch.zeros((cfg.n_heads + 2 * cfg.n_kv_heads) * hd)
        if qk_norm:
            w |= {f"blk.{i}.q_norm": torch.ones(hd), f"blk.{i}.k_norm": torch.ones(hd)}
    m = Transformer(cfg, w, torch.device("cpu"), None)
    m.fused = None
    return m


@pytest.fixture(scope="module")
def recording() -> Recorder:
    rec = Recorder()
    mp = pytest.MonkeyPatch()
    mp.setattr(gpu_step, "_k", lambda: rec)
    mp.setattr(gpu_sample, "_k", lambda: rec)
    try:
        model = bundled_shapes_model()
        kv = torch.zeros(64, model.cfg.n_layers, 2, 16, model.cfg.n_kv_heads, model.cfg.head_dim, dtype=torch.float16)
        tunings = [gpu_tuning.Tuning()] + [gpu_tuning.Tuning.read(p) for p in sorted(gpu_tuning.HERE.glob("*.json"))]
        # qgemv for decode rows, as a sweep (bench/gpu_tune.py) may choose it: the H200's tiles
        # with up to 16 rows through qgemv, its norm 256 values a step (every decode BLOCK_M)
        h200 = gpu_tuning.Tuning.read(gpu_tuning.shipped("NVIDIA H200"))
        tunings.append(gpu_tuning.Tuning({s: dataclasses.replace(t, gemv=16, norm_w=256)
                                          for s, t in h200.tiles.items()}, "gemv"))
        for precision, tuning, reduce in itertools.product(gpu_step.PRECISIONS, tunings,
                                                           gpu_step.REDUCE + ("pdl", "pdl-exit")):
            if reduce == "pdl-exit":        # `bench gpu --modes graphs-pdl-exit`: the defaults on CUDA but PDL
                if precision != gpu_step.DEFAULT_PRECISION["cuda"] or tuning.source != h200.source:
                    continue
            elif reduce != "fused" and (precision != "ieee" or tuning.source != h200.source):
                continue            # (the other kernels of these modes: those of the fused ones)
            if precision == "tf32x3" and tuning.source != h200.source:
                continue            # (TANDEM_GPU_PRECISION=tf32x3: qmatmul at every M, the H200's tiles)
            rec.default = (precision == gpu_step.DEFAULT_PRECISION["cuda"] and tuning.source == h200.source
                           and reduce == "fused")
            st = gpu_step.GpuStep(model, 8192, precision, tuning=tuning)
            if reduce == "launch":          # TANDEM_GPU_REDUCE=launch: split_sum, attn_merge, rope_kv
                st.counters, st.reduce = None, "launch"
            # TANDEM_GPU_PDL=1 / exit: programmatic dependent launch (``gpu_step.pdl_mode``)
            st.pdl = {"pdl": 1, "pdl-exit": 2}.get(reduce, 0)
            # TANDEM_GPU_PREFILL_ATTN: tf32 beside the tf32 matmuls, fp16 beside PDL
            st.prefill_attn = "fp16" if reduce == "pdl" else "tf32" if precision == "tf32" else "ieee"
            # prefill, prefill after a prefix (its keys past one segment: attn_prefill split), decodes
            plan = [(0, 100), (300, 20), (37, 1), (500, 1)]
            chunks, off = [], 0
            for start, n in plan:
                chunks.append(AttnChunk(start, n, off, torch.zeros(1), [0] * (-(-(start + n) // 16))))
                off += n
            z = torch.zeros(off, dtype=torch.int64)
            st.forward(z, StepContext(z, z, z, chunks, torch.tensor([99, 119, 120, 121])), kv)
            for b in (1, 2, 3, 8, 16, 17, 40):                       # every M tile of a decode step
                i = torch.zeros(b, dtype=torch.int32)
                st.decode(i, i, i, i, torch.zeros(b, 512, dtype=torch.int32), i, i, kv)
            if rec.default:                 # and the prefill attention's other precisions
                for attn in ("tf32", "fp16", "tf32x3"):
                    st.prefill_attn = attn
                    st.forward(z, StepContext(z, z, z, chunks, torch.tensor([99, 119, 120, 121])), kv)
                rec.default = False
        # `bench gpu --modes graphs-all`: every off-by-default decode setting at once (PDL, prefetch
        # everywhere, 3xTF32), with the H200's tiles and with qgemv for decode rows
        for tuning in (h200, tunings[-1]):
            st = gpu_step.GpuStep(model, 8192, "tf32x3", tuning=tuning)
            st.pdl, st.prefetch = 1, "1"
            for b in (1, 16, 17, 40):
                i = torch.zeros(b, dtype=torch.int32)
                st.decode(i, i, i, i, torch.zeros(b, 512, dtype=torch.int32), i, i, kv)
        for arch in ({"bias": True}, {"qk_norm": True}):              # rope_kv / attn_decode's qwen variants
            st = gpu_step.GpuStep(bundled_shapes_model(**arch), 8192, "ieee", tuning=h200)
            i = torch.zeros(1, dtype=torch.int32)
            st.decode(i, i, i, i, torch.zeros(1, 512, dtype=torch.int32), i, i, kv)
            z = torch.zeros(20, dtype=torch.int64)
            st.forward(z, StepContext(z, z, z, [AttnChunk(0, 20, 0, torch.zeros(1), [0, 0])], z[-1:]), kv)
        rec.default = True
        i = torch.zeros(3, dtype=torch.int32)                         # the decode graphs' sampler
        gpu_sample.uniforms(i, i, i, torch.zeros(3, dtype=torch.float64))
        rec.default = False
    finally:
        mp.undo()
    return rec


@pytest.fixture(scope="module")
def launches(recording) -> list[tuple]:
    """Every variant recorded."""
    return list(recording.launches.values())


def _ptxas():
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        p = get_ptxas(90)
        return getattr(p, "path", p)
    except Exception as e:  # noqa: BLE001 - no NVIDIA backend in this triton build
        pytest.skip(f"triton's NVIDIA backend (ptxas) is not available: {e}")


def test_the_step_launches_the_variants_expected(launches):
    names = {fn.__name__ for fn, *_ in launches}
    assert {p for *_, p in launches} == {True, False}
    assert names == {"embed", "qmatmul", "qgemv", "split_sum", "rope_kv", "attn_decode", "attn_merge",
                     "attn_prefill", "philox_uniform"}
    assert {c["BLOCK_M"] for fn, s, c, *_ in launches if fn.__name__ == "qgemv"} == {1, 2, 4, 8, 16}
    assert {c["PRECISION"] for fn, s, c, *_ in launches if fn.__name__ == "qmatmul"} == {"ieee", "tf32", "tf32x3"}
    assert {c["PRECISION"] for fn, s, c, *_ in launches
            if fn.__name__ == "attn_prefill"} == {"ieee", "tf32", "fp16", "tf32x3"}
    assert {c["PSEG"] for fn, s, c, *_ in launches if fn.__name__ == "attn_prefill"} == {0, 256}
    # attn_decode's sum form (the matmuls in "ieee") and its dot form (3xTF32)
    assert {c["DOT"] for fn, s, c, *_ in launches if fn.__name__ == "attn_decode"} == {"", "tf32x3"}
    assert {c["FIXUP"] for fn, s, c, *_ in launches if fn.__name__ in ("qmatmul", "qgemv", "attn_decode")} == {True, False}
    rope = {(c["HAS_BIAS"], c["QK_NORM"]) for fn, s, c, *_ in launches if fn.__name__ in ("rope_kv", "attn_decode")
            and c.get("ROPE", True)}
    assert rope == {(False, False), (True, False), (False, True)}


SHOWN = ("BLOCK_M", "BLOCK_N", "DOT", "NORM", "SILU", "SPLIT", "FIXUP", "ROPE", "HAS_BIAS", "QK_NORM", "PRECISION", "RESIDUAL",
         "PREFETCH", "BLOCK_K", "BLOCK_Q", "PSEG", "SPLITS")


_INSTR = re.compile(r"^(?:@!?%p\d+\s+)?([a-z][\w.]*)\s+(.*);$")
_REG = re.compile(r"%[a-z]+\d+")


def _loaded_from(ptx: str, kernel: str, params: list[str]) -> set[str]:
    """The kernel parameters the addresses of ``ptx``'s global loads derive from (a walk back
    through the straight-line PTX's definitions to its ``ld.param``s; ``params``: the kernel's
    arguments in PTX order)."""
    defs: dict[str, tuple[str, list[str]]] = {}
    addresses = []
    for line in ptx.splitlines():
        m = _INSTR.match(line.strip())
        if not m:
            continue
        op, operands = m[1], m[2]
        if op.startswith("ld.param"):
            defs[_REG.findall(operands)[0]] = (re.search(rf"\[{kernel}_param_(\d+)\]", operands)[1], [])
            continue
        head, _, rest = operands.partition("," if not operands.startswith("{") else "}")
        if op.startswith("ld.global"):
            addresses += _REG.findall(rest)
        for reg in _REG.findall(head):
            defs[reg] = ("", _REG.findall(rest))

    def source(reg: str, seen: set) -> set[str]:
        if reg in seen or reg not in defs:
            return set()
        seen.add(reg)
        param, srcs = defs[reg]
        return {params[int(param)]} if param else set().union(*(source(r, seen) for r in srcs))
    return set().union(*(source(r, set()) for r in addresses))


def _compile(job) -> dict:
    """One variant compiled for sm_90 (in a pool process): ptxas' registers and spills, the PTX's
    global loads, and what comes before ``griddepcontrol.wait`` under PDL."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import gpu_triton
    name, sig, consts, aligned, warps, pdl, ptx_path = job
    fn = getattr(gpu_triton, name)
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "launch_pdl": pdl})
    ptx = c.asm["ptx"]
    got = {"loads": len(re.findall(r"\bld\.global", ptx)), "pre": None}
    if consts.get("PDL"):
        # PDL 1: the next kernel let launch right after the wait; 2 (exit): by the programs' exits alone
        assert "griddepcontrol.wait" in ptx, name
        assert ("griddepcontrol.launch_dependents" in ptx) == (consts["PDL"] == 1), name
        before = ptx[:ptx.index("griddepcontrol.wait")]
        params = [n for n in fn.arg_names if sig[n] != "constexpr"]
        tensors = {n for n in params if sig[n].startswith("*")}       # (not the integers in the addresses)
        got["pre"] = (sorted(_loaded_from(before, name, params) & tensors) if "ld.global" in before else [],
                      "st.global" in before or "atom." in before)
    with open(ptx_path, "w") as f:
        f.write(ptx)
    out = subprocess.run([_ptxas(), "-v", "--gpu-name=sm_90a", ptx_path, "-o", "/dev/null"],
                         capture_output=True, text=True, check=True).stderr
    got["regs"] = int(re.search(r"Used (\d+) registers", out).group(1))
    got["spills"] = int(re.search(r"(\d+) bytes spill stores", out).group(1))
    return got


def _compile_all(launches, tmp_path) -> None:
    """Compile ``launches`` (a process per core) and check them: no spill past ``SPILL_OK``; under
    PDL nothing but a matmul's weights read before the wait."""
    _ptxas()
    jobs = [(fn.__name__, sig, consts, aligned, warps, pdl, str(tmp_path / f"k{k}.ptx"))
            for k, (fn, sig, consts, aligned, warps, pdl) in enumerate(launches)]
    # every core (compiling is most of this test: ~1-3 s a variant, 200 of them)
    with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_compile, jobs))
    report = []
    for (name, sig, consts, aligned, warps, pdl, _), got in zip(jobs, results):
        if got["pre"] is not None:
            # under PDL, griddepcontrol.wait before anything the previous kernel writes: nothing stored
            # before it; loaded, in a matmul, only from its Q4_0 weights (the quant bytes and fp16
            # scales of the first K step's tile it fetches while the previous kernel ends) — the
            # addresses of its loads traced back to the kernel's parameters
            pre, stored = got["pre"]
            assert not stored, name
            assert set(pre) <= {"q_ptr", "d_ptr"} and (not pre or name in ("qmatmul", "qgemv")), (name, pre)
        shown = {n: v for n, v in consts.items() if n in SHOWN}
        report.append((name, shown, warps, got["regs"], got["spills"], got["loads"]))
    print("\n" + "\n".join(f"{n} {s} warps={w}: {r} registers, {sp} B spilled, {ld} global loads"
                            for n, s, w, r, sp, ld in report))
    assert not [r for r in report if r[4] > SPILL_OK], f"register spills past {SPILL_OK} B"


@pytest.mark.slow
def test_every_variant_compiles_for_sm90_without_spills(launches, tmp_path):
    """Every variant (the slow lane, and ``scripts/gpu-check prepare`` before a lease)."""
    _compile_all(launches, tmp_path)


def _one_of_each(launches: list[tuple]) -> list[tuple]:
    """One launch per kernel, precision, split and M tile, and warps (the first, in key order)."""
    out: dict[tuple, tuple] = {}
    for launch in launches:
        fn, _, consts, _, warps, pdl = launch
        kind = (fn.__name__, warps, pdl) + tuple(consts.get(c) for c in ("PRECISION", "DOT", "SPLIT", "BLOCK_M"))
        out.setdefault(kind, launch)
    return list(out.values())


@pytest.mark.slow   # ~35 variants: 95 s of a cold compile on a 2-vCPU AVX2 Xeon
def test_the_default_step_compiles_for_sm90_without_spills(recording, tmp_path):
    """What the bundled model launches on an H200 with no setting changed (its table, 3xTF32, the
    in-kernel sums), decode at every M tile and a mixed step, and the prefill attention in TF32,
    float16 and 3xTF32."""
    default = [recording.launches[k] for k in sorted(recording.defaults, key=repr)]
    assert 20 <= len(default) < len(recording.launches) / 3
    _compile_all(default, tmp_path)


def test_each_kernel_of_the_default_step_compiles_for_sm90_without_spills(recording, tmp_path):
    """The default lane's share of the test above: one variant of each kernel, precision, split,
    M tile and warps the default step launches (about half of them; the other variants differ in
    their shapes and tiles' N and K)."""
    default = [recording.launches[k] for k in sorted(recording.defaults, key=repr)]
    some = _one_of_each(default)
    assert {fn.__name__ for fn, *_ in some} == {fn.__name__ for fn, *_ in default}
    assert 10 <= len(some) <= len(default) * 2 / 3, (len(some), len(default))
    _compile_all(some, tmp_path)


def test_a_decode_step_is_five_launches_a_layer(monkeypatch):
    """The bundled model's decode step (one sequence, the H200's tiles): q|k|v, attn_decode (with
    rope_kv's work), o, gate|up, down a layer, with the embedding and the lm head — 152 launches
    (302 before the split sums, attention's merges and rope_kv went into other kernels); with
    TANDEM_GPU_REDUCE=launch they come back as launches of their own (302)."""
    counts: dict[str, int] = {}

    class Counter:
        def __getattr__(self, name):
            class Launch:
                def __getitem__(self, grid):
                    return lambda *a, **k: counts.__setitem__(name, counts.get(name, 0) + 1)
            return Launch()
    monkeypatch.setattr(gpu_step, "_k", lambda: Counter())
    model = bundled_shapes_model()
    kv = torch.zeros(64, model.cfg.n_layers, 2, 16, model.cfg.n_kv_heads, model.cfg.head_dim, dtype=torch.float16)
    got = {}
    for reduce in gpu_step.REDUCE:
        monkeypatch.setenv("TANDEM_GPU_REDUCE", reduce)
        st = gpu_step.GpuStep(model, 8192, tuning=gpu_tuning.Tuning.read(gpu_tuning.shipped("NVIDIA H200")))
        counts.clear()
        i = torch.zeros(1, dtype=torch.int32)
        st.decode(i, i, i, i, torch.zeros(1, 512, dtype=torch.int32), i, i, kv)
        got[reduce] = dict(counts)
    layers = model.cfg.n_layers
    assert got["fused"] == {"embed": 1, "qmatmul": 4 * layers + 1, "attn_decode": layers}
    assert sum(got["fused"].values()) == 152
    assert got["launch"]["split_sum"] == 3 * layers and got["launch"]["attn_merge"] == layers
    assert got["launch"]["rope_kv"] == layers and sum(got["launch"].values()) == 302
