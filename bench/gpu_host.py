"""The host's share of a graphs decode step, without a GPU: ``python -m bench.gpu_host``.

The engine runs as on CUDA with decode graphs — scheduling, ``DecodeInputs.fill`` (the static
buffers), the tokens read back, sampling's bookkeeping, the incremental detokenizer — but the
graph is a stub that does no GPU work (``StubGraphs``). What a step then takes is the host's part
of it; on a GPU, a step's wall time minus its GPU work minus this is what lies between the
kernels and in the copies (docs/kernels.md, "Measured on a GPU").

``--gpu-us T`` models a device too: each replay "runs" T µs after the one before it ends,
asynchronously, and reading its tokens back waits (spinning, as a CUDA synchronize does) until
then. The table then shows a step's wall time stepped one after another (host + T) and with the
next step launched ahead (TANDEM_GPU_AHEAD=1: before the last one's tokens are read) — the
mechanism's gain for a given host and device time, not a GPU's figure."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from kernels.gpu_step import DecodeGraphs


# what the stub "generates": the detokenizer's work depends on it (a special token's empty text
# keeps a sequence's decode window growing: token 0 made this bench's 64-sequence step ~30 % slower)
TEXT = ("The quick brown fox jumps over the lazy dog. A serving system streams tokens to many users "
        "at once; each step decodes one token for every running sequence, and the host turns those "
        "tokens into text, checks stop strings and hands the deltas on. Naïve, café, 東京, 👍 — "
        "multi-byte characters arrive in pieces and wait for their last byte.")


class StubGraphs(DecodeGraphs):
    """DecodeGraphs whose every bucket "replays" in no time: zero logits, and row r's token at step k
    ``tokens[(k + r) % len(tokens)]`` (default: token 0)."""

    def __init__(self, cap: int, width: int, block_size: int, vocab: int, tokens: list[int] | None = None):
        super().__init__(SimpleNamespace(device=torch.device("cpu"), persistent=False), None, cap, width, block_size, 0,
                         capture=False)
        self.logits = torch.zeros(self.sizes[-1], vocab)
        self.best = torch.zeros(self.sizes[-1], dtype=torch.int64)
        self.tokens = torch.tensor(tokens or [0], dtype=torch.int64)

    def _body(self, bucket, variant=None):
        self.best[:bucket] = self.tokens[(self.steps + torch.arange(bucket)) % len(self.tokens)]
        return self.logits[:bucket], self.best[:bucket]


class ModeledDevice(StubGraphs):
    """StubGraphs whose replays take ``gpu_us`` each on a modeled device: one after another, from
    the launch or the end of the one before; ``finish`` waits for the step's end."""

    def __init__(self, *a, gpu_us: float, **kw):
        super().__init__(*a, **kw)
        self.gpu_s, self.busy_until, self.ends = gpu_us / 1e6, 0.0, {}

    def start(self, *a, **kw):
        started = super().start(*a, **kw)
        self.busy_until = max(time.perf_counter(), self.busy_until) + self.gpu_s
        self.ends[id(started)] = self.busy_until
        return started

    def finish(self, started):
        end = self.ends.pop(id(started))
        while time.perf_counter() < end:    # the host waits on the device (a synchronize spins)
            pass
        return super().finish(started)


def _decode_steps(e, n: int, steps: int) -> float:
    """µs a decode step of ``n`` sequences, over ``steps`` steps after two unmeasured ones."""
    from shared.engine.sampling import SamplingParams
    p = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(n):
        e.add(f"h{n}-{i}", e.tokenizer.encode("The quick brown fox"), p)
    e.step()
    e.step()
    t0, k = time.perf_counter(), 0
    while e.has_work() and k < steps:
        e.step()
        k += 1
    us = (time.perf_counter() - t0) / k * 1e6
    while e.has_work():
        e.step()
    return us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--gpu-us", type=float, default=0.0,
                    help="model a device whose replay takes this long: stepped vs launched ahead (0: host only)")
    ap.add_argument("--rounds", type=int, default=3, help="with --gpu-us: stepped and ahead in turn, this many times")
    a = ap.parse_args(argv)
    from shared.engine.engine import Engine, EngineConfig
    top = max(a.seqs)
    # KV for every sequence's whole run (prompt, two warm-up steps, the steps): nothing preempted
    # (with the default 256 MiB, 64 sequences of 200 steps swapped 8 times: not the host's step)
    blocks = top * -(-(16 + a.steps + 8) // 16) + 8
    e = Engine.from_path(None, EngineConfig(threads=2, enable_prefix_caching=False, max_num_seqs=top,
                                            num_kv_blocks=blocks))
    stub = (e.model.cfg.vocab_size, e.tokenizer.encode(TEXT, add_special_tokens=False))
    host = StubGraphs(top, 512, e.layout.block_size, *stub)
    if not a.gpu_us:
        e.graphs = host
        print("| sequences | host µs a decode step |\n|---:|---:|")
    else:
        modeled = ModeledDevice(top, 512, e.layout.block_size, *stub, gpu_us=a.gpu_us)
        print(f"| sequences | host µs a decode step | stepped µs (device {a.gpu_us:.0f}) | launched ahead µs | "
              "stepped ÷ ahead |\n|---:|---:|---:|---:|---:|")
    for n in a.seqs:
        e.graphs = host
        us = _decode_steps(e, n, a.steps)
        if not a.gpu_us:
            print(f"| {n} | {us:.0f} |", flush=True)
        else:   # the two in turn, --rounds times (this machine's noise moves both alike), medians
            e.graphs, runs = modeled, {False: [], True: []}
            for _ in range(a.rounds):
                for ahead in (False, True):
                    modeled.ahead = ahead
                    runs[ahead].append(_decode_steps(e, n, a.steps))
            stepped, ahead = statistics.median(runs[False]), statistics.median(runs[True])
            print(f"| {n} | {us:.0f} | {stepped:.0f} | {ahead:.0f} | {stepped / ahead:.2f} |", flush=True)
        if e.scheduler.num_preemptions:
            print(f"(preempted {e.scheduler.num_preemptions} times: the figure includes KV swaps)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
