"""``tandem up``: the whole stack on one machine — NATS (embedded unless TANDEM_NATS_URL is set)
and one process per service copy, with prefixed logs; Ctrl-C / SIGTERM stops it all cleanly.

Start order: NATS → decode and prefill workers → router → gateway. Shutdown: SIGTERM to the
gateway first (it drains in-flight requests), then the workers (they finish what they hold),
then NATS.
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
    p.add_argument("--prefill", type=int, default=1, help="prefill worker copies (default 1)")
    p.add_argument("--gpu-decode", type=int, default=1, help="gpu-decode worker copies (default 1)")
    p.add_argument("--cpu-decode", type=int, default=1, help="cpu-decode worker copies (default 1)")
    p.add_argument("--router", type=int, default=1, help="router copies (default 1)")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (TANDEM_MODEL; default bundled)")


def plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, service) for every child process, in start order."""
    out = []
    for service, n in (("cpu-decode", args.cpu_decode), ("gpu-decode", args.gpu_decode),
                       ("prefill", args.prefill), ("router", args.router)):
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
    children = plan(args)
    env = dict(os.environ)
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
        log.info("started %s; gateway on port %s", ", ".join(procs), env.get("TANDEM_PORT", "8000"))
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
        plan(args)
    except ValueError as e:
        log.error("%s", e)
        return 2
    return asyncio.run(_up(args))
