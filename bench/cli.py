"""``tandem bench BENCH`` (engine, gpu, node, agents, kernels, serve, stack, crossover, pool, migration, tiers, chaos, grammar, stops, ring, startup, tenants, two-hosts, hosts): one module per benchmark.

A benchmark module exposes ``add_arguments(parser)`` and ``main(args) -> int``. Every
benchmark takes ``--json FILE``. ``serve`` is dispatched to ``bench.serve`` when that module exists.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging


def at_least(low: float, kind=int):
    """An argparse type: a ``kind`` number of at least ``low`` (a bench given --duration -5 or
    --concurrency 0 ran anyway, and one of them left a stack behind)."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low:g}, got {text}")
        return v
    return parse


def _module_arguments(name: str):
    return lambda p: importlib.import_module(name).add_arguments(p)


def _module_main(name: str):
    return lambda args: importlib.import_module(name).main(args)


# name -> (help, add_arguments(parser), main(args))
BENCHES = {
    "engine": ("engine prefill / decode tokens/s and peak RSS on CPU",
               _module_arguments("bench.engine"), _module_main("bench.engine")),
    "gpu": ("the CUDA engine op by op, fused and as CUDA graphs vs the host's CPU engine: decode tok/s, "
            "launches and GPU busy time per step, prefill, tokens per joule (bench/gpu.py; needs a GPU)",
            _module_arguments("bench.gpu"), _module_main("bench.gpu")),
    "node": ("the same streamed request on the node's gpu-decode (interactive) and cpu-decode (standard) "
             "pools through the stack: TTFT / TPOT side by side (bench/node.py)",
             _module_arguments("bench.node"), _module_main("bench.node")),
    "kernels": ("Q4_0 kernels: matmuls vs the reference, the model vs llama.cpp (--with-llama-cpp)",
                _module_arguments("bench.kernels"), _module_main("bench.kernels")),
    "serve": ("load generator against any OpenAI-compatible server (bench/serve.py)",
              _module_arguments("bench.serve"), _module_main("bench.serve")),
    "stack": ("the stack (tandem up, openai client streaming) vs the in-process engine, c=1 and c=16 (bench/stack.py)",
              _module_arguments("bench.stack"), _module_main("bench.stack")),
    "crossover": ("every topology on one budget at rising concurrency (bench/crossover.py)",
                  _module_arguments("bench.crossover"), _module_main("bench.crossover")),
    "pool": ("KV pool: TTFT cold vs warm, codecs on real KV, lookups/s, transfer GB/s per path",
             _module_arguments("bench.pool"), _module_main("bench.pool")),
    "migration": ("live migration: moving a decoding request's KV vs recomputing its prefix",
                  _module_arguments("bench.migration"), _module_main("bench.migration")),
    "tiers": ("mixed agent workload: SLA tiers vs one FIFO queue, side by side (bench/tiers.py)",
              _module_arguments("bench.tiers"), _module_main("bench.tiers")),
    "grammar": ("grammar libraries (llguidance, xgrammar, outlines-core): schema compile and mask time per token",
                _module_arguments("bench.grammar"), _module_main("bench.grammar")),
    "chaos": ("steady load while engine workers and NATS are killed: lost, resumed, exact (bench/chaos.py)",
              _module_arguments("bench.chaos"), _module_main("bench.chaos")),
    "sampler": ("the host sampler's top-p: the candidates it sorts vs a sort of the whole row, on the model's "
                "logits and in the CPU engine's decode (bench/sampler.py)",
                _module_arguments("bench.sampler"), _module_main("bench.sampler")),
    "stops": ("16 stop strings of 30 KB on one sequence vs the rest of its batch's decode speed (bench/stops.py)",
              _module_arguments("bench.stops"), _module_main("bench.stops")),
    "hosts": ("N hosts on one machine (network namespaces, root), one NATS cluster: a server killed "
              "mid-stream, a host killed, the host back (bench/hosts.py)",
              _module_arguments("bench.hosts"), _module_main("bench.hosts")),
    "two-hosts": ("two hosts on one machine (network namespaces, root): prefill on one, decode on the other, "
                  "the pool shared (bench/two_hosts.py)",
                  _module_arguments("bench.two_hosts"), _module_main("bench.two_hosts")),
    "ring": ("ring decode (cpu-ring(N), members in one process) vs a single worker per context; the compute/transfer model",
             _module_arguments("bench.ring"), _module_main("bench.ring")),
    "agents": ("agent loops through /v1/responses (previous_response_id, tool pauses), idle and beside a batch "
               "flood: turn TTFT, cached share of input, conversation prefilled again (bench/agents.py)",
               _module_arguments("bench.agents"), _module_main("bench.agents")),
    "tenants": ("one API key's flood beside another key's single request: the engine's queue shared fairly "
                "between keys vs one arrival-order queue, side by side (bench/tenants.py)",
                _module_arguments("bench.tenants"), _module_main("bench.tenants")),
    "startup": ("seconds to ready, cold and warm weight cache, one engine and tandem up; RSS/PSS per engine",
                _module_arguments("bench.startup"), _module_main("bench.startup")),
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


def json_destination_problem(path: str) -> str | None:
    """Why ``--json PATH`` could not be written after the run (checked before it), or None."""
    import os
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"--json {path}: a directory"
    if not os.path.isdir(folder):
        return f"--json {path}: no directory {folder}"
    if not os.access(folder, os.W_OK):
        return f"--json {path}: {folder} is not writable"
    return None


def main(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request of the load
    if getattr(args, "json", None) and (problem := json_destination_problem(args.json)):
        logging.getLogger("tandem.bench").error("%s (said before the run, whose results it would lose)", problem)
        return 2
    from shared.engine.model_files import ModelLoadError
    try:
        return int(BENCHES[args.bench][2](args) or 0)
    except ModelLoadError as e:     # --model naming no model: its line, not a traceback
        logging.getLogger("tandem.bench").error("%s", e)
        return 2
