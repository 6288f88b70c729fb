"""``tandem bench startup``: seconds until ready, cold (empty weight cache: the first run converts)
and warm (the cache file is mapped), for one engine and for ``tandem up``; memory of each engine.

    tandem bench startup [--rounds 2] [--skip-stack] [--json out.json]

A round runs, in this order: one engine cold, one engine warm, the stack cold, the stack warm,
and (``--with-off``) one engine and the stack with the cache off (``TANDEM_WEIGHT_CACHE_DIR=""``:
every engine converts, taking turns). Each cold run gets a new empty cache directory, its warm
run the directory the cold run filled. Rounds alternate, so drift of a shared machine falls on
every column alike.

- one engine: a fresh interpreter runs ``Engine.from_path`` (bundled model, the engine settings a
  worker gets) and prints a line; the time is from spawning it to that line (imports included).
- the stack: ``tandem up`` (embedded NATS, KV pool, prefill, gpu-decode, cpu-decode, router,
  gateway; counts as given) until the gateway's /health lists every engine worker and the router
  as ready (polled every 0.1 s).
- memory: once every worker is ready, for each engine process ``/proc/<pid>/smaps_rollup`` (RSS,
  PSS, anonymous) and the RSS of its mapping of the weight cache file (``/proc/<pid>/smaps``).
  PSS splits shared pages among the processes mapping them: N engines mapping one cache file
  each hold 1/N of the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from bench import cpu_time
from bench.cli import at_least
from bench.serve import Server, bench_env
from shared.nats_server import free_port

ROLES = ("prefill", "gpu-decode", "cpu-decode")

_ENGINE = """
import logging
logging.basicConfig(level=logging.INFO)
from shared.engine.engine import Engine
from shared.settings import Settings
from services.worker import engine_config
Engine.from_path(None, engine_config(Settings.from_env(), "cpu"))
print("READY", flush=True)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=at_least(1), default=2, help="alternating rounds (default 2)")
    p.add_argument("--threads", type=int, default=0, help="TANDEM_THREADS of every engine (0: the default)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers of the stack (default 1)")
    p.add_argument("--gpu-decode", type=int, default=1, help="gpu-decode workers (default 1; on the CPU without CUDA)")
    p.add_argument("--cpu-decode", type=int, default=1, help="cpu-decode workers (default 1)")
    p.add_argument("--skip-stack", action="store_true", help="one engine only")
    p.add_argument("--with-off", action="store_true", help="also the cache off (every engine converts)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a start may take (default 300)")
    p.add_argument("--json", default=None, help="write the results here")


def _env(args: argparse.Namespace, cache_dir: str) -> dict:
    env = bench_env(args.threads)
    if not args.threads:
        env.pop("TANDEM_THREADS")
    env["TANDEM_WEIGHT_CACHE_DIR"] = cache_dir
    env.setdefault("TANDEM_KV_BUDGET_MB", "256")
    return env


