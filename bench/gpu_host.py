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
mechanism's gain for a given host and device time, not a GPU's figure.

``--stack T [T ...]``: what the stack adds to a token when its engine is that fast. For each T and
``--streams`` level: the engine in process on a device modeled at T µs a step, then streamed
interactive chats (the ``openai`` client, through the gateway) from ``tandem up --prefill 0
--gpu-decode 1 --cpu-decode 0 --kvpool 0`` whose gpu-decode worker builds its engine as usual and
then decodes on the same modeled device (bench/modeled_site, ``attach``): TPOT p50 / p90 beside
the engine's step, tokens a second in all, and each process's CPU µs a streamed token;
``--ahead``: each level stepped and launched ahead, side by side. There the wait for the modeled
device sleeps (the last 100 µs spinning): a Python spin would hold the GIL the worker's event loop
needs, where a CUDA synchronize leaves it free. Issue 34's stack target is an interactive TPOT on
gpu-decode of at most a third of cpu-decode's: this says which device step the stack can carry to
a client at that TPOT, on this machine (docs/benchmarks.md, "What the stack adds to a fast
engine")."""

from __future__ import annotations

import argparse
import os
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
        super().__init__(SimpleNamespace(device=torch.device("cpu")), None, cap, width, block_size, 0,
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

    def __init__(self, *a, gpu_us: float, sleep: bool = False, **kw):
        super().__init__(*a, **kw)
        self.gpu_s, self.busy_until, self.ends, self.sleep = gpu_us / 1e6, 0.0, {}, sleep

    def start(self, *a, **kw):
        started = super().start(*a, **kw)
        self.busy_until = max(time.perf_counter(), self.busy_until) + self.gpu_s
        self.ends[id(started)] = self.busy_until
        return started

    def finish(self, started):
        end = self.ends.pop(id(started))
        left = end - time.perf_counter()
        if self.sleep and left > 2e-4:      # asleep, the GIL free (a sleep oversleeps: the last 100 µs spun)
            time.sleep(left - 1e-4)
        while time.perf_counter() < end:    # the host waits on the device (a synchronize spins)
            pass
        return super().finish(started)


def attach(e, gpu_us: float) -> ModeledDevice:
    """Engine ``e``'s decode steps on a device modeled at ``gpu_us`` µs a step (``ModeledDevice``,
    its buckets up to the engine's ``max_num_seqs``, waited for asleep); prefill stays its own."""
    e.graphs = ModeledDevice(e.config.max_num_seqs, 512, e.layout.block_size, e.model.cfg.vocab_size,
                             e.tokenizer.encode(TEXT, add_special_tokens=False), gpu_us=gpu_us, sleep=True)
    return e.graphs


def _decode_steps(e, n: int, steps: int, temperature: float = 0.0, top_p: float = 1.0) -> float:
    """µs a decode step of ``n`` sequences, over ``steps`` steps after two unmeasured ones; greedy,
    or drawn at ``temperature`` (and ``top_p``) with a seed — rows the graph draws on a GPU
    (``sampler.on_device``), so the host's share is their bookkeeping, not a draw."""
    from shared.engine.sampling import SamplingParams
    p = SamplingParams(max_tokens=steps + 8, temperature=temperature, top_p=top_p, seed=7 if temperature else None,
                       ignore_eos=True)
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


# the stack's processes by what their command line holds (``_cpu_seconds``)
ROLES = (("serve gpu-decode", "worker"), ("serve gateway", "gateway"), ("nats-server", "nats"),
         ("serve router", "router"), ("services.cli up", "supervisor"))


def _cpu_seconds(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the process tree under ``root_pid`` by role
    (``ROLES``), and of this process ("client": the load generator)."""
    tick = os.sysconf("SC_CLK_TCK")
    procs = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            procs[int(d)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, cmd)
    tree, grew = {root_pid}, True
    while grew:
        more = {pid for pid, (ppid, _, _) in procs.items() if ppid in tree} - tree
        tree |= more
        grew = bool(more)
    out = {"client": procs.get(os.getpid(), (0, 0.0, ""))[1]}
    for pid in tree & procs.keys():
        _, cpu, cmd = procs[pid]
        role = next((name for key, name in ROLES if key in cmd), "other")
        out[role] = out.get(role, 0.0) + cpu
    return out


def stack_tpot(gpu_us: float, requests: int, max_tokens: int, concurrency: int = 1, ahead: bool = False) -> dict:
    """TPOT / TTFT of ``requests`` streamed interactive chats, ``concurrency`` at a time, through a
    stack whose gpu-decode worker decodes on a device modeled at ``gpu_us`` µs a step
    (bench/modeled_site), each decode step launched before the last one's tokens are read where
    ``ahead`` (TANDEM_GPU_AHEAD=1); the tokens a second streamed in all, and the CPU µs a streamed
    token each of the stack's processes (and the client) spent."""
    import asyncio
    from pathlib import Path

    from bench.node import _level, _stack, _stop, summarize
    root = Path(__file__).resolve().parent.parent
    server = _stack(SimpleNamespace(threads=0), 0, {
        "TANDEM_MODELED_GPU_US": str(gpu_us), "TANDEM_GPU_AHEAD": str(int(ahead)),
        "PYTHONPATH": os.pathsep.join(p for p in (str(root / "bench" / "modeled_site"), str(root),
                                                  os.environ.get("PYTHONPATH", "")) if p)})
    try:
        before, t0 = _cpu_seconds(server.proc.pid), time.perf_counter()
        got = summarize(asyncio.run(_level(server.url, "interactive", concurrency, requests, max_tokens)))
        wall, after = time.perf_counter() - t0, _cpu_seconds(server.proc.pid)
        tokens = got["ok"] * max_tokens
        got["tokens_per_s"] = round(tokens / wall)
        got["cpu_us_a_token"] = {k: round((after[k] - before.get(k, 0.0)) / tokens * 1e6) for k in after} \
            if tokens else {}
        return got
    finally:
        _stop(server)


def _stack_main(a, e) -> int:
    cols = ("worker", "gateway", "nats", "client")
    print("| device µs a step | streams | launched ahead | engine µs a step | stack TPOT p50 / p90 µs | stack ÷ engine | "
          "tok/s in all | " + " | ".join(f"{c} CPU µs a token" for c in cols)
          + " |\n|---:|---:|---|---:|---:|---:|---:|" + "---:|" * len(cols), flush=True)
    for t in a.stack:
        modeled = attach(e, t)
        for c in a.streams:
            order = (False, True) if a.ahead else (False,)
            for ahead in order[::-1] if c % 2 else order:   # (turned level by level: drift hits both alike)
                modeled.ahead = ahead
                engine_us = _decode_steps(e, c, a.steps)
                got = stack_tpot(t, c * a.requests, a.max_tokens, c, ahead)
                if got["errors"]:
                    print(f"({got['errors']} of {c * a.requests} requests failed)", flush=True)
                tpot, cpu = got["tpot_p50_ms"] * 1e3, got["cpu_us_a_token"]
                print(f"| {t:g} | {c} | {'yes' if ahead else 'no'} | {engine_us:.0f} | {tpot:.0f} / "
                      f"{got['tpot_p90_ms'] * 1e3:.0f} | {tpot / engine_us:.2f} | {got['tokens_per_s']} | "
                      + " | ".join(str(cpu.get(col, "—")) for col in cols) + " |", flush=True)
    return 0


def _sampled_main(a, e, host) -> int:
    """The host's share of a greedy step beside one whose rows are drawn (on a GPU, by the graph)."""
    t, top_p = a.sampled
    e.graphs = host
    print(f"| sequences | greedy host µs a step | drawn (T {t:g}, top-p {top_p:g}) host µs | drawn − greedy µs |\n"
          "|---:|---:|---:|---:|")
    for n in a.seqs:
        runs = {False: [], True: []}
        for _ in range(a.rounds):
            for drawn in (False, True):
                runs[drawn].append(_decode_steps(e, n, a.steps, t if drawn else 0.0, top_p if drawn else 1.0))
        g, d = statistics.median(runs[False]), statistics.median(runs[True])
        print(f"| {n} | {g:.0f} | {d:.0f} | {d - g:+.0f} |", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--gpu-us", type=float, default=0.0,
                    help="model a device whose replay takes this long: stepped vs launched ahead (0: host only)")
    ap.add_argument("--rounds", type=int, default=3, help="with --gpu-us: stepped and ahead in turn, this many times")
    ap.add_argument("--stack", type=float, nargs="+", metavar="T",
                    help="device µs a step: the engine in process vs streamed through the stack")
    ap.add_argument("--streams", type=int, nargs="+", default=[1], help="with --stack: chats at once (default 1)")
    ap.add_argument("--ahead", action="store_true",
                    help="with --stack: each level stepped and launched ahead (TANDEM_GPU_AHEAD=1), side by side")
    ap.add_argument("--requests", type=int, default=3, help="with --stack: chats a stream (default 3)")
    ap.add_argument("--sampled", type=float, nargs=2, metavar=("T", "TOP_P"),
                    help="host only: greedy steps beside steps drawn at temperature T and top-p TOP_P, in turn "
                         "--rounds times (medians)")
    ap.add_argument("--max-tokens", type=int, default=1024,
                    help="with --stack: tokens a chat (default 1024: the worker's CPU prefill of its prompt spread thin)")
    a = ap.parse_args(argv)
    from shared.engine.engine import Engine, EngineConfig
    top = max(a.seqs)
    # KV for every sequence's whole run (prompt, two warm-up steps, the steps): nothing preempted
    # (with the default 256 MiB, 64 sequences of 200 steps swapped 8 times: not the host's step)
    blocks = top * -(-(16 + a.steps + 8) // 16) + 8
    e = Engine.from_path(None, EngineConfig(threads=2, enable_prefix_caching=False, max_num_seqs=top,
                                            num_kv_blocks=blocks))
    if a.stack:
        return _stack_main(a, e)
    stub = (e.model.cfg.vocab_size, e.tokenizer.encode(TEXT, add_special_tokens=False))
    host = StubGraphs(top, 512, e.layout.block_size, *stub)
    if a.sampled:
        return _sampled_main(a, e, host)
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
