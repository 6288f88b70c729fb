"""How `tandem bench` shows results: Markdown tables, PNG plots (matplotlib, imported only
when a plot is asked for) and the JSON file (``write_json``)."""

from __future__ import annotations

import json
import math
import sys

from bench.loadgen import load_label


def fmt(x, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown_table(runs: list[dict]) -> str:
    """One row per (system, load level): latency quantiles, throughput, goodput."""
    head = ("| system | load | requests | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | TPOT p50 ms | TPOT p90 ms "
            "| TPOT p99 ms | ITL p99 ms | output tok/s | goodput req/s | SLO met | errors |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(runs, key=lambda r: (r.get("rate") or r["concurrency"], r["system"])):
        slo = r.get("slo_met")
        lines.append(
            f"| {r['system']} | {load_label(r)} | {r['requests']} | {fmt(r['ttft_p50_ms'])} | {fmt(r.get('ttft_p90_ms'))} "
            f"| {fmt(r['ttft_p99_ms'])} | {fmt(r['tpot_p50_ms'])} | {fmt(r.get('tpot_p90_ms'))} "
            f"| {fmt(r['tpot_p99_ms'])} | {fmt(r['itl_p99_ms'])} | {fmt(r['throughput_tok_s'])} "
            f"| {fmt(r.get('goodput_req_s'), 2)} | {'-' if slo is None else fmt(100 * slo, 0) + ' %'} | {r['errors']} |")
    return "\n".join(lines)


def tier_table(runs: list[dict]) -> str:
    """Per SLA tier of each run: TTFT / TPOT p50 and p99, goodput against the tier's SLO."""
    lines = ["| system | load | tier | SLO TTFT/TPOT ms | requests | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms "
             "| TPOT p99 ms | goodput req/s | SLO met |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        for tier, s in r.get("per_tier", {}).items():
            ttft, tpot = r["slos"][tier]
            lines.append(f"| {r['system']} | {load_label(r)} | {tier} | {ttft:g}/{tpot:g} | {s['requests']} "
                         f"| {fmt(s['ttft_p50_ms'])} | {fmt(s['ttft_p99_ms'])} | {fmt(s['tpot_p50_ms'])} "
                         f"| {fmt(s['tpot_p99_ms'])} | {fmt(s['goodput_req_s'], 2)} | {fmt(100 * s['slo_met'], 0)} % |")
    return "\n".join(lines)


def pivot_table(runs: list[dict], key: str, title: str, digits: int = 1) -> str:
    """Rows: load level; columns: systems; cells: ``key`` (e.g. the crossover's throughput)."""
    systems = list(dict.fromkeys(r["system"] for r in runs))
    levels = sorted({r["concurrency"] for r in runs})
    by = {(r["system"], r["concurrency"]): r for r in runs}
    lines = [f"| {title} | " + " | ".join(systems) + " |", "|---:|" + "---:|" * len(systems)]
    for c in levels:
        lines.append(f"| {c} | " + " | ".join(fmt(by[(s, c)][key], digits) if (s, c) in by else "-"
                                              for s in systems) + " |")
    return "\n".join(lines)


def plot(runs: list[dict], path: str, title: str, panels=(("throughput_tok_s", "output tokens/s"),
                                                          ("ttft_p50_ms", "TTFT p50 (ms)"),
                                                          ("tpot_p50_ms", "TPOT p50 (ms)"))) -> str:
    """One PNG, one panel per metric, one line per system against load (concurrency or rate)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    open_loop = any(r.get("mode") == "open" for r in runs)
    for ax, (key, label) in zip(axes[0], panels):
        for system in dict.fromkeys(r["system"] for r in runs):
            pts = sorted((r["rate"] if open_loop else r["concurrency"], r[key]) for r in runs
                         if r["system"] == system and r.get(key) is not None and not math.isnan(r[key]))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=system)
        ax.set_xlabel("offered load (req/s)" if open_loop else "concurrency")
        if not open_loop:
            ax.set_xscale("log", base=2)
            levels = sorted({r["concurrency"] for r in runs})
            ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def progress(tag: str):
    """A bench's progress line writer: ``progress("bench engine")("msg")`` -> stderr ``[bench engine] msg``."""
    def write(msg: str) -> None:
        sys.stderr.write(f"[{tag}] {msg}\n")
        sys.stderr.flush()
    return write


def emit(res: dict, table, json_path: str | None) -> None:
    """Print ``table(res)`` (Markdown) on stdout; write ``res`` as JSON to ``json_path`` if given."""
    print(table(res))
    if json_path:
        write_json(json_path, res)


def write_json(path: str, obj: dict) -> None:
    """Write ``obj`` (NaN -> null) atomically: a temporary file, then a rename."""
    import os

    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_nan_to_none(obj), f, indent=1)
    os.replace(tmp, path)


def _nan_to_none(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_nan_to_none(v) for v in x]
    return x
