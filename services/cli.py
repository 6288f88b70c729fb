"""The ``tandem`` command. Each subcommand lives in its own module, imported only when used.

A subcommand module exposes ``add_arguments(parser)`` and ``main(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("shared.engine.generate_cli", "stream a completion from the engine in this process"),
    "quantize": ("shared.engine.quantize", "convert a GGUF or safetensors model to a Q4_0 GGUF"),
    "up": ("services.up", "start NATS (embedded unless TANDEM_NATS_URL is set) and every service"),
    "serve": ("services.serve", "run one service (what a container runs)"),
    "tap": ("services.tap", "print live bus traffic"),
    "nats-auth": ("services.nats_auth", "write the bus role credentials and the nats-server config accepting them"),
    "kube": ("services.kube", "Kubernetes: the Secrets, render, offline validation, podman form (docs/deploy.md)"),
    "health": ("services.health", "exit 0 when the service on this host takes work (container health checks)"),
    "bench": ("bench.cli", "benchmarks, each printing a table of side-by-side ratios (`tandem bench --help` "
                           "lists them)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: one model on every processor of a node.")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # only the chosen subcommand's module is imported (torch is slow to import)
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from shared.tracing import setup_logging
    setup_logging(args.log_level.upper())  # the request id in every line (shared/tracing.py)
    from shared.settings import unknown_env
    for line in unknown_env().values():    # a typo'd variable would be ignored in silence
        logging.getLogger("tandem").warning("%s", line)
    return int(importlib.import_module(COMMANDS[args.command][0]).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
