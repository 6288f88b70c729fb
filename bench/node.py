"""``tandem bench node``: the node's two decode pools side by side through the stack — the same
streamed request as an interactive one (routed to gpu-decode) and as a standard one (cpu-decode).

    tandem bench node [--requests 8] [--concurrency 1 8] [--max-tokens 128] [--json FILE]

One ``tandem up --prefill 0 --gpu-decode 1 --cpu-decode 1 --kvpool 0`` (its own embedded NATS;
gpu-decode on CUDA where a device exists, on the CPU otherwise — the table says which). At each
``--concurrency`` level, ``--requests`` streamed chats per tier (greedy, ``ignore_eos``), the
tiers alternating level by level so that drift hits both: TTFT and TPOT p50 / p90 per tier, and
the ratio interactive ÷ standard (the issue's target on a GPU node: interactive TPOT ≤ 1/3 of
the same request on cpu-decode). Prints a Markdown table; run on a lent GPU by scripts/gpu-check.

``--capacity``: then the node's capacity at an interactive SLO (bench/capacity.py: the highest
Poisson request rate of a mixed interactive + batch workload with the interactive tier's TTFT p90
and TPOT p90 inside ``--slo-ttft-ms`` / ``--slo-tpot-ms``), on this stack (gpu-decode +
cpu-decode) and on a second one with gpu-decode alone (``--cpu-decode 0``: every tier on the
GPU), and their ratio — within ``--budget-s`` for the two together (the ladder stops early and
says so). ``--no-levels`` skips the side-by-side part. On a machine without CUDA both stacks run
gpu-decode on the CPU: a degenerate run that checks the code path, not a capacity figure.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from bench import report
from bench.loadgen import Request, client_for, percentile, run_jobs, served_model
from bench.serve import Server, bench_env
from shared.nats_server import free_port
from bench.cli import at_least

PROMPT = "Write a long story about a lighthouse keeper and a storm."
TIERS = ("interactive", "standard")


# the capacity ladder's numeric options: flag, type, default, meaning
_CAPACITY_ARGS = (
    ("--slo-ttft-ms", float, 500.0, "interactive TTFT p90 bound"),
    ("--slo-tpot-ms", float, 50.0, "interactive TPOT p90 bound"),
    ("--cap-max-tokens", int, 64, "tokens a request"),
    ("--level-s", float, 10.0, "seconds of arrivals a level"),
    ("--drain-s", float, 15.0, "seconds a level may take to drain"),
    ("--settle-s", float, 5.0, "pause after a failed level (and after the warm-up)"),
    ("--warmup-s", float, 4.0, "seconds of arrivals at the start rate before a ladder, not judged (0: none)"),
    ("--start-rate", float, 1.0, "first rate, req/s, doubled each level"),
    ("--max-rate", float, 256.0, "highest rate tried"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=8, help="requests per tier and level (default 8)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="streams at once (default 1 8)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--threads", type=at_least(0), default=0, help="engine threads (0: as tandem up picks them)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument("--no-levels", action="store_true", help="skip the side-by-side TTFT / TPOT levels")
    c = p.add_argument_group("capacity (bench/capacity.py)")
    c.add_argument("--capacity", action="store_true", help="compare node capacity: GPU + CPU vs GPU alone")
    c.add_argument("--mix", default="interactive=1,batch=2", help="tier mix (default interactive=1,batch=2)")
    for flag, kind, default, what in _CAPACITY_ARGS:
        c.add_argument(flag, type=kind, default=default, help=f"{what} (default {default:g})")
    c.add_argument("--budget-s", type=float, default=200.0,
                   help="seconds for the capacity part, both stacks and their start (default 200)")


def _device() -> str:
    try:
        import torch
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "the CPU (no CUDA device)"
    except Exception:  # noqa: BLE001 - the table names what it ran on, whatever torch says
        return "unknown"


async def _level(url: str, tier: str, c: int, n: int, max_tokens: int) -> list:
    jobs = [[Request([{"role": "user", "content": f"[{tier} {c} {i}] {PROMPT}"}], max_tokens, tier=tier)]
            for i in range(n)]
    async with client_for(c) as client:
        model = await served_model(client, url)
    results, _ = await run_jobs(url, jobs, concurrency=c, model=model, label=f"{tier} x{c}", progress=False)
    return results


def summarize(results: list) -> dict:
    ok = [r for r in results if r.ok]
    return {"ok": len(ok), "errors": len(results) - len(ok),
            "ttft_p50_ms": percentile([r.ttft * 1e3 for r in ok], 50),
            "ttft_p90_ms": percentile([r.ttft * 1e3 for r in ok], 90),
            "tpot_p50_ms": percentile([r.tpot * 1e3 for r in ok], 50),
            "tpot_p90_ms": percentile([r.tpot * 1e3 for r in ok], 90)}


def _stack(args: argparse.Namespace, cpu_decode: int, extra_env: dict | None = None) -> Server:
    """``tandem up`` with gpu-decode (and ``cpu_decode`` cpu-decode workers), warmed up; ``extra_env``
    on top of the bench's environment (bench/gpu_host.py: a modeled device)."""
    port = free_port()
    env = dict(bench_env(args.threads) if args.threads else bench_env(0), TANDEM_PORT=str(port), **(extra_env or {}))
    if not args.threads:
        env.pop("TANDEM_THREADS", None)
    argv = [sys.executable, "-m", "services.cli", "up", "--prefill", "0", "--gpu-decode", "1", "--cpu-decode",
            str(cpu_decode), "--kvpool", "0", "--port", str(port)]
    server = Server("node" if cpu_decode else "node-gpu-only", argv, env, port)
    t0 = time.perf_counter()
    try:
        server.wait_workers({"gpu-decode": 1, "cpu-decode": 1} if cpu_decode else {"gpu-decode": 1})
        sys.stderr.write(f"[bench node] stack ({'gpu + cpu' if cpu_decode else 'gpu alone'}) ready in "
                         f"{time.perf_counter() - t0:.0f} s\n")
        for tier in TIERS:   # warm-up: graphs captured, kernels compiled, weights paged in
            asyncio.run(_level(server.url, tier, 1, 2, 16))
    except BaseException:
        _stop(server)
        raise
    return server


