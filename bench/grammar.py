"""``tandem bench grammar``: the grammar libraries side by side on this model's tokenizer.

For each of llguidance, xgrammar and outlines-core that is installed: wheel size on disk, the
time to wrap the tokenizer (once per process), the time to compile a JSON schema (once per
request with a new schema), and the time to compute one token mask while walking a valid JSON
document token by token (once per generated token), for one sequence (c=1) and for 16 at once
(c=16: the masks one engine step of 16 constrained sequences needs, one after another on one
thread, as Tandem computes them). Rounds alternate between the libraries; medians are reported.

Only llguidance is a dependency of Tandem; install the others by hand to compare (xgrammar with
``--no-deps``: its requirements include torch, which must stay pinned).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

import numpy as np
from bench.cli import at_least

SCHEMAS = {
    "tool_call": {  # a typical tool's parameters
        "type": "object",
        "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["location", "unit", "days"], "additionalProperties": False,
    },
    "nested": {  # objects in arrays, optional fields, numbers, booleans
        "type": "object",
        "properties": {
            "title": {"type": "string"}, "year": {"type": "integer"}, "rating": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
            "cast": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "role": {"type": "string"}, "lead": {"type": "boolean"}},
                "required": ["name", "role"], "additionalProperties": False}},
        },
        "required": ["title", "year", "cast"], "additionalProperties": False,
    },
}
DOCS = {
    "tool_call": {"location": "Paris, France", "unit": "celsius", "days": 3},
    "nested": {"title": "The Lighthouse", "year": 2019, "rating": 7.4, "tags": ["drama", "horror", "sea"],
               "cast": [{"name": "Robert Pattinson", "role": "Ephraim", "lead": True},
                        {"name": "Willem Dafoe", "role": "Thomas", "lead": True}]},
}


class _Lib:
    name: str
    module: str

    def size_mb(self) -> float:
        spec = importlib.util.find_spec(self.module)
        total = 0
        for root, _, files in os.walk(os.path.dirname(spec.origin)):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        return total / 2**20


class LLGuidance(_Lib):
    name, module = "llguidance", "llguidance"

    def __init__(self, tok):
        from shared.engine.grammar import GrammarCompiler
        self.compiler = GrammarCompiler(tok)

    def compile(self, schema):
        self.compiler._cache.clear()  # measure the compilation, not Tandem's cache
        return self.compiler.compile({"kind": "json_schema", "value": schema})

    def matcher(self, compiled):
        return self.compiler.matcher_for(compiled)

    def fill(self, m):
        m.mask()

    def accept(self, m, t):
        m.accept(t)


class XGrammar(_Lib):
    name, module = "xgrammar", "xgrammar"

    def __init__(self, tok):
        import xgrammar as xgr
        self.xgr = xgr
        vocab = [tok.backend.id_to_token(i) for i in range(tok.vocab_size)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=tok.vocab_size,
                                 stop_token_ids=sorted(tok.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, tok.vocab_size)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m):
        m.fill_next_token_bitmask(self.mask)

    def accept(self, m, t):
        assert m.accept_token(t)


class OutlinesCore(_Lib):
    name, module = "outlines-core", "outlines_core"

    def __init__(self, tok):
        from outlines_core import Vocabulary
        from shared.engine.tokenizer import _bytes_to_unicode
        inv = {c: b for b, c in _bytes_to_unicode().items()}
        eos = tok.eos_token_id
        words: dict[bytes, list[int]] = {}
        for i in range(tok.vocab_size):
            piece = tok.backend.id_to_token(i)
            if i == eos or tok.is_special(i):
                continue
            try:
                words.setdefault(bytes(inv[c] for c in piece), []).append(i)
            except KeyError:  # added non-byte-level tokens
                words.setdefault(piece.encode(), []).append(i)
        self.vocab = Vocabulary(eos, words)
        self.mask = np.zeros(((tok.vocab_size + 31) // 32,), dtype=np.int32)

    def compile(self, schema):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema
        return Index(build_regex_from_schema(json.dumps(schema), r"[ ]?"), self.vocab)

    def matcher(self, compiled):
        from outlines_core import Guide
        return Guide(compiled)

    def fill(self, m):
        m.write_mask_into(self.mask.ctypes.data, self.mask.size, 4)

    def accept(self, m, t):
        m.advance(t)


LIBS = [LLGuidance, XGrammar, OutlinesCore]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=at_least(1), default=3, help="alternating rounds per library (medians reported)")
    p.add_argument("--engine", action="store_true", help="also: the engine's decode tok/s with and without a "
                   "JSON schema (bundled model, greedy, c=1 and c=16, alternating rounds)")
    p.add_argument("--threads", type=at_least(1), default=2, help="--engine: kernel threads (default 2)")
    p.add_argument("--json", default=None, help="write the results here")


def _round(lib, doc_tokens: dict[str, list[int]], out: dict) -> None:
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()  # compile, build a matcher, compute the first mask: all before token 1
        compiled = lib.compile(schema)
        lib.fill(lib.matcher(compiled))
        out.setdefault(f"compile_ms:{name}", []).append((time.perf_counter() - t0) * 1e3)
        toks = doc_tokens[name]
        for c in (1, 16):
            ms = [lib.matcher(compiled) for _ in range(c)]
            spent = 0.0
            for t in toks:
                t0 = time.perf_counter()
                for m in ms:
                    lib.fill(m)
                spent += time.perf_counter() - t0
                for m in ms:
                    lib.accept(m, t)
            out.setdefault(f"mask_us_c{c}:{name}", []).append(spent / len(toks) / c * 1e6)
            out.setdefault(f"step_us_c{c}:{name}", []).append(spent / len(toks) * 1e6)


def engine_steps(threads: int, rounds: int) -> dict[str, dict[str, float]]:
    """Decode tok/s of the real engine, unconstrained vs a JSON schema, at c=1 and 16: output
    tokens over the time of the steps after every prompt is computed (a grammar that forces
    tokens appends them without a step each, so constrained decode is counted in tokens, not
    steps), summed over ``rounds`` alternating rounds."""
    from bench.loadgen import QUESTIONS, STRUCTURED_SCHEMA
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.sampling import SamplingParams

    e = Engine.from_path(None, EngineConfig(num_kv_blocks=512, threads=threads))
    guide = {"kind": "json_schema", "value": STRUCTURED_SCHEMA}
    prompts = [e.tokenizer.encode(e.tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                                  add_special_tokens=False) for q in QUESTIONS]

    def run(c: int, g) -> tuple[int, float, int]:
        for i in range(c):
            e.add(f"r{i}", prompts[i % len(prompts)], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, guide=g))
        tokens, seconds, steps = 0, 0.0, 0
        while e.seqs:
            decoding = all(s.num_computed >= s.num_prompt_tokens for s in e.seqs.values())
            t0 = time.perf_counter()
            outs = e.step()
            if decoding:
                seconds += time.perf_counter() - t0
                tokens += sum(len(o.token_ids) for o in outs)
                steps += 1
        return tokens, seconds, steps

    tot: dict[str, list[float]] = {}
    for rnd in range(rounds):
        for c in (1, 16):
            for name, g in ((("free", None), ("json", guide)) if rnd % 2 == 0 else (("json", guide), ("free", None))):
                n, sec, steps = run(c, g)
                acc = tot.setdefault(f"{name}_c{c}", [0, 0.0, 0])
                acc[0] += n
                acc[1] += sec
                acc[2] += steps
    return {k: {"tok_s": n / sec, "tokens_per_step": n / steps, "step_ms": sec / steps * 1e3}
            for k, (n, sec, steps) in tot.items()}


def main(args: argparse.Namespace) -> int:
    from kernels import cpu
    from shared.engine.model_files import load_tokenizer

    tok, cfg = load_tokenizer(None)
    isa = cpu.isa()
    doc_tokens = {n: tok.encode(json.dumps(d, separators=(",", ":")), add_special_tokens=False)
                  for n, d in DOCS.items()}
    libs, results = [], {}
    for cls in LIBS:
        if importlib.util.find_spec(cls.module) is None:
            print(f"{cls.name}: not installed, skipped")
            continue
        t0 = time.perf_counter()
        lib = cls(tok)
        results[cls.name] = {"tokenizer_ms": [(time.perf_counter() - t0) * 1e3], "size_mb": [lib.size_mb()]}
        libs.append(lib)
    for _ in range(args.rounds):
        for lib in libs:
            _round(lib, doc_tokens, results[lib.name])
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}
    print(f"grammar libraries on {cfg.name} (vocabulary {tok.vocab_size}), CPU ISA {isa}, one thread, "
          f"median of {args.rounds} alternating rounds; documents of "
          + ", ".join(f"{n} {len(t)} tokens" for n, t in doc_tokens.items()))
    cols = ["size_mb", "tokenizer_ms"] + [f"{m}:{s}" for s in SCHEMAS for m in ("compile_ms", "mask_us_c1", "step_us_c16")]
    print("| library | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for n, r in med.items():
        print(f"| {n} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |")
    steps = None
    if args.engine:
        steps = engine_steps(args.threads, args.rounds)
        print(f"\nengine decode, bundled model, greedy, 48 tokens, {args.threads} kernel threads, CPU ISA {isa}, "
              f"{args.rounds} alternating rounds:")
        print("| concurrency | tok/s, no schema | tok/s, JSON schema | ratio | tokens per step, JSON "
              "| step ms, no schema / JSON |")
        print("|---|---|---|---|---|---|")
        for c in (1, 16):
            f, j = steps[f"free_c{c}"], steps[f"json_c{c}"]
            print(f"| {c} | {f['tok_s']:.1f} | {j['tok_s']:.1f} | {j['tok_s'] / f['tok_s']:.3f} | "
                  f"{j['tokens_per_step']:.2f} | {f['step_ms']:.2f} / {j['step_ms']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": isa, "vocab": tok.vocab_size, "median": med, "raw": results, "engine_decode": steps},
                      f, indent=1)
    return 0
