"""The host sampler: the torch ops (top-p by a sort of the whole row, or of its candidates) and the
compiled draw (kernels/sample_cpu.cpp, ``sampler.draw_rows``), side by side.

Why: a sampled request with top-p < 1 (most chat clients send 0.9-0.95) sorted all 49,152 logits
of the bundled model for every token on the CPU engine — ~4.5 ms on one core of a 2-vCPU AMD EPYC,
as much as the model's own decode step. ``_top_p`` sorts only the logits within a span of the
best (wider while their mass is short of top-p) and drops what the full sort would drop; the
compiled draw does the whole choice (temperature, filters, the draw) for every sampled row of a
step in one call, spread over the kernel threads.

What runs, side by side in one process (rounds interleaved, medians):
1. on the bundled model's real next-token logits (a few prompts, a few temperatures), one core:
   µs a row of top-p each torch way (the tokens kept checked equal), and of the whole choice
   (top-p, softmax, draw) by the torch ops and by the compiled draw (its tokens checked equal);
2. the CPU engine decoding one stream (greedy, T 0.8, T 0.8 with top-p 0.95) and 16 streams
   (T 0.8 with top-p 0.95) each way: tokens a second in all.

    python -m bench.sampler [--tokens 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

from bench import report

PROMPTS = ["Tell me a story about a dragon.", "The capital of France is", "def fibonacci(n):",
           "Write a haiku about the sea.", "List three uses of copper:", "In 1905, Albert Einstein"]


def full_sort(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition: a stable descending sort of the whole row, its softmax in that order."""
    idx = torch.sort(row, descending=True, stable=True).indices
    ps = row.softmax(-1)[idx]
    drop = (ps.cumsum(-1) - ps) >= top_p
    drop[0] = False
    return row.masked_fill(torch.zeros_like(drop).scatter(0, idx, drop), float("-inf"))


def _table(head: list[str], rows: list[list]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=48, help="tokens a stream (part 2)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each measurement (medians)")


def rows_part(engine, rounds: int) -> list[list]:
    from kernels import cpu
    from shared.engine import sampler
    from shared.engine.sampling import SamplingParams
    from shared.engine.sequence import Sequence
    lib = cpu._library()
    if lib is None:
        raise SystemExit("bench sampler: the compiled kernels did not load (a C++ compiler is needed)")
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for temp in (0.7, 1.0, 1.3):
            for top_p in (0.9, 0.95):
                a_us, b_us, c_us, d_us, kept = [], [], [], [], []
                for n, prompt in enumerate(PROMPTS):
                    logits = engine.prompt_logits(engine.tokenizer.encode(prompt))[-1].float().contiguous()
                    row = logits / temp
                    want, got = full_sort(row, top_p), sampler._top_p(row, top_p)
                    if not torch.equal(want, got):
                        raise AssertionError(f"the candidates kept other tokens than the full sort ({prompt!r})")
                    kept.append(int(torch.isfinite(got).sum()))
                    seq = Sequence("b", [0], SamplingParams(temperature=temp, top_p=top_p, seed=n))
                    if sampler._choose(logits, seq, None)[0] != sampler.draw_rows([logits], [seq], lib)[0]:
                        raise AssertionError(f"the compiled draw chose another token ({prompt!r})")
                    us = lambda f: min(timeit.repeat(f, number=5, repeat=rounds)) / 5 * 1e6   # noqa: E731
                    a_us.append(us(lambda: full_sort(row, top_p)))
                    b_us.append(us(lambda: sampler._top_p(row, top_p)))
                    c_us.append(us(lambda: sampler._choose(logits, seq, None)))
                    d_us.append(us(lambda: sampler.draw_rows([logits], [seq], lib)))
                a, b, c, d = (statistics.median(v) for v in (a_us, b_us, c_us, d_us))
                out.append([temp, top_p, f"{min(kept)}-{max(kept)}", f"{a:.0f}", f"{b:.0f}", f"{a / b:.1f}x",
                            f"{c:.0f}", f"{d:.0f}", f"{c / d:.1f}x"])
    finally:
        torch.set_num_threads(threads)
    return out


def decode_part(engine, tokens: int, rounds: int) -> list[list]:
    from shared.engine import sampler
    from shared.engine.engine import run_to_completion
    from shared.engine.sampling import SamplingParams

    def streams(n: int, **kw) -> dict:
        return {f"r{i}": (engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)] + f" ({i})"),
                          SamplingParams(max_tokens=tokens, seed=i, ignore_eos=True, **kw)) for i in range(n)}
    kinds = {"1 stream, greedy": streams(1, temperature=0.0), "1 stream, T 0.8": streams(1, temperature=0.8),
             "1 stream, T 0.8, top-p 0.95": streams(1, temperature=0.8, top_p=0.95),
             "16 streams, T 0.8, top-p 0.95": streams(16, temperature=0.8, top_p=0.95)}
    ways = {"full sort": (full_sort, False), "candidates": (sampler._top_p, False),
            "compiled": (sampler._top_p, True)}   # (top-p of the torch ops, sampler.NATIVE)
    rate: dict[tuple[str, str], list[float]] = {}
    texts: dict[tuple[str, str], dict] = {}
    run_to_completion(engine, kinds["16 streams, T 0.8, top-p 0.95"])      # (warm)
    try:
        for r in range(rounds):
            for way in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                sampler._top_p, sampler.NATIVE = ways[way]
                for kind, reqs in kinds.items():
                    t = time.perf_counter()
                    done = run_to_completion(engine, reqs)
                    rate.setdefault((kind, way), []).append(len(reqs) * tokens / (time.perf_counter() - t))
                    texts[(kind, way)] = {k: c.token_ids for k, c in done.items()}
    finally:
        sampler._top_p, sampler.NATIVE = ways["compiled"]
    rows = []
    for kind in kinds:
        a, b, c = (statistics.median(rate[(kind, w)]) for w in ways)
        same = texts[(kind, "full sort")] == texts[(kind, "candidates")]
        same_c = texts[(kind, "candidates")] == texts[(kind, "compiled")]
        rows.append([kind, f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x", "yes" if same else "NO", f"{c:.1f}",
                     f"{c / b:.2f}x", "yes" if same_c else "NO"])
    return rows


def main(args: argparse.Namespace) -> int:
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.loader import load_model
    progress = report.progress("bench sampler")
    engine = Engine(load_model(), EngineConfig(num_kv_blocks=1024, max_num_seqs=16))
    progress("part 1: top-p on the model's next-token logits, one core")
    t1 = rows_part(engine, args.rounds)
    progress(f"part 2: the CPU engine decoding 1 and 16 streams, {args.tokens} tokens, {args.rounds} rounds")
    t2 = decode_part(engine, args.tokens, args.rounds)
    from bench.gpu import _cpu_name
    from kernels import cpu
    where = f"{_cpu_name()}, {cpu.isa()}, the engine's kernels on {cpu.get_num_threads()} threads"
    print(f"\nThe host's choice of a sampled row on the bundled model's next-token logits ({len(PROMPTS)} prompts, medians; one core; "
          f"{where})\n")
    print(_table(["T", "top-p", "tokens kept", "top-p: full sort µs", "candidates µs", "ratio",
                  "whole choice: torch ops µs", "compiled µs", "ratio"], t1))
    print(f"\nCPU engine, {args.tokens} tokens a stream (tokens a second in all, medians of {args.rounds}; "
          f"{where})\n")
    print(_table(["requests", "torch ops, top-p by full sort", "by candidates", "ratio", "same tokens",
                  "compiled draw", "÷ candidates", "same tokens"], t2))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.sampler", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
