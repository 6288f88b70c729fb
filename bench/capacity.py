"""Node capacity at an interactive SLO: the highest open-loop request rate a running stack serves
with the interactive tier inside its SLO — the figure behind "GPU + CPU serve more than the GPU
alone" (issue 34 part 5; run by ``tandem bench node --capacity``, which compares two stacks).

A level: ``level_s`` seconds of Poisson arrivals at ``rate`` requests/s of the chat workload in
a tier mix (by default interactive 1 : batch 2), ``max_tokens`` each (``ignore_eos``), then the
drain. It **passes** when every request finished without error, the whole level took at most
``level_s + drain_s`` (the node kept up: a backlog shows here first), and the interactive tier's
TTFT p90 and TPOT p90 are within the SLO. After a failed level the ladder waits ``settle_s``
(what the level left queued drains or is aborted). The ladder doubles the rate from ``start`` until a
level fails, then tries the geometric mean of the last pass and the first fail once; the
capacity is the highest passing rate, bracketed by the lowest failing one. Before the first
level, ``warmup_s`` seconds at the start rate are served and not judged: first-use work (a GPU's
kernel compiles, caches filling) once failed a first level on its own. It stops early —
and says so — when the next level would not fit the time left (``deadline``): without a
failing level the capacity is then "at least" that rate.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass

from bench.loadgen import make_jobs, parse_mix, run_jobs, summarize


@dataclass
class Slo:
    ttft_ms: float = 500.0     # interactive TTFT p90
    tpot_ms: float = 50.0      # interactive TPOT p90

    def describe(self) -> str:
        return f"interactive TTFT p90 <= {self.ttft_ms:g} ms and TPOT p90 <= {self.tpot_ms:g} ms"


def judge(summary: dict, wall_s: float, level_s: float, drain_s: float, slo: Slo) -> tuple[bool, str]:
    """Does a level pass (see the module's docstring)? (verdict, why) from ``loadgen.summarize``'s
    output; a level that timed out has ``wall_s`` = inf."""
    if summary["errors"]:
        return False, f"{summary['errors']} of {summary['requests']} requests failed"
    if wall_s == math.inf:
        return False, f"did not drain: cut off past {level_s:g} + {drain_s:g} s"
    if wall_s > level_s + drain_s:
        return False, f"did not drain: {wall_s:.1f} s > {level_s:g} + {drain_s:g} s"
    inter = summary["per_tier"].get("interactive")
    if not inter or not inter["requests"]:
        return False, "no interactive request in the level"
    ttft, tpot = inter["ttft_p90_ms"], inter["tpot_p90_ms"]
    if not ttft <= slo.ttft_ms:
        return False, f"interactive TTFT p90 {ttft:.0f} ms > {slo.ttft_ms:g}"
    if not (tpot <= slo.tpot_ms or math.isnan(tpot)):
        return False, f"interactive TPOT p90 {tpot:.1f} ms > {slo.tpot_ms:g}"
    return True, f"TTFT p90 {ttft:.0f} ms, TPOT p90 {tpot:.1f} ms"


def next_rate(tried: list[tuple[float, bool]], start: float) -> float | None:
    """The ladder's next rate from the levels tried so far ((rate, passed) in order), None when
    done: double while passing; after the first fail, the geometric mean of the best pass and
    the lowest fail, once; a fail at the start halves once (a lower bound still shows)."""
    if not tried:
        return start
    passes = [r for r, ok in tried if ok]
    fails = [r for r, ok in tried if not ok]
    if not fails:
        return tried[-1][0] * 2
    if not passes:
        low = min(fails) / 2
        return low if len(fails) == 1 and low >= start / 4 else None
    lo, hi = max(passes), min(fails)
    return math.sqrt(lo * hi) if lo < hi and hi / lo > 1.5 else None   # one bisection of a doubling


def capacity(tried: list[tuple[float, bool]]) -> float:
    """The highest passing rate below every failing one (0 when none passed)."""
    fails = [r for r, ok in tried if not ok]
    cap = min(fails) if fails else math.inf
    return max([r for r, ok in tried if ok and r < cap], default=0.0)


def level_jobs(rate: float, level_s: float, mix: str, max_tokens: int, seed: int) -> list:
    """The jobs of one level: ``rate × level_s`` chat requests (at least 6) in the tier ``mix``,
    two of them at least interactive (the SLO is the interactive tier's)."""
    tiers = parse_mix(mix)
    if not tiers.get("interactive"):
        raise ValueError(f"--mix {mix!r} has no interactive requests: the capacity is measured at their SLO")
    jobs = make_jobs("chat", max(6, round(rate * level_s)), max_tokens=max_tokens, tiers=tiers, seed=seed)
    for job in [j for j in jobs if j[0].tier != "interactive"][:max(0, 2 - sum(j[0].tier == "interactive"
                                                                                for j in jobs))]:
        job[0].tier = "interactive"
    return jobs


def _level(url: str, rate: float, args, k: int, level_s: float | None = None) -> tuple[dict, float]:
    jobs = level_jobs(rate, args.level_s if level_s is None else level_s, args.mix, args.cap_max_tokens, k)
    n = len(jobs)
    t0 = time.perf_counter()

    async def go():
        return await asyncio.wait_for(run_jobs(url, jobs, mode="open", rate=rate, seed=k, progress=False),
                                      args.level_s + args.drain_s + 5)
    try:
        results, wall = asyncio.run(go())
    except TimeoutError:
        return {"requests": n, "errors": 0, "per_tier": {}}, math.inf
    s = summarize(results, wall, None)
    s["wall_s"] = round(time.perf_counter() - t0, 2)
    return s, wall


def ladder(url: str, args, name: str, deadline: float) -> dict:
    """Run the ladder against the stack at ``url`` until done or ``deadline`` (time.monotonic)."""
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    tried: list[tuple[float, bool]] = []
    levels = []
    stopped = ""
    k = 0
    warm = None
    if args.warmup_s > 0:   # first-use work (kernel compiles, caches) must not fail the first level
        s, wall = _level(url, args.start_rate, args, -1, args.warmup_s)
        inter = s.get("per_tier", {}).get("interactive", {})
        warm = {"rate": args.start_rate, "level_s": args.warmup_s, "requests": s["requests"], "errors": s["errors"],
                "wall_s": wall, "interactive_ttft_p90_ms": inter.get("ttft_p90_ms")}
        sys.stderr.write(f"[capacity {name}] warm-up, {args.warmup_s:g} s at {args.start_rate:g} req/s (not judged): "
                         f"interactive TTFT p90 {inter.get('ttft_p90_ms') or math.nan:.0f} ms\n")
        time.sleep(args.settle_s)
    while (rate := next_rate(tried, args.start_rate)) is not None:
        if rate > args.max_rate:
            stopped = f"--max-rate {args.max_rate:g} reached"
            break
        need = args.level_s + args.drain_s + args.settle_s
        if time.monotonic() + need > deadline:
            stopped = f"time budget: {deadline - time.monotonic():.0f} s left, a level may take {need:g} s"
            break
        s, wall = _level(url, rate, args, k)
        k += 1
        ok, why = judge(s, wall, args.level_s, args.drain_s, slo)
        tried.append((rate, ok))
        inter = s.get("per_tier", {}).get("interactive", {})
        levels.append({"rate": rate, "passed": ok, "why": why, "requests": s["requests"], "errors": s["errors"],
                       "wall_s": wall, "throughput_tok_s": s.get("throughput_tok_s"),
                       "interactive_ttft_p90_ms": inter.get("ttft_p90_ms"),
                       "interactive_tpot_p90_ms": inter.get("tpot_p90_ms"),
                       "tiers": {t: v["requests"] for t, v in s.get("per_tier", {}).items()}})
        sys.stderr.write(f"[capacity {name}] {rate:.3g} req/s: {'pass' if ok else 'FAIL'} ({why})\n")
        if not ok:      # what a failed level left queued must not weigh on the next one
            time.sleep(args.settle_s)
    fails = [r for r, ok in tried if not ok]
    return {"capacity_req_s": capacity(tried), "first_fail_req_s": min(fails) if fails else None,
            "stopped": stopped, "levels": levels, "warmup": warm}


def table(res: dict) -> str:
    """The comparison as Markdown (``res``: bench node's ``capacity`` entry)."""
    a, b = res["configs"]["gpu+cpu"], res["configs"]["gpu"]
    lines = [f"Node capacity at the interactive SLO ({res['slo']}); chat workload, tiers {res['mix']}, "
             f"{res['max_tokens']} tokens a request, {res['level_s']:g} s of Poisson arrivals a level "
             f"(+ {res['drain_s']:g} s to drain)", "",
             "| stack | capacity req/s | levels (req/s: verdict) |", "|---|---:|---|"]
    for label, r in (("gpu-decode + cpu-decode", a), ("gpu-decode alone", b)):
        lv = "; ".join(f"{x['rate']:.3g}: {'pass' if x['passed'] else 'fail'} ({x['why']})" for x in r["levels"])
        cap = (f"{r['capacity_req_s']:.3g} (fails at {r['first_fail_req_s']:.3g})" if r["first_fail_req_s"]
               else f"≥ {r['capacity_req_s']:.3g}")
        stop = f" — stopped: {r['stopped']}" if r["stopped"] else ""
        lines.append(f"| {label} | {cap} | {lv}{stop} |")
    ratio = res.get("ratio")
    if not ratio:
        verdict = "n/a (no passing level)"
    elif res.get("bracketed", True):
        verdict = f"{ratio:.2f}"
    else:
        verdict = (f"{ratio:.2f} of lower bounds — not a capacity ratio: a ladder stopped before a failing level "
                   "(raise --max-rate or --budget-s)")
    lines += ["", f"GPU + CPU ÷ GPU alone at this SLO: {verdict}"]
    return "\n".join(lines)
