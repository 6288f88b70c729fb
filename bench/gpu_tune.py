"""Tune the fused step's Q4_0 matmul tiles on the GPU at hand and write a table for
kernels/gpu_tuning.py: ``python -m bench.gpu_tune --out FILE [--budget-s 90]``.

For each weight shape of the model (SmolLM2-135M by default: q|k|v, o, gate|up, down, lm head) and
each candidate tile (BLOCK_N x BLOCK_B x warps x splits over K; qmatmul's, and qgemv's for up to
16 rows with its norm pass 16 x BLOCK_B or 256 values a step), the layer's matmuls of one
decode step (30 of them on 30 distinct random Q4_0 weights, as in the model; one for the lm head,
with the prologue / epilogue each has in the step) are captured as one CUDA graph and its replays
timed at M = 1, 16 and 64 rows (qgemv's at 1 and 16: they are decode tiles), split sums added by each
tile's last program (kernels/gpu_step.py
``qmatmul``). A shape gets two tiles, among those that spill at most SPILL_OK bytes: for decode
batches of up to 16 rows (``Tuning.decode``) the one with the lowest sum of times at 1 and 16 rows
relative to each M's best, and for more rows the fastest at 64 (the table keeps one where they
are the same). Then the whole step's matmuls (all shapes, as
one graph) with the chosen tiles against the built-in rule, and against the chosen tiles with their
split sums in ``split_sum`` launches (TANDEM_GPU_REDUCE=launch), side by side, printed as a table.

The candidates compile first in a pool of processes (Triton's disk cache is shared), so the timing
process finds them compiled. Needs CUDA.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from multiprocessing import get_context

# name: (N, K, NORM, SILU, RESIDUAL, launches a step) for SmolLM2-135M (30 layers)
SHAPES = {"qkv": (960, 576, True, False, False, 30), "o": (576, 576, False, False, True, 30),
          "gate_up": (3072, 576, True, False, False, 30), "down": (576, 1536, False, True, True, 30),
          "lm_head": (49152, 576, True, False, False, 1)}
MS = (1, 16, 64)
BLOCK_N = (16, 32, 64)
BLOCK_B = (1, 2)              # 4 and 8 lost every shape on an H200, 8 spilled at 16 and 64 rows (2026-11-27)
MIN_PROGRAMS = (0, 132, 528, 2048)
# qgemv (up to 16 rows without tl.dot; past them the same tile runs qmatmul)
GEMV_BLOCK_N, GEMV_BLOCK_B = (32, 64), (1, 2, 4)
NORM_W = (0, 256)             # qgemv's RMSNorm pass: 16 x BLOCK_B values a step (0), or 256
SPILL_OK = 16                 # bytes a tile may spill (tests/unit/test_gpu_compile.py: the same bound)
DEVICE = "cuda"     # "cpu" with --dry-run (Triton's interpreter: the code paths, no timing)
PRECISION = "tf32x3"  # the dots' (--precision: the engine's TANDEM_GPU_PRECISION, tf32x3 on CUDA by default)


def candidates(n: int, k: int, norm: bool = False):
    """The tiles to try for an N x K weight: qmatmul's, then qgemv's for up to 16 rows."""
    from kernels.gpu_tuning import Tile
    seen = set()
    families = [(BLOCK_N, BLOCK_B, (4, 8), (0,), 0),
                (GEMV_BLOCK_N, GEMV_BLOCK_B, (4, 8), NORM_W if norm else (0,), 16)]
    for ns, bs, ws, nws, gemv in families:
        for bn, bb, w, mp, nw in itertools.product(ns, bs, ws, MIN_PROGRAMS, nws):
            tiles = -(-n // bn)
            splits = max(1, min(-(-mp // tiles), k // 32 // bb, 64)) if tiles < mp else 1
            t = Tile(bn, bb, w, splits, nw, gemv)
            key = (bn, bb, w, t.plan(n, k), t.norm_step if norm and gemv else 0, gemv)
            if key not in seen:
                seen.add(key)
                yield t


class Shape:
    """One weight shape's buffers on the device: ``count`` distinct weights, activations, outputs."""

    def __init__(self, name: str, m: int, count: int | None = None):
        import torch
        from kernels.gpu_step import Q4Weight
        n, k, self.norm, self.silu, self.residual, launches = SHAPES[name]
        self.name, self.n, self.k, self.m = name, n, k, m
        count = launches if count is None else count
        g = torch.Generator(device=DEVICE).manual_seed(zlib.crc32(name.encode()))
        nb = k // 32
        self.w = []
        for _ in range(count):
            q = torch.randint(0, 256, (n, nb, 18), dtype=torch.uint8, device=DEVICE, generator=g)
            d = (torch.rand(n, nb, device=DEVICE, generator=g) * 0.01 + 0.001).half()
            q[:, :, :2] = d.view(torch.uint8).view(n, nb, 2)
            self.w.append(Q4Weight.of(q.view(n, nb * 18)))
        self.x = torch.randn(m, 2 * k if self.silu else k, device=DEVICE, generator=g)
        self.nw = torch.rand(k, device=DEVICE, generator=g) + 0.5
        self.out = torch.zeros(m, n, device=DEVICE)
        self.part = torch.empty(64 * m * n, device=DEVICE)
        from kernels.gpu_step import COUNTERS
        self.counters = torch.zeros(COUNTERS, dtype=torch.int32, device=DEVICE)

    def launch(self, tile, w, fused: bool = True):
        """One matmul of the step as GpuStep.matmul launches it — in the step's precision
        (``PRECISION``), its split sums added by its last programs (``fused``) or by a split_sum
        launch; its compiled kernel."""
        from kernels.gpu_step import qmatmul
        return qmatmul(self.x, w, self.out, tile, self.nw if self.norm else None, self.silu, self.residual,
                       precision=PRECISION, part=self.part,
                       reduce=self.name != "qkv",   # q|k|v's partials: rope_kv adds them
                       counters=self.counters if fused else None,
                       prefetch_mode=os.environ.get("TANDEM_GPU_PREFETCH", "auto"))


