"""``tandem bench stops``: does one sequence's stop strings slow the rest of its batch?

    tandem bench stops [--batch 8] [--gen-tokens 256] [--stop-strings 16] [--stop-chars 30000] [--json FILE]

One engine on CPU decodes a batch of ``--batch`` sequences (greedy, ignore_eos) of
``--gen-tokens`` tokens each, in rounds of two variants (in the order AB, BA, AB, ... so that a
machine whose load drifts does not favour one):

- **without**: no sequence has stop strings;
- **with**: sequence 0 has ``--stop-strings`` stop strings of ``--stop-chars`` characters. They are
  the worst case for a matcher: each begins with a longer prefix of the text sequence 0 is about
  to generate (known from the round before: greedy is deterministic), then random filler, so
  they match further at every step and never complete (sequence 0's text is all held back
  until it ends by length).

Reported per variant (median over ``--rounds``): the other sequences' decode tokens/s (counted
once every sequence has its first token) and the mean engine step; and the ratio of the two
variants. Stop matching is linear (shared/engine/stops.py): the ratio should be ~1.0, within the
machine's noise. Because a loaded machine's noise is larger than the effect, the matcher's own
cost is also measured alone: sequence 0's text, replayed in the pieces its steps produced,
through a ``StopMatcher`` with the same stop strings (microseconds per step, and as a share of
the mean step without stop strings).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from bench import report

PROMPT = "Write a long story about a lighthouse keeper and the sea. Chapter {i}:"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    p.add_argument("--threads", type=int, default=2, help="torch and kernel threads (default 2)")
    p.add_argument("--batch", type=int, default=8, help="sequences decoding together (default 8)")
    p.add_argument("--gen-tokens", type=int, default=256, help="tokens each sequence generates (default 256)")
    p.add_argument("--stop-strings", type=int, default=16,
                   help="stop strings of sequence 0 (default 16, the API's most)")
    p.add_argument("--stop-chars", type=int, default=30000, help="characters per stop string (default 30000)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each variant, alternating (default 2)")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 sequences x 32 tokens, 1 round")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")


_progress = report.progress("bench stops")


def adversarial_stops(text: str, n: int, chars: int, seed: int = 0) -> list[str]:
    """``n`` stop strings of ``chars`` characters: ever longer prefixes of ``text``, then filler
    (not in any output: control characters)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        head = text[:min(chars - 1, len(text) * (i + 1) // (n + 1))]
        out.append(head + "".join(chr(rng.randrange(1, 9)) for _ in range(chars - len(head))))
    return out


def one_round(engine, prompts: list[list[int]], gen: int, stops: list[str], tag: str) -> dict:
    """Decode the batch; sequence 0 gets ``stops``. Its text, the others' tok/s, mean step."""
    from shared.engine.sampling import SamplingParams

    n = len(prompts)
    for i, ids in enumerate(prompts):
        engine.add(f"{tag}-{i}", ids, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True,
                                                     stop=stops if i == 0 else []))
    first = f"{tag}-0"
    text, started, tokens, steps = [], set(), 0, 0
    t_start = None
    while engine.has_work():
        outs = engine.step()
        if t_start is not None:
            steps += 1
            tokens += sum(len(o.token_ids) for o in outs if o.request_id != first)
        for o in outs:
            started.add(o.request_id)
            if o.request_id == first:
                text.append(o.text)
        if t_start is None and len(started) == n:
            t_start = time.perf_counter()
    dt = time.perf_counter() - t_start
    return {"pieces": text, "others_tok_s": tokens / dt, "step_ms": 1000 * dt / max(1, steps)}


def matcher_us_per_step(pieces: list[str], stops: list[str], reps: int = 5) -> float:
    """The stop matcher alone: ``pieces`` fed one per step; best of ``reps``, microseconds per step."""
    from shared.engine.stops import StopMatcher

    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        m = StopMatcher(stops)
        for piece in pieces:
            if m.feed(piece):
                raise RuntimeError("a stop string completed")
            m.holdback
        best = min(best, time.perf_counter() - t0)
    return 1e6 * best / max(1, len(pieces))


def run(args: argparse.Namespace) -> dict:
    import torch

    from kernels import cpu
    from kernels.dispatch import describe
    from shared.engine.engine import Engine, EngineConfig

    if args.quick:
        args.batch, args.gen_tokens, args.rounds = 4, 32, 1
    torch.set_num_threads(args.threads)
    cpu.set_num_threads(args.threads)
    _progress("loading the model")
    engine = Engine.from_path(args.model, EngineConfig(threads=args.threads, enable_prefix_caching=False,
                                                       max_num_seqs=args.batch, kv_cache_bytes=256 << 20))
    tok = engine.tokenizer
    prompts = [tok.encode(PROMPT.format(i=i)) for i in range(args.batch)]
    base = one_round(engine, prompts, args.gen_tokens, [], "warm")  # warm-up; sequence 0's text
    stops = adversarial_stops("".join(base["pieces"]), args.stop_strings, args.stop_chars)
    res: dict = {"isa": cpu.isa(), "matmul_path": describe("cpu"), "threads": args.threads, "batch": args.batch,
                 "gen_tokens": args.gen_tokens, "stop_strings": args.stop_strings, "stop_chars": args.stop_chars,
                 "rounds": args.rounds, "without": [], "with": []}
    for r in range(args.rounds):
        for variant in ("without", "with") if r % 2 == 0 else ("with", "without"):  # ABBA: load drift cancels
            out = one_round(engine, prompts, args.gen_tokens, stops if variant == "with" else [], f"{variant}{r}")
            if variant == "with" and "".join(out["pieces"]) != "".join(base["pieces"]):
                raise RuntimeError("sequence 0's text changed with the stop strings (they must never complete)")
            res[variant].append({k: round(v, 3) for k, v in out.items() if k != "pieces"})
            _progress(f"round {r + 1} {variant}: others {out['others_tok_s']:.1f} tok/s, "
                      f"{out['step_ms']:.1f} ms/step")
    for variant in ("without", "with"):
        res[f"{variant}_others_tok_s"] = round(statistics.median(x["others_tok_s"] for x in res[variant]), 2)
        res[f"{variant}_step_ms"] = round(statistics.median(x["step_ms"] for x in res[variant]), 2)
    res["ratio"] = round(res["with_others_tok_s"] / res["without_others_tok_s"], 3)
    res["matcher_us_per_step"] = round(matcher_us_per_step(base["pieces"], stops), 1)
    res["matcher_share_of_step"] = round(res["matcher_us_per_step"] / 1000 / res["without_step_ms"], 5)
    res["held_back_chars"] = len("".join(base["pieces"]))
    return res


def table(res: dict) -> str:
    lines = [f"Stop strings vs the rest of the batch: {res['batch']} sequences x {res['gen_tokens']} tokens, "
             f"CPU {res['isa']} ({res['matmul_path']}), {res['threads']} threads, median of {res['rounds']} rounds",
             "", "| sequence 0's stop strings | other sequences' tok/s | ms per step | vs without |",
             "|---|---:|---:|---:|",
             f"| none | {res['without_others_tok_s']:.1f} | {res['without_step_ms']:.1f} | 1.000 |",
             f"| {res['stop_strings']} x {res['stop_chars']} chars | {res['with_others_tok_s']:.1f} | "
             f"{res['with_step_ms']:.1f} | {res['ratio']:.3f} |", "",
             f"The matcher alone, sequence 0's {res['held_back_chars']} characters replayed step by step: "
             f"{res['matcher_us_per_step']:.1f} us per step = {100 * res['matcher_share_of_step']:.3f} % of a step."]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    res = run(args)
    report.emit(res, table, args.json)
    return 0
