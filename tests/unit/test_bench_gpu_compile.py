"""`tandem bench gpu --compile-only` (bench/gpu.py): the engines of a lease's bench built in
processes of their own, all at once, so that Triton's disk cache holds their kernels before the
bench and the tests run — and Triton's own count of what it compiled, which tells on a lease
whether that worked. No GPU here: the processes are real (a stand-in command, and the real
``--compile-job`` failing without CUDA); the count is over a real compile for sm_90."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import warnings

import pytest

from bench import gpu

LEASE_MODES = ["graphs", "graphs-all", "graphs-ahead", "graphs-pdl", "graphs-tf32x3", "graphs-noprefetch",
               "graphs-attn-sum"]


def test_each_kernel_setting_is_one_engine_and_the_stack_worker_one_more():
    assert gpu.compile_jobs(LEASE_MODES) == [
        "graphs", "graphs-all", "graphs-pdl", "graphs-tf32x3", "graphs-noprefetch",
        "graphs-attn-sum",                                # (graphs-ahead: graphs' kernels, launched earlier)
        "prefill_tf32_ms", "prefill_ieee_ms", "prefill_kernels_ms", "prefill_attn_fp16_ms", "prefill_attn_tf32x3_ms",
        "prefill_tf32_attn_fp16_ms", "worker"]
    assert gpu.compile_jobs(["ops", "fused", "graphs-pdl"]) == ["graphs", "graphs-pdl", *gpu.PREFILL_VARIANTS,
                                                                 "worker"]
    assert gpu.compile_jobs(["graphs-ahead", "graphs-pdl"]) == ["graphs-ahead", "graphs-pdl", "worker"]


def _args(modes, jobs=0):
    return argparse.Namespace(modes=modes, jobs=jobs, quick=False, concurrency=[1, 8], prefill_tokens=2048)


def _stand_in(plan, live, peak):
    """A spawn whose process does what ``plan[name]`` says: (seconds, exit status, stdout)."""
    def spawn(name, args, out):
        secs, rc, text = plan[name]
        live.add(name)
        peak.append(len(live))
        code = f"import sys, time; time.sleep({secs}); print({text!r}); sys.exit({rc})"
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out)
        real_poll = proc.poll

        def poll():
            rc = real_poll()
            if rc is not None:
                live.discard(name)
            return rc
        proc.poll = poll
        return proc
    return spawn


def test_the_engines_compile_at_once_and_a_failure_costs_the_others_nothing():
    ok = json.dumps({"compiled": 31, "from_cache": 2, "seconds": 40.5})
    plan = {"graphs-pdl": (0.3, 0, ok),
            "graphs-tf32x3": (0.1, 0, "a line of its own\n" + json.dumps({"error": "RuntimeError: no capture",
                                                                        "compiled": 3, "from_cache": 0,
                                                                        "seconds": 2.0})),
            "worker": (0.2, 3, "")}                  # died without a result (a crash, an abort)
    live, peak, res = set(), [], {}
    gpu.compile_ahead(_args(["graphs-pdl", "graphs-tf32x3"], jobs=2), res, spawn=_stand_in(plan, live, peak))
    assert max(peak) == 2 and res["processes"] == 2 and not live
    assert res["engines"]["graphs-pdl"] == {"compiled": 31, "from_cache": 2, "seconds": 40.5}
    assert res["failed"] == {"graphs-tf32x3": "RuntimeError: no capture",
                             "worker": "the process ended with status 3 and no result"}
    out = gpu.compile_table(res)
    assert out.startswith("Triton kernels compiled ahead: 3 engines in 2 processes, ")
    assert "| graphs-pdl | 31 | 2 | 40.5 |" in out and "| worker | None | None | None |" in out
    assert "FAILED: worker: the process ended with status 3 and no result" in out


def test_a_stop_kills_the_engines_still_compiling():
    """The step's time limit (SIGTERM, here an alarm): the run ends at once, saying what finished."""
    plan = {"graphs-pdl": (0.1, 0, json.dumps({"compiled": 5, "from_cache": 0, "seconds": 0.1})),
            "worker": (60, 0, "")}
    started = []

    def spawn(name, args, out):
        started.append(_stand_in(plan, set(), [])(name, args, out))
        return started[-1]
    before = signal.signal(signal.SIGALRM, gpu._stop)
    res = {}
    t0 = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        with pytest.raises(gpu.Stopped):
            gpu.compile_ahead(_args(["graphs-pdl"]), res, spawn=spawn)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    assert time.monotonic() - t0 < 10
    assert all(p.returncode is not None for p in started)          # none left running
    res["stopped"] = "signal 14 after 1 s"
    assert "STOPPED (signal 14 after 1 s): not finished: worker" in gpu.compile_table(res)


def test_a_real_job_without_cuda_reports_its_error():
    """The real ``--compile-job`` processes (`tandem bench gpu`), here with no CUDA device: each
    engine's error comes back as its line, nothing hangs, nothing is counted as compiled."""
    res = {}
    gpu.compile_ahead(_args(["graphs-pdl"]), res)
    assert set(res["engines"]) == {"graphs-pdl", "worker"}
    for got in res["engines"].values():
        assert "torch sees no CUDA device" in got["error"] and got["compiled"] == 0


def test_the_count_is_triton_s_own(tmp_path, monkeypatch):
    """What ``TritonCompiles`` counts: a kernel compiled (for sm_90, Triton's ptxas), then the same
    kernel found in the disk cache; the listener before it still called, and put back after."""
    triton = pytest.importorskip("triton")
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import gpu_triton
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        get_ptxas(90)
    except Exception as e:  # noqa: BLE001 - no NVIDIA backend in this triton build
        pytest.skip(f"triton's NVIDIA backend (ptxas) is not available: {e}")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    seen = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda *, cache_hit, **kw: seen.append(cache_hit))
    sig = {"seed_lo_ptr": "*i32", "seed_hi_ptr": "*i32", "ctr_ptr": "*i32", "out_ptr": "*fp64", "n": "i32",
           "BLOCK": "constexpr"}

    def build():
        with warnings.catch_warnings():     # (Triton 3.9's notice on TRITON_DEFAULT_FP_FUSION)
            warnings.simplefilter("ignore")
            triton.compile(ASTSource(fn=gpu_triton.philox_uniform, signature=sig, constexprs={"BLOCK": 64}),
                           target=GPUTarget("cuda", 90, 32))
    with gpu.TritonCompiles() as first:
        build()
    with gpu.TritonCompiles() as second:
        build()
    assert first.counts() == {"compiled": 1, "from_cache": 0}
    assert second.counts() == {"compiled": 0, "from_cache": 1}
    assert seen == [False, True]
