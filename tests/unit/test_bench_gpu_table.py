"""`tandem bench gpu`'s table (bench/gpu.py) from a result shaped as its H200 run wrote it
(2026-11-27; docs/kernels.md), with the per-kernel split the profile now adds."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import time

import pytest

from bench import gpu


def _result():
    graphs = {"decode": {"1": 269.8, "8": 2102.5}, "tokens_per_joule": 29.37, "prefill_ms": 172.92,
              "profile_1": {"launches": 1.0, "gpu_busy_us": 3163.0, "wall_us": 3705.2, "kernels": 303.0,
                            "by_kernel_us": {"qmatmul": 2803.6, "attn_decode": 107.4, "split_sum": 83.3}},
              "profile_16": {"launches": 1.0, "gpu_busy_us": 3268.8, "by_kernel_us": {"qmatmul": 2860.1}},
              "decode_sampled": {"1": 192.9, "8": 1635.9},
              "profile_16_sampled": {"launches": 1.0, "gpu_busy_us": 3690.2},
              "profile_1_sampled": {"launches": 1.0, "gpu_busy_us": 2000.0, "wall_us": 4700.0, "kernels": 190.0,
                                    "by_kernel_us": {"qmatmul": 1400.0, "sort": 60.0}}}
    ops = {"decode": {"1": 33.1, "8": 85.3}, "prefill_ms": 643.8,
           "profile_1": {"launches": 1823.0, "gpu_busy_us": 3955.5, "by_kernel_us": {"gemv": 1.0}},
           "profile_16": {"launches": 11723.0, "gpu_busy_us": 21890.4}}
    cpu = {"decode": {"1": 639.1, "8": 1333.7}, "threads": 16, "isa": "amx", "tokens_per_joule": 17.9}
    return {"gpu": "NVIDIA H200", "sms": 132, "torch": "2.11.0+cu130", "host_cpu": "x86_64", "energy": "nvml:gpu0",
            "concurrency": [1, 8], "engines": {"ops": ops, "graphs": graphs, "cpu": cpu}, "prefill_tf32_ms": 74.23}


def test_the_table_has_each_engine_the_ratios_and_the_kernel_split():
    out = gpu.table(_result())
    assert "| cuda graphs | 269.8 | 2102.5 | 1.0 / 1.0 | 3163.0 / 3268.8 | 172.92 | 29.4 |" in out
    assert "| host CPU (16 threads, amx) | 639.1 | 1333.7 |" in out
    assert "graphs ÷ host CPU: x1 0.42, x8 1.58" in out
    assert ("cuda graphs, 1 seq: a decode step 3705.2 µs of wall, 3163.0 of GPU work in 303.0 kernels; by kernel: "
            "qmatmul 2803.6, attn_decode 107.4, split_sum 83.3") in out
    assert "cuda graphs, 16 seq: a decode step ? µs of wall, 3268.8 of GPU work in ? kernels; by kernel: " \
           "qmatmul 2860.1" in out                          # (a result without the newer fields)
    assert "| cuda graphs, sampled (T 0.8, top-p 0.95) | 192.9 | 1635.9 | 1.0 / 1.0 | 2000.0 / 3690.2 |" in out
    assert ("cuda graphs, 1 seq, sampled: a decode step 4700.0 µs of wall, 2000.0 of GPU work in 190.0 kernels; "
            "by kernel: qmatmul 1400.0, sort 60.0") in out
    assert "cuda ops, 1 seq" not in out                       # 1,800 launches a step: nothing to read there


def test_the_prefill_profile_is_a_line_of_its_own():
    res = _result()
    res["prefill_tokens"] = 2048
    res["engines"]["graphs"]["profile_prefill"] = {"launches": 410.0, "gpu_busy_us": 52000.0, "wall_us": 93000.0,
                                                   "kernels": 600.0, "by_kernel_us": {"attn_prefill": 30000.0,
                                                                                      "sgemm": 12000.0}}
    assert ("cuda graphs, prefill of 2048 tokens (profiled): 93000.0 µs of wall, 52000.0 of GPU work in 600.0 "
            "kernels (410.0 launches); by kernel: attn_prefill 30000.0, sgemm 12000.0") in gpu.table(res)


def test_decode_at_long_contexts_is_a_line_with_each_engine_against_graphs():
    res = _result()
    res["long_prompt"] = 1024
    res["engines"]["graphs"]["decode_long"] = {"1": 600.0, "32": 9000.0}
    res["engines"]["graphs-attn-sum"] = {"decode": {"1": 250.0, "8": 2000.0}, "decode_long": {"1": 300.0, "32": 3000.0}}
    out = gpu.table(res)
    assert ("decode tok/s at 1024-token contexts: graphs x1 600.0, x32 9000.0; graphs-attn-sum x1 300.0, x32 3000.0"
            in out)
    assert "  graphs-attn-sum ÷ graphs: x1 0.50, x32 0.33" in out
    assert "1024-token contexts" not in gpu.table(_result())      # (an older result: no line)


def test_a_variant_is_compared_with_graphs():
    res = _result()
    res["engines"]["graphs-pdl"] = {"decode": {"1": 337.3, "8": 2102.5},
                                    "profile_1": {"launches": 1.0, "gpu_busy_us": 3100.0},
                                    "profile_16": {"launches": 1.0, "gpu_busy_us": 3200.0}}
    out = gpu.table(res)
    assert "| cuda graphs-pdl | 337.3 | 2102.5 | 1.0 / 1.0 |" in out
    assert "graphs-pdl (programmatic dependent launch) ÷ graphs: x1 1.25, x8 1.00" in out


def test_kernel_names_are_cut_for_the_table():
    assert gpu._short("void at::native::vectorized_gather_kernel<16, long>(char*, char*)") == \
        "at::native::vectorized_gather_kernel"
    assert gpu._short("qmatmul") == "qmatmul"


def test_an_engine_that_fails_costs_the_others_nothing():
    ran, res = [], {}

    def measure(name):
        ran.append(name)
        if name == "graphs-pdl":
            raise RuntimeError("Triton: launch_pdl is not supported\nsecond line")

    gpu.each(res, ["graphs", "graphs-pdl", "graphs-tf32x3"], measure)
    assert ran == ["graphs", "graphs-pdl", "graphs-tf32x3"]
    assert res["failed"] == {"graphs-pdl": "RuntimeError: Triton: launch_pdl is not supported"}


def test_a_stop_ends_the_engines_loop():
    ran = []

    def measure(name):
        ran.append(name)
        raise gpu.Stopped("signal 15")

    with pytest.raises(gpu.Stopped):
        gpu.each({}, ["graphs", "graphs-pdl"], measure)
    assert ran == ["graphs"]


def test_sigterm_reports_what_was_measured(monkeypatch, tmp_path, capsys):
    """`scripts/gpu-check` stops a step at its limit with SIGTERM: the engines measured so far are
    still printed and written, the exit status says the run is incomplete."""
    def run(args, res):
        res.update({k: v for k, v in _result().items() if k != "engines"})
        res["engines"] = {"graphs": {"decode": {"1": 424.8}, "profile_1": {"launches": 1.0, "gpu_busy_us": 1688.0}},
                          "cpu": {"decode": {"1": 598.4, "8": 1698.0}, "threads": 16, "isa": "amx"}}
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(gpu, "run", run)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "bench.json"
    assert gpu.main(argparse.Namespace(json=str(out), compile_job=None, compile_only=False)) == 1
    assert signal.getsignal(signal.SIGTERM) is before
    text = capsys.readouterr().out
    assert "| cuda graphs | 424.8 | nan | 1.0 / — | 1688.0 / — |" in text     # a row cut part way
    assert "graphs ÷ host CPU: x1 0.71" in text
    assert re.search(r"^STOPPED \(signal 15 after \d+ s\): engines not listed above were not measured$", text, re.M)
    saved = json.loads(out.read_text())
    assert saved["stopped"].startswith("signal 15") and saved["engines"]["graphs"]["decode"] == {"1": 424.8}


def test_a_stop_before_the_device_is_read_is_said():
    assert gpu.table({"stopped": "signal 15 after 3 s"}) == "STOPPED (signal 15 after 3 s) before any engine ran"
    res = _result()
    res["failed"] = {"graphs-pdl": "RuntimeError: boom"}
    assert gpu.table(res).endswith("FAILED: graphs-pdl: RuntimeError: boom")


def test_the_stack_runs_with_the_fastest_variant_at_one_sequence():
    res = _result()
    assert gpu.best_env(res) == {}                                         # no variant measured
    e = res["engines"]
    e["graphs-pdl"] = {"decode": {"1": 280.0, "8": 2500.0}}                # +4 %: within the margin
    e["graphs-ahead"] = {"decode": {"1": 330.0, "8": 2000.0}}
    e["graphs-all"] = {"decode": {"1": 400.0}}                             # failed part way: not taken
    res["failed"] = {"graphs-all": "RuntimeError: boom"}
    assert gpu.best_env(res) == {"TANDEM_GPU_AHEAD": "1"}
    assert gpu.best_env(res, "8") == {"TANDEM_GPU_PDL": "1"}
    # launching ahead changes no kernel: where it beat graphs on its own it joins the fastest variant
    e["graphs-prefetch"] = {"decode": {"1": 420.0}}
    assert gpu.best_env(res) == {"TANDEM_GPU_PREFETCH": "1", "TANDEM_GPU_AHEAD": "1"}
    e["graphs-ahead"]["decode"]["1"] = 280.0                               # +4 %: left out
    assert gpu.best_env(res) == {"TANDEM_GPU_PREFETCH": "1"}
    del e["graphs"]
    assert gpu.best_env(res) == {}                                         # nothing to beat: the defaults


def test_the_table_says_what_each_engine_still_compiled():
    res = _result()
    assert "Triton kernels" not in gpu.table(res)                          # (a result from before the count)
    res["engines"]["graphs"]["triton"] = {"compiled": 0, "from_cache": 40}
    res["engines"]["graphs-pdl"] = {"decode": {"1": 300.0}, "triton": {"compiled": 3, "from_cache": 30}}
    assert gpu.table(res).splitlines()[-1].endswith("compiled them first): graphs 0, graphs-pdl 3")
