"""Engine benchmark on CPU: prefill and decode throughput, and peak resident memory.

    tandem bench engine [--threads 2] [--quick] [--with-transformers] [--json FILE]

- prefill: one 512-token prompt computed in one step (prefix cache off), best of ``--reps``;
- decode at 1, 8 and 32 concurrent sequences: every sequence generates ``--gen-tokens`` tokens
  (greedy, ignore_eos); tokens/s counts the tokens produced after every sequence has its first
  token, over the time that took (so prefill is not in it);
- peak RSS of this process (VmHWM) at the end;
- ``--with-transformers``: naive HF transformers fp32 decode tok/s (batch 1) on the same GGUF,
  measured in the same run (in a spawned process, with ``--torch-threads``) because the machine is noisy;
- ``--torch-threads``: override torch's intra-op threads after the engine is built (default: what
  the engine chose — 1 when the compiled kernels own the cores; see docs/benchmarks.md).

Prints a Markdown table on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from bench import report
from bench.cli import at_least

PROMPT_TEXT = ("The printing press changed how knowledge moved through Europe. Before it, books were "
               "copied by hand in monasteries, slowly and at great cost. ")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    p.add_argument("--threads", type=at_least(1), default=2, help="torch and kernel threads (default 2)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads, set after the engine is built (default: the engine's choice)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prefill prompt length (default 512)")
    p.add_argument("--gen-tokens", type=int, default=64, help="tokens generated per sequence in decode (default 64)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes")
    p.add_argument("--reps", type=int, default=3, help="prefill repetitions (best is reported)")
    p.add_argument("--quick", action="store_true", help="short smoke run: 128-token prompt, 8 tokens, 1 and 8 seqs")
    p.add_argument("--with-transformers", action="store_true", help="also time HF transformers fp32 decode")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")


_progress = report.progress("bench engine")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _prompt(tok, n: int, salt: int = 0) -> list[int]:
    ids = tok.encode(f"[{salt}] " + PROMPT_TEXT * (n // 20 + 2))
    return ids[:n]


def bench_prefill(engine, n: int, reps: int) -> float:
    from shared.engine.engine import run_to_completion
    from shared.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    run_to_completion(engine, {"warm": (_prompt(engine.tokenizer, 32, -1), params)})
    best = float("inf")
    for r in range(reps):
        ids = _prompt(engine.tokenizer, n, r)
        t0 = time.perf_counter()
        run_to_completion(engine, {f"p{r}": (ids, params)})
        best = min(best, time.perf_counter() - t0)
        _progress(f"prefill {n} tokens: {n / (time.perf_counter() - t0):.0f} tok/s (rep {r + 1}/{reps})")
    return n / best


def bench_decode(engine, concurrency: int, gen: int, prompt_tokens: int = 16, sampled: dict | None = None) -> float:
    """Decode tokens/s of ``concurrency`` sequences with ``prompt_tokens``-token prompts, counted
    once every sequence has its first token (``gen - 1`` decode steps each). Greedy, or with the
    ``sampled`` parameters (e.g. ``{"temperature": 0.8, "top_p": 0.95}``; seeded per sequence)."""
    import dataclasses

    from shared.engine.sampling import SamplingParams

    params = SamplingParams(**{"max_tokens": gen, "temperature": 0.0, "ignore_eos": True, **(sampled or {})})
    for i in range(concurrency):
        engine.add(f"d{concurrency}-{i}", _prompt(engine.tokenizer, prompt_tokens, 1000 + i),
                   dataclasses.replace(params, seed=i) if sampled else params)
    started: set[str] = set()
    t_start = None
    tokens = 0
    while engine.has_work():
        outs = engine.step()
        if t_start is not None:
            tokens += sum(len(o.token_ids) for o in outs)
        started.update(o.request_id for o in outs)
        if t_start is None and len(started) == concurrency:
            t_start = time.perf_counter()  # every sequence has its first token: decode only from here
    dt = time.perf_counter() - t_start
    rate = tokens / dt if dt > 0 else float("nan")
    _progress(f"decode x{concurrency} ({prompt_tokens}-token prompts): {rate:.1f} tok/s ({tokens} tokens in {dt:.2f}s)")
    return rate


def _transformers_rate(path: str, threads: int, gen: int) -> float:
    """HF transformers fp32 greedy decode tok/s at batch 1 (runs in a fresh process)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    d, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    ids = torch.tensor([list(range(1000, 1016))])
    kw = {"do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=gen + 1, min_new_tokens=gen + 1, **kw)
        dt = time.perf_counter() - t0 - t_first  # the first token is the prefill
    return gen / dt


def bench_transformers(path: str, threads: int, gen: int) -> float:
    """``_transformers_rate`` in a spawned process: the engine's thread pools and memory stay out of it."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        rate = pool.apply(_transformers_rate, (path, threads, gen))
    _progress(f"transformers fp32 decode x1: {rate:.1f} tok/s")
    return rate


def run(args: argparse.Namespace) -> dict:
    import torch

    from kernels import cpu
    from kernels.dispatch import describe
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.model_files import bundled_model_path

    if args.quick:
        args.prompt_tokens, args.gen_tokens, args.concurrency, args.reps = 128, 8, [1, 8], 1
    torch.set_num_threads(args.threads)
    cpu.set_num_threads(args.threads)
    _progress("loading the model")
    t0 = time.perf_counter()
    max_seqs = max(args.concurrency)
    engine = Engine.from_path(args.model, EngineConfig(
        threads=args.threads, enable_prefix_caching=False, max_num_seqs=max(max_seqs, 1),
        step_tokens=max(args.prompt_tokens, max_seqs), kv_cache_bytes=128 << 20))
    load_s = time.perf_counter() - t0
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    torch_threads = torch.get_num_threads()
    path = describe("cpu")
    _progress(f"loaded in {load_s:.1f}s; matmul path: {path}")
    res: dict = {"model": args.model or os.path.basename(bundled_model_path()), "threads": args.threads,
                 "torch_threads": torch_threads, "matmul_path": path, "load_s": round(load_s, 2),
                 "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens}
    res["prefill_tok_s"] = round(bench_prefill(engine, args.prompt_tokens, args.reps), 1)
    res["decode_tok_s"] = {str(c): round(bench_decode(engine, c, args.gen_tokens), 1) for c in args.concurrency}
    res["peak_rss_mib"] = round(peak_rss_bytes() / 2**20, 1)
    if args.with_transformers:
        res["transformers_fp32_decode_tok_s"] = round(
            bench_transformers(args.model or bundled_model_path(), args.torch_threads or args.threads,
                               min(args.gen_tokens, 32)), 1)
    return res


def table(res: dict) -> str:
    rows = [("prefill", f"{res['prompt_tokens']}-token prompt", res["prefill_tok_s"])]
    rows += [("decode", f"{c} concurrent x {res['gen_tokens']} tokens", v) for c, v in res["decode_tok_s"].items()]
    if "transformers_fp32_decode_tok_s" in res:
        rows.append(("decode (HF transformers fp32)", "1 sequence", res["transformers_fp32_decode_tok_s"]))
    lines = [f"Engine on CPU, {res['threads']} threads (torch {res['torch_threads']}), {res['matmul_path']}; model {res['model']}", "",
             "| phase | workload | tokens/s |", "|---|---|---:|"]
    lines += [f"| {a} | {b} | {v:.1f} |" for a, b, v in rows]
    lines.append(f"| peak RSS | whole process | {res['peak_rss_mib']:.0f} MiB |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    res = run(args)
    res["load_before"] = load
    report.emit(res, table, args.json)
    if load > cores / 2:   # a probe saw 3 tok/s at x1 on a loaded machine, 113 with --threads 1
        print(f"\nnote: the machine was busy before this run (1-min load average {load:.1f} on {cores} cores). "
              "An engine's OpenMP threads spin-wait for each other at every layer, so on a busy machine a step "
              "can take many times longer: compare the figures of one run, or run with --threads 1 or "
              "GOMP_SPINCOUNT=10000 (what `tandem up` sets where engine threads outnumber the cores).")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
