"""GPU engine benchmark: the CUDA engine op by op, fused (eager) and as CUDA graphs, beside the
host's CPU engine on all its cores, in one run and one table.

    tandem bench gpu [--concurrency 1 8 32 64] [--gen-tokens 64] [--cpu-threads N] [--quick] [--json FILE]

Per engine and batch size: decode tokens/s (``bench.engine.bench_decode``: every sequence has its
first token before the clock starts), after a warm-up at the same batch size (Triton compiles,
graphs are captured there). Per CUDA engine, from the torch profiler over a few decode steps of
1 and of 16 sequences: the launches the host makes per step (``cudaLaunchKernel`` and siblings,
``cudaGraphLaunch``) and the GPU's busy time per step (the kernels' summed durations). Prefill of
a 2,048-token prompt (its matmuls through cuBLAS on dequantized weights, and TF32, and through the
Q4_0 kernels). Energy where readable (``shared/energy.py``: NVML for the GPU, RAPL for
the host): tokens per joule of the decode runs at the largest batch. The op-by-op engine decodes
fewer tokens per sequence (``--ops-gen-tokens``): it is the slow baseline, its rate is what counts.

``--compile-only``: measure nothing; compile every engine's Triton kernels into Triton's disk cache,
a process an engine, all at once (``compile_jobs``). In the bench's one process the engines compile
the kernels their settings change one after another (~150 for a lease's variants, ~1 s each on an
H200's host: docs/benchmarks.md "Kernels compiled ahead"). ``scripts/gpu-check run`` runs it
before the tests and the bench; each engine's row then says how many kernels it still compiled
(``triton``).

Needs a CUDA device (and Triton); on a machine without one it says so and exits 2.
Prints a Markdown table on stdout, progress on stderr. Run on a lent GPU by ``scripts/gpu-check``.
An engine that raises is a FAILED line and the next one runs; SIGTERM (a time limit) prints the
table of what was measured, with a STOPPED line; either exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import signal
import subprocess
import sys
import time
from unittest import mock

from bench import report
from bench.engine import bench_decode, bench_prefill

LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
            "cudaLaunchCooperativeKernel"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64], help="decode batch sizes")
    p.add_argument("--gen-tokens", type=int, default=64, help="tokens per sequence in decode (default 64)")
    p.add_argument("--ops-gen-tokens", type=int, default=16, help="the same for the op-by-op engine (default 16)")
    p.add_argument("--cpu-threads", type=int, default=0, help="threads of the host's CPU engine (0: every core)")
    p.add_argument("--prefill-tokens", type=int, default=2048, help="prompt of the prefill line (default 2048)")
    p.add_argument("--long-prompt", type=int, default=1024,
                   help="each CUDA engine's decode again at 1 and 32 sequences of contexts this long, where "
                        "attention weighs (default 1024; 0: not)")
    p.add_argument("--modes", nargs="+", default=["ops", "fused", "graphs"],
                   help="CUDA engines to run: ops, fused, graphs, and the variants " + ", ".join(VARIANTS)
                        + " (decode and profiles only)")
    p.add_argument("--no-cpu", action="store_true", help="leave out the host's CPU engine")
    p.add_argument("--quick", action="store_true", help="1 and 8 sequences, 16 tokens")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument("--compile-only", action="store_true",
                   help="measure nothing: compile the engines' Triton kernels into the disk cache, in parallel")
    p.add_argument("--jobs", type=int, default=0, help="processes of --compile-only (0: one an engine, up to the cores)")
    p.add_argument("--compile-job", metavar="ENGINE", help=argparse.SUPPRESS)     # one process of --compile-only


_progress = report.progress("bench gpu")


# graphs with settings changed, to compare in the same run: name -> (environment, what it is)
VARIANTS = {"graphs-all": ({"TANDEM_GPU_AHEAD": "1", "TANDEM_GPU_PDL": "1", "TANDEM_GPU_PRECISION": "tf32x3",
                            "TANDEM_GPU_PREFETCH": "1"}, "ahead, PDL, 3xTF32 and prefetch everywhere at once"),
            "graphs-ahead": ({"TANDEM_GPU_AHEAD": "1"}, "each decode step launched before the last one's tokens are read"),
            "graphs-pdl": ({"TANDEM_GPU_PDL": "1"}, "programmatic dependent launch"),
            "graphs-pdl-exit": ({"TANDEM_GPU_PDL": "exit"}, "programmatic dependent launch, triggered as programs exit"),
            "graphs-launch": ({"TANDEM_GPU_REDUCE": "launch"}, "split sums, attention merges and rope launched"),
            "graphs-noprefetch": ({"TANDEM_GPU_PREFETCH": "0"}, "each K step's weights fetched at use"),
            "graphs-prefetch": ({"TANDEM_GPU_PREFETCH": "1"}, "weights fetched a step ahead in every program of 2+ steps"),
            "graphs-tf32x3": ({"TANDEM_GPU_PRECISION": "tf32x3"}, "the matmuls' dots on the tensor cores, 3 TF32 passes"),
            # the defaults on CUDA since 2026-11-30 (tf32x3, ahead) undone, to compare
            "graphs-ieee": ({"TANDEM_GPU_PRECISION": "ieee"}, "the matmuls' dots in f32 on the FMA units"),
            "graphs-stepped": ({"TANDEM_GPU_AHEAD": "0"}, "each decode step's tokens read before the next is launched"),
            "graphs-attn-sum": ({"TANDEM_GPU_DECODE_ATTN": "sum"},
                                "a decode's attention as products reduced across lanes, not tl.dot")}


# prefill lines of the graphs engine: the matmuls on the tensor cores (TF32: cuBLAS's, and the Q4_0
# kernels' above 64 rows), in f32 (cuBLAS's SGEMM: the default's 3xTF32 products before 2026-12-01),
# and through the Q4_0 kernels instead of cuBLAS on dequantized weights
PREFILL_VARIANTS = {"prefill_tf32_ms": {"TANDEM_GPU_PRECISION": "tf32"},
                    "prefill_ieee_ms": {"TANDEM_GPU_PRECISION": "ieee"},
                    "prefill_kernels_ms": {"TANDEM_GPU_GEMM_ROWS": "0"},
                    "prefill_attn_fp16_ms": {"TANDEM_GPU_PREFILL_ATTN": "fp16"},
                    "prefill_attn_tf32x3_ms": {"TANDEM_GPU_PREFILL_ATTN": "tf32x3"},
                    "prefill_tf32_attn_fp16_ms": {"TANDEM_GPU_PRECISION": "tf32", "TANDEM_GPU_PREFILL_ATTN": "fp16"}}


# settings that change only the host's side of a decode step: an engine that differs from another
# only in these launches the same kernels (``compile_jobs``)
HOST_ONLY = ("TANDEM_GPU_AHEAD",)


def _cuda_engine(mode: str, max_seqs: int, prefill: int, env: dict | None = None):
    from shared.engine.engine import Engine, EngineConfig
    env = env or (VARIANTS[mode][0] if mode in VARIANTS else {})
    with mock.patch.dict(os.environ, env):      # read when the engine builds its GPU step
        return Engine.from_path(None, EngineConfig(device="cuda", gpu_step=mode.split("-")[0],
                                                   enable_prefix_caching=False, max_num_seqs=max_seqs,
                                                   step_tokens=max(prefill, max_seqs), kv_cache_bytes=1 << 30))


SAMPLED = {"temperature": 0.8, "top_p": 0.95}   # the sampled decode lines: every row drawn on the device


def profile_steps(engine, seqs: int, steps: int = 5, sampled: dict | None = None) -> dict:
    """Host launches and GPU busy microseconds per decode step of ``seqs`` sequences (greedy, or
    with the ``sampled`` parameters)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from shared.engine.sampling import SamplingParams
    params = SamplingParams(**{"max_tokens": steps + 8, "temperature": 0.0, "ignore_eos": True, **(sampled or {})})
    for i in range(seqs):
        engine.add(f"prof{seqs}-{i}", [1000 + i] * 16, params)
    started: set[str] = set()
    while len(started) < seqs:
        started.update(o.request_id for o in engine.step())
    engine.step()                      # one more: the bucket's graph exists before the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    while engine.has_work():
        engine.step()
    return _summary(prof, steps, wall, KERNELS_SHOWN)


