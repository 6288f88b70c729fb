"""``tandem bench tiers``: a mixed agent workload with the SLA tiers on vs one FIFO queue.

    tandem bench tiers [--batch-sessions 4] [--turns 3] [--interactive 12] [--rate 0.5]
                       [--max-tokens 32] [--interactive-tokens 16] [--policies fifo sla] [--json F]

For each router policy in turn, the same stack (``tandem up --prefill 0 --gpu-decode 1
--cpu-decode 1 --kvpool 0``, one engine thread each, its own embedded NATS; on a machine
without CUDA the gpu-decode pool runs on the CPU too) gets the same load, in one asyncio loop:

- background: ``--batch-sessions`` agent sessions at the batch tier, closed loop — each sends
  its turns one after the other (a long shared system prompt, each turn adding a reply and a
  tool result: the context grows), starting over with a new session id when done, until the
  interactive users are done;
- foreground: ``--interactive`` short chat requests at the interactive tier, arriving as a
  Poisson process of ``--rate`` requests/s (seeded: both policies see the same arrivals),
  starting once every background session has sent its first turn.

``sla``: the tiers choose the pool (interactive -> gpu-decode, batch -> cpu-decode with overflow),
the queue order and preemption in every engine. ``fifo``: no tiers — the least-loaded worker,
one priority. Printed side by side: interactive TTFT / TPOT p50 and p99, batch throughput
(batch output tokens streamed while the interactive users were served, over that time — and,
for reference, every batch token over the whole run including the drain after the last
interactive reply, where a few in-flight requests finish alone), and the ratios against the issue's targets
(interactive p99 TTFT >= 3x better with tiers, batch throughput >= 90 % of FIFO's).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import signal
import sys
import time

from bench import report
from bench.loadgen import RequestResult, client_for, make_jobs, percentile, send, served_model
from bench.serve import Server, bench_env, run_cli
from shared.nats_server import free_port

POLICIES = ("fifo", "sla")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                   help="router policies to compare, in this order (default: fifo sla)")
    p.add_argument("--batch-sessions", type=int, default=4, help="background agent sessions (default 4)")
    p.add_argument("--turns", type=int, default=3, help="turns per agent session (default 3)")
    p.add_argument("--turn-words", type=int, default=100, help="words a tool result adds per turn (default 100)")
    p.add_argument("--interactive", type=int, default=12, help="interactive requests (default 12)")
    p.add_argument("--rate", type=float, default=0.5, help="interactive arrivals per second (default 0.5)")
    p.add_argument("--max-tokens", type=int, default=32, help="batch output tokens per turn (default 32)")
    p.add_argument("--interactive-tokens", type=int, default=16,
                   help="interactive output tokens per request (default 16)")
    p.add_argument("--threads", type=int, default=1, help="engine threads per worker (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


async def _load(url: str, args: argparse.Namespace) -> tuple[list[RequestResult], list[RequestResult], float, float]:
    """Background batch sessions and foreground interactive arrivals on one loop: (interactive
    results, batch results, seconds until the last interactive reply, seconds until the last
    batch reply)."""
    inter_jobs = make_jobs("chat", args.interactive, max_tokens=args.interactive_tokens,
                           tiers={"interactive": 1.0}, seed=args.seed)
    inter: list[RequestResult] = []
    batch: list[RequestResult] = []
    done = asyncio.Event()
    started = 0
    all_started = asyncio.Event()
    async with client_for(args.batch_sessions + args.interactive) as client:
        model = await served_model(client, url)
        t0 = time.perf_counter()

        async def background(k: int) -> None:
            nonlocal started
            for round_ in itertools.count():
                session = make_jobs("agent", args.turns, max_tokens=args.max_tokens, tiers={"batch": 1.0},
                                    seed=1000 * k + round_, turns=args.turns, turn_words=args.turn_words)[0]
                for i, req in enumerate(session):
                    if round_ == 0 and i == 0:
                        started += 1
                        if started == args.batch_sessions:
                            all_started.set()
                    batch.append(await send(client, url, model, req, t0))
                    if done.is_set():
                        return

        async def foreground() -> None:
            nonlocal mixed
            await all_started.wait()
            await asyncio.sleep(2.0)  # the first turns' prefills are under way
            rng, tasks = random.Random(args.seed), []
            for job in inter_jobs:
                tasks.append(asyncio.create_task(send(client, url, model, job[0], t0)))
                await asyncio.sleep(rng.expovariate(args.rate))
            inter.extend(await asyncio.gather(*tasks))
            mixed = time.perf_counter() - t0
            done.set()

        mixed = 0.0
        await asyncio.gather(foreground(), *(background(k) for k in range(args.batch_sessions)))
        window = time.perf_counter() - t0
    return inter, batch, mixed, window


def tokens_by(r: RequestResult, t: float) -> float:
    """Output tokens of ``r`` streamed by ``t`` seconds after the run began (from its chunk times)."""
    if not r.ok or math.isnan(r.ttft):
        return 0.0
    times = list(itertools.accumulate(r.itl, initial=r.start + r.ttft))
    return sum(1 for x in times if x <= t) * r.tokens / len(times)


def summarize(policy: str, inter: list[RequestResult], batch: list[RequestResult], mixed: float,
              window: float) -> dict:
    ok_i = [r for r in inter if r.ok]
    ok_b = [r for r in batch if r.ok]
    tpots = [r.tpot for r in ok_i if not math.isnan(r.tpot)]
    return {
        "system": policy, "interactive_requests": len(inter), "interactive_errors": len(inter) - len(ok_i),
        "batch_requests": len(batch), "batch_errors": len(batch) - len(ok_b),
        "errors": len(inter) - len(ok_i) + len(batch) - len(ok_b),
        "interactive_ttft_p50_ms": percentile([r.ttft for r in ok_i], 50) * 1e3,
        "interactive_ttft_p99_ms": percentile([r.ttft for r in ok_i], 99) * 1e3,
        "interactive_tpot_p50_ms": percentile(tpots, 50) * 1e3,
        "interactive_tpot_p99_ms": percentile(tpots, 99) * 1e3,
        "batch_ttft_p50_ms": percentile([r.ttft for r in ok_b], 50) * 1e3,
        "batch_tok_s": sum(tokens_by(r, mixed) for r in ok_b) / mixed if mixed > 0 else math.nan,
        "batch_tok_s_with_drain": sum(r.tokens for r in ok_b) / window if window > 0 else math.nan,
        "batch_prompt_tokens_mean": sum(r.prompt_tokens for r in ok_b) / max(1, len(ok_b)),
        "batch_computed_tokens_mean": sum(r.prompt_tokens - r.cached_tokens for r in ok_b) / max(1, len(ok_b)),
        "mixed_s": mixed, "window_s": window,
    }


def run_policy(args: argparse.Namespace, policy: str) -> dict:
    port = free_port()
    env = dict(bench_env(args.threads), TANDEM_PORT=str(port), TANDEM_ROUTER_POLICY=policy)
    argv = [sys.executable, "-m", "services.cli", "up", "--prefill", "0", "--gpu-decode", "1", "--cpu-decode", "1",
            "--kvpool", "0", "--port", str(port)]
    server = Server(policy, argv, env, port)
    try:
        server.wait_workers({"gpu-decode": 1, "cpu-decode": 1})
        sys.stderr.write(f"[{policy}] {args.batch_sessions} batch sessions + {args.interactive} interactive "
                         f"requests at {args.rate:g}/s ...\n")
        inter, batch, mixed, window = asyncio.run(_load(server.url, args))
    finally:
        rc = server.stop()
        if rc not in (0, -signal.SIGTERM):
            sys.stderr.write(f"[{policy}] exited with {rc}:\n{server.tail()}\n")
    out = summarize(policy, inter, batch, mixed, window)
    errors = [r.error for r in inter + batch if not r.ok]
    if errors:
        sys.stderr.write(f"[{policy}] {len(errors)} failed, first: {errors[0]}\n")
    return out


ROWS = [("interactive TTFT p50 ms", "interactive_ttft_p50_ms", "lower"),
        ("interactive TTFT p99 ms", "interactive_ttft_p99_ms", "lower"),
        ("interactive TPOT p50 ms", "interactive_tpot_p50_ms", "lower"),
        ("interactive TPOT p99 ms", "interactive_tpot_p99_ms", "lower"),
        ("batch TTFT p50 ms", "batch_ttft_p50_ms", "lower"),
        ("batch output tok/s (while interactive runs)", "batch_tok_s", "higher"),
        ("batch output tok/s (incl. drain)", "batch_tok_s_with_drain", "higher"),
        ("batch requests", "batch_requests", "higher"),
        ("mean batch prompt tokens", "batch_prompt_tokens_mean", ""),
        ("  of which computed (not cached)", "batch_computed_tokens_mean", ""),
        ("errors", "errors", "")]


def table(runs: list[dict]) -> str:
    names = [r["system"] for r in runs]
    head = "| metric | " + " | ".join(names) + (" | fifo / sla |" if names == ["fifo", "sla"] else " |")
    lines = [head, "|" + "---|" * (len(names) + 1 + (names == ["fifo", "sla"]))]
    for title, key, _ in ROWS:
        vals = [r[key] for r in runs]
        cells = [report.fmt(v) if isinstance(v, float) else str(v) for v in vals]
        if names == ["fifo", "sla"]:
            ratio = vals[0] / vals[1] if vals[1] else math.nan
            cells.append(f"{ratio:.2f}x" if key != "errors" else "")
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    if args.batch_sessions < 1 or args.turns < 1 or args.interactive < 1 or args.rate <= 0:
        raise ValueError("--batch-sessions, --turns and --interactive must be >= 1, --rate > 0")
    runs = [run_policy(args, p) for p in args.policies]
    print(f"tiers vs FIFO: {args.batch_sessions} batch agent sessions ({args.turns} turns, max_tokens "
          f"{args.max_tokens}) + {args.interactive} interactive chats at {args.rate:g}/s (max_tokens "
          f"{args.interactive_tokens}); 1 gpu-decode + 1 cpu-decode, {args.threads} thread(s) each")
    print()
    print(table(runs))
    by = {r["system"]: r for r in runs}
    if {"fifo", "sla"} <= set(by):
        f, s = by["fifo"], by["sla"]
        ttft = f["interactive_ttft_p99_ms"] / s["interactive_ttft_p99_ms"]
        tput = s["batch_tok_s"] / f["batch_tok_s"]
        print()
        print(f"interactive p99 TTFT: {ttft:.2f}x better with tiers (target >= 3x: "
              f"{'met' if ttft >= 3 else 'NOT met'}); batch throughput {tput:.0%} of FIFO's (target >= 90 %: "
              f"{'met' if tput >= 0.9 else 'NOT met'})")
    out = {"config": {k: v for k, v in vars(args).items() if k not in ("func",)}, "runs": runs}
    if args.json:
        report.write_json(args.json, out)
    return out


def main(args: argparse.Namespace) -> int:
    return run_cli("tiers", run, args)
