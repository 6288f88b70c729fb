"""``tandem serve SERVICE``: run one service in this process (what a container runs).

Configuration comes from the environment (``shared/settings.py``; ``--help`` lists every
variable). SIGTERM / SIGINT drain: in-flight requests finish (or fail with a clear error),
then the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal

from shared import subjects, tracing
from shared.settings import ConfigError, Settings, env_help

log = logging.getLogger("tandem.serve")

SERVICES = ("gateway", "router", "prefill", "gpu-decode", "cpu-decode", "kvpool")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from services.gateway.app import add_arguments as gateway_arguments
    p.add_argument("service", choices=SERVICES, help="which service to run")
    gateway_arguments(p)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = env_help()


async def _run(args: argparse.Namespace, settings: Settings) -> None:
    if args.service == "gateway":  # uvicorn installs its own signal handlers
        await _run_gateway(args, settings)
        return
    # Building the service loads the model: until it is built, SIGTERM ends the process at once
    # (the default action; nothing is in flight yet). Until it has started (NATS may keep it
    # waiting: a cluster electing its leader) SIGINT / SIGTERM stop it at once; then they drain it.
    if args.service == "router":
        from services.router import Router
        service = Router(settings)
    elif args.service == "prefill":
        from services.prefill import PrefillWorker
        service = PrefillWorker(settings, settings.worker.device or "cpu")
    elif args.service == subjects.KVPOOL:
        from services.kvpool import PoolService
        service = PoolService(settings)
    else:
        from services.decode import DecodeWorker
        service = DecodeWorker(settings, args.service)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    starting, stopped = asyncio.ensure_future(service.start()), asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        log.warning("%s stopped before it was ready", args.service)
        return
    stopped.cancel()
    starting.result()
    await service.run_until(stop)


def exposure_warning(host: str, has_keys: bool) -> str | None:
    """The warning a gateway logs at start when it serves anyone beyond this machine: bound
    beyond loopback with no API key. None: no warning."""
    if has_keys or _loopback(host):
        return None
    return (f"!!! the gateway listens on {host} WITHOUT AN API KEY: anyone who reaches this port can use "
            "the model and read stored responses. Set TANDEM_API_KEY or TANDEM_API_KEYS (docs/security.md), "
            "or TANDEM_HOST=127.0.0.1")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


async def _run_gateway(args: argparse.Namespace, settings: Settings) -> None:
    from shared.bus import Bus
    from shared.engine.model_files import load_tokenizer, served_model_name
    from services.gateway.app import serve
    from services.gateway.nats_backend import NatsBackend

    gw = args.gateway
    if (warning := exposure_warning(gw.host, bool(gw.key_tiers()))) is not None:
        log.warning("%s", warning)
    tracing.setup("gateway")  # span export only when TANDEM_OTLP_ENDPOINT is set
    tokenizer, cfg = load_tokenizer(settings.worker.model)  # metadata only, no weights
    name, ctx = gw.served_model_name or served_model_name(settings.worker.model), cfg.max_context
    if settings.worker.max_context:
        ctx = min(ctx, settings.worker.max_context)
    gateway_id = settings.worker.resolved_worker_id("gateway")
    bus = await Bus.connect(settings, name=gateway_id, role=subjects.GATEWAY)
    backend = NatsBackend(bus, name, ctx, tokenizer, gw, gateway_id)
    await backend.start()
    try:
        await serve(backend, gw)
    finally:
        await backend.close()
        await bus.close()


def main(args: argparse.Namespace) -> int:
    from shared.bus import BusError
    from services.gateway.app import settings_from_args
    try:
        settings = Settings.from_env()
        args.gateway = settings_from_args(args) if args.service == "gateway" else None
        if not settings.nats.servers():
            raise ValueError("no NATS server: set TANDEM_NATS_URL (or run `tandem up`, which starts an embedded one)")
        keyed = args.service not in ("gateway", "router")   # the data plane's services, the pool's secret
        data_key = b""
        if keyed:   # their key files, read now: one that cannot be read is a ValueError naming it
            settings.pool.secret()
            data_key = settings.data.secret()
        if keyed and not _loopback(settings.data.host) and not data_key:
            raise ValueError(f"TANDEM_DATA_HOST={settings.data.host} takes KV from beyond this machine, but there "
                             "is no data-plane key to tell its peers from anyone else: set TANDEM_DATA_KEY (the "
                             "same on every host, e.g. `openssl rand -hex 32`) or TANDEM_DATA_KEY_FILE "
                             f"naming a file that holds one (now {settings.data.key_file}: missing or empty) — "
                             "docs/security.md")
        if os.environ.get(tracing.OTLP_ENV):
            tracing.check_exporter()
    except ValueError as e:
        log.error("bad configuration: %s", e)
        return 2
    try:
        asyncio.run(_run(args, settings))
    except ConfigError as e:  # found while starting (a fixed port another process has): one line
        log.error("bad configuration: %s", e)
        return 2
    except BusError as e:     # NATS unreachable or refusing this role at start: one line, not a traceback
        if e.code != "unavailable":
            raise
        log.error("%s", e.message)
        return 1
    return 0
