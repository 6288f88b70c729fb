"""``tandem bench node``: the node's two decode pools side by side through the stack — the same
streamed request as an interactive one (routed to gpu-decode) and as a standard one (cpu-decode).

    tandem bench node [--requests 8] [--concurrency 1 8] [--max-tokens 128] [--json FILE]

One ``tandem up --prefill 0 --gpu-decode 1 --cpu-decode 1 --kvpool 0`` (its own embedded NATS;
gpu-decode on CUDA where a device exists, on the CPU otherwise — the table says which). At each
``--concurrency`` level, ``--requests`` streamed chats per tier (greedy, ``ignore_eos``), the
tiers alternating level by level so that drift hits both: TTFT and TPOT p50 / p90 per tier, and
the ratio interactive ÷ standard (the issue's target on a GPU node: interactive TPOT ≤ 1/3 of
the same request on cpu-decode). Prints a Markdown table; run on a lent GPU by scripts/gpu-check.
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

PROMPT = "Write a long story about a lighthouse keeper and a storm."
TIERS = ("interactive", "standard")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=8, help="requests per tier and level (default 8)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="streams at once (default 1 8)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--threads", type=int, default=0, help="engine threads (0: as tandem up picks them)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")


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


def run(args: argparse.Namespace) -> dict:
    port = free_port()
    env = dict(bench_env(args.threads) if args.threads else bench_env(0), TANDEM_PORT=str(port))
    if not args.threads:
        env.pop("TANDEM_THREADS", None)
    argv = [sys.executable, "-m", "services.cli", "up", "--prefill", "0", "--gpu-decode", "1", "--cpu-decode", "1",
            "--kvpool", "0", "--port", str(port)]
    server = Server("node", argv, env, port)
    res: dict = {"gpu_decode_on": _device(), "max_tokens": args.max_tokens, "levels": {}}
    try:
        t0 = time.perf_counter()
        server.wait_workers({"gpu-decode": 1, "cpu-decode": 1})
        sys.stderr.write(f"[bench node] stack ready in {time.perf_counter() - t0:.0f} s\n")
        for tier in TIERS:   # warm-up: graphs captured, kernels compiled, weights paged in
            asyncio.run(_level(server.url, tier, 1, 2, 16))
        for k, c in enumerate(args.concurrency):
            level = {}
            for tier in (TIERS if k % 2 == 0 else TIERS[::-1]):
                level[tier] = summarize(asyncio.run(_level(server.url, tier, c, args.requests, args.max_tokens)))
                sys.stderr.write(f"[bench node] x{c} {tier}: {level[tier]}\n")
            level["tpot_ratio"] = level["interactive"]["tpot_p50_ms"] / level["standard"]["tpot_p50_ms"]
            level["ttft_ratio"] = level["interactive"]["ttft_p50_ms"] / level["standard"]["ttft_p50_ms"]
            res["levels"][str(c)] = level
    finally:
        rc = server.stop()
        if rc not in (0, -signal.SIGTERM):
            sys.stderr.write(f"[bench node] the stack exited with {rc}:\n{server.tail()}\n")
    return res


def table(res: dict) -> str:
    lines = [f"gpu-decode on {res['gpu_decode_on']}; cpu-decode on the host; {res['max_tokens']} tokens a request", "",
             "| streams | tier (pool) | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms | errors |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for c, level in res["levels"].items():
        for tier, pool in (("interactive", "gpu-decode"), ("standard", "cpu-decode")):
            s = level[tier]
            lines.append(f"| {c} | {tier} ({pool}) | {report.fmt(s['ttft_p50_ms'])} | {report.fmt(s['ttft_p90_ms'])} | "
                         f"{report.fmt(s['tpot_p50_ms'], 2)} | {report.fmt(s['tpot_p90_ms'], 2)} | {s['errors']} |")
        lines.append(f"| {c} | interactive ÷ standard | {level['ttft_ratio']:.2f} | | {level['tpot_ratio']:.2f} | | |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    res = run(args)
    report.emit(res, table, args.json)
    return 0 if all(level[t]["errors"] == 0 for level in res["levels"].values() for t in TIERS) else 1
