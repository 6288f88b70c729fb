"""``tandem bench {engine,kernels,serve}``: each benchmark lives in its own module.

A benchmark module exposes ``add_arguments(parser)`` and ``main(args) -> int`` (``bench.kernels``
predates that and is adapted here). Every benchmark takes ``--json FILE``. ``serve`` is
dispatched to ``bench.serve`` when that module exists.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json


def _kernels_arguments(p: argparse.ArgumentParser) -> None:
    from bench import kernels

    for action in kernels.parser()._actions:  # reuse its options (it has no add_arguments)
        if action.option_strings and "-h" not in action.option_strings:
            p._add_action(action)
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")


def _kernels_main(args: argparse.Namespace) -> int:
    from bench import kernels

    rows = kernels.run(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0


def _module_arguments(name: str):
    return lambda p: importlib.import_module(name).add_arguments(p)


def _module_main(name: str):
    return lambda args: importlib.import_module(name).main(args)


# name -> (help, add_arguments(parser), main(args))
BENCHES = {
    "engine": ("engine prefill / decode tokens/s and peak RSS on CPU",
               _module_arguments("bench.engine"), _module_main("bench.engine")),
    "kernels": ("Q4_0 matmul: torch reference vs fast CPU kernels",
                _kernels_arguments, _kernels_main),
    "serve": ("end-to-end serving benchmark (bench/serve.py)",
              _module_arguments("bench.serve"), _module_main("bench.serve")),
}


def _available(name: str) -> bool:
    return name != "serve" or importlib.util.find_spec("bench.serve") is not None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (help_text, add_args, _) in BENCHES.items():
        if not _available(name):
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)


def main(args: argparse.Namespace) -> int:
    return int(BENCHES[args.bench][2](args) or 0)