def _stop(server: Server) -> None:
    rc = server.stop()
    if rc not in (0, -signal.SIGTERM):
        sys.stderr.write(f"[bench node] the stack exited with {rc}:\n{server.tail()}\n")


def run(args: argparse.Namespace) -> dict:
    res: dict = {"gpu_decode_on": _device(), "max_tokens": args.max_tokens, "levels": {}}
    if args.capacity:
        from bench import capacity
        capacity.level_jobs(1, 1, args.mix, 1, 0)      # a --mix without interactive fails now, not later
    t_start = time.monotonic()
    server = _stack(args, 1)
    try:
        for k, c in enumerate([] if args.no_levels else args.concurrency):
            level = {}
            for tier in (TIERS if k % 2 == 0 else TIERS[::-1]):
                level[tier] = summarize(asyncio.run(_level(server.url, tier, c, args.requests, args.max_tokens)))
                sys.stderr.write(f"[bench node] x{c} {tier}: {level[tier]}\n")
            level["tpot_ratio"] = level["interactive"]["tpot_p50_ms"] / level["standard"]["tpot_p50_ms"]
            level["ttft_ratio"] = level["interactive"]["ttft_p50_ms"] / level["standard"]["ttft_p50_ms"]
            res["levels"][str(c)] = level
        if args.capacity:
            from bench import capacity
            t_cap = time.monotonic()
            deadline = t_cap + args.budget_s
            slo = capacity.Slo(args.slo_ttft_ms, args.slo_tpot_ms)
            cap = res["capacity"] = {"slo": slo.describe(), "mix": args.mix, "max_tokens": args.cap_max_tokens,
                                     "level_s": args.level_s, "drain_s": args.drain_s, "budget_s": args.budget_s,
                                     "configs": {}}
            # the first stack gets half the budget; the second what is left once it has started
            cap["configs"]["gpu+cpu"] = capacity.ladder(server.url, args, "gpu+cpu", t_cap + args.budget_s / 2)
            _stop(server)
            server = _stack(args, 0)
            cap["configs"]["gpu"] = capacity.ladder(server.url, args, "gpu alone", deadline)
            a, b = (cap["configs"][k]["capacity_req_s"] for k in ("gpu+cpu", "gpu"))
            cap["ratio"] = a / b if a and b else None
            # a capacity ratio only where both ladders reached a failing level (else lower bounds)
            cap["bracketed"] = all(cap["configs"][k]["first_fail_req_s"] for k in ("gpu+cpu", "gpu"))
            cap["seconds"] = round(time.monotonic() - t_cap, 1)
    finally:
        _stop(server)
    res["seconds"] = round(time.monotonic() - t_start, 1)
    return res


def table(res: dict) -> str:
    lines = [f"gpu-decode on {res['gpu_decode_on']}; cpu-decode on the host"]
    if res["levels"]:
        lines += [f"{res['max_tokens']} tokens a request", "",
                  "| streams | tier (pool) | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms | errors |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
    for c, level in res["levels"].items():
        for tier, pool in (("interactive", "gpu-decode"), ("standard", "cpu-decode")):
            s = level[tier]
            lines.append(f"| {c} | {tier} ({pool}) | {report.fmt(s['ttft_p50_ms'])} | {report.fmt(s['ttft_p90_ms'])} | "
                         f"{report.fmt(s['tpot_p50_ms'], 2)} | {report.fmt(s['tpot_p90_ms'], 2)} | {s['errors']} |")
        lines.append(f"| {c} | interactive ÷ standard | {level['ttft_ratio']:.2f} | | {level['tpot_ratio']:.2f} | | |")
    if "capacity" in res:
        from bench import capacity
        lines += ["", capacity.table(res["capacity"]), "", f"({res['capacity']['seconds']:g} s of "
                  f"{res['capacity']['budget_s']:g} s budgeted for the capacity part; the bench {res['seconds']:g} s)"]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    res = run(args)
    report.emit(res, table, args.json)
    ok = all(level[t]["errors"] == 0 for level in res["levels"].values() for t in TIERS)
    if "capacity" in res:
        ok = ok and all(c["levels"] for c in res["capacity"]["configs"].values())
    return 0 if ok else 1
