"""Time the prefill attention's tiles on the GPU at hand and add the best to a tuning table:
``python -m bench.gpu_prefill_tune [--out FILE] [--budget-s 60]``.

Each candidate (the dots' precision; query tokens a program, keys a loop step, warps, keys a
segment: ``kernels.gpu_tuning.PrefillTile``) runs the attention of one layer over a
``--tokens``-token prompt (2,048) in the bundled model's shapes (SmolLM2-135M: 9 query heads over 3
kv heads of 64), its float16 keys and values read through a shuffled block table, prefilled in
chunks of each of ``--chunks`` tokens (2,048: ``tandem bench gpu``'s one step; 512: a worker's
``step_tokens``) — each prompt's launches captured as one CUDA graph and its replays timed. Its
output is checked against the f32 tile without segments (a candidate off by more than its
precision allows is dropped, and said so). Per precision, the tile with the lowest sum of times
relative to each chunking's best is chosen; the table prints every candidate timed, fastest
first, with the built-in tile's row, and × 30 layers: the prompt's attention time.

``--out FILE``: the chosen tiles go into FILE's ``prefill_attn`` (FILE as it is, else the table
kernels/tuning/ ships for this card, else an empty one), which ``TANDEM_GPU_TUNING=FILE`` then
applies (kernels/gpu_tuning.py). The candidates compile first in a pool of processes (Triton's
disk cache is shared); spilling ones are dropped. ``--dry-run``: the code paths in Triton's
interpreter on the CPU (a short prompt, two tiles; the times mean nothing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

NH, NKV, HD, BS, LAYERS = 9, 3, 64, 16, 30       # SmolLM2-135M's attention; the KV's block size
SPILL_OK = 16                                     # bytes (bench/gpu_tune.py's bound)
BOUND = {"ieee": 1e-4, "tf32": 5e-3, "fp16": 5e-3, "tf32x3": 1e-4}   # max |diff| against f32 without segments
DEVICE = "cuda"


# (block_q, block_k, warps) that compile for sm_90 without spilling, each with and without key
# segments (ptxas' report of every candidate of 16/32/64 x 16..128 x 4/8 compiled here, as the JIT
# would: Triton 3.9, 2026-11-30, and 3.6.0 — the device image's — 2026-12-01): the f32 dots hold
# only the built-in 16 x 16 with 8 warps; float16's every 16-token tile, 32 x 32 (4 or 8 warps),
# 32 x 64 / 32 x 128 / 64 x 32 with 8 (64 x 64 with 8 spilled 28 B with segments); TF32's the same
# but 16 x 128 with 4 warps and 32 x 128 (Triton 3.6: 36-112 B)
_TC = [(16, k, w) for k in (32, 64, 128) for w in (4, 8)] + [(32, 32, 4), (32, 32, 8), (32, 64, 8), (32, 128, 8),
                                                             (64, 32, 8)]
FITS = {"ieee": [(16, 16, 8)], "tf32": [f for f in _TC if f not in ((16, 128, 4), (32, 128, 8))], "fp16": _TC}
# 3xTF32 (the operands split in two: more registers): 16 x 16 / 16 x 32 with 4 or 8 warps, 32 x 32 and
# 32 x 64 with 8 (16 x 64 spilled 36-72 B with segments; 32 x 32 with 4, 64 x 32: ~200 B)
FITS["tf32x3"] = [(16, 16, 4), (16, 16, 8), (16, 32, 4), (16, 32, 8), (32, 32, 8), (32, 64, 8)]
SEGS = (0, 128, 256, 512)


def candidates():
    """(precision, PrefillTile), the built-in tiles first, then round-robin over the precisions so
    a budget that cuts the timing short leaves each measured alike."""
    from kernels.gpu_tuning import PREFILL, PrefillTile
    per = {p: [PrefillTile(q, k, w, s) for (q, k, w), s in itertools.product(fits, SEGS) if s == 0 or s >= k]
           for p, fits in FITS.items()}
    firsts = [(p, PREFILL[p]) for p in per]
    rest = [c for group in itertools.zip_longest(*[[(p, t) for t in ts] for p, ts in per.items()]) for c in group if c]
    return list(dict.fromkeys(firsts + rest))


class Prompt:
    """One layer's attention over a prompt of ``tokens`` tokens prefilled in chunks of ``chunk``."""

    def __init__(self, tokens: int, chunk: int, seed: int = 0):
        import torch
        from kernels.gpu_step import COUNTERS, PagedBatch
        from shared.engine.model import AttnChunk
        g = torch.Generator().manual_seed(seed)
        nblocks = -(-tokens // BS) + 8
        self.kv = torch.randn(nblocks, 1, 2, BS, NKV, HD, generator=g).half().to(DEVICE)
        table = torch.randperm(nblocks, generator=g)[:-(-tokens // BS)].tolist()
        self.steps = []
        for start in range(0, tokens, chunk):
            n = min(chunk, tokens - start)
            c = AttnChunk(start, n, 0, torch.tensor(table[:-(-(start + n) // BS)]), table[:-(-(start + n) // BS)])
            q = torch.randn(n, NH * HD, generator=g).to(DEVICE)
            self.steps.append((q, PagedBatch.of([c], DEVICE), torch.empty_like(q)))
        self.counters = torch.zeros(COUNTERS, dtype=torch.int32, device=DEVICE)

    def run(self, precision: str, tile) -> list:
        """The prompt's launches; their compiled kernels."""
        from kernels.gpu_step import prefill_attention
        return [prefill_attention(q, self.kv[:, 0], pb, out, NH // NKV, HD ** -0.5, tile, precision, self.counters)
                for q, pb, out in self.steps]

    def outputs(self) -> list:
        return [out for *_, out in self.steps]


def _compile(jobs):
    """In a pool process: each (precision, tile) launched once over a short prompt whose tiles
    span segments (Triton compiles it into the disk cache); its most bytes spilled, or why it
    failed."""
    import torch
    got = {}
    p = Prompt(600, 600)
    for precision, tile in jobs:
        try:
            ks = p.run(precision, tile)
            torch.cuda.synchronize()
            got[(precision, tile)] = (max((getattr(k, "n_spills", 0) or 0) for k in ks), None)
        except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
            got[(precision, tile)] = (None, f"{type(e).__name__}: {e}"[:200])
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_prefill_tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="the tuning table to add the chosen tiles to (JSON)")
    ap.add_argument("--budget-s", type=float, default=60, help="stop timing candidates after this (default 60)")
    ap.add_argument("--tokens", type=int, default=2048, help="the prompt (default 2048)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[2048, 512], help="chunk sizes (default 2048 512)")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="compile processes")
    ap.add_argument("--dry-run", action="store_true",
                    help="on the CPU in Triton's interpreter: a 96-token prompt, two tiles, their code paths only")
    a = ap.parse_args(argv)
    global DEVICE
    if a.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE = "cpu"
        a.tokens, a.chunks = 96, [96, 48]
    import torch
    import triton

    from bench import gpu_tune
    gpu_tune.DEVICE = DEVICE          # (its graph_time: a plain call off CUDA)
    from kernels.gpu_tuning import PREFILL, PrefillTile, Tuning, shipped
    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_prefill_tune needs a CUDA device (--dry-run runs its code paths on the CPU)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    say = lambda msg: print(f"[gpu_prefill_tune {time.monotonic() - t0:5.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    cands = candidates()
    if a.dry_run:
        cands = [("ieee", PREFILL["ieee"]), ("fp16", PrefillTile(16, 32, 4, 32))]
    bad = {}
    if not a.dry_run:
        say(f"{len(cands)} tiles to compile in {a.workers} processes")
        with ProcessPoolExecutor(a.workers, mp_context=get_context("spawn")) as pool:
            for got in pool.map(_compile, [cands[i::a.workers] for i in range(a.workers)]):
                bad |= {c: v for c, v in got.items() if v[1] or (v[0] or 0) > SPILL_OK}
        say(f"compiled; {len(bad)} failed or spilled: "
            + ", ".join(f"{p} {t}: {v[1] or f'{v[0]} B'}" for (p, t), v in list(bad.items())[:6]))
    prompts = {c: Prompt(a.tokens, c) for c in a.chunks}
    ref = {}
    for c, p in prompts.items():
        p.run("ieee", PrefillTile(16, 16, 8, 0))
        ref[c] = [o.clone() for o in p.outputs()]
    times, wrong = {}, {}
    deadline = t0 + a.budget_s
    for i, (precision, tile) in enumerate(c for c in cands if c not in bad):
        if i and time.monotonic() > deadline:
            say(f"budget spent after {i} tiles")
            break
        for chunk, p in prompts.items():
            p.run(precision, tile)
            err = max(float((o - r).abs().max()) for o, r in zip(p.outputs(), ref[chunk]))
            if err > BOUND[precision]:
                wrong[(precision, tile)] = err
                break
            times[(precision, tile, chunk)] = gpu_tune.graph_time(lambda: p.run(precision, tile))
    say(f"timed {len({k[:2] for k in times})} tiles; {len(wrong)} wrong")
    best_c = {c: min(v for k, v in times.items() if k[2] == c) for c in a.chunks}
    scored = {}
    for precision, tile, _ in times:
        if all((precision, tile, c) in times for c in a.chunks):
            scored[(precision, tile)] = sum(times[(precision, tile, c)] / best_c[c] for c in a.chunks)
    chosen = {}
    for precision in PREFILL:
        mine = [k for k in scored if k[0] == precision]
        if mine:
            chosen[precision] = min(mine, key=scored.get)[1]
    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    cols = " | ".join(f"chunks of {c}: µs a layer" for c in a.chunks)
    print(f"\n{dev}, triton {triton.__version__}: the prefill attention of a {a.tokens}-token prompt, one layer "
          f"(CUDA graph replay; x{LAYERS} layers in the last column, chunks of {a.chunks[0]})\n")
    print(f"| precision | block_q | block_k | warps | seg | {cols} | ms a prompt ({LAYERS} layers) | |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(a.chunks) + "---:|---|")
    for key in sorted(scored, key=lambda k: (k[0], scored[k])):
        precision, tile = key
        mark = ", ".join(m for m, on in (("chosen", chosen.get(precision) == tile), ("built-in", PREFILL[precision] == tile))
                         if on)
        print(f"| {precision} | {tile.block_q} | {tile.block_k} | {tile.warps} | {tile.seg} | "
              + " | ".join(f"{times[(precision, tile, c)]:.1f}" for c in a.chunks)
              + f" | {times[(precision, tile, a.chunks[0])] * LAYERS / 1000:.2f} | {mark} |")
    for (precision, tile), err in wrong.items():
        print(f"\nWRONG: {precision} {tile}: max |diff| {err:.2e} against f32 without segments (bound {BOUND[precision]})")
    for (precision, tile), v in bad.items():
        print(f"\nnot timed: {precision} {tile}: {v[1] or f'{v[0]} B spilled'}")
    if a.out:
        if os.path.exists(a.out):
            table = json.load(open(a.out))
        elif DEVICE == "cuda" and shipped(dev).exists():
            table = json.load(open(shipped(dev)))
        else:
            table = {"tiles": {}}
        table["prefill_attn"] = Tuning(prefill=chosen).to_json()["prefill_attn"] if chosen else {}
        table["prefill_attn_measured"] = f"python -m bench.gpu_prefill_tune on {dev}, {time.strftime('%Y-%m-%d')}"
        Tuning.from_json(table, a.out)          # what the engine will read: checked before it is written
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        os.replace(tmp, a.out)
        say(f"wrote the prefill tiles into {a.out}: " + ", ".join(f"{p} {t}" for p, t in chosen.items()))
    return 0 if chosen else 1


if __name__ == "__main__":
    sys.exit(main())
