"""``tandem bench tiers``: a mixed agent workload with the SLA tiers (and the OS priorities) vs
one FIFO queue, and the interactive latency idle vs under the batch flood.

    tandem bench tiers [--batch-sessions 4] [--turns 3] [--interactive 12] [--rate 0.5]
                       [--max-tokens 32] [--interactive-tokens 16] [--idle 12]
                       [--systems fifo sla-os-off sla] [--threads 0] [--prefill 0] [--kvpool 0] [--json F]

For each system in turn, the same stack (``tandem up --prefill 0 --gpu-decode 1 --cpu-decode 1
--kvpool 0``, engine threads as ``tandem up`` picks them unless ``--threads``, its own embedded
NATS; on a machine without CUDA the gpu-decode pool runs on the CPU too) gets the same load:

1. idle: ``--idle`` interactive requests one after the other, nothing else running (after two
   warm-up requests) — the interactive TTFT a user sees on a quiet stack;
2. flood, in one asyncio loop:
   - background: ``--batch-sessions`` agent sessions at the batch tier, closed loop — each sends
     its turns one after the other (a long shared system prompt, each turn adding a reply and a
     tool result: the context grows), starting over with a new session id when done, until the
     interactive users are done;
   - foreground: ``--interactive`` short chat requests at the interactive tier, arriving as a
     Poisson process of ``--rate`` requests/s (seeded: every system sees the same arrivals),
     starting once every background session has sent its first turn.

Systems: ``fifo`` — no tiers (``TANDEM_ROUTER_POLICY=fifo``): the least-loaded worker, one
priority; ``sla-os-off`` — the tiers (pool, queue order, preemption, step budgets) without any
OS knob (``TANDEM_OS_PRIORITY=0 TANDEM_OMP_SPIN=off TANDEM_ROLE_THREADS=0``: what `tandem up`
did before them: every engine on every core, libgomp's long spin); ``sla-lane-off`` — the tiers,
the threads per role and the bounded spin, but no batch lane (``TANDEM_OS_PRIORITY=0``: every
step at normal priority); ``sla`` — the tiers and every OS knob (shared/os_priority.py).
Printed side by side: interactive TTFT p50/p90/p99 idle and under the flood, and their ratios
(the targets: p90 under flood <= 2x idle, p99 <= 3x), interactive TPOT, batch throughput (batch
output tokens streamed while the interactive users were served, over that time — and, for
reference, every batch token over the whole run including the drain), and the ratios against
the other targets (interactive p99 TTFT >= 3x better than FIFO, batch throughput >= 90 % of
FIFO's and of the tiers' without the OS priorities).
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

# system -> the environment its stack gets
SYSTEMS = {"fifo": {"TANDEM_ROUTER_POLICY": "fifo"},
           "sla-os-off": {"TANDEM_ROUTER_POLICY": "sla", "TANDEM_OS_PRIORITY": "0", "TANDEM_OMP_SPIN": "off",
                          "TANDEM_ROLE_THREADS": "0"},
           "sla-lane-off": {"TANDEM_ROUTER_POLICY": "sla", "TANDEM_OS_PRIORITY": "0"},
           "sla": {"TANDEM_ROUTER_POLICY": "sla"}}
DEFAULT_SYSTEMS = ("fifo", "sla-lane-off", "sla")
WARMUP = 2   # idle requests sent before the measured ones


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(DEFAULT_SYSTEMS),
                   help="systems to compare, in this order (default: fifo sla-lane-off sla)")
    p.add_argument("--batch-sessions", type=int, default=4, help="background agent sessions (default 4)")
    p.add_argument("--turns", type=int, default=3, help="turns per agent session (default 3)")
    p.add_argument("--turn-words", type=int, default=100, help="words a tool result adds per turn (default 100)")
    p.add_argument("--interactive", type=int, default=12, help="interactive requests (default 12)")
    p.add_argument("--rate", type=float, default=0.5, help="interactive arrivals per second (default 0.5)")
    p.add_argument("--max-tokens", type=int, default=32, help="batch output tokens per turn (default 32)")
    p.add_argument("--interactive-tokens", type=int, default=16,
                   help="interactive output tokens per request (default 16)")
    p.add_argument("--idle", type=int, default=12, help="interactive requests measured on the idle stack, one "
                   "at a time, before the flood (default 12)")
    p.add_argument("--threads", type=int, default=0,
                   help="TANDEM_THREADS of every engine (default 0: as `tandem up` picks them)")
    p.add_argument("--prefill", type=int, default=0, help="prefill workers (default 0)")
    p.add_argument("--kvpool", type=int, default=0, help="KV pool services (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


async def _load(url: str, args: argparse.Namespace) -> dict:
    """The idle requests one at a time, then background batch sessions and foreground interactive
    arrivals on one loop: {idle, interactive, batch: results; mixed: seconds until the last
    interactive reply; window: seconds until the last batch reply}."""
    inter_jobs = make_jobs("chat", args.interactive, max_tokens=args.interactive_tokens,
                           tiers={"interactive": 1.0}, seed=args.seed)
    inter: list[RequestResult] = []
    batch: list[RequestResult] = []
    done = asyncio.Event()
    started = 0
    all_started = asyncio.Event()
    async with client_for(args.batch_sessions + args.interactive) as client:
        model = await served_model(client, url)
        idle_jobs = make_jobs("chat", WARMUP + args.idle, max_tokens=args.interactive_tokens,
                              tiers={"interactive": 1.0}, seed=args.seed + 1)   # not the flood's prompts (cache)
        idle = [await send(client, url, model, job[0]) for job in idle_jobs][WARMUP:]
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
    return {"idle": idle, "interactive": inter, "batch": batch, "mixed": mixed, "window": window}


def tokens_by(r: RequestResult, t: float) -> float:
    """Output tokens of ``r`` streamed by ``t`` seconds after the run began (from its chunk times)."""
    if not r.ok or math.isnan(r.ttft):
        return 0.0
    times = list(itertools.accumulate(r.itl, initial=r.start + r.ttft))
    return sum(1 for x in times if x <= t) * r.tokens / len(times)


def ttfts(results: list[RequestResult]) -> dict[str, float]:
    """TTFT p50/p90/p99 in ms of the successful ``results``."""
    xs = [r.ttft for r in results if r.ok]
    return {f"p{q}": percentile(xs, q) * 1e3 for q in (50, 90, 99)}


def summarize(system: str, load: dict) -> dict:
    idle, inter, batch, mixed, window = (load[k] for k in ("idle", "interactive", "batch", "mixed", "window"))
    ok_i = [r for r in inter if r.ok]
    ok_b = [r for r in batch if r.ok]
    tpots = [r.tpot for r in ok_i if not math.isnan(r.tpot)]
    quiet, flood = ttfts(idle), ttfts(inter)
    return {
        "system": system, "interactive_requests": len(inter), "interactive_errors": len(inter) - len(ok_i),
        "batch_requests": len(batch), "batch_errors": len(batch) - len(ok_b),
        "errors": sum(not r.ok for r in idle + inter + batch),
        **{f"idle_ttft_{q}_ms": v for q, v in quiet.items()},
        **{f"interactive_ttft_{q}_ms": v for q, v in flood.items()},
        **{f"flood_over_idle_{q}": flood[q] / quiet[q] if quiet[q] else math.nan for q in quiet},
        "interactive_tpot_p50_ms": percentile(tpots, 50) * 1e3,
        "interactive_tpot_p99_ms": percentile(tpots, 99) * 1e3,
        "batch_ttft_p50_ms": percentile([r.ttft for r in ok_b], 50) * 1e3,
        "batch_tok_s": sum(tokens_by(r, mixed) for r in ok_b) / mixed if mixed > 0 else math.nan,
        "batch_tok_s_with_drain": sum(r.tokens for r in ok_b) / window if window > 0 else math.nan,
        "batch_prompt_tokens_mean": sum(r.prompt_tokens for r in ok_b) / max(1, len(ok_b)),
        "batch_computed_tokens_mean": sum(r.prompt_tokens - r.cached_tokens for r in ok_b) / max(1, len(ok_b)),
        "mixed_s": mixed, "window_s": window,
    }


def run_system(args: argparse.Namespace, system: str) -> dict:
    port = free_port()
    env = dict(bench_env(args.threads), TANDEM_PORT=str(port), **SYSTEMS[system])
    argv = [sys.executable, "-m", "services.cli", "up", "--prefill", str(args.prefill), "--gpu-decode", "1",
            "--cpu-decode", "1", "--kvpool", str(args.kvpool), "--port", str(port)]
    server = Server(system, argv, env, port)
    try:
        server.wait_workers({"gpu-decode": 1, "cpu-decode": 1, **({"prefill": args.prefill} if args.prefill else {})})
        sys.stderr.write(f"[{system}] {args.idle} idle interactive requests, then {args.batch_sessions} batch "
                         f"sessions + {args.interactive} interactive requests at {args.rate:g}/s ...\n")
        load = asyncio.run(_load(server.url, args))
    finally:
        rc = server.stop()
        if rc not in (0, -signal.SIGTERM):
            sys.stderr.write(f"[{system}] exited with {rc}:\n{server.tail()}\n")
    out = summarize(system, load)
    out["os_priorities"] = next((line.split("| ", 1)[-1].split("OS priorities ", 1)[-1].strip()
                                 for line in server.log if "OS priorities on" in line), "")
    errors = [r.error for k in ("idle", "interactive", "batch") for r in load[k] if not r.ok]
    if errors:
        sys.stderr.write(f"[{system}] {len(errors)} failed, first: {errors[0]}\n")
    return out


ROWS = [("interactive TTFT p50 ms idle", "idle_ttft_p50_ms", "lower"),
        ("interactive TTFT p90 ms idle", "idle_ttft_p90_ms", "lower"),
        ("interactive TTFT p99 ms idle", "idle_ttft_p99_ms", "lower"),
        ("interactive TTFT p50 ms under flood", "interactive_ttft_p50_ms", "lower"),
        ("interactive TTFT p90 ms under flood", "interactive_ttft_p90_ms", "lower"),
        ("interactive TTFT p99 ms under flood", "interactive_ttft_p99_ms", "lower"),
        ("  p50 flood / idle", "flood_over_idle_p50", "lower"),
        ("  p90 flood / idle (target <= 2)", "flood_over_idle_p90", "lower"),
        ("  p99 flood / idle (target <= 3)", "flood_over_idle_p99", "lower"),
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
    lines = ["| metric | " + " | ".join(r["system"] for r in runs) + " |", "|" + "---|" * (len(runs) + 1)]
    for title, key, _ in ROWS:
        cells = [report.fmt(r[key]) if isinstance(r[key], float) else str(r[key]) for r in runs]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(by: dict[str, dict]) -> list[str]:
    """The targets, one line each, for the systems that ran."""
    out = []
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    for name, r in by.items():
        if name != "fifo":
            p90, p99 = r["flood_over_idle_p90"], r["flood_over_idle_p99"]
            out.append(f"{name}: interactive TTFT under flood / idle: p90 {p90:.2f}x (target <= 2: {met(p90 <= 2)}), "
                       f"p99 {p99:.2f}x (target <= 3: {met(p99 <= 3)})")
    if "fifo" in by and "sla" in by:
        ttft = by["fifo"]["interactive_ttft_p99_ms"] / by["sla"]["interactive_ttft_p99_ms"]
        tput = by["sla"]["batch_tok_s"] / by["fifo"]["batch_tok_s"]
        out.append(f"sla vs fifo: interactive p99 TTFT {ttft:.2f}x better (target >= 3x: {met(ttft >= 3)}); batch "
                   f"throughput {tput:.0%} of FIFO's (target >= 90 %: {met(tput >= 0.9)})")
    for base, without in (("sla-lane-off", "the batch lane's priority"), ("sla-os-off", "any OS priority knob")):
        if base in by and "sla" in by:
            tput = by["sla"]["batch_tok_s"] / by[base]["batch_tok_s"]
            out.append(f"sla vs {base}: batch throughput {tput:.0%} of what it was without {without} "
                       f"(target >= 90 %: {met(tput >= 0.9)})")
    return out


def run(args: argparse.Namespace) -> dict:
    if args.batch_sessions < 1 or args.turns < 1 or args.interactive < 1 or args.idle < 1 or args.rate <= 0:
        raise ValueError("--batch-sessions, --turns, --interactive and --idle must be >= 1, --rate > 0")
    runs = [run_system(args, s) for s in args.systems]
    print(f"tiers: {args.idle} idle interactive chats, then {args.batch_sessions} batch agent sessions ({args.turns} "
          f"turns, max_tokens {args.max_tokens}) + {args.interactive} interactive chats at {args.rate:g}/s "
          f"(max_tokens {args.interactive_tokens}); {args.prefill} prefill + 1 gpu-decode + 1 cpu-decode"
          f"{' + kvpool' if args.kvpool else ''}, engine threads "
          f"{args.threads if args.threads else 'as tandem up picks them'}")
    for r in runs:
        print(f"  {r['system']}: OS priorities {r['os_priorities'] or '(no start-up line)'}")
    print()
    print(table(runs))
    print()
    for line in verdicts({r["system"]: r for r in runs}):
        print(line)
    out = {"config": {k: v for k, v in vars(args).items() if k not in ("func",)}, "runs": runs}
    if args.json:
        report.write_json(args.json, out)
    return out


def main(args: argparse.Namespace) -> int:
    return run_cli("tiers", run, args)
