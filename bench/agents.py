"""``tandem bench agents``: agent loops through ``/v1/responses`` with ``previous_response_id``,
idle and beside a batch flood — per-turn TTFT, and how much of each turn's prompt was cached.

    tandem bench agents [--sessions 3] [--turns 10] [--reply-tokens 64] [--pause 2] [--tool-words 40]
                        [--flood 6] [--flood-words 950] [--flood-tokens 16] [--flood-alone 60xR]
                        [--rounds R=1] [--tier standard] [--threads 0] [--gpu-decode 1] [--json F]

One default ``tandem up`` (a prefill worker, gpu-decode, cpu-decode, the KV pool — its disk tier in
a fresh directory: the same seed sends the same prompts, which an earlier run's entries would hold;
engine threads as ``tandem up`` picks them unless ``--threads``; its own embedded NATS) gets, in
order:

1. **idle**: ``--sessions`` agent sessions at once, each ``--turns`` turns: a turn sends the tool's
   output (``--tool-words`` words, fresh per session and turn) as the input of a streamed
   ``/v1/responses`` request continuing the previous one (``previous_response_id``; the same
   instructions each turn, as Codex sends them), greedy, ``--reply-tokens`` output tokens exactly
   (``ignore_eos``); then the tool "runs": ``--pause`` seconds before the next turn. ``--rounds``
   runs that many such groups of sessions one after the other (new sessions each round).
2. **flood alone**: ``--flood`` clients in a closed loop, each sending fresh ~1K-token prompts
   (``--flood-words`` words) at the batch tier for ``--flood-tokens`` output tokens, for
   ``--flood-alone`` seconds: the flood's throughput (prompt + output tokens per second).
3. **beside the flood**: the same sessions (new ones, the same rounds) while the flood runs; the
   flood's throughput over that time. A flood request is ~1K tokens: a one-round phase completes
   6-20 of them (fewer on slower CPUs), so one request more or less moves the flood's ratio by
   5-15 points; ``--rounds 3`` (and the alone phase 3x as long) resolves it to a few points.

Printed per phase: turn TTFT p50 / p90 (time to the first ``response.output_text.delta``), the
cached share of the input tokens (turns from the second), the tokens of the conversation so far
(the earlier turns' inputs and replies: the previous turn's input + output) prefilled again per
turn — its median and the share of turns with at most 32 — and the flood's throughput against
the flood alone. The issue's targets: >= 90 % of turns with <= 32 such tokens, turn TTFT p90
beside the flood <= 3x idle, the flood's throughput within 10 % of the flood alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from bench import cpu_time, report
from bench.loadgen import _text, client_for, make_jobs, percentile, send, served_model
from bench.serve import Server, bench_env, run_cli
from shared.nats_server import free_port
from bench.cli import at_least

INSTRUCTIONS = ("You are a coding agent. You read the tool's output, say what it means and what to do next, "
                "then call the next tool.")
NEAR = 32       # the bound: tokens of the conversation so far prefilled again on a turn


@dataclass
class Turn:
    session: int
    turn: int
    ttft: float = math.nan        # seconds to the first output text
    seconds: float = math.nan     # seconds from the send to the completed response
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    known: int = 0                # tokens of the conversation before this turn (previous input + output)
    resumes: int = 0              # times the turn went on elsewhere after losing its worker (usage.tandem)
    error: str | None = None

    @property
    def reprefilled(self) -> int:
        """Tokens of the conversation so far computed again (0 on a first turn)."""
        return max(0, self.known - self.cached_tokens)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=3, help="agent sessions at once (default 3)")
    p.add_argument("--turns", type=int, default=10, help="turns per session (default 10)")
    p.add_argument("--reply-tokens", type=int, default=64, help="output tokens per turn (default 64)")
    p.add_argument("--pause", type=float, default=2.0, help="seconds the tool runs between turns (default 2)")
    p.add_argument("--tool-words", type=int, default=40, help="words of tool output per turn (default 40)")
    p.add_argument("--flood", type=int, default=6, help="batch clients flooding fresh prompts (default 6)")
    p.add_argument("--flood-words", type=int, default=950, help="words per flood prompt (~1K tokens; default 950)")
    p.add_argument("--flood-tokens", type=int, default=16, help="output tokens per flood request (default 16)")
    p.add_argument("--flood-alone", type=float, default=None, help="seconds of the flood alone (default 60 "
                   "per round)")
    p.add_argument("--rounds", type=at_least(1), default=1, help="rounds of sessions per phase, back to back (default 1): "
                   "a flood request is ~1K tokens, so one phase of one round completes only 6-20 of them (one "
                   "more or less moves the flood's ratio 5-15 points); more rounds resolve it finer")
    p.add_argument("--tier", default="standard", help="the sessions' SLA tier (default standard)")
    p.add_argument("--threads", type=at_least(0), default=0, help="TANDEM_THREADS of every engine (default 0: as "
                   "`tandem up` picks them)")
    p.add_argument("--gpu-decode", type=int, default=1, help="gpu-decode worker copies of the stack (default 1, "
                   "as `tandem up`; 0: every decode on the cpu-decode worker)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


async def _turn(client, url: str, model: str, body: dict) -> tuple[float, float, dict]:
    """One streamed Responses turn: (seconds to the first text delta, seconds to the end, the final
    response object)."""
    t0 = time.perf_counter()
    ttft, final = math.nan, None
    async with client.stream("POST", url + "/v1/responses", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev["type"] == "response.output_text.delta" and math.isnan(ttft):
                ttft = time.perf_counter() - t0
            elif ev["type"] in ("response.completed", "response.incomplete", "response.failed"):
                final = ev["response"]
    if final is None or final.get("status") == "failed":
        raise RuntimeError(f"the turn failed: {final and final.get('error')}")
    return ttft, time.perf_counter() - t0, final


async def _session(client, url: str, model: str, k: int, args: argparse.Namespace, phase: str) -> list[Turn]:
    rng = random.Random(f"{args.seed}-{phase}-{k}")
    prev, known, out = None, 0, []
    for t in range(args.turns):
        body = {"model": model, "input": f"Tool output ({t}):\n{_text(rng, args.tool_words)}",
                "instructions": INSTRUCTIONS, "previous_response_id": prev, "stream": True, "temperature": 0,
                "max_output_tokens": args.reply_tokens, "ignore_eos": True, "sla": args.tier}
        turn = Turn(k, t, known=known)
        try:
            body = {k_: v for k_, v in body.items() if v is not None}
            turn.ttft, turn.seconds, final = await _turn(client, url, model, body)
            u = final["usage"]
            turn.input_tokens, turn.output_tokens = u["input_tokens"], u["output_tokens"]
            turn.cached_tokens = u["input_tokens_details"]["cached_tokens"]
            turn.resumes = (u.get("tandem") or {}).get("resumes", 0)
            prev, known = final["id"], turn.input_tokens + turn.output_tokens
        except Exception as e:  # counted; the session goes on from its last good turn
            turn.error = f"{type(e).__name__}: {e}"
        out.append(turn)
        if t + 1 < args.turns:
            await asyncio.sleep(args.pause)
    return out


async def _rounds(client, url: str, model: str, args: argparse.Namespace, phase: str) -> list[list[Turn]]:
    """``args.rounds`` rounds of ``args.sessions`` sessions at once (new sessions each round)."""
    out = []
    for r in range(args.rounds):
        name = phase if r == 0 else f"{phase}-{r}"   # round 0: the same prompts as a one-round run
        out += await asyncio.gather(*(_session(client, url, model, k, args, name) for k in range(args.sessions)))
    return out


async def _flood(client, url: str, model: str, args: argparse.Namespace, stop: asyncio.Event,
                 k: int) -> list:
    """One flood client: fresh ~1K-token batch prompts, one after the other, until ``stop``."""
    results = []
    for i in range(1 << 30):
        if stop.is_set():
            return results
        (job,) = make_jobs("long", 1, max_tokens=args.flood_tokens, tiers={"batch": 1.0},
                           seed=hash((args.seed, k, i, time.time_ns())) & 0xFFFFFFFF, long_words=args.flood_words)
        results.append(await send(client, url, model, job[0]))
    return results


def _flood_rate(results: list, seconds: float) -> dict:
    ok = [r for r in results if r.ok]
    toks = sum(r.prompt_tokens + r.tokens for r in ok)
    return {"flood_requests": len(ok), "flood_errors": len(results) - len(ok), "seconds": seconds,
            "flood_tok_s": toks / seconds if seconds > 0 else math.nan}


async def _phases(url: str, args: argparse.Namespace, session: int) -> dict:
    """The three phases against the stack at ``url`` (its processes: the session ``session``)."""
    async with client_for(args.sessions + args.flood + 4) as client:
        model = await served_model(client, url)
        # warm-up: one short turn (first-request costs out of the measured ones)
        await _turn(client, url, model, {"model": model, "input": "Hello.", "max_output_tokens": 4, "stream": True,
                                         "store": False})
        sys.stderr.write(f"[agents] idle: {args.rounds} x {args.sessions} sessions x {args.turns} turns ...\n")
        idle = await _rounds(client, url, model, args, "idle")

        sys.stderr.write(f"[agents] the flood alone: {args.flood} clients for {args.flood_alone:g} s ...\n")
        stop = asyncio.Event()
        t0, cpu0 = time.perf_counter(), cpu_time.by_service(session)
        tasks = [asyncio.create_task(_flood(client, url, model, args, stop, k)) for k in range(args.flood)]
        await asyncio.sleep(args.flood_alone)
        stop.set()
        alone = [r for rs in await asyncio.gather(*tasks) for r in rs]
        alone_s = time.perf_counter() - t0   # until the last request in flight at the stop ended
        cpu_alone = cpu_time.cores(cpu0, cpu_time.by_service(session), alone_s)

        sys.stderr.write("[agents] the sessions beside the flood ...\n")
        stop = asyncio.Event()
        t1, cpu1 = time.perf_counter(), cpu_time.by_service(session)
        tasks = [asyncio.create_task(_flood(client, url, model, args, stop, 100 + k)) for k in range(args.flood)]
        await asyncio.sleep(5.0)   # the flood is under way
        beside = await _rounds(client, url, model, args, "flood")
        stop.set()
        flood = [r for rs in await asyncio.gather(*tasks) for r in rs]
        beside_s = time.perf_counter() - t1
        cpu_beside = cpu_time.cores(cpu1, cpu_time.by_service(session), beside_s)
    return {"idle": [t for s in idle for t in s], "flood": [t for s in beside for t in s],
            "alone": _flood_rate(alone, alone_s), "beside": _flood_rate(flood, beside_s),
            "cpu": {"alone": cpu_alone, "beside": cpu_beside}}


def summarize(turns: list[Turn]) -> dict:
    ok = [t for t in turns if t.error is None]
    later = [t for t in ok if t.turn > 0]
    ttfts = [t.ttft for t in ok if not math.isnan(t.ttft)]
    again = [t.reprefilled for t in later]
    last = max((t.turn for t in ok), default=0)
    n_last = sum(1 for t in ok if t.turn == last)
    return {"turns": len(turns), "errors": len(turns) - len(ok), "resumed": sum(t.resumes > 0 for t in ok),
            "ttft_p50_ms": percentile(ttfts, 50) * 1e3, "ttft_p90_ms": percentile(ttfts, 90) * 1e3,
            "later_ttft_p50_ms": percentile([t.ttft for t in later], 50) * 1e3,
            "later_ttft_p90_ms": percentile([t.ttft for t in later], 90) * 1e3,
            "turn_p50_s": percentile([t.seconds for t in ok], 50), "turn_p90_s": percentile([t.seconds for t in ok], 90),
            "cached_share": sum(t.cached_tokens for t in later) / max(1, sum(t.input_tokens for t in later)),
            "reprefilled_p50": percentile(again, 50), "reprefilled_max": max(again, default=0),
            "turns_within_32_share": sum(a <= NEAR for a in again) / max(1, len(again)),
            "input_tokens_last_mean": sum(t.input_tokens for t in ok if t.turn == last) / max(1, n_last)}

ROWS = [("turn TTFT p50 ms (every turn)", "ttft_p50_ms"), ("turn TTFT p90 ms (every turn)", "ttft_p90_ms"),
        ("turn TTFT p50 ms (from the 2nd)", "later_ttft_p50_ms"), ("turn TTFT p90 ms (from the 2nd)", "later_ttft_p90_ms"),
        ("turn time p50 s (send to completed: TTFT + the reply)", "turn_p50_s"), ("turn time p90 s", "turn_p90_s"),
        ("cached share of input tokens (from the 2nd)", "cached_share"),
        ("conversation tokens prefilled again, median per turn", "reprefilled_p50"),
        ("  ... at most", "reprefilled_max"),
        (f"  turns with <= {NEAR} of them (target >= 90 %)", "turns_within_32_share"),
        ("mean input tokens of the last turn", "input_tokens_last_mean"), ("turns resumed after a lost worker", "resumed"),
        ("errors", "errors")]


def run(args: argparse.Namespace) -> dict:
    if (args.sessions < 1 or args.turns < 2 or args.reply_tokens < 1 or args.flood < 0 or args.pause < 0
            or args.rounds < 1):
        raise ValueError("--sessions >= 1, --turns >= 2, --reply-tokens >= 1, --flood >= 0, --pause >= 0, --rounds >= 1")
    if args.flood_alone is None:
        args.flood_alone = 60.0 * args.rounds
    port = free_port()
    # a KV pool directory of its own: the disk tier keeps entries across runs, and the same seed
    # sends the same prompts — a later run would find whole prompts there
    pool_dir = tempfile.mkdtemp(prefix="tandem-bench-agents-pool-")
    env = dict(bench_env(args.threads), TANDEM_PORT=str(port), TANDEM_POOL_DIR=pool_dir)
    if not args.threads:
        env.pop("TANDEM_THREADS")   # as `tandem up` picks them
    if args.gpu_decode < 0:
        raise ValueError("--gpu-decode >= 0")
    server = Server("stack", [sys.executable, "-m", "services.cli", "up", "--port", str(port),
                              "--gpu-decode", str(args.gpu_decode)], env, port)
    try:
        server.wait_workers({"prefill": 1, "gpu-decode": args.gpu_decode, "cpu-decode": 1})
        load = asyncio.run(_phases(server.url, args, server.proc.pid))
    finally:
        rc = server.stop()
        shutil.rmtree(pool_dir, ignore_errors=True)
        if rc not in (0, -signal.SIGTERM):
            sys.stderr.write(f"[agents] the stack exited with {rc}:\n{server.tail()}\n")
    idle, flood = summarize(load["idle"]), summarize(load["flood"])
    ratio = flood["ttft_p90_ms"] / idle["ttft_p90_ms"] if idle["ttft_p90_ms"] else math.nan
    tput = load["beside"]["flood_tok_s"] / load["alone"]["flood_tok_s"] if load["alone"]["flood_tok_s"] else math.nan
    print(f"agents: {args.sessions} sessions x {args.turns} turns through /v1/responses (previous_response_id), "
          f"{args.reply_tokens}-token replies, {args.pause:g} s tool pauses, {args.tool_words}-word tool outputs, "
          f"tier {args.tier}; flood: {args.flood} batch clients, ~{args.flood_words}-word prompts, "
          f"{args.flood_tokens} output tokens; "
          f"{'the default tandem up' if args.gpu_decode == 1 else f'tandem up --gpu-decode {args.gpu_decode}'}")
    print()
    print("| metric | idle | beside the flood |\n|---|---|---|")
    for title, key in ROWS:
        cell = lambda v: str(v) if isinstance(v, int) else f"{v:.0%}" if "share" in key else report.fmt(v)  # noqa: E731
        print(f"| {title} | {cell(idle[key])} | {cell(flood[key])} |")
    print(f"| flood tokens/s (prompt + output) | {report.fmt(load['alone']['flood_tok_s'])} (alone) | "
          f"{report.fmt(load['beside']['flood_tok_s'])} |")
    print(f"| flood requests completed (errors) | {load['alone']['flood_requests']} ({load['alone']['flood_errors']}) "
          f"(alone, {load['alone']['seconds']:.0f} s) | {load['beside']['flood_requests']} "
          f"({load['beside']['flood_errors']}) ({load['beside']['seconds']:.0f} s) |")
    cpu = load["cpu"]
    if cpu["alone"] and cpu["beside"]:
        print()
        print("| CPU cores by service (from /proc) | the flood alone | the flood beside the sessions |\n|---|---:|---:|")
        for name in sorted(set(cpu["alone"]) | set(cpu["beside"]), key=lambda n: -cpu["beside"].get(n, 0.0)):
            print(f"| {name} | {cpu['alone'].get(name, 0.0):.2f} | {cpu['beside'].get(name, 0.0):.2f} |")
        print(f"| all | {sum(cpu['alone'].values()):.2f} | {sum(cpu['beside'].values()):.2f} |")
    print()
    within = flood["turns_within_32_share"]
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    print(f"turns (from the 2nd) beside the flood with <= {NEAR} tokens of the conversation prefilled again: {within:.0%} "
          f"(target >= 90 %: {met(within >= 0.9)})")
    print(f"turn TTFT p90 beside the flood / idle: {ratio:.2f}x (target <= 3: {met(ratio <= 3)})")
    print(f"the flood's throughput beside the sessions / alone: {tput:.0%} (target >= 90 %: {met(tput >= 0.9)})")
    if cpu["alone"].get("prefill"):
        print(f"  (the prefill workers' CPU time, which the flood's prompts take: beside / alone "
              f"{cpu['beside'].get('prefill', 0.0) / cpu['alone']['prefill']:.0%})")
    out = {"config": vars(args), "runs": [dict(idle, system="idle"), dict(flood, system="flood")],
           "flood": {"alone": load["alone"], "beside": load["beside"]}, "ttft_p90_ratio": ratio,
           "flood_ratio": tput, "within_32": within, "cpu_cores": cpu,
           "turns": {k: [asdict(t) for t in load[k]] for k in ("idle", "flood")}}
    if args.json:
        report.write_json(args.json, out)
    return out


def main(args: argparse.Namespace) -> int:
    return run_cli("agents", run, args)
