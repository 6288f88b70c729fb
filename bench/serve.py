"""Serving benchmark: TTFT / TPOT / ITL of streaming chat completions over HTTP.

    tandem bench serve --url http://127.0.0.1:8000 [--concurrency 1 8] [--num-requests 32]
    tandem bench serve [--compare] [--num-requests 16]      # no --url: compare mode
    python -m bench.serve ...                                # the same, without the CLI

With ``--url``: a closed-loop load generator against any OpenAI-compatible server. For each
``--concurrency`` level, N streams each send a request, wait for its last chunk and send the
next, until ``--num-requests`` requests are done. Every request is a short chat prompt with
``temperature=0``, ``max_tokens=--max-tokens`` and ``ignore_eos`` (so each one yields exactly
that many tokens where the server honours the vLLM extension).

Without ``--url`` (``--compare``): in ONE run, start the in-process gateway (the engine in the
gateway's process, ``InProcessBackend``) and then the whole stack (``tandem up --gpu-decode 0``:
embedded NATS, router, prefill, cpu-decode, gateway), one after the other on free ports with the
same engine settings (``TANDEM_THREADS``, KV budget), run the same workload against each and
print one Markdown table side by side plus the stack / in-process TPOT ratio at concurrency 1.

Per request: TTFT = first content delta - send; TPOT = (last token time - first token time) /
(tokens - 1) with tokens from the final usage chunk; ITL = gaps between content chunks.
Aggregates: p50 / p99 (linear interpolation between order statistics, as numpy's default),
throughput = output tokens / wall time of the level.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from shared.nats_server import free_port

PROMPTS = [
    "What is the capital of France?",
    "Tell me a short story about a cat.",
    "Explain what a neural network is.",
    "List three colours of the rainbow.",
    "How do plants make their food?",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Give me a tip for learning to cook.",
]

STACK_TOPOLOGY = "tandem up --gpu-decode 0: embedded NATS, router, prefill, cpu-decode, gateway"


# ---- statistics (pure) ---------------------------------------------------------------------

def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) of ``values`` by linear interpolation between order
    statistics (numpy's default "linear" method). NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(float(v) for v in values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class RequestResult:
    ok: bool
    tokens: int = 0                 # completion tokens (usage chunk; else content chunks)
    ttft: float = math.nan          # seconds
    tpot: float = math.nan          # seconds per output token after the first
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    latency: float = math.nan       # send -> end of stream
    error: str | None = None


def request_metrics(t_send: float, chunk_times: list[float], t_end: float, tokens: int | None) -> RequestResult:
    """Metrics of one streamed request from its content-chunk arrival times (pure)."""
    if not chunk_times:
        return RequestResult(ok=False, error="no content received", latency=t_end - t_send)
    n = tokens if tokens else len(chunk_times)
    tpot = (chunk_times[-1] - chunk_times[0]) / (n - 1) if n > 1 else math.nan
    return RequestResult(ok=True, tokens=n, ttft=chunk_times[0] - t_send, tpot=tpot,
                         itl=[b - a for a, b in itertools.pairwise(chunk_times)], latency=t_end - t_send)


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    """p50/p99 of TTFT, TPOT, ITL and latency (milliseconds), throughput (pure)."""
    ok = [r for r in results if r.ok]
    out: dict = {"requests": len(results), "errors": len(results) - len(ok), "wall_s": wall_s,
                 "output_tokens": sum(r.tokens for r in ok)}
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if not math.isnan(r.tpot)],
              "itl": [x for r in ok for x in r.itl], "latency": [r.latency for r in ok]}
    for name, xs in series.items():
        for q in (50, 99):
            out[f"{name}_p{q}_ms"] = percentile(xs, q) * 1e3
    out["throughput_tok_s"] = out["output_tokens"] / wall_s if wall_s > 0 else math.nan
    out["throughput_req_s"] = len(ok) / wall_s if wall_s > 0 else math.nan
    return out


# ---- load generator -------------------------------------------------------------------------

async def _one_request(client, url: str, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    chunk_times: list[float] = []
    tokens = None
    t_send = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                return RequestResult(ok=False, error=f"HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                d = json.loads(data)
                if "error" in d:
                    return RequestResult(ok=False, error=str(d["error"])[:200])
                for ch in d.get("choices") or ():
                    if (ch.get("delta") or {}).get("content"):
                        chunk_times.append(now)
                if d.get("usage"):
                    tokens = d["usage"].get("completion_tokens")
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}")
    return request_metrics(t_send, chunk_times, time.perf_counter(), tokens)


async def run_load(url: str, concurrency: int, num_requests: int, max_tokens: int, model: str | None = None,
                   label: str = "", warmup: int = 0) -> dict:
    """Closed loop: ``concurrency`` streams until ``num_requests`` are done. Returns the summary
    plus per-request results."""
    import httpx

    url = url.rstrip("/").removesuffix("/v1")
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0),
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        if model is None:
            r = await client.get(url + "/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        for i in range(warmup):
            w = await _one_request(client, url, model, PROMPTS[i % len(PROMPTS)], max_tokens)
            if not w.ok:
                raise RuntimeError(f"warm-up request failed: {w.error}")
        results: list[RequestResult | None] = [None] * num_requests
        next_i = 0
        done = 0

        async def stream_loop() -> None:
            nonlocal next_i, done
            while next_i < num_requests:
                i = next_i
                next_i += 1
                results[i] = await _one_request(client, url, model, PROMPTS[i % len(PROMPTS)], max_tokens)
                done += 1
                sys.stderr.write(f"\r[{label} c={concurrency}] {done}/{num_requests} requests done")
                sys.stderr.flush()

        t0 = time.perf_counter()
        await asyncio.gather(*(stream_loop() for _ in range(min(concurrency, num_requests))))
        wall = time.perf_counter() - t0
        sys.stderr.write("\n")
    res = [r for r in results if r is not None]
    summary = summarize(res, wall)
    errors = [r.error for r in res if not r.ok]
    if errors:
        sys.stderr.write(f"[{label} c={concurrency}] {len(errors)} failed, first: {errors[0]}\n")
    return {"system": label, "url": url, "model": model, "concurrency": concurrency, "max_tokens": max_tokens,
            **summary, "per_request": [asdict(r) for r in res]}


# ---- servers under test ---------------------------------------------------------------------

class Server:
    """A server under test in its own process group, logs kept for failures."""

    def __init__(self, name: str, argv: list[str], env: dict, port: int):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log: list[str] = []
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def tail(self, n: int = 40) -> str:
        return "".join(self.log[-n:])

    def wait_healthy(self, timeout: float = 300) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy in {timeout:.0f} s:\n{self.tail()}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def bench_env(args: argparse.Namespace) -> dict:
    """The engine settings both sides get (the same variables reach every engine)."""
    env = dict(os.environ, TANDEM_THREADS=str(args.threads), PYTHONUNBUFFERED="1",
               TANDEM_HEARTBEAT_INTERVAL=os.environ.get("TANDEM_HEARTBEAT_INTERVAL", "0.5"))
    env.pop("TANDEM_NATS_URL", None)  # the stack gets its own embedded NATS
    env.pop("TANDEM_PORT", None)
    return env


def start_in_process(args: argparse.Namespace) -> Server:
    port = free_port()
    argv = [sys.executable, "-c", f"from bench.serve import serve_in_process; serve_in_process({port})"]
    return Server("in-process", argv, bench_env(args), port)


def start_stack(args: argparse.Namespace) -> Server:
    port = free_port()
    env = dict(bench_env(args), TANDEM_PORT=str(port))
    argv = [sys.executable, "-m", "services.cli", "up", "--gpu-decode", "0", "--port", str(port)]
    return Server("stack", argv, env, port)


def serve_in_process(port: int) -> None:
    """The in-process gateway: uvicorn + ``InProcessBackend`` over one engine, configured from
    the environment exactly as a stack worker is (``services.worker.engine_config``)."""
    import logging

    from services.gateway.app import GatewaySettings, serve
    from services.gateway.backend import InProcessBackend
    from services.worker import engine_config
    from shared.engine.async_engine import AsyncEngine
    from shared.engine.engine import Engine
    from shared.engine.loader import load_model
    from shared.settings import Settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings.from_env()
    loaded = load_model(settings.worker.model)
    engine = AsyncEngine(Engine(loaded, engine_config(settings, "cpu")))
    backend = InProcessBackend(engine, model_name=loaded.config.name)
    asyncio.run(serve(backend, GatewaySettings.from_env(host="127.0.0.1", port=port), log_level="warning"))


def split_rounds(total: int, rounds: int) -> list[int]:
    """``total`` requests over at most ``rounds`` rounds, as even as can be (earlier rounds larger)."""
    rounds = max(1, min(rounds, total))
    return [total // rounds + (i < total % rounds) for i in range(rounds)]


def merge_runs(parts: list[dict]) -> dict:
    """One run from several rounds of the same (system, concurrency): requests pooled, walls summed."""
    per = [r for p in parts for r in p["per_request"]]
    res = [RequestResult(**r) for r in per]
    return {**parts[0], **summarize(res, sum(p["wall_s"] for p in parts)), "rounds": len(parts), "per_request": per}


def compare_runs(args: argparse.Namespace) -> list[dict]:
    """Both servers up side by side (an idle one costs next to nothing); each concurrency level
    runs on one, then the other, alternating the order every round so that load drift on a
    shared machine hits both alike."""
    servers: dict[str, Server] = {}
    runs: list[dict] = []
    try:
        for name, start in (("in-process", start_in_process), ("stack", start_stack)):
            sys.stderr.write(f"[{name}] starting...\n")
            servers[name] = start(args)
        for s in servers.values():
            s.wait_healthy()
        for name, s in servers.items():  # warm-up, unmeasured
            if args.warmup > 0:
                asyncio.run(run_load(s.url, 1, args.warmup, args.max_tokens, args.model, label=f"{name} warm-up"))
        order = list(servers)
        for c in args.concurrency:
            parts: dict[str, list[dict]] = {n: [] for n in order}
            for rnd, n in enumerate(split_rounds(args.num_requests, args.rounds)):
                for name in (order if rnd % 2 == 0 else order[::-1]):
                    parts[name].append(asyncio.run(run_load(servers[name].url, c, n, args.max_tokens,
                                                            args.model, label=name)))
            runs += [merge_runs(parts[n]) for n in order]
    finally:
        for name, s in reversed(servers.items()):
            rc = s.stop()
            if rc not in (0, -signal.SIGTERM):
                sys.stderr.write(f"[{name}] exited with {rc}:\n{s.tail()}\n")
    return runs


# ---- output ---------------------------------------------------------------------------------

def _f(x: float, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown_table(runs: list[dict]) -> str:
    """One row per (system, concurrency)."""
    head = ("| system | conc. | requests | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
            "| ITL p99 ms | output tok/s | errors |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(runs, key=lambda r: (r["concurrency"], r["system"])):
        lines.append(f"| {r['system']} | {r['concurrency']} | {r['requests']} | {_f(r['ttft_p50_ms'])} "
                     f"| {_f(r['ttft_p99_ms'])} | {_f(r['tpot_p50_ms'])} | {_f(r['tpot_p99_ms'])} "
                     f"| {_f(r['itl_p99_ms'])} | {_f(r['throughput_tok_s'])} | {r['errors']} |")
    return "\n".join(lines)


def tpot_ratio(runs: list[dict], concurrency: int = 1) -> float | None:
    """Stack TPOT p50 / in-process TPOT p50 at ``concurrency`` (None when either is missing)."""
    by = {(r["system"], r["concurrency"]): r for r in runs}
    a, b = by.get(("stack", concurrency)), by.get(("in-process", concurrency))
    if not a or not b or not b["tpot_p50_ms"] or math.isnan(b["tpot_p50_ms"]):
        return None
    return a["tpot_p50_ms"] / b["tpot_p50_ms"]


# ---- entry points ---------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="an OpenAI-compatible server (e.g. http://127.0.0.1:8000); "
                   "unset: --compare")
    p.add_argument("--compare", action="store_true",
                   help="start the in-process gateway and the whole stack and compare them (default without --url)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="closed-loop streams (default 1 8)")
    p.add_argument("--num-requests", type=int, default=16, help="requests per concurrency level (and system in --compare; default 16)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    p.add_argument("--rounds", type=int, default=2,
                   help="--compare: split each level's requests into this many rounds, alternating which system "
                   "goes first, so load drift on a shared machine hits both alike (default 2)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each system (default 2)")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("TANDEM_THREADS") or 2),
                   help="TANDEM_THREADS for every engine in --compare (default $TANDEM_THREADS or 2)")
    p.add_argument("--json", default=None, metavar="FILE", help="write all results (with per-request data) here")


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark, print the table and return everything measured."""
    if any(c < 1 for c in args.concurrency) or min(args.num_requests, args.max_tokens, args.rounds) < 1:
        raise ValueError("--concurrency, --num-requests, --max-tokens and --rounds must be >= 1")
    compare = args.compare or not args.url
    runs: list[dict] = []
    config = {"mode": "compare" if compare else "url", "concurrency": args.concurrency,
              "num_requests": args.num_requests, "rounds": args.rounds, "max_tokens": args.max_tokens, "threads": args.threads,
              "cpus": os.cpu_count()}
    if not compare:
        for c in args.concurrency:
            runs.append(asyncio.run(run_load(args.url, c, args.num_requests, args.max_tokens, args.model,
                                             label="server", warmup=args.warmup if c == args.concurrency[0] else 0)))
    else:
        config["in_process"] = "one process: uvicorn gateway + InProcessBackend(AsyncEngine(Engine)) on cpu"
        config["stack"] = STACK_TOPOLOGY
        runs = compare_runs(args)
    rounds = split_rounds(args.num_requests, args.rounds) if compare else [args.num_requests]
    print(f"serving benchmark: {args.num_requests} requests per level and system"
          f"{f' (alternating rounds of {rounds})' if compare else ''}, max_tokens={args.max_tokens} "
          f"(ignore_eos), temperature 0, {os.cpu_count()} CPUs, TANDEM_THREADS={args.threads}")
    if compare:
        print(f"in-process: {config['in_process']}")
        print(f"stack:      {STACK_TOPOLOGY} (each engine process TANDEM_THREADS={args.threads})")
    print()
    print(markdown_table(runs))
    ratio = tpot_ratio(runs) if compare else None
    if ratio is not None:
        print()
        print(f"stack / in-process TPOT p50 at concurrency 1: {ratio:.3f} "
              f"({(ratio - 1) * 100:+.1f} % overhead; target <= +10 %: {'met' if ratio <= 1.10 else 'NOT met'})")
    out = {"config": config, "runs": runs, "tpot_ratio_c1": ratio}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=lambda x: None)
    return out


def main(args: argparse.Namespace | None = None) -> int:
    if args is None:
        p = argparse.ArgumentParser(prog="bench.serve", description=__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(p)
        args = p.parse_args()
    try:
        out = run(args)
    except (ValueError, RuntimeError, TimeoutError) as e:
        sys.stderr.write(f"bench serve: {e}\n")
        return 1
    return 0 if all(r["errors"] == 0 for r in out["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