def engine_start(args: argparse.Namespace, cache_dir: str) -> tuple[float, float]:
    """Seconds from spawning a fresh interpreter to its engine being built; seconds of that spent
    converting (the loader's "loaded ... in X s" line; 0 when it mapped the cache)."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _ENGINE], env=_env(args, cache_dir), capture_output=True,
                          text=True, timeout=args.timeout)
    dt = time.monotonic() - t0
    if proc.returncode != 0 or "READY" not in proc.stdout:
        raise RuntimeError(f"engine start failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    conv = re.search(r"loaded .* in ([0-9.]+)s", proc.stderr)
    return dt, float(conv.group(1)) if conv else 0.0


def _children(pid: int) -> dict[int, str]:
    """pid -> service of the ``tandem up`` children (``python -m services.cli serve SERVICE``; the
    embedded nats-server is ``nats``)."""
    return {p.pid: p.service for p in cpu_time.processes() if p.ppid == pid}


def memory(pid: int) -> dict[str, float]:
    """MiB: rss, pss, anon (smaps_rollup) and weights_rss (RSS of the mapped weight cache file)."""
    mib = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Rss", "Pss", "Anonymous"):
                mib[{"Rss": "rss", "Pss": "pss", "Anonymous": "anon"}[k]] = int(v.split()[0]) / 1024
    weights, in_cache = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:   # a mapping's first line
                in_cache = line.rstrip().endswith(".tqw")
            elif in_cache and head and head[0] == "Rss:":
                weights += int(head[1])
    mib["weights_rss"] = weights / 1024
    return mib


def stack_start(args: argparse.Namespace, cache_dir: str) -> tuple[float, list[dict]]:
    """Seconds from ``tandem up`` to every worker ready; memory of each engine process then."""
    import httpx

    port = free_port()
    want = {"router": 1, "prefill": args.prefill, "gpu-decode": args.gpu_decode, "cpu-decode": args.cpu_decode}
    want = {r: n for r, n in want.items() if n}
    argv = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--prefill", str(args.prefill),
            "--gpu-decode", str(args.gpu_decode), "--cpu-decode", str(args.cpu_decode)]
    t0 = time.monotonic()
    server = Server("stack", argv, dict(_env(args, cache_dir), TANDEM_PORT=str(port)), port)
    try:
        while True:
            if time.monotonic() - t0 > args.timeout:
                raise TimeoutError(f"not every worker of {want} ready in {args.timeout:.0f} s:\n{server.tail()}")
            if server.proc.poll() is not None:
                raise RuntimeError(f"tandem up exited with {server.proc.returncode}:\n{server.tail()}")
            try:
                details = httpx.get(server.url + "/health", timeout=2).json().get("details", {})
            except (httpx.HTTPError, ValueError):
                details = {}
            if all(len(details.get(r, {}).get("workers", [])) >= n for r, n in want.items()):
                break
            time.sleep(0.1)
        dt = time.monotonic() - t0
        procs = [{"service": s, "pid": pid, **memory(pid)}
                 for pid, s in sorted(_children(server.proc.pid).items()) if s in ROLES]
        return dt, procs
    finally:
        server.stop()


def main(args: argparse.Namespace) -> int:
    from kernels import cpu

    isa = cpu.isa()
    modes = ["cold", "warm"] + (["off"] if args.with_off else [])
    times: dict[tuple[str, str], list[float]] = {}
    mem: dict[str, list[dict]] = {}
    converting: dict[str, list[float]] = {}   # cache mode -> seconds one engine spent converting
    with tempfile.TemporaryDirectory(prefix="tandem-bench-startup-") as root:
        for r in range(args.rounds):
            for what in ("engine",) + (() if args.skip_stack else ("stack",)):
                cache = os.path.join(root, f"{what}-{r}")
                for mode in modes:
                    d = "" if mode == "off" else cache
                    if what == "engine":
                        dt, conv = engine_start(args, d)
                        converting.setdefault(mode, []).append(conv)
                    else:
                        dt, procs = stack_start(args, d)
                        mem.setdefault(mode, procs)   # the first round's
                    times.setdefault((what, mode), []).append(dt)
                    print(f"round {r + 1}: {what} {mode}: {dt:.2f} s", file=sys.stderr, flush=True)
    print(f"\n## Start-up to ready (CPU ISA {isa}, {os.cpu_count()} cores, {args.rounds} rounds, "
          f"alternating; TANDEM_THREADS={args.threads or 'default'})\n")
    print("| start | cache | median s | min s | max s | of which converting (median s) |")
    print("|---|---|---:|---:|---:|---:|")
    for (what, mode), v in times.items():
        label = "one engine" if what == "engine" else \
            f"tandem up (prefill {args.prefill}, gpu-decode {args.gpu_decode}, cpu-decode {args.cpu_decode})"
        conv = f"{statistics.median(converting[mode]):.2f}" if what == "engine" else ""
        print(f"| {label} | {mode} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} | {conv} |")
    for mode, procs in mem.items():
        print(f"\n### Engine processes, every worker ready, cache {mode} (MiB)\n")
        print("| process | RSS | PSS | anonymous | weight-cache pages in RSS |")
        print("|---|---:|---:|---:|---:|")
        for p in procs:
            print(f"| {p['service']} (pid {p['pid']}) | {p['rss']:.0f} | {p['pss']:.0f} | {p['anon']:.0f} | "
                  f"{p['weights_rss']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": isa, "rounds": args.rounds, "threads": args.threads,
                       "times": {f"{w} {m}": v for (w, m), v in times.items()},
                       "engine_converting": converting, "memory": mem}, f, indent=1)
    return 0
