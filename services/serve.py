"""``tandem serve SERVICE``: run one service in this process (what a container runs).

Configuration comes from the environment (``shared/settings.py``; ``--help`` lists every
variable). SIGTERM / SIGINT drain: in-flight requests finish (or fail with a clear error),
then the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from shared import subjects
from shared.settings import Settings, env_help

log = logging.getLogger("tandem.serve")

SERVICES = ("gateway", "router", "prefill", "gpu-decode", "cpu-decode", "kvpool")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("service", choices=SERVICES, help="which service to run")
    p.add_argument("--port", type=int, default=None, help="gateway HTTP port (TANDEM_PORT, default 8000)")
    p.add_argument("--host", default=None, help="gateway bind address (TANDEM_HOST)")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = env_help()


async def _run(args: argparse.Namespace, settings: Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if args.service != "gateway":  # uvicorn installs its own handlers for the gateway
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    if args.service == "router":
        from services.router import Router
        await Router(settings).run(stop)
    elif args.service == "prefill":
        from services.prefill import PrefillWorker
        await PrefillWorker(settings, settings.worker.device or "cpu").run(stop)
    elif args.service == subjects.KVPOOL:
        from services.kvpool import PoolService
        await PoolService(settings).run(stop)
    elif args.service in (subjects.GPU_DECODE, subjects.CPU_DECODE):
        from services.decode import DecodeWorker
        await DecodeWorker(settings, args.service).run(stop)
    else:
        await _run_gateway(args, settings)


async def _run_gateway(args: argparse.Namespace, settings: Settings) -> None:
    from shared import tracing
    from shared.bus import Bus
    from shared.engine.loader import load_tokenizer
    from services.gateway.app import GatewaySettings, serve
    from services.gateway.nats_backend import NatsBackend

    gw = GatewaySettings.from_env(host=args.host, port=args.port)
    tracing.setup("gateway")  # span export only when TANDEM_OTLP_ENDPOINT is set
    tokenizer, cfg = load_tokenizer(settings.worker.model)  # metadata only, no weights
    name, ctx = cfg.name, cfg.max_context
    if settings.worker.max_context:
        ctx = min(ctx, settings.worker.max_context)
    bus = await Bus.connect(settings, name="gateway")
    backend = NatsBackend(bus, name, ctx, tokenizer, stall_timeout=gw.request_timeout)
    await backend.start()
    try:
        await serve(backend, gw)
    finally:
        await backend.close()
        await bus.close()


def main(args: argparse.Namespace) -> int:
    try:
        settings = Settings.from_env()
    except ValueError as e:
        log.error("bad configuration: %s", e)
        return 2
    asyncio.run(_run(args, settings))
    return 0