_SHAPES: dict = {}     # a pool process's buffers, by (shape, M)


def _compile_one(name, m, tile, precision):
    """In a pool process: launch (shape, m, tile) once (Triton compiles it into the disk cache);
    its registers, spills, and why it failed (or None)."""
    import torch
    global PRECISION
    PRECISION = precision
    s = _SHAPES.get((name, m)) or _SHAPES.setdefault((name, m), Shape(name, m, count=1))
    try:
        c = s.launch(tile, s.w[0])
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return getattr(c, "n_regs", None), getattr(c, "n_spills", None), None
    except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
        return None, None, f"{type(e).__name__}: {e}"[:200]


def _compile(jobs):
    """``_compile_one`` over jobs (shape, m, tile) in this process: {job: (registers, spills, error)}."""
    return {(name, m, tile): _compile_one(name, m, tile, PRECISION) for name, m, tile in jobs}


def shipped_tiles(device_name: str) -> dict:
    """(N, K) -> the tiles (main, then decode) of the table kernels/tuning/ ships for ``device_name``;
    {} where none ships."""
    from kernels.gpu_tuning import Tuning, shipped
    path = shipped(device_name) if device_name else None
    if not path or not path.exists():
        return {}
    t = Tuning.read(path)
    return {shape: [tile] + ([t.decode[shape]] if shape in t.decode else []) for shape, tile in t.tiles.items()}


def sweep_order(cands: dict, known: dict) -> dict:
    """name -> the order its candidates are timed in: the rule's tile, then the tiles of ``known``
    (``shipped_tiles``) for its shape that are candidates, then the rest of ``cands[name]``."""
    from kernels.gpu_tuning import rule
    order = {}
    for name, ts in cands.items():
        shape = SHAPES[name][:2]
        first = list(dict.fromkeys([rule(*shape)] + [t for t in known.get(shape, []) if t in ts]))
        order[name] = first + [t for t in ts if t not in first]
    return order


def best_tile(times: dict, cands: list, name: str, ms: list[int]):
    """Of ``cands`` timed at every M of ``ms`` (and not failed), the one with the lowest sum of
    times relative to each M's best; None if none (or ``ms`` is empty)."""
    if not ms:
        return None
    best_m = {m: min((v for (s_, m_, _), v in times.items() if s_ == name and m_ == m), default=None) for m in ms}
    scored = {t: sum(times[(name, m, t)] / best_m[m] for m in ms)
              for t in cands if all((name, m, t) in times for m in ms)}
    return min(scored, key=scored.get) if scored else None


def graph_time(fn, reps: int = 10, rounds: int = 5) -> float:
    """Median µs of one replay of ``fn`` captured as a CUDA graph."""
    import torch
    if DEVICE != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(2):
        g.replay()
    t = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        t.append(a.elapsed_time(b) * 1000 / reps)
    del g
    return statistics.median(t)


