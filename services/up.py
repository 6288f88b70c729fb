"""``tandem up``: the whole stack on one machine — NATS (embedded unless TANDEM_NATS_URL is set)
and one process per service copy, with prefixed logs; Ctrl-C / SIGTERM stops it all cleanly.

Start order: NATS → KV pool → decode and prefill workers → router → gateway. Shutdown: SIGTERM to the
gateway first (it drains in-flight requests), then the workers (they finish what they hold),
then NATS.

Topologies on one budget: ``TOPOLOGY_HELP`` below (also in ``tandem up --help``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from shared.nats_server import EmbeddedNats

log = logging.getLogger("tandem.up")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=None, help="gateway HTTP port (TANDEM_PORT, default 8000)")
    p.add_argument("--topology", choices=TOPOLOGIES, default=None,
                   help="a named topology on one budget (overrides the per-service counts; see above)")
    p.add_argument("--workers", type=int, default=2, help="--topology: engine processes (default 2)")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                   help="--topology: CPU cores the engines share (default: all of this machine's)")
    p.add_argument("--prefill", type=int, default=1, help="prefill worker copies (default 1)")
    p.add_argument("--gpu-decode", type=int, default=1, help="gpu-decode worker copies (default 1)")
    p.add_argument("--cpu-decode", type=int, default=1, help="cpu-decode worker copies (default 1)")
    p.add_argument("--router", type=int, default=1, help="router copies (default 1)")
    p.add_argument("--kvpool", type=int, default=1, help="KV pool service copies (default 1; 0: no pool)")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (TANDEM_MODEL; default bundled)")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = TOPOLOGY_HELP


TOPOLOGIES = ("single", "replicated", "disaggregated", "heterogeneous")
TOPOLOGY_HELP = """\
topologies on one budget (--topology; --workers W engine processes share --cores C: each engine
gets C // W threads, a single engine all C; NATS, router, gateway and KV pool come on top):
  single          one colocated cpu-decode worker (it prefills and decodes), C threads
  replicated      W colocated cpu-decode workers behind a round-robin router
  disaggregated   W // 2 prefill + the rest cpu-decode workers, KV over the data plane
  heterogeneous   one gpu-decode + W - 1 cpu-decode workers, the SLA router (tier -> pool)
without --topology the per-service counts (--prefill ...) apply, with the SLA router"""


def topology(args: argparse.Namespace) -> dict[str, str]:
    """Apply ``--topology``: set the per-service counts on ``args``; the environment every child
    gets (TANDEM_THREADS, TANDEM_ROUTER_POLICY). Empty without a topology."""
    name = args.topology
    if name is None:
        return {}
    w, cores = args.workers, args.cores
    if w < 1 or cores < 1:
        raise ValueError("--workers and --cores must be >= 1")
    if name in ("disaggregated", "heterogeneous") and w < 2:
        raise ValueError(f"--topology {name} needs --workers >= 2")
    counts = {"single": (0, 0, 1), "replicated": (0, 0, w), "disaggregated": (w // 2, 0, w - w // 2),
              "heterogeneous": (0, 1, w - 1)}[name]
    args.prefill, args.gpu_decode, args.cpu_decode = counts
    threads = cores if name == "single" else max(1, cores // w)
    return {"TANDEM_THREADS": str(threads), "TANDEM_ROUTER_POLICY": "round-robin" if name == "replicated" else "sla"}


def engines(name: str, workers: int) -> dict[str, int]:
    """Engine processes per role of topology ``name`` with ``workers`` engines (bench, tests)."""
    args = argparse.Namespace(topology=name, workers=workers, cores=1)
    topology(args)
    counts = {"prefill": args.prefill, "gpu-decode": args.gpu_decode, "cpu-decode": args.cpu_decode}
    return {role: n for role, n in counts.items() if n}


def plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, service) for every child process, in start order."""
    out = []
    for service, n in (("kvpool", getattr(args, "kvpool", 0)), ("cpu-decode", args.cpu_decode),
                       ("gpu-decode", args.gpu_decode), ("prefill", args.prefill), ("router", args.router)):
        if n < 0:
            raise ValueError(f"--{service} must be >= 0")
        out += [(f"{service}-{i + 1}" if n > 1 else service, service) for i in range(n)]
    if args.cpu_decode + args.gpu_decode == 0:
        raise ValueError("at least one decode worker is needed (--cpu-decode or --gpu-decode)")
    if args.router < 1:
        raise ValueError("at least one router is needed")
    return out + [("gateway", "gateway")]


async def _pump(name: str, stream: asyncio.StreamReader) -> None:
    width = 12
    while line := await stream.readline():
        sys.stderr.write(f"{name:<{width}}| {line.decode(errors='replace')}")
        sys.stderr.flush()


async def _up(args: argparse.Namespace) -> int:
    env = dict(os.environ, **topology(args))
    children = plan(args)
    nats = None
    if not env.get("TANDEM_NATS_URL"):
        nats = EmbeddedNats()
        env["TANDEM_NATS_URL"] = nats.start()
        log.info("embedded NATS (JetStream) at %s", env["TANDEM_NATS_URL"])
    if args.port:
        env["TANDEM_PORT"] = str(args.port)
    if args.model:
        env["TANDEM_MODEL"] = args.model
    procs: dict[str, asyncio.subprocess.Process] = {}
    pumps = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        for name, service in children:
            child_env = dict(env, TANDEM_WORKER_ID=f"{name}-{os.getpid()}")
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.cli", "serve", service, env=child_env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
            procs[name] = proc
            pumps.append(asyncio.create_task(_pump(name, proc.stdout)))
        log.info("started %s%s; gateway on port %s", ", ".join(procs),
                 f" (topology {args.topology}, {env['TANDEM_THREADS']} thread(s) per engine)" if args.topology else "",
                 env.get("TANDEM_PORT", "8000"))
        waits = {asyncio.create_task(p.wait()): n for n, p in procs.items()}
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopper, *waits], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t in waits:
                log.error("%s exited with code %s; stopping the stack", waits[t], t.result())
        return 0 if stopper in done else 1
    finally:
        # gateway first (drains HTTP), then workers, then NATS
        for name in ["gateway"] + [n for n in procs if n != "gateway"]:
            p = procs.get(name)
            if p is not None and p.returncode is None:
                p.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(p.wait(), 40)
                except asyncio.TimeoutError:
                    log.warning("%s did not stop in time; killing it", name)
                    p.kill()
                    await p.wait()
        await asyncio.gather(*pumps, return_exceptions=True)
        if nats is not None:
            nats.stop()
        log.info("stack stopped")


def main(args: argparse.Namespace) -> int:
    try:
        topology(args)
        plan(args)
    except ValueError as e:
        log.error("%s", e)
        return 2
    return asyncio.run(_up(args))
