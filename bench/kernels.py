"""Q4_0 matmul benchmark: torch reference vs the fast CPU kernels, side by side in one run.

    python -m bench.kernels [--threads 2] [--m 1 16 512] [--reps 0.3]

Prints, per weight shape of SmolLM2-135M and per M, the time per call and the effective
bandwidth over the Q4_0 weight bytes (bytes / time) for both paths, and the speed-up.
"""

from __future__ import annotations

import argparse
import time

import torch

from kernels import cpu, q4_0

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


def run(args: argparse.Namespace) -> list[dict]:
    """Run the benchmark, print the table and return its rows."""
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu.set_num_threads(args.threads or None)
    if not cpu.available():
        print("fast kernels unavailable: the 'fast' column is the torch reference")
    rows = []
    print(f"threads={cpu.get_num_threads()} isa={cpu.isa()}  (time per call; GB/s = Q4_0 weight bytes / time)")
    header = f"{'shape':<10} {'N x K':>12} {'M':>4} | {'ref ms':>9} {'ref GB/s':>8} | {'fast ms':>9} {'fast GB/s':>9} | {'speed-up':>8}"
    print(header)
    print("-" * len(header))
    for name, n, k in SHAPES:
        q = q4_0.quantize(torch.randn(n, k) * 0.02)
        nbytes = q.numel()
        for m in args.m:
            if args.skip_big and m * n > 512 * 1536 and n == 49152:
                continue  # prefill never runs the lm head on every token
            x = torch.randn(m, k)
            out = torch.empty(m, n)
            t_ref = _time(lambda: q4_0.matmul(x, q), args.budget)
            t_fast = _time(lambda: cpu.matmul(x, q, out=out), args.budget)
            row = dict(shape=name, n=n, k=k, m=m, ref_s=t_ref, fast_s=t_fast,
                       ref_gbs=nbytes / t_ref / 1e9, fast_gbs=nbytes / t_fast / 1e9)
            rows.append(row)
            print(f"{name:<10} {f'{n} x {k}':>12} {m:>4} | {t_ref * 1e3:>9.3f} {row['ref_gbs']:>8.2f} | "
                  f"{t_fast * 1e3:>9.3f} {row['fast_gbs']:>9.2f} | {t_ref / t_fast:>7.1f}x")
    # one decode step's matmuls: 30 layers x (q, k, v, o, gate, up, down) + lm head, M=1
    per_layer = {"q/o proj": 2, "k/v proj": 2, "gate/up": 2, "down": 1}
    for m in args.m:
        got = {r["shape"]: r for r in rows if r["m"] == m}
        if len(got) != len(SHAPES):
            continue
        t = {p: sum(got[s][f"{p}_s"] * c * 30 for s, c in per_layer.items()) + got["lm head"][f"{p}_s"]
             for p in ("ref", "fast")}
        print(f"model matmuls, M={m}: ref {t['ref'] * 1e3:.2f} ms, fast {t['fast'] * 1e3:.2f} ms "
              f"-> {m / t['fast']:.0f} tok/s matmul-only ceiling (fast)")
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="threads for both paths (0: torch's default)")
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 512], help="activation rows per call")
    p.add_argument("--budget", type=float, default=0.3, help="seconds of timing per case and path")
    p.add_argument("--skip-big", action=argparse.BooleanOptionalAction, default=True,
                   help="skip the lm head at M=512 (slow on the reference, never run in prefill)")
    return p


def main() -> None:
    run(parser().parse_args())


if __name__ == "__main__":
    main()