def main(argv=None) -> int:
    global DEVICE, MS, PRECISION
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the tuning table to write (JSON, TANDEM_GPU_TUNING reads it)")
    ap.add_argument("--budget-s", type=float, default=90, help="stop timing candidates after this (default 90)")
    ap.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 1) - 1)),
                    help="compile processes (default: the cores but one, up to 16)")
    ap.add_argument("--ms", type=int, nargs="+", default=list(MS),
                    help="rows to time at (default 1 16 64; 1 16: decode tiles only, the shipped main tiles kept)")
    ap.add_argument("--precision", default=None,
                    help="the dots' precision (default: TANDEM_GPU_PRECISION, else the CUDA default, tf32x3)")
    ap.add_argument("--dry-run", action="store_true",
                    help="on the CPU in Triton's interpreter, two tiles a shape, M = 1, one weight: the code "
                         "paths only (its times mean nothing)")
    a = ap.parse_args(argv)
    from kernels.gpu_step import DEFAULT_PRECISION, PRECISIONS
    PRECISION = a.precision or os.environ.get("TANDEM_GPU_PRECISION") or DEFAULT_PRECISION["cuda"]
    if PRECISION not in PRECISIONS:
        ap.error(f"--precision must be one of {', '.join(PRECISIONS)}")
    if not set(a.ms) <= set(MS) or 1 not in a.ms:
        ap.error(f"--ms: rows among {MS}, 1 among them")
    MS = tuple(sorted(a.ms))
    if a.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE, MS, PRECISION = "cpu", (1,), a.precision or "ieee"
        for name, v in SHAPES.items():                     # one weight each; a small lm head
            SHAPES[name] = (min(v[0], 512), *v[1:5], 1)
    import torch
    import triton
    from kernels.gpu_tuning import DECODE_ROWS, Tuning, rule
    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_tune needs a CUDA device (--dry-run runs its code paths on the CPU)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    say = lambda msg: print(f"[gpu_tune {time.monotonic() - t0:5.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    # the fewest blocks a step first (one won every shape on an H200, 2026-11-27), qgemv beside qmatmul
    cands = {name: sorted(candidates(n, k, norm), key=lambda t: (t.block_b, -t.splits, t.gemv, t.norm_w,
                                                                  t.block_n, t.warps))
             for name, (n, k, norm, *_) in SHAPES.items()}
    if a.dry_run:
        cands = {name: [rule(n, k), ts[-1]] for (name, ts), (n, k, *_) in zip(cands.items(), SHAPES.values())}
    # a qgemv tile (gemv > 0) is a choice for decode batches only: past 16 rows it would run the
    # qmatmul its parameters make, which qmatmul's own candidates cover (norm_w aside, which qmatmul
    # ignores) — so it is compiled and timed at 1 and 16 rows, not 64
    def wanted(m, t):
        return m <= DECODE_ROWS or not t.gemv
    # round by round over every (shape, M): the rule's tile first, then the tiles a table shipped for
    # this card holds (so a sweep its budget cuts short picks nothing slower than what ships), then
    # candidate i of each, so a deadline leaves every shape measured alike
    known = shipped_tiles(torch.cuda.get_device_name() if DEVICE == "cuda" else "")
    order = sweep_order(cands, known)
    rounds = max(len(v) for v in order.values())
    jobs = [(name, m, order[name][i]) for i in range(rounds) for name in SHAPES for m in MS
            if i < len(order[name]) and wanted(m, order[name][i])]
    # compiled in a pool of processes in the order they are timed, while the timing goes on: the
    # budget covers both (a sweep of ~1,000 launches did not finish compiling in 180 s on an
    # H200's 16-core host, 2026-11-30, and timed nothing)
    say(f"{len(jobs)} (shape, M, tile) launches in {rounds} rounds, {PRECISION} dots, compiled in "
        f"{a.workers} processes as they are timed; {a.budget_s:.0f} s")
    # (the compile processes niced: the timing's replays are enqueued from this one, and a GPU left
    # waiting for them would be timed too)
    pool = None if a.dry_run else ProcessPoolExecutor(a.workers, mp_context=get_context("spawn"), initializer=os.nice,
                                                      initargs=(10,))
    futures = {j: pool.submit(_compile_one, *j, PRECISION) for j in jobs} if pool else {}
    times: dict[tuple, float] = {}
    bad: dict[tuple, tuple] = {}
    deadline = t0 + a.budget_s
    shapes = {(name, m): Shape(name, m) for name, m in itertools.product(SHAPES, MS)}
    stopped = None
    for i in range(rounds):
        if i and time.monotonic() > deadline:
            stopped = f"budget spent after {i} rounds of candidates (of {rounds})"
            break
        for (name, m), s in shapes.items():
            if i >= len(order[name]) or not wanted(m, order[name][i]):
                continue
            t = order[name][i]
            j = (name, m, t)
            if pool:
                try:      # round 0 (the rule's tiles) whatever it takes; the rest within the budget
                    got = futures[j].result(timeout=None if i == 0 else max(1.0, deadline - time.monotonic()))
                except FuturesTimeout:
                    stopped = f"budget spent compiling round {i} (of {rounds})"
                    break
            else:
                got = _compile_one(*j, PRECISION)
            if got[2] or (got[1] or 0) > SPILL_OK:
                bad[j] = got
                continue
            times[j] = graph_time(lambda: [s.launch(t, w) for w in s.w])
        if stopped:
            break
    if pool:
        pool.shutdown(wait=False, cancel_futures=True)
    if stopped:
        say(stopped)
    say(f"{len(bad)} failed or spilled: "
        + ", ".join(f"{j[0]} m{j[1]} {j[2]}: {v[2] or f'{v[1]} B spilled'}" for j, v in list(bad.items())[:6]))
    del shapes
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    say(f"timed {len(times)} graphs")
    chosen, decode = {}, {}
    rows = []
    for name, (n, k, *_) in SHAPES.items():
        base = rule(n, k)
        large = best_tile(times, cands[name], name, [m for m in MS if m > DECODE_ROWS])
        small = best_tile(times, cands[name], name, [m for m in MS if m <= DECODE_ROWS])
        # (a sweep of decode rows only, --ms 1 16, keeps the shipped main tile for more rows)
        shipped_main = (known.get((n, k)) or [None])[0] if not any(m > DECODE_ROWS for m in MS) else None
        chosen[(n, k)] = large or shipped_main or small or base
        if small and small != chosen[(n, k)]:
            decode[(n, k)] = small
        rows.append((name, n, k, base, chosen[(n, k)], decode.get((n, k)), [times.get((name, m, base)) for m in MS]))
    tuned = Tuning(chosen, a.out, decode)
    # the whole step's matmuls, rule vs chosen, side by side
    whole = {}
    tiles = {"rule": (lambda s: rule(s.n, s.k), True), "tuned": (lambda s: tuned.tile(s.n, s.k, s.m), True),
             "tuned, split sums launched": (lambda s: tuned.tile(s.n, s.k, s.m), False)}
    for m in MS:
        step = [Shape(name, m) for name in SHAPES]
        for label, (pick, fused) in tiles.items():
            whole[(label, m)] = graph_time(lambda: [s.launch(pick(s), w, fused) for s in step for w in s.w])
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    table = tuned.to_json(
        device=dev, triton=triton.__version__, torch=torch.__version__,
        measured=time.strftime("%Y-%m-%d", time.gmtime()), command="python -m bench.gpu_tune",
        step_matmuls_us={f"{label} m{m}": round(v, 1) for (label, m), v in whole.items()})
    with open(a.out, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"\n{dev}, triton {triton.__version__}: one decode step's Q4_0 matmuls (CUDA graph replay, µs)\n")
    ms = " / ".join(f"m{m}" for m in MS)
    print(f"| shape | N x K | rule tile | tuned tile | decode tile (≤ {DECODE_ROWS} rows) | rule µs {ms} | tuned µs {ms} |")
    print("|---|---|---|---|---|---:|---:|")
    fmt = lambda t: "—" if t is None else (f"n{t.block_n} b{t.block_b} w{t.warps} s{t.splits}"  # noqa: E731
                                           + (f" gemv{t.gemv}" if t.gemv else "") + (f" nw{t.norm_w}" if t.norm_w else ""))
    for name, n, k, base, large, small, tb in rows:
        tt = [times.get((name, m, tuned.tile(n, k, m))) for m in MS]
        print(f"| {name} | {n}x{k} | {fmt(base)} | {fmt(large)} | {fmt(small)} | "
              + " / ".join(f"{v:.1f}" if v else "-" for v in tb) + " | "
              + " / ".join(f"{v:.1f}" if v else "-" for v in tt) + " |")
    print("\n| rows M | rule: all matmuls µs | tuned µs | rule ÷ tuned | tuned, split sums launched µs | "
          "launched ÷ fused |\n|---:|---:|---:|---:|---:|---:|")
    for m in MS:
        r, t, ln = whole[("rule", m)], whole[("tuned", m)], whole[("tuned, split sums launched", m)]
        print(f"| {m} | {r:.1f} | {t:.1f} | {r / t:.2f} | {ln:.1f} | {ln / t:.2f} |")
    say(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
