"""llama.cpp's CUDA build beside Tandem's CUDA engine, from one GPU check (issue 34's llama.cpp target).

    python -m bench.llamacpp_cuda LLAMA_JSON [TANDEM_BENCH_JSON | TANDEM_BENCH_LOG]

``LLAMA_JSON``: ``llama-bench -o json`` on the all-Q4_0 GGUF of the bundled model (the same weights
Tandem runs), as ``scripts/gpu-check llama`` runs it: tg128 (one sequence, 128 tokens after an empty
prompt) and pp512 / pp2048, flash attention off and on. The second file is ``tandem bench gpu``'s
JSON from the same machine (call 2), or, where that step was cut off before writing it, its log,
whose progress lines carry the same figures. Prints one table: llama.cpp's best of each test,
Tandem's CUDA graphs at one sequence (16-token prompts, 64 tokens: the nearest to tg128 the bench
runs) and its 2,048-token prefill, and the ratio Tandem ÷ llama.cpp.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path


def llama_rows(path: str) -> dict[str, dict]:
    """{"tg128" | "pp512" | "pp2048": the fastest record of that test (over flash attention off / on)}."""
    text = Path(path).read_text()
    records = json.loads(text) if text.strip() else []
    best: dict[str, dict] = {}
    for r in records:
        test = f"tg{r['n_gen']}" if r.get("n_gen") else f"pp{r['n_prompt']}"
        if test not in best or r["avg_ts"] > best[test]["avg_ts"]:
            best[test] = r
    return best


def tandem_figures(path: str | None) -> dict:
    """{"decode_x1": tok/s of the graphs engine at one sequence, "prefill_ms", "prefill_tokens"}: what
    the bench's JSON (or its log's progress lines) holds; {} when neither is there."""
    if not path or not Path(path).exists():
        return {}
    text = Path(path).read_text()
    try:
        res = json.loads(text)
    except ValueError:          # the log: "[bench gpu] graphs: decode tok/s {'1': 424.8, ...}"
        out: dict = {}
        for line in text.splitlines():
            if m := re.search(r"\] graphs: decode tok/s (\{.*\})", line):
                out["decode_x1"] = ast.literal_eval(m.group(1)).get("1")
            elif m := re.search(r"\] graphs: prefill of (\d+) tokens ([\d.]+) ms", line):
                out["prefill_tokens"], out["prefill_ms"] = int(m.group(1)), float(m.group(2))
        return {k: v for k, v in out.items() if v is not None}
    g = res.get("engines", {}).get("graphs", {})
    out = {"gpu": res.get("gpu")}
    if "1" in g.get("decode", {}):
        out["decode_x1"] = g["decode"]["1"]
    if "prefill_ms" in g:
        out["prefill_ms"], out["prefill_tokens"] = g["prefill_ms"], res.get("prefill_tokens", 2048)
    return out


def on_gpu(llama: dict[str, dict]) -> bool:
    """Did llama-bench run on a GPU? Where CUDA does not initialize (no driver, a runtime newer than
    the driver) it says so on stderr and runs on the CPU, with an empty ``gpu_info``."""
    return bool(llama) and all(r.get("gpu_info") for r in llama.values())


def table(llama: dict[str, dict], tandem: dict) -> str:
    any_row = next(iter(llama.values()), {})
    if llama and not on_gpu(llama):   # a CPU figure beside a GPU one is no comparison
        tandem = {}
    lines = [f"llama.cpp {any_row.get('build_commit', '?')} (llama-bench, CUDA, {any_row.get('gpu_info', '?')}), "
             f"model {any_row.get('model_type', '?')}, {any_row.get('n_gpu_layers', '?')} layers on the GPU; "
             "Tandem: `tandem bench gpu`, CUDA graphs, same machine", "",
             "| test | llama.cpp tok/s (± sd, flash attn) | Tandem | Tandem ÷ llama.cpp |", "|---|---:|---:|---:|"]
    for test in sorted(llama, key=lambda t: (t[:2] != "tg", int(t[2:]))):
        r = llama[test]
        mine, ratio = "—", "—"
        if test.startswith("tg") and "decode_x1" in tandem:
            mine = f"{tandem['decode_x1']:.1f} tok/s (x1, 64 tokens)"
            ratio = f"{tandem['decode_x1'] / r['avg_ts']:.2f}"
        elif test.startswith("pp") and int(test[2:]) == tandem.get("prefill_tokens") and "prefill_ms" in tandem:
            rate = tandem["prefill_tokens"] / tandem["prefill_ms"] * 1000
            mine = f"{rate:,.0f} tok/s ({tandem['prefill_ms']} ms)"
            ratio = f"{rate / r['avg_ts']:.2f}"
        lines.append(f"| {test} | {r['avg_ts']:,.1f} ± {r.get('stddev_ts', 0):,.1f} "
                     f"(fa {r.get('flash_attn', '?')}) | {mine} | {ratio} |")
    if not llama:
        lines.append("| (llama-bench wrote no result: see llama.log) | | | |")
    elif not on_gpu(llama):
        lines += ["", "**llama.cpp ran on the CPU**: CUDA did not initialize (llama.log says why): no GPU figure."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    llama = llama_rows(argv[0]) if Path(argv[0]).exists() else {}
    tandem = tandem_figures(argv[1] if len(argv) > 1 else None)
    print(table(llama, tandem))
    return 0 if on_gpu(llama) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
