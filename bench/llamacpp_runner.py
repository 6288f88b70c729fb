"""llama.cpp side of ``tandem bench kernels --with-llama-cpp``; runs in the llama.cpp venv (no torch).

    python llamacpp_runner.py MODEL.gguf --threads 2 --reps 3 --batch-seqs 8 --batch-ctx 128

Prints one JSON object on stdout: best-of-reps tokens/s for
- ``tg``: decode ``--tg`` tokens one at a time from an empty context (llama-bench ``tg128``);
- ``pp``: one ``--pp``-token prompt in one batch (llama-bench ``pp512``);
- ``batched``: ``--batch-seqs`` sequences, each with a ``--batch-ctx``-token prompt, then
  ``--batch-gen`` decode steps of one token per sequence (total tokens/s of those steps; the
  shape of llama-batched-bench);
- with ``--long-pp N …``: ``ppN``, one N-token prompt in 512-token batches (long prompts);
- with ``--ctx-tg C``: ``tg_ctxC``, ``--ctx-gen`` decode steps of one sequence after a C-token
  prompt (decode at a long context; the prompt is not timed).
Token ids are fixed pseudo-random ids, as llama-bench uses; logits are computed, never sampled.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import llama_cpp
from llama_cpp import llama_cpp as L  # the low-level C API bindings


def _fn(*names):
    """The first of ``names`` this llama-cpp-python version has (the C API renamed several)."""
    for n in names:
        if hasattr(L, n):
            return getattr(L, n)
    raise AttributeError(f"llama_cpp has none of {names}")


class Runner:
    def __init__(self, path: str, threads: int, n_ctx: int, n_seq: int):
        L.llama_backend_init()
        self.model = _fn("llama_model_load_from_file", "llama_load_model_from_file")(
            path.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 512, 512, n_seq
        p.n_threads = p.n_threads_batch = threads
        self.ctx = _fn("llama_init_from_model", "llama_new_context_with_model")(self.model, p)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = L.llama_batch_init(512, 0, n_seq)
        vocab = L.llama_model_get_vocab(self.model) if hasattr(L, "llama_model_get_vocab") else self.model
        self.n_vocab = _fn("llama_vocab_n_tokens", "llama_n_vocab")(vocab)

    def clear(self) -> None:
        if hasattr(L, "llama_get_memory"):
            L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        else:
            _fn("llama_kv_self_clear", "llama_kv_cache_clear")(self.ctx)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, want logits) items."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def token(self, i: int) -> int:
        return (i * 7919 + 17) % self.n_vocab

    def tg(self, n: int) -> float:
        self.clear()
        t0 = time.perf_counter()
        for p in range(n):
            self.decode([(self.token(p), p, 0, True)])
        return n / (time.perf_counter() - t0)

    def pp(self, n: int) -> float:
        self.clear()
        t0 = time.perf_counter()
        for s in range(0, n, 512):
            m = min(512, n - s)
            self.decode([(self.token(s + i), s + i, 0, s + i == n - 1) for i in range(m)])
        return n / (time.perf_counter() - t0)

    def tg_at(self, ctx: int, n: int) -> float:
        self.pp(ctx)
        t0 = time.perf_counter()
        for p in range(ctx, ctx + n):
            self.decode([(self.token(p), p, 0, True)])
        return n / (time.perf_counter() - t0)

    def batched(self, seqs: int, ctx: int, gen: int) -> float:
        self.clear()
        for s in range(seqs):
            for c in range(0, ctx, 512):
                m = min(512, ctx - c)
                self.decode([(self.token(s * ctx + c + i), c + i, s, c + i == ctx - 1) for i in range(m)])
        t0 = time.perf_counter()
        for g in range(gen):
            self.decode([(self.token(1000 + g * seqs + s), ctx + g, s, True) for s in range(seqs)])
        return seqs * gen / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--batch-seqs", type=int, default=8)
    ap.add_argument("--batch-ctx", type=int, default=128)
    ap.add_argument("--batch-gen", type=int, default=64)
    ap.add_argument("--long-pp", type=int, nargs="*", default=[])
    ap.add_argument("--ctx-tg", type=int, default=0)
    ap.add_argument("--ctx-gen", type=int, default=64)
    a = ap.parse_args()
    n_seq = a.batch_seqs
    n_ctx = max(a.pp, a.tg, a.batch_ctx + a.batch_gen, *a.long_pp, a.ctx_tg + a.ctx_gen) * n_seq
    r = Runner(a.model, a.threads, n_ctx, n_seq)
    r.tg(8)  # warm-up
    res = {"version": llama_cpp.__version__, "threads": a.threads,
           "tg": max(r.tg(a.tg) for _ in range(a.reps)),
           "pp": max(r.pp(a.pp) for _ in range(a.reps)),
           "batched": max(r.batched(a.batch_seqs, a.batch_ctx, a.batch_gen) for _ in range(a.reps))}
    for n in a.long_pp:
        res[f"pp{n}"] = max(r.pp(n) for _ in range(a.reps))
    if a.ctx_tg:
        res[f"tg_ctx{a.ctx_tg}"] = max(r.tg_at(a.ctx_tg, a.ctx_gen) for _ in range(a.reps))
    json.dump(res, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
