"""Q4_0 kernels benchmark: matmuls (reference vs fast) and the model vs llama.cpp, in one run.

    tandem bench kernels [--threads 2] [--with-llama-cpp] [--json FILE]

1. matmuls (``--matmuls``, default on): per weight shape of SmolLM2-135M and per M, time per
   call and effective bandwidth over the Q4_0 weight bytes: torch reference, the CPU kernels
   with f32 activations, and q16 (packed weights, int16 activations: the default).
2. the model (``--model-bench``, default on): the bundled model written once as an all-Q4_0 GGUF
   (cached under ~/.cache/tandem/bench), loaded by the Tandem engine and — with
   ``--with-llama-cpp`` — by llama.cpp (llama-cpp-python, installed into its own venv on first
   use: bench/llamacpp.py), side by side: decode 1 sequence (tg128), prefill 512 (pp512),
   batched decode (Tandem ``--batch-seqs-tandem`` 16 sequences vs llama.cpp 8, 128-token
   contexts), plus a memory read-bandwidth probe and the decode limit it implies
   (bandwidth / weight bytes read per token). ``--reps`` rounds alternate Tandem and llama.cpp
   (a fresh llama.cpp process per round); each side reports its best tok/s, and the ratio
   judged against the issue's targets is the median over the rounds of Tandem's figure over the
   llama.cpp round right after it — this shared machine drifts by ±15 % within minutes.
   ``--long`` adds long contexts: prefill of 2,048 and 8,000-token prompts (``--long-pp``, both
   sides in 512-token steps) and decode of one sequence at an 8,000-token context
   (``--ctx-tg``; the prompt untimed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from kernels import cpu, q4_0
from bench import report
from bench.cli import at_least

# (name, N rows of W, K) for SmolLM2-135M: hidden 576, intermediate 1536, 3 KV heads x 64
SHAPES = [
    ("q/o proj", 576, 576),
    ("k/v proj", 192, 576),
    ("gate/up", 1536, 576),
    ("down", 576, 1536),
    ("lm head", 49152, 576),
]


def _time(fn, budget_s: float, min_reps: int = 3) -> float:
    """Median seconds per call of ``fn`` over about ``budget_s`` seconds (after a warm-up)."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 10_000:
            break
    times.sort()
    return times[len(times) // 2]


def run(args: argparse.Namespace) -> dict:
    """Run the parts asked for, print their tables and return their results."""
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu.set_num_threads(args.threads or None)
    res: dict = {}
    if args.matmuls:
        res["matmuls"] = run_matmuls(args)
    if args.model_bench:
        res["model"] = run_model(args)
        print(model_table(res["model"]))
    return res


def run_matmuls(args: argparse.Namespace) -> list[dict]:
    """The per-shape matmul table: torch reference vs the CPU kernels with f32 activations (row-major
    weights) and q16 (the default: weights packed once, int16 activations)."""
    if not cpu.available():
        print("fast kernels unavailable: nothing to compare with the torch reference")
        return []
    rows = []
    print(f"threads={cpu.get_num_threads()} isa={cpu.isa()}  (time per call; GB/s = Q4_0 weight bytes / time)")
    header = (f"{'shape':<10} {'N x K':>12} {'M':>4} | {'ref ms':>9} | {'f32 ms':>9} {'f32 GB/s':>8} | "
              f"{'q16 ms':>9} {'q16 GB/s':>8} | {'ref/q16':>8} {'f32/q16':>8}")
    print(header)
    print("-" * len(header))
    for name, n, k in SHAPES:
        q = q4_0.quantize(torch.randn(n, k) * 0.02)
        packed = cpu.pack(q)
        nbytes = q.numel()
        for m in args.m:
            if args.skip_big and m * n > 512 * 1536 and n == 49152:
                continue  # prefill never runs the lm head on every token
            x = torch.randn(m, k)
            out = torch.empty(m, n)
            t_ref = _time(lambda: q4_0.matmul(x, q), args.budget)
            t_f32 = _time(lambda: cpu.matmul_with(x, q, out=out, act="f32"), args.budget)
            t_q16 = _time(lambda: cpu.matmul(x, packed, out=out), args.budget)
            row = dict(shape=name, n=n, k=k, m=m, ref_s=t_ref, f32_s=t_f32, q16_s=t_q16,
                       f32_gbs=nbytes / t_f32 / 1e9, q16_gbs=nbytes / t_q16 / 1e9)
            rows.append(row)
            print(f"{name:<10} {f'{n} x {k}':>12} {m:>4} | {t_ref * 1e3:>9.3f} | {t_f32 * 1e3:>9.3f} "
                  f"{row['f32_gbs']:>8.2f} | {t_q16 * 1e3:>9.3f} {row['q16_gbs']:>8.2f} | "
                  f"{t_ref / t_q16:>7.1f}x {t_f32 / t_q16:>7.2f}x")
    # one decode step's matmuls: 30 layers x (q, k, v, o, gate, up, down) + lm head
    per_layer = {"q/o proj": 2, "k/v proj": 2, "gate/up": 2, "down": 1}
    for m in args.m:
        got = {r["shape"]: r for r in rows if r["m"] == m}
        if len(got) != len(SHAPES):
            continue
        t = {p: sum(got[s][f"{p}_s"] * c * 30 for s, c in per_layer.items()) + got["lm head"][f"{p}_s"]
             for p in ("ref", "f32", "q16")}
        print(f"model matmuls, M={m}: ref {t['ref'] * 1e3:.2f} ms, f32 {t['f32'] * 1e3:.2f} ms, "
              f"q16 {t['q16'] * 1e3:.2f} ms -> {m / t['q16']:.0f} tok/s matmul-only ceiling (q16, hot caches)")
    return rows


_progress = report.progress("bench kernels")


def q4_0_gguf(src: str | None) -> str:
    """An all-Q4_0 GGUF of ``src`` (None: the bundled model), written once into the cache."""
    from shared.engine.model_files import bundled_model_path
    from shared.engine.quantize import quantize_model

    src = src or bundled_model_path()
    out = Path.home() / ".cache" / "tandem" / "bench" / f"{Path(src).stem}-q4_0.gguf"
    if not out.exists():
        _progress(f"writing the all-Q4_0 GGUF {out}")
        out.parent.mkdir(parents=True, exist_ok=True)
        quantize_model(src, str(out))
    return str(out)


def read_bandwidth_gbs(threads: int, nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Memory read bandwidth: best of ``reps`` sums over a buffer far larger than the caches."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        buf.sum()
        best = min(_time_once(buf.sum) for _ in range(reps))
    finally:
        torch.set_num_threads(before)
    return nbytes / best / 1e9


def _time_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_weight_bytes(model) -> int:
    """Q4_0 bytes one decode step reads: every layer matrix and the lm head (embedding rows aside)."""
    mats = ("qkv", "o", "gate_up", "down")
    return sum(L[k].numel() for L in model.layers for k in mats) + model.output.numel()


def _tandem_round(engine, args: argparse.Namespace) -> dict:
    from bench.engine import bench_decode, bench_prefill

    res = {"tg": bench_decode(engine, 1, args.tg + 1, prompt_tokens=1),
           "pp": bench_prefill(engine, args.pp, 1),
           "batched": bench_decode(engine, args.batch_seqs_tandem, args.batch_gen + 1,
                                   prompt_tokens=args.batch_ctx)}
    if args.long:
        for n in args.long_pp:
            res[f"pp{n}"] = bench_prefill(engine, n, 1)
        res[f"tg_ctx{args.ctx_tg}"] = bench_decode(engine, 1, args.ctx_gen + 1, prompt_tokens=args.ctx_tg)
    return res


def targets(args: argparse.Namespace) -> list[tuple[str, str, float]]:
    """(key, workload, target ratio Tandem / llama.cpp) of this run."""
    out = list(TARGETS)
    if args.long:
        out += [(f"pp{n}", f"prefill, {n} tokens (pp{n}, 512-token steps)", 1.0) for n in args.long_pp]
        out.append((f"tg_ctx{args.ctx_tg}", f"decode, 1 sequence at a {args.ctx_tg}-token context "
                    f"({args.ctx_gen} tokens)", 1.0))
    return out


def run_model(args: argparse.Namespace) -> dict:
    """Tandem (and llama.cpp) on the same all-Q4_0 GGUF; figures are best-of tokens/s."""
    from kernels.dispatch import describe
    from shared.engine.engine import Engine, EngineConfig

    path = q4_0_gguf(args.model)
    threads = args.threads or torch.get_num_threads()
    seqs = max(args.batch_seqs_tandem, 1)
    longest = max([args.pp, args.tg + 1, args.batch_ctx + args.batch_gen]
                  + ([*args.long_pp, args.ctx_tg + args.ctx_gen] if args.long else []))
    engine = Engine.from_path(path, EngineConfig(
        threads=threads, enable_prefix_caching=False, max_num_seqs=seqs,
        step_tokens=max(args.pp, seqs), kv_cache_bytes=max(256 << 20, 2 * longest * (32 << 10))))
    res: dict = {"gguf": path, "threads": threads, "tandem_path": describe("cpu"),
                 "fused_forward": engine.model.fused is not None,
                 "weight_mb_per_token": decode_weight_bytes(engine.model) / 1e6,
                 "tg_tokens": args.tg, "pp_tokens": args.pp, "batch_ctx": args.batch_ctx,
                 "batch_gen": args.batch_gen, "batch_seqs_tandem": seqs, "batch_seqs_llama": args.batch_seqs_llama,
                 "targets": targets(args)}
    _progress(f"Tandem: {res['tandem_path']}, fused forward {res['fused_forward']}")
    rounds, llama_rounds = [], []
    for i in range(max(args.reps, 1)):   # alternating rounds: drift on a shared machine hits both
        rounds.append(_tandem_round(engine, args))
        if args.with_llama_cpp:
            from bench import llamacpp

            _progress(f"llama.cpp side, round {i + 1} of {args.reps}")
            llama_rounds.append(llamacpp.run(path, threads, 1, args.tg, args.pp, args.batch_seqs_llama,
                                             args.batch_ctx, args.batch_gen,
                                             long_pp=args.long_pp if args.long else [],
                                             ctx_tg=args.ctx_tg if args.long else 0, ctx_gen=args.ctx_gen))
            _progress(f"llama.cpp: {llama_rounds[-1]}")
    res["tandem"] = {k: max(r[k] for r in rounds) for k in rounds[0]}
    res["tandem_rounds"] = rounds
    if llama_rounds:
        res["llama_cpp"] = {**llama_rounds[0], **{k: max(r[k] for r in llama_rounds) for k, _, _ in res["targets"]}}
        res["llama_cpp_rounds"] = llama_rounds
        # each Tandem round against the llama.cpp round right after it; the median is the figure
        res["ratios"] = {k: statistics.median(t[k] / lr[k] for t, lr in zip(rounds, llama_rounds))
                         for k, _, _ in res["targets"]}
    res["read_gbs"] = read_bandwidth_gbs(threads)
    res["bandwidth_limit_tok_s"] = res["read_gbs"] * 1e3 / res["weight_mb_per_token"]
    return res


# (key, workload, target ratio Tandem / llama.cpp)
TARGETS = [("tg", "decode, 1 sequence (tg{tg_tokens})", 1.0),
           ("pp", "prefill, {pp_tokens} tokens (pp{pp_tokens})", 0.8),
           ("batched", "batched decode, {batch_ctx}-token contexts: Tandem {batch_seqs_tandem} seqs "
                       "vs llama.cpp {batch_seqs_llama} seqs (total)", 2.0)]


def model_table(res: dict) -> str:
    """The side-by-side table (Markdown): best tok/s of each side, and the median over alternating
    rounds of Tandem / llama.cpp (the figure the targets are judged on)."""
    llama = res.get("llama_cpp")
    lines = [f"Model on CPU, {res['threads']} threads; Tandem: {res['tandem_path']}"
             f"{', fused forward' if res['fused_forward'] else ', op-by-op forward'}; "
             f"llama.cpp: {'llama-cpp-python ' + llama['version'] if llama else 'not run (--with-llama-cpp)'}",
             f"GGUF {res['gguf']}", "",
             "| workload | Tandem tok/s (best) | llama.cpp tok/s (best) | ratio (median of rounds) | target | met |",
             "|---|---:|---:|---:|---:|---|"]
    for key, name, target in res["targets"]:
        t = res["tandem"][key]
        if llama:
            ratio = res["ratios"][key]
            lines.append(f"| {name.format(**res)} | {t:.1f} | {llama[key]:.1f} | {ratio:.2f} | ≥ {target:.1f} | "
                         f"{'yes' if ratio >= target else f'no ({(ratio / target - 1) * 100:+.0f} %)'} |")
        else:
            lines.append(f"| {name.format(**res)} | {t:.1f} | — | — | ≥ {target:.1f} | — |")
    lim = res["bandwidth_limit_tok_s"]
    lines.append(f"| decode limit: {res['read_gbs']:.1f} GB/s read ÷ {res['weight_mb_per_token']:.1f} MB/token | "
                 f"{lim:.0f} | | | | |")
    share = f"Tandem decode = {res['tandem']['tg'] / lim * 100:.0f} % of the bandwidth limit"
    if llama:
        share += f", llama.cpp {llama['tg'] / lim * 100:.0f} %"
    if llama and len(res.get("llama_cpp_rounds", [])) > 1:
        share += ("\nper round (Tandem / llama.cpp): " + "; ".join(
            ", ".join(f"{k} {t[k]:.0f}/{lr[k]:.0f}" for k, _, _ in res["targets"])
            for t, lr in zip(res["tandem_rounds"], res["llama_cpp_rounds"])))
    return "\n".join(lines + ["", share])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=at_least(0), default=2, help="threads for both paths (0: torch's default)")
    p.add_argument("--matmuls", action=argparse.BooleanOptionalAction, default=True, help="the matmul table")
    p.add_argument("--model-bench", action=argparse.BooleanOptionalAction, default=True,
                   help="the model-level table (Tandem, and llama.cpp with --with-llama-cpp)")
    p.add_argument("--with-llama-cpp", action="store_true",
                   help="run llama.cpp side by side (installs llama-cpp-python into its own venv first)")
    p.add_argument("--model", default=None, help="source model (default: the bundled one); converted to all-Q4_0")
    p.add_argument("--reps", type=int, default=3,
                   help="model-level rounds per side, alternating (best tok/s and the median ratio are reported)")
    p.add_argument("--tg", type=int, default=128, help="decode tokens for the 1-sequence figure")
    p.add_argument("--pp", type=int, default=512, help="prompt tokens for the prefill figure")
    p.add_argument("--batch-ctx", type=int, default=128, help="prompt tokens per sequence, batched decode")
    p.add_argument("--batch-gen", type=int, default=32, help="decode steps timed, batched decode")
    p.add_argument("--batch-seqs-tandem", type=int, default=16, help="Tandem sequences, batched decode")
    p.add_argument("--batch-seqs-llama", type=int, default=8, help="llama.cpp sequences, batched decode")
    p.add_argument("--long", action=argparse.BooleanOptionalAction, default=False,
                   help="add long contexts: prefill of --long-pp prompts, decode at a --ctx-tg context")
    p.add_argument("--long-pp", type=int, nargs="+", default=[2048, 8000], help="long prompt lengths (--long; the bundled model holds 8,192 positions)")
    p.add_argument("--ctx-tg", type=int, default=8000, help="context of the long-context decode figure (--long)")
    p.add_argument("--ctx-gen", type=int, default=64, help="decode tokens timed at that context (--long)")
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 512], help="activation rows per call")
    p.add_argument("--budget", type=float, default=0.3, help="seconds of timing per case and path")
    p.add_argument("--skip-big", action=argparse.BooleanOptionalAction, default=True,
                   help="skip the lm head at M=512 (slow on the reference, never run in prefill)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def main(args: argparse.Namespace | None = None) -> int:
    args = args or parser().parse_args()
    res = run(args)
    if args.json:
        report.write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
