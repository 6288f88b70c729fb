"""``tandem bench crossover``: the same workload on every topology, one hardware budget, at
rising concurrency — where replicated serving stops winning and disaggregated starts.

    tandem bench crossover [--topologies single replicated disaggregated heterogeneous]
                           [--concurrency 1 2 4 8 16 32] [--workers 2] [--cores N]
                           [--workload chat] [--max-tokens 16] [--json FILE] [--plot PNG]

For each topology in turn: start ``tandem up --topology T --workers W --cores C`` (its own
embedded NATS, free ports; services/up.py says what each topology runs), wait until healthy,
send the warm-up, then for each concurrency level a closed loop of ``max(--num-requests,
c x --per-stream)`` requests (by default a third each interactive, standard and batch, so
that the heterogeneous topology's SLA router feeds both of its pools); stop the stack. Prints per topology and level the full latency
table, then throughput, TTFT p50 and TPOT p50 pivoted (rows: concurrency, columns: topology),
and tokens per joule where RAPL / NVML report energy (else "n/a", never estimated).

On a machine without CUDA every pool — gpu-decode included — runs on the CPU; the output
says so. Levels run one topology after the other, so load from other work on a shared
machine shows up as noise between topologies: rerun on a quiet machine for figures.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from bench import report
from bench.loadgen import make_jobs, parse_mix, run_level
from bench.serve import (Server, add_workload_arguments, bench_env, check_arguments, parse_slos, run_cli,
                         warm_up)
from services.up import TOPOLOGIES, engines
from shared.energy import EnergyMeter, tokens_per_joule
from shared.nats_server import free_port

LEVELS = [1, 2, 4, 8, 16, 32]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topologies", nargs="+", choices=TOPOLOGIES, default=list(TOPOLOGIES),
                   help="topologies to compare (default: all four)")
    p.add_argument("--concurrency", type=int, nargs="+", default=LEVELS,
                   help=f"closed-loop levels (default {' '.join(map(str, LEVELS))})")
    p.add_argument("--workers", type=int, default=2, help="engine processes per topology (the budget; default 2)")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                   help="CPU cores the engines share (default: all of this machine's)")
    p.add_argument("--per-stream", type=int, default=2,
                   help="requests per concurrent stream at each level (default 2)")
    # a mix of tiers, so that the heterogeneous topology's SLA router uses both of its pools
    add_workload_arguments(p, num_requests=8, max_tokens=16, tiers="interactive=1,standard=1,batch=1")


def device_note() -> str:
    import torch

    if torch.cuda.is_available():
        return f"CUDA: {torch.cuda.get_device_name(0)} (gpu-decode on the GPU, every other pool on the CPU)"
    return "no CUDA device: every pool, gpu-decode included, runs on the CPU"


def start_topology(args: argparse.Namespace, name: str) -> Server:
    port = free_port()
    env = dict(bench_env(1), TANDEM_PORT=str(port))  # `up --topology` sets the engines' threads
    argv = [sys.executable, "-m", "services.cli", "up", "--topology", name, "--workers", str(args.workers),
            "--cores", str(args.cores), "--port", str(port)]
    return Server(name, argv, env, port)


def run_topology(args: argparse.Namespace, name: str, meter: EnergyMeter) -> list[dict]:
    server = start_topology(args, name)
    runs = []
    try:
        server.wait_workers(engines(name, args.workers))
        warm_up(args, server.url, name)
        for c in args.concurrency:
            n = max(args.num_requests, c * args.per_stream)
            jobs = make_jobs(args.workload, n, max_tokens=args.max_tokens, tiers=parse_mix(args.tiers),
                             turns=args.turns, turn_words=args.turn_words, long_words=args.long_words)
            before = meter.read()
            run = run_level(server.url, jobs, system=name, workload=args.workload, mode="closed", concurrency=c,
                            rate=1.0, model=args.model, slos=parse_slos(args.slo))
            run["tokens_per_joule"] = tokens_per_joule(run["output_tokens"], meter.joules_since(before))
            runs.append(run)
    finally:
        rc = server.stop()
        if rc not in (0, -signal.SIGTERM):
            sys.stderr.write(f"[{name}] exited with {rc}:\n{server.tail()}\n")
    return runs


def run(args: argparse.Namespace) -> dict:
    args.rate, args.rounds = [1.0], 1
    check_arguments(args)
    if args.workers < 2 and set(args.topologies) & {"disaggregated", "heterogeneous"}:
        raise ValueError("--workers must be >= 2 for the disaggregated and heterogeneous topologies")
    if args.per_stream < 1 or args.cores < 1:
        raise ValueError("--per-stream and --cores must be >= 1")
    meter = EnergyMeter()
    note = device_note()
    config = {k: getattr(args, k) for k in ("topologies", "concurrency", "workers", "cores", "per_stream",
                                            "workload", "num_requests", "max_tokens", "tiers")}
    config.update(device=note, energy=meter.describe(), cpus=os.cpu_count(), slos=parse_slos(args.slo))
    runs: list[dict] = []
    for name in args.topologies:
        sys.stderr.write(f"[{name}] starting tandem up --topology {name}...\n")
        runs += run_topology(args, name, meter)
    print(f"crossover: {args.workload} workload, max_tokens={args.max_tokens} (ignore_eos), closed loop, "
          f"{args.workers} engine processes on {args.cores} cores per topology; {note}; energy: {meter.describe()}")
    print()
    for key, title in (("throughput_tok_s", "output tok/s"), ("ttft_p50_ms", "TTFT p50 ms"),
                       ("tpot_p50_ms", "TPOT p50 ms")):
        print(report.pivot_table(runs, key, f"{title} \\ conc."))
        print()
    if meter.available:
        print(report.pivot_table(runs, "tokens_per_joule", "tokens/J \\ conc.", digits=2))
        print()
    print(report.markdown_table(runs))
    if args.plot:
        print(f"\nplot: {report.plot(runs, args.plot, f'crossover on one budget: {args.workload}, {note}')}")
    out = {"config": config, "runs": runs}
    if args.json:
        report.write_json(args.json, out)
    return out


def main(args: argparse.Namespace) -> int:
    return run_cli("crossover", run, args)