def profile_prefill(engine, n: int) -> dict:
    """``profile_steps``' figures for the prefill of one ``n``-token prompt (its first token
    included): where the prefill target's time goes, by kernel (issue 34 asks a profile of what
    bounds a target that is not met)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.engine import _prompt
    from shared.engine.engine import run_to_completion
    from shared.engine.sampling import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ids = _prompt(engine.tokenizer, n, 99)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run_to_completion(engine, {"prof-prefill": (ids, params)})
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return _summary(prof, 1, wall, PREFILL_KERNELS_SHOWN)


def _summary(prof, steps: int, wall: float, shown: int) -> dict:
    """Per step: host launches, GPU busy µs, wall µs, kernels and the ``shown`` costliest kernels."""
    launches, busy = 0, 0.0
    by_kernel: dict[str, float] = {}
    kernel_counts: dict[str, int] = {}
    for ev in prof.events():
        if ev.name in LAUNCHES:
            launches += 1
        if str(getattr(ev, "device_type", "")).endswith("CUDA"):
            t = float(getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0.0) or 0.0)
            busy += t
            by_kernel[ev.name] = by_kernel.get(ev.name, 0.0) + t
            kernel_counts[ev.name] = kernel_counts.get(ev.name, 0) + 1
    if busy == 0.0:   # kernels attributed to the host ops that launched them (older profilers)
        busy = sum(float(getattr(ev, "self_device_time_total", 0.0) or 0.0) for ev in prof.events())
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:shown]
    return {"launches": round(launches / steps, 1), "gpu_busy_us": round(busy / steps, 1),
            "wall_us": round(wall / steps * 1e6, 1),     # (under the profiler: a little above a plain step)
            "kernels": round(sum(n for n in kernel_counts.values()) / steps, 1),
            "by_kernel_us": {_short(n): round(t / steps, 1) for n, t in top}}


KERNELS_SHOWN = 6
PREFILL_KERNELS_SHOWN = 10


def _short(name: str) -> str:
    """A kernel's name for a table: Triton's as they are, C++ templates cut to their function."""
    return name.split("<")[0].split("(")[0].replace("void ", "").strip()[:48]


def _energy_run(engine, c: int, gen: int, meter) -> tuple[float, dict | None]:
    before = meter.read() if meter is not None else None
    rate = bench_decode(engine, c, gen)
    used = meter.joules_since(before) if meter is not None else None
    return rate, used


class Stopped(Exception):
    """SIGTERM (the time limit of ``scripts/gpu-check``'s step): the engines measured so far are
    reported, the rest marked as not run."""


def _stop(signum, _frame):
    raise Stopped(f"signal {signum}")


def each(res: dict, names: list[str], measure) -> None:
    """``measure(name)`` for each engine in turn; one that raises is recorded under ``res["failed"]``
    (the error's first line) and the next runs: a variant that breaks on a card must not cost the
    others their figures on a lease. ``Stopped`` ends the loop."""
    for name in names:
        try:
            measure(name)
            continue
        except Stopped:
            raise
        except Exception as e:  # noqa: BLE001 - reported in the table and the exit status, then the next engine
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
            res.setdefault("failed", {})[name] = msg
            _progress(f"{name}: FAILED: {msg}")
        _release()      # (out of the except block: its traceback no longer holds the failed engine)


def _release() -> None:
    """Free what a failed engine left on the device, where the device still answers."""
    import gc

    import torch
    gc.collect()
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a broken CUDA context: the next engine reports its own failure
        pass


def run(args: argparse.Namespace, res: dict) -> None:
    """Measure into ``res`` (filled as it goes: a run stopped part way reports what it has)."""
    import torch

    from shared.energy import EnergyMeter, tokens_per_joule
    if args.quick:
        args.concurrency, args.gen_tokens, args.ops_gen_tokens = [1, 8], 16, 8
    bad = [m for m in args.modes if m not in ("ops", "fused", "graphs", *VARIANTS)]
    if bad:
        raise SystemExit(f"tandem bench gpu: unknown mode {', '.join(bad)} (ops, fused, graphs, {', '.join(VARIANTS)})")
    if not torch.cuda.is_available():
        raise SystemExit("tandem bench gpu: no CUDA device here (torch.cuda.is_available() is False)")
    dev = torch.cuda.get_device_properties(0)
    meter = EnergyMeter()
    top = max(args.concurrency)
    res.update({"gpu": dev.name, "sms": dev.multi_processor_count, "torch": torch.__version__,
                "host_cpu": platform.processor() or _cpu_name(), "energy": meter.describe(),
                "concurrency": args.concurrency, "gen_tokens": args.gen_tokens, "prefill_tokens": args.prefill_tokens,
                "long_prompt": args.long_prompt,
                "engines": {}})

    def run_mode(mode: str) -> None:
        _progress(f"CUDA engine, gpu_step={mode}: loading")
        engine = _cuda_engine(mode, top, args.prefill_tokens)
        gen = args.ops_gen_tokens if mode == "ops" else args.gen_tokens
        row: dict = {"decode": {}, "gen_tokens": gen}
        res["engines"][mode] = row        # filled as it goes: a stop or a failure keeps what it has
        with TritonCompiles() as compiles:
            for c in args.concurrency:
                bench_decode(engine, c, 4)                               # compile, capture
                if c == top and meter.available:
                    rate, used = _energy_run(engine, c, gen, meter)
                    row["joules"] = used
                    row["tokens_per_joule"] = tokens_per_joule(c * (gen - 1), used)
                else:
                    rate = bench_decode(engine, c, gen)
                row["decode"][str(c)] = round(rate, 1)
            if args.long_prompt and mode != "ops":
                # contexts of --long-prompt tokens (16-token prompts above: attention a small share)
                row["decode_long"] = {}
                for c in sorted({1, min(32, top)}):
                    row["decode_long"][str(c)] = round(bench_decode(engine, c, gen, args.long_prompt), 1)
        row["triton"] = compiles.counts()   # kernels its decode levels compiled (none: --compile-only ran first)
        _progress(f"{mode}: decode tok/s {row['decode']}, at {args.long_prompt}-token contexts "
                  f"{row.get('decode_long')}; Triton kernels {row['triton']}")
        st = engine.model.gpu
        if st is not None:                     # what this engine's step ran with (the table's tiles, ...)
            row["step"] = {"precision": st.precision, "tiles": st.tuning.source, "prefill_attn": st.prefill_attn,
                           "prefill_tile": list(dataclasses.astuple(st.prefill_tile)),
                           "ahead": bool(engine.graphs is not None and engine.graphs.ahead)}
            _progress(f"{mode}: step {row['step']}")
        for seqs in (1, 16):
            row[f"profile_{seqs}"] = profile_steps(engine, seqs)
            _progress(f"{mode}: {seqs} seqs: {row[f'profile_{seqs}']}")
        if mode in VARIANTS:            # decode and profiles only: the variant's difference
            del engine
            torch.cuda.empty_cache()
            return
        if engine.graphs is not None and engine.graphs.device_sample:
            # the same decode with every row drawn in the graphs' sampler (top-p: the sorting variant),
            # each level after a short unmeasured one that captures its bucket's sampling graph (and
            # compiles the sampler's kernels): the first H200 run timed those captures, and read
            # sampled decode at 0.50 / 0.66 / 0.72 / 0.75 of greedy's rate at 1 / 8 / 32 / 64 sequences
            row["decode_sampled"] = {}
            for c in args.concurrency:
                bench_decode(engine, c, 4, sampled=SAMPLED)
                row["decode_sampled"][str(c)] = round(bench_decode(engine, c, gen, sampled=SAMPLED), 1)
            for seqs in (1, 16):        # (sampled decode at 1 sequence ran at half greedy's rate: why)
                row[f"profile_{seqs}_sampled"] = profile_steps(engine, seqs, sampled=SAMPLED)
            row["rows_drawn"] = engine.graphs.drawn
            _progress(f"{mode}, sampled {SAMPLED}: {row['decode_sampled']}, 16 seqs: {row['profile_16_sampled']}")
        rate = bench_prefill(engine, args.prefill_tokens, 3)
        row["prefill_ms"] = round(args.prefill_tokens / rate * 1000, 2)
        _progress(f"{mode}: prefill of {args.prefill_tokens} tokens {row['prefill_ms']} ms")
        row["profile_prefill"] = profile_prefill(engine, args.prefill_tokens)
        _progress(f"{mode}: prefill profile {row['profile_prefill']}")
        if engine.graphs is not None:
            row["graph_replays"] = engine.graphs.replays
        del engine
        torch.cuda.empty_cache()
        if mode == "graphs":    # the same prefill with one setting changed
            each(res, list(PREFILL_VARIANTS), run_prefill)

    def run_prefill(key: str) -> None:
        env = PREFILL_VARIANTS[key]
        engine = _cuda_engine("graphs", top, args.prefill_tokens, env)
        rate = bench_prefill(engine, args.prefill_tokens, 3)
        res[key] = round(args.prefill_tokens / rate * 1000, 2)
        _progress(f"{key} ({env}): {res[key]} ms")
        del engine
        torch.cuda.empty_cache()

    def run_cpu(_name: str) -> None:
        from kernels import cpu
        from kernels.dispatch import describe
        from shared.engine.engine import Engine, EngineConfig
        threads = args.cpu_threads or os.cpu_count() or 1
        _progress(f"host CPU engine, {threads} threads: loading")
        engine = Engine.from_path(None, EngineConfig(threads=threads, enable_prefix_caching=False,
                                                     max_num_seqs=top, step_tokens=max(512, top)))
        row = res["engines"]["cpu"] = {"decode": {}, "gen_tokens": args.gen_tokens, "path": describe("cpu"),
                                       "threads": threads, "isa": cpu.isa()}
        for c in args.concurrency:
            bench_decode(engine, c, 4)
            if c == top and meter.available:
                rate, used = _energy_run(engine, c, args.gen_tokens, meter)
                row["joules"] = used
                row["tokens_per_joule"] = tokens_per_joule(c * (args.gen_tokens - 1), used)
            else:
                rate = bench_decode(engine, c, args.gen_tokens)
            row["decode"][str(c)] = round(rate, 1)
            _progress(f"host CPU: x{c} {row['decode'][str(c)]} tok/s")

    # the engines, then the host CPU engine (the targets' comparison), then the variants: a run stopped
    # at its time limit loses the variants first
    each(res, [m for m in args.modes if m not in VARIANTS], run_mode)
    if not args.no_cpu:
        each(res, ["cpu"], run_cpu)
    each(res, [m for m in args.modes if m in VARIANTS], run_mode)


class TritonCompiles:
    """Triton's compiles in this process while open (``triton.knobs.compilation.listener``):
    kernels compiled, and kernels found in the disk cache. Kernels the process already holds are
    neither (the JIT does not ask the compiler again)."""

    def __enter__(self) -> "TritonCompiles":
        self.compiled = self.cached = 0
        try:
            from triton import knobs
        except ImportError:         # (no Triton: nothing compiles)
            self._knobs = None
            return self
        self._knobs, self._before = knobs, knobs.compilation.listener

        def listen(*, cache_hit: bool, **kw) -> None:
            if cache_hit:
                self.cached += 1
            else:
                self.compiled += 1
            if self._before is not None:
                self._before(cache_hit=cache_hit, **kw)
        knobs.compilation.listener = listen
        return self

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.compilation.listener = self._before

    def counts(self) -> dict:
        return {"compiled": self.compiled, "from_cache": self.cached}


def compile_jobs(modes: list[str]) -> list[str]:
    """The engines ``--compile-only`` builds, a process each: a bench mode for each distinct kernel
    setting among ``modes`` (``fused`` launches the kernels ``graphs`` does; ``ops`` launches none;
    ``HOST_ONLY`` settings change no kernel), the prefill variants beside ``graphs``, and
    ``worker``: the engine a gpu-decode worker of the stack builds."""
    jobs, seen = [], set()
    for m in modes:
        if m == "ops":
            continue
        name = "graphs" if m == "fused" else m
        kernels = tuple(sorted((k, v) for k, v in _job_env(name).items() if k not in HOST_ONLY))
        if kernels not in seen:
            seen.add(kernels)
            jobs.append(name)
    if "graphs" in jobs:
        jobs += list(PREFILL_VARIANTS)
    return jobs + ["worker"]


def _job_env(name: str) -> dict:
    return VARIANTS[name][0] if name in VARIANTS else PREFILL_VARIANTS.get(name, {})


def compile_job(name: str, concurrency: list[int], prefill: int) -> dict:
    """Engine ``name`` of ``compile_jobs`` built and run through what the bench (or the stack's
    worker) runs on it — its warm-up (prefill shapes, every bucket's decode graphs and sampler
    graphs), the bench's decode levels, its prefill — so that Triton compiles each kernel it
    launches into the disk cache. Its seconds and Triton's counts, or the error that stopped it.
    (``--compile-job``: a process of ``compile_ahead``.)"""
    t0 = time.perf_counter()
    out: dict = {}
    with TritonCompiles() as compiles:
        try:
            if name == "worker":
                from services.worker import engine_config
                from shared import subjects
                from shared.engine.engine import Engine
                from shared.settings import Settings
                settings = Settings.from_env()
                engine = Engine.from_path(settings.worker.model, engine_config(
                    settings, settings.worker.device or "cuda", subjects.GPU_DECODE))
                engine.warm_up()
            else:
                mode = "graphs" if name in PREFILL_VARIANTS else name
                engine = _cuda_engine(mode, max(concurrency), prefill, _job_env(name))
                engine.warm_up()
                if name not in PREFILL_VARIANTS:
                    for c in concurrency:
                        bench_decode(engine, c, 2)
                if name == "graphs" and engine.graphs is not None and engine.graphs.device_sample:
                    for c in concurrency:
                        bench_decode(engine, c, 2, sampled=SAMPLED)
                if name not in VARIANTS:
                    bench_prefill(engine, prefill, 1)
        except Exception as e:  # noqa: BLE001 - reported in the table; the bench meets it again, measured
            out["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    return out | compiles.counts() | {"seconds": round(time.perf_counter() - t0, 1)}


def _spawn_job(name: str, args: argparse.Namespace, out) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", "bench", "gpu", "--compile-job", name,
                             "--concurrency", *map(str, args.concurrency), "--prefill-tokens", str(args.prefill_tokens)],
                            stdout=out)


def compile_ahead(args: argparse.Namespace, res: dict, spawn=_spawn_job) -> None:
    """``--compile-only``: each engine of ``compile_jobs(args.modes)`` in a process of its own
    (``--compile-job``), ``args.jobs`` at once (default: all of them, up to the cores); filled into
    ``res`` as each ends. A process that dies is a FAILED line with its exit status; a stop (the
    step's time limit) kills the ones still running. ``spawn(name, args, out)``: a ``Popen`` whose
    last line on ``out`` (a file) is ``compile_job``'s JSON."""
    import json
    import tempfile
    if args.quick:
        args.concurrency = [1, 8]
    bad = [m for m in args.modes if m not in ("ops", "fused", "graphs", *VARIANTS)]
    if bad:
        raise SystemExit(f"tandem bench gpu: unknown mode {', '.join(bad)} (ops, fused, graphs, {', '.join(VARIANTS)})")
    jobs = compile_jobs(args.modes)
    workers = args.jobs or min(len(jobs), os.cpu_count() or 1)
    res.update({"compile_only": True, "jobs": jobs, "processes": workers, "engines": {}})
    _progress(f"compiling the kernels of {len(jobs)} engines, {workers} at once: {', '.join(jobs)}")
    t0 = time.perf_counter()
    waiting, running = list(jobs), {}
    try:
        while waiting or running:
            while waiting and len(running) < workers:
                name = waiting.pop(0)
                out = tempfile.TemporaryFile("w+")
                running[name] = (spawn(name, args, out), out)
            time.sleep(0.05)
            for name, (proc, out) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                out.seek(0)
                lines = out.read().strip().splitlines()
                out.close()
                try:
                    got = json.loads(lines[-1])
                except (IndexError, ValueError):
                    got = {"error": f"the process ended with status {proc.returncode} and no result"}
                got = {"compiled": None, "from_cache": None, "seconds": None} | got
                res["engines"][name] = got
                if "error" in got:
                    res.setdefault("failed", {})[name] = got["error"]
                _progress(f"{name}: {got['compiled']} kernels compiled, {got['from_cache']} from the cache, "
                          f"{got['seconds']} s" + (f"; FAILED: {got['error']}" if "error" in got else ""))
    finally:
        for proc, out in running.values():  # (a stop at the time limit: the engines still compiling go with it)
            proc.kill()
            proc.wait()
            out.close()
        res["wall_s"] = round(time.perf_counter() - t0, 1)


def compile_table(res: dict) -> str:
    lines = [f"Triton kernels compiled ahead: {len(res.get('jobs', []))} engines in {res.get('processes', '?')} "
             f"processes, {res.get('wall_s', '?')} s of wall", "",
             "| engine | kernels compiled | from the cache | seconds |", "|---|---:|---:|---:|"]
    for name, got in res.get("engines", {}).items():
        lines.append(f"| {name} | {got['compiled']} | {got['from_cache']} | {got['seconds']} |")
    lines += [f"FAILED: {name}: {why}" for name, why in res.get("failed", {}).items()]
    left = [n for n in res.get("jobs", []) if n not in res.get("engines", {})]
    if res.get("stopped"):
        lines += [f"STOPPED ({res['stopped']}): " + (f"not finished: {', '.join(left)}" if left else "all finished")]
    return "\n".join(lines)


def best_env(res: dict, seqs: str = "1", margin: float = 1.05) -> dict:
    """The settings of the variant that decoded fastest at ``seqs`` sequences in ``res``, where it
    beat plain graphs by ``margin`` or more ({} where none did), plus each host-side variant
    (``HOST_ONLY``: launching ahead) that beat graphs by ``margin`` on its own — it changes no
    kernel, so it combines with any. ``scripts/gpu-check`` runs the stack (`bench node`) with them,
    so its through-stack figures are the best engine this run measured. (Launching ahead also
    takes the worker's stream handling off the step's path: on a modeled device of 500 µs a step,
    one stream's TPOT through the stack 1,251 → 698 µs; docs/benchmarks.md.)"""
    eng, failed = res.get("engines", {}), res.get("failed", {})
    base = eng.get("graphs", {}).get("decode", {}).get(seqs) or 0

    def rate(v: str) -> float:
        return 0.0 if v in failed else eng.get(v, {}).get("decode", {}).get(seqs) or 0.0
    best, env = base * margin, {}
    for v, (e, _) in VARIANTS.items():
        if best and rate(v) > best:
            best, env = rate(v), e
    for v, (e, _) in VARIANTS.items():
        if set(e) <= set(HOST_ONLY) and base and rate(v) > base * margin:
            env = {**env, **e}
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _ratios(a: dict, b: dict, cs: list[str]) -> str:
    """``a``'s decode rate over ``b``'s at each batch size both have."""
    return ", ".join(f"x{c} {a['decode'][c] / b['decode'][c]:.2f}" for c in cs
                     if a["decode"].get(c) and b["decode"].get(c)) or "—"


def table(res: dict) -> str:
    if "engines" not in res:      # stopped or failed before the device was read
        return "\n".join([f"FAILED: {n}: {why}" for n, why in res.get("failed", {}).items()]
                         + [f"STOPPED ({res['stopped']}) before any engine ran"] * bool(res.get("stopped")))
    cs = [str(c) for c in res["concurrency"]]
    eng = res["engines"]
    lines = [f"{res['gpu']} ({res['sms']} SMs), torch {res['torch']}; host {res['host_cpu']}; energy: {res['energy']}",
             "", "| engine | " + " | ".join(f"decode x{c} tok/s" for c in cs)
             + " | launches/step x1 / x16 | GPU busy µs/step x1 / x16 | prefill ms | tok/J |",
             "|---|" + "---:|" * (len(cs) + 4)]
    for name, row in eng.items():
        label = f"cuda {name}" if name != "cpu" else f"host CPU ({row['threads']} threads, {row['isa']})"
        p1, p16 = row.get("profile_1") or {}, row.get("profile_16") or {}
        prof = f"{p1.get('launches', '—')} / {p16.get('launches', '—')}" if p1 else "—"
        busy = f"{p1.get('gpu_busy_us', '—')} / {p16.get('gpu_busy_us', '—')}" if p1 else "—"
        tpj = row.get("tokens_per_joule")
        lines.append(f"| {label} | " + " | ".join(f"{row['decode'].get(c, float('nan')):.1f}" for c in cs)
                     + f" | {prof} | {busy} | {row.get('prefill_ms', '—')} | "
                     + (f"{tpj:.1f}" if tpj else "n/a") + " |")
        if "decode_sampled" in row:
            p1s, ps = row.get("profile_1_sampled") or {}, row.get("profile_16_sampled") or {}
            lines.append(f"| cuda {name}, sampled (T {SAMPLED['temperature']}, top-p {SAMPLED['top_p']}) | "
                         + " | ".join(f"{row['decode_sampled'].get(c, float('nan')):.1f}" for c in cs)
                         + f" | {p1s.get('launches', '—')} / {ps.get('launches', '—')} | {p1s.get('gpu_busy_us', '—')} / "
                           f"{ps.get('gpu_busy_us', '—')} | | |")
    for name, row in eng.items():
        for seqs, kind in ((1, ""), (16, ""), (1, "_sampled")):
            k = (row.get(f"profile_{seqs}{kind}") or {}).get("by_kernel_us")
            if k and name != "ops":
                p = row[f"profile_{seqs}{kind}"]
                lines += ["" if seqs == 1 and not kind else None,
                          f"cuda {name}, {seqs} seq{', sampled' if kind else ''}: a decode step {p.get('wall_us', '?')} "
                          f"µs of wall, {p['gpu_busy_us']} of GPU work in {p.get('kernels', '?')} kernels; by kernel: "
                          + ", ".join(f"{n} {t}" for n, t in k.items())]
        p = row.get("profile_prefill")
        if p and name != "ops":
            lines += [f"cuda {name}, prefill of {res.get('prefill_tokens', '?')} tokens (profiled): {p['wall_us']} µs "
                      f"of wall, {p['gpu_busy_us']} of GPU work in {p['kernels']} kernels ({p['launches']} launches);"
                      " by kernel: " + ", ".join(f"{n} {t}" for n, t in p["by_kernel_us"].items())]
    lines = [x for x in lines if x is not None]
    if "graphs" in eng and "cpu" in eng:
        lines += ["", "graphs ÷ host CPU: " + _ratios(eng["graphs"], eng["cpu"], cs)]
    for v, (_, what) in VARIANTS.items():
        if v in eng and "graphs" in eng:
            lines += ["", f"{v} ({what}) ÷ graphs: " + _ratios(eng[v], eng["graphs"], cs)]
    long = [(n, r["decode_long"]) for n, r in eng.items() if r.get("decode_long")]
    if long:
        lines += ["", f"decode tok/s at {res.get('long_prompt', '?')}-token contexts: "
                  + "; ".join(f"{n} " + ", ".join(f"x{c} {v:.1f}" for c, v in d.items()) for n, d in long)]
        base = eng.get("graphs", {}).get("decode_long")
        for n, d in long:
            if base and n != "graphs":
                lines += [f"  {n} ÷ graphs: " + ", ".join(f"x{c} {d[c] / base[c]:.2f}" for c in d if base.get(c))]
    if "prefill_tf32_ms" in res:
        lines += ["", f"prefill of the same prompt with TANDEM_GPU_PRECISION=tf32: {res['prefill_tf32_ms']} ms"]
    if "prefill_ieee_ms" in res:
        lines += [f"prefill of the same prompt with TANDEM_GPU_PRECISION=ieee (cuBLAS in f32, not 3xTF32): "
                  f"{res['prefill_ieee_ms']} ms"]
    if "prefill_kernels_ms" in res:
        lines += [f"prefill of the same prompt through the Q4_0 kernels (TANDEM_GPU_GEMM_ROWS=0, not cuBLAS): "
                  f"{res['prefill_kernels_ms']} ms"]
    if "prefill_attn_fp16_ms" in res:
        lines += [f"prefill of the same prompt with its attention in float16 on the tensor cores "
                  f"(TANDEM_GPU_PREFILL_ATTN=fp16): {res['prefill_attn_fp16_ms']} ms; with TF32 matmuls too: "
                  f"{res.get('prefill_tf32_attn_fp16_ms', '?')} ms"]
    if "prefill_attn_tf32x3_ms" in res:
        lines += [f"prefill of the same prompt with its attention in 3xTF32 on the tensor cores (f32's accuracy; "
                  f"TANDEM_GPU_PREFILL_ATTN=tf32x3): {res['prefill_attn_tf32x3_ms']} ms"]
    if "graphs" in eng and "ops" in eng:
        lines += ["graphs ÷ ops: " + _ratios(eng["graphs"], eng["ops"], cs)]
    compiled = {name: row["triton"]["compiled"] for name, row in eng.items() if row.get("triton")}
    if compiled:
        lines += ["", "Triton kernels each engine compiled in its decode levels' warm-ups (the bench's time, not "
                  "its rates; 0 where `--compile-only` compiled them first): "
                  + ", ".join(f"{n} {k}" for n, k in compiled.items())]
    for name, why in res.get("failed", {}).items():
        lines += [f"FAILED: {name}: {why}"]
    if res.get("stopped"):
        lines += [f"STOPPED ({res['stopped']}): engines not listed above were not measured"]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """0: every engine measured; 1: one failed, or the run was stopped (SIGTERM) part way — the
    table and JSON then hold what was measured; 2: no CUDA device or a bad argument."""
    if args.compile_job:                # a process of --compile-only: its result on stdout
        import json
        print(json.dumps(compile_job(args.compile_job, args.concurrency, args.prefill_tokens)))
        return 0
    t0 = time.perf_counter()
    res: dict = {}
    before = signal.signal(signal.SIGTERM, _stop)
    try:
        if args.compile_only:
            import torch
            if not torch.cuda.is_available():
                raise SystemExit("tandem bench gpu: no CUDA device here (torch.cuda.is_available() is False)")
            compile_ahead(args, res)
        else:
            run(args, res)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    except Stopped as e:
        res["stopped"] = f"{e} after {time.perf_counter() - t0:.0f} s"
        _progress(f"stopped ({res['stopped']}): reporting what was measured")
    finally:
        signal.signal(signal.SIGTERM, before)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    report.emit(res, compile_table if args.compile_only else table, args.json)
    return 1 if res.get("failed") or res.get("stopped") else 0

