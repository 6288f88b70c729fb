"""``tandem bench serve``: load against any OpenAI-compatible server; TTFT / TPOT / ITL,
throughput and goodput, as a Markdown table, a PNG plot and JSON.

    tandem bench serve --url http://127.0.0.1:8000 --concurrency 1 8 --num-requests 32 --json out.json
    tandem bench serve --url URL --mode open --rate 0.5 1 2 --workload agent --tiers interactive=1,batch=3
    tandem bench serve [--compare] [--num-requests 16]      # no --url: compare mode
    python -m bench.serve ...                                # the same, without the CLI

With ``--url``: for each load level (``--concurrency`` in the closed loop, ``--rate`` jobs/s in
the open, Poisson loop) send ``--num-requests`` requests of ``--workload`` (chat | agent |
long, see bench/loadgen.py), each with ``temperature=0``, ``--max-tokens`` and ``ignore_eos``
(so it yields exactly that many tokens where the server honours the vLLM extension) and its SLA
tier (``--tiers`` mix, ``X-Tandem-SLA``). Goodput counts requests within their tier's SLO
(``--slo TIER=TTFT_MS:TPOT_MS``; defaults in bench/loadgen.py).

Without ``--url`` (``--compare``): in ONE run, start the in-process gateway (the engine in the
gateway's process, ``InProcessBackend``) and the whole stack (``tandem up --gpu-decode 0``:
embedded NATS, router, prefill, cpu-decode, gateway) on free ports with the same engine
settings (``TANDEM_THREADS``, KV budget), run the same workload against each (alternating
rounds) and print one table side by side plus the stack / in-process TPOT ratio at
concurrency 1.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import subprocess
import sys
import threading
import time

from bench import report
from bench.loadgen import (DEFAULT_SLOS, WORKLOADS, RequestResult, make_jobs, parse_mix, run_level,
                           summarize)
from shared.nats_server import die_with_parent, free_port
from shared.tier import TIERS
from bench.cli import at_least

STACK_TOPOLOGY = "tandem up --gpu-decode 0: embedded NATS, KV pool, router, prefill, cpu-decode, gateway"


# ---- servers under test ---------------------------------------------------------------------

class Server:
    """A server under test in its own process group, logs kept for failures; it gets SIGTERM when
    the bench dies, however it dies (a bench stopped by ``timeout`` left a whole stack behind)."""

    def __init__(self, name: str, argv: list[str], env: dict, port: int):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log: list[str] = []
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, preexec_fn=die_with_parent)
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

    def health(self) -> dict:
        """The gateway's /health body ({} while it does not answer)."""
        import httpx

        try:
            return httpx.get(self.url + "/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return {}

    def wait_workers(self, want: dict[str, int], timeout: float = 300) -> None:
        """Wait until /health lists at least ``want[role]`` live workers of each role (healthy
        means one router and one decode worker; a topology's other workers may come later)."""
        import httpx

        self.wait_healthy(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            details = httpx.get(self.url + "/health", timeout=5).json().get("details", {})
            if all(len(details.get(role, {}).get("workers", [])) >= n for role, n in want.items()):
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.name}: not every worker of {want} live in {timeout:.0f} s:\n{self.tail()}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def bench_env(threads: int) -> dict:
    """The engine settings both sides get (the same variables reach every engine)."""
    env = dict(os.environ, TANDEM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               TANDEM_HEARTBEAT_INTERVAL=os.environ.get("TANDEM_HEARTBEAT_INTERVAL", "0.5"))
    env.pop("TANDEM_NATS_URL", None)  # the stack gets its own embedded NATS
    env.pop("TANDEM_PORT", None)
    return env


def start_in_process(args: argparse.Namespace) -> Server:
    port = free_port()
    argv = [sys.executable, "-c", f"from bench.serve import serve_in_process; serve_in_process({port})"]
    return Server("in-process", argv, bench_env(args.threads), port)


def start_stack(args: argparse.Namespace) -> Server:
    port = free_port()
    env = dict(bench_env(args.threads), TANDEM_PORT=str(port))
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
    from shared.engine.model_files import served_model_name
    from shared.settings import Settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings.from_env()
    loaded = load_model(settings.worker.model)
    engine = AsyncEngine(Engine(loaded, engine_config(settings, "cpu")))
    gw = GatewaySettings.from_env(host="127.0.0.1", port=port)
    backend = InProcessBackend(engine, model_name=gw.served_model_name or served_model_name(settings.worker.model))
    asyncio.run(serve(backend, gw, log_level="warning"))


def split_rounds(total: int, rounds: int) -> list[int]:
    """``total`` requests over at most ``rounds`` rounds, as even as can be (earlier rounds larger)."""
    rounds = max(1, min(rounds, total))
    return [total // rounds + (i < total % rounds) for i in range(rounds)]


def merge_runs(parts: list[dict]) -> dict:
    """One run from several rounds of the same (system, level): requests pooled, walls summed."""
    per = [r for p in parts for r in p["per_request"]]
    res = [RequestResult(**r) for r in per]
    return {**parts[0], **summarize(res, sum(p["wall_s"] for p in parts), parts[0].get("slos")),
            "rounds": len(parts), "per_request": per}


def levels(args: argparse.Namespace) -> list[tuple[int, float]]:
    """(concurrency, rate) per load level of ``--mode``."""
    return [(c, 0.0) for c in args.concurrency] if args.mode == "closed" else [(1, r) for r in args.rate]


def jobs_for(args: argparse.Namespace, n: int, seed: int = 0):
    return make_jobs(args.workload, n, max_tokens=args.max_tokens, tiers=parse_mix(args.tiers), seed=seed,
                     turns=args.turns, turn_words=args.turn_words, long_words=args.long_words)


def measure(args: argparse.Namespace, url: str, system: str, concurrency: int, rate: float, n: int,
            seed: int = 0) -> dict:
    return run_level(url, jobs_for(args, n, seed), system=system, workload=args.workload, mode=args.mode,
                     concurrency=concurrency, rate=rate or 1.0, model=args.model, slos=parse_slos(args.slo),
                     seed=seed)


def warm_up(args: argparse.Namespace, url: str, system: str) -> None:
    """Unmeasured requests (chat, closed loop) so that first-call costs stay out of the figures."""
    if args.warmup > 0:
        w = run_level(url, make_jobs("chat", args.warmup, max_tokens=args.max_tokens), system=f"{system} warm-up",
                      workload="chat", mode="closed", concurrency=1, rate=1.0, model=args.model)
        if w["errors"]:
            raise RuntimeError(f"{system}: warm-up requests failed")


def compare_runs(args: argparse.Namespace) -> list[dict]:
    """Both servers up side by side (an idle one costs next to nothing); each load level runs
    on one, then the other, alternating the order every round so that load drift on a shared
    machine hits both alike."""
    servers: dict[str, Server] = {}
    runs: list[dict] = []
    try:
        for name, start in (("in-process", start_in_process), ("stack", start_stack)):
            sys.stderr.write(f"[{name}] starting...\n")
            servers[name] = start(args)
        for s in servers.values():
            s.wait_healthy()
        for name, s in servers.items():
            warm_up(args, s.url, name)
        order = list(servers)
        for c, rate in levels(args):
            parts: dict[str, list[dict]] = {n: [] for n in order}
            for rnd, n in enumerate(split_rounds(args.num_requests, args.rounds)):
                for name in (order if rnd % 2 == 0 else order[::-1]):
                    parts[name].append(measure(args, servers[name].url, name, c, rate, n, seed=rnd))
            runs += [merge_runs(parts[n]) for n in order]
    finally:
        for name, s in reversed(servers.items()):
            rc = s.stop()
            if rc not in (0, -signal.SIGTERM):
                sys.stderr.write(f"[{name}] exited with {rc}:\n{s.tail()}\n")
    return runs


def structured_runs(args: argparse.Namespace) -> list[dict]:
    """The structured-output workload: the same chat questions unconstrained ("chat") and as JSON
    of a schema ("structured"), on one in-process server, alternating the order every round."""
    server = start_in_process(args)
    runs: list[dict] = []
    try:
        server.wait_healthy()
        warm_up(args, server.url, "in-process")
        kinds = ["chat", "structured"]
        for c, rate in levels(args):
            parts: dict[str, list[dict]] = {k: [] for k in kinds}
            for rnd, n in enumerate(split_rounds(args.num_requests, args.rounds)):
                for kind in (kinds if rnd % 2 == 0 else kinds[::-1]):
                    jobs = make_jobs(kind, n, max_tokens=args.max_tokens, tiers=parse_mix(args.tiers), seed=rnd)
                    parts[kind].append(run_level(server.url, jobs, system=f"in-process {kind}", workload=kind,
                                                 mode=args.mode, concurrency=c, rate=rate or 1.0, model=args.model,
                                                 slos=parse_slos(args.slo), seed=rnd))
            runs += [merge_runs(parts[k]) for k in kinds]
    finally:
        rc = server.stop()
        if rc not in (0, -signal.SIGTERM):
            sys.stderr.write(f"[in-process] exited with {rc}:\n{server.tail()}\n")
    return runs


def structured_ratios(runs: list[dict]) -> dict[int, float]:
    """Decode tok/s constrained / unconstrained (the inverse ratio of TPOT p50) per concurrency."""
    by = {(r["system"], r["concurrency"]): r for r in runs}
    out = {}
    for (system, c), r in by.items():
        free = by.get(("in-process chat", c))
        if system == "in-process structured" and free and r["tpot_p50_ms"] and free["tpot_p50_ms"]:
            out[c] = free["tpot_p50_ms"] / r["tpot_p50_ms"]
    return out


def tpot_ratio(runs: list[dict], concurrency: int = 1) -> float | None:
    """Stack TPOT p50 / in-process TPOT p50 at ``concurrency`` (None when either is missing)."""
    by = {(r["system"], r["concurrency"]): r for r in runs}
    a, b = by.get(("stack", concurrency)), by.get(("in-process", concurrency))
    if not a or not b or not b["tpot_p50_ms"] or math.isnan(b["tpot_p50_ms"]):
        return None
    return a["tpot_p50_ms"] / b["tpot_p50_ms"]


def parse_slos(specs: list[str] | None) -> dict[str, tuple[float, float]]:
    """``["interactive=500:50"]`` -> {tier: (TTFT ms, TPOT ms)} over the defaults."""
    slos = dict(DEFAULT_SLOS)
    for spec in specs or ():
        tier, _, bounds = spec.partition("=")
        ttft, _, tpot = bounds.partition(":")
        if tier not in TIERS:
            raise ValueError(f"--slo {spec!r}: unknown tier {tier!r} (one of {', '.join(TIERS)})")
        try:
            slos[tier] = (float(ttft), float(tpot))
        except ValueError:
            raise ValueError(f"--slo {spec!r}: expected TIER=TTFT_MS:TPOT_MS") from None
    return slos


# ---- entry points ---------------------------------------------------------------------------

def add_workload_arguments(p: argparse.ArgumentParser, num_requests: int = 16, max_tokens: int = 64,
                           tiers: str = "standard") -> None:
    """What every load-generating bench shares (serve, crossover)."""
    p.add_argument("--workload", choices=WORKLOADS, default="chat",
                   help="chat (short prompt and reply) | agent (multi-turn sessions, shared system prompt, "
                   "growing context) | long (RAG-like long prompt) | structured (chat unconstrained vs "
                   "answered as JSON of a schema, side by side on one in-process server); default chat")
    p.add_argument("--num-requests", type=int, default=num_requests,
                   help=f"requests per load level (and system; default {num_requests})")
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"max_tokens of every request (default {max_tokens})")
    p.add_argument("--tiers", default=tiers,
                   help=f"SLA tier mix, e.g. interactive=1,standard=2,batch=1 (default {tiers})")
    p.add_argument("--slo", action="append", metavar="TIER=TTFT_MS:TPOT_MS",
                   help="a tier's SLO for goodput (repeatable; defaults: " +
                   ", ".join(f"{t}={a:g}:{b:g}" for t, (a, b) in DEFAULT_SLOS.items()) + ")")
    p.add_argument("--turns", type=int, default=6, help="agent: turns per session (default 6)")
    p.add_argument("--turn-words", type=int, default=250, help="agent: words of tool output per turn (default 250)")
    p.add_argument("--long-words", type=int, default=1500, help="long: words of the document (default 1500)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each system (default 2)")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--json", default=None, metavar="FILE", help="write all results (with per-request data) here")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw throughput / TTFT / TPOT against load here")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="an OpenAI-compatible server (e.g. http://127.0.0.1:8000; "
                   "OPENAI_API_KEY, when set, is sent as its bearer token); "
                   "unset: --compare")
    p.add_argument("--compare", action="store_true",
                   help="start the in-process gateway and the whole stack and compare them (default without --url)")
    p.add_argument("--mode", choices=("closed", "open"), default="closed",
                   help="closed loop at --concurrency, or open loop (Poisson arrivals) at --rate (default closed)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="closed-loop streams (default 1 8)")
    p.add_argument("--rate", type=float, nargs="+", default=[1.0],
                   help="open loop: arrivals per second (agent: sessions per second; default 1)")
    add_workload_arguments(p)
    p.add_argument("--rounds", type=at_least(1), default=2,
                   help="--compare: split each level's requests into this many rounds, alternating which system "
                   "goes first, so load drift on a shared machine hits both alike (default 2)")
    p.add_argument("--threads", type=at_least(1), default=int(os.environ.get("TANDEM_THREADS") or 2),
                   help="TANDEM_THREADS for every engine in --compare (default $TANDEM_THREADS or 2)")


def check_arguments(args: argparse.Namespace) -> None:
    if min(args.num_requests, args.max_tokens, args.turns, getattr(args, "rounds", 1)) < 1:
        raise ValueError("--num-requests, --max-tokens, --turns and --rounds must be >= 1")
    if any(c < 1 for c in args.concurrency) or any(r <= 0 for r in getattr(args, "rate", [1.0])):
        raise ValueError("--concurrency must be >= 1 and --rate > 0")
    parse_mix(args.tiers)
    parse_slos(args.slo)


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark, print the tables and return everything measured."""
    check_arguments(args)
    compare = args.compare or not args.url
    config = {k: getattr(args, k) for k in ("mode", "concurrency", "rate", "workload", "num_requests", "max_tokens",
                                            "tiers", "turns", "turn_words", "long_words", "rounds", "threads")}
    config.update(target="compare" if compare else args.url, cpus=os.cpu_count(), slos=parse_slos(args.slo))
    if args.workload == "structured":
        config["in_process"] = "one process: uvicorn gateway + InProcessBackend(AsyncEngine(Engine)) on cpu"
        runs, compare = structured_runs(args), False
    elif compare:
        config["in_process"] = "one process: uvicorn gateway + InProcessBackend(AsyncEngine(Engine)) on cpu"
        config["stack"] = STACK_TOPOLOGY
        runs = compare_runs(args)
    else:
        warm_up(args, args.url, "server")
        runs = [measure(args, args.url, "server", c, rate, args.num_requests) for c, rate in levels(args)]
    rounds = split_rounds(args.num_requests, args.rounds) if compare else [args.num_requests]
    print(f"serving benchmark: {args.workload} workload, {args.mode} loop, {args.num_requests} requests per level"
          f"{' and system (alternating rounds of ' + str(rounds) + ')' if compare else ''}, "
          f"max_tokens={args.max_tokens} (ignore_eos), temperature 0, tiers {args.tiers}, {os.cpu_count()} CPUs")
    if compare:
        print(f"in-process: {config['in_process']}")
        print(f"stack:      {STACK_TOPOLOGY} (each engine process TANDEM_THREADS={args.threads})")
    print()
    print(report.markdown_table(runs))
    print()
    print(report.tier_table(runs))
    ratio = tpot_ratio(runs) if compare else None
    if ratio is not None:
        print()
        print(f"stack / in-process TPOT p50 at concurrency 1: {ratio:.3f} "
              f"({(ratio - 1) * 100:+.1f} % overhead; target <= +10 %: {'met' if ratio <= 1.10 else 'NOT met'})")
    if args.workload == "structured":
        from kernels import cpu
        print()
        for c, r in structured_ratios(runs).items():
            print(f"decode tok/s with a JSON schema / without at concurrency {c}: {r:.3f} (target >= 0.9: "
                  f"{'met' if r >= 0.9 else 'NOT met'}; CPU ISA {cpu.isa()})")
    if args.plot:
        print(f"plot: {report.plot(runs, args.plot, f'tandem bench serve: {args.workload}, {args.mode} loop')}")
    out = {"config": config, "runs": runs, "tpot_ratio_c1": ratio}
    if args.json:
        report.write_json(args.json, out)
    return out


def main(args: argparse.Namespace | None = None) -> int:
    if args is None:
        p = argparse.ArgumentParser(prog="bench.serve", description=__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(p)
        args = p.parse_args()
    return run_cli("serve", run, args)


def run_cli(name: str, run_bench, args: argparse.Namespace) -> int:
    """Exit status of a load bench: 1 on a bad argument or a server that failed, or when any
    request failed; 0 otherwise."""
    try:
        out = run_bench(args)
    except (ValueError, RuntimeError, TimeoutError, ConnectionError) as e:
        sys.stderr.write(f"bench {name}: {e}\n")
        return 1
    return 0 if all(r["errors"] == 0 for r in out["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
