"""bench/llamacpp_cuda.py: llama-bench's JSON beside `tandem bench gpu`'s figures (the GPU check's call 3)."""

from __future__ import annotations

import json

from bench.llamacpp_cuda import llama_rows, main, table, tandem_figures


def record(n_prompt: int, n_gen: int, fa: int, ts: float, gpu: str = "NVIDIA H200") -> dict:
    """One llama-bench result, with the fields its README's JSON example has (those read here)."""
    return {"build_commit": "0c1e570", "gpu_info": gpu, "backends": "CUDA", "model_type": "llama ?B Q4_0",
            "n_gpu_layers": 99, "flash_attn": fa, "n_prompt": n_prompt, "n_gen": n_gen, "avg_ts": ts,
            "stddev_ts": ts / 100}


def test_the_fastest_of_each_test_beside_tandems_figures(tmp_path):
    runs = [record(512, 0, 0, 90000.0), record(512, 0, 1, 120000.0), record(2048, 0, 0, 70000.0),
            record(2048, 0, 1, 100000.0), record(0, 128, 0, 900.0), record(0, 128, 1, 850.0)]
    (tmp_path / "llama.json").write_text(json.dumps(runs))
    best = llama_rows(str(tmp_path / "llama.json"))
    assert {k: (r["flash_attn"], r["avg_ts"]) for k, r in best.items()} == \
        {"pp512": (1, 120000.0), "pp2048": (1, 100000.0), "tg128": (0, 900.0)}
    bench = {"gpu": "NVIDIA H200", "prefill_tokens": 2048,
             "engines": {"graphs": {"decode": {"1": 450.0, "8": 3000.0}, "prefill_ms": 40.96}}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    mine = tandem_figures(str(tmp_path / "bench.json"))
    assert mine["decode_x1"] == 450.0 and mine["prefill_ms"] == 40.96 and mine["prefill_tokens"] == 2048
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table(best, mine).splitlines() if line.startswith("| tg") or line.startswith("| pp")}
    assert list(rows) == ["tg128", "pp512", "pp2048"]
    assert rows["tg128"][-1] == "0.50"                      # 450 / 900
    assert rows["pp2048"][-1] == "0.50"                     # 2048 / 40.96 ms = 50,000 tok/s over 100,000
    assert rows["pp512"][-1] == "—"                         # Tandem's bench prefills 2,048 tokens only


def test_figures_from_the_log_of_a_bench_cut_off_before_its_json(tmp_path, capsys):
    log = tmp_path / "bench.log"
    log.write_text("[bench gpu] CUDA engine, gpu_step=graphs: loading\n"
                   "[bench gpu] graphs: decode tok/s {'1': 424.8, '8': 2891.0}\n"
                   "[bench gpu] graphs: prefill of 2048 tokens 93.6 ms\n"
                   "[bench gpu] graphs-pdl: decode tok/s {'1': 500.0}\n")
    assert tandem_figures(str(log)) == {"decode_x1": 424.8, "prefill_tokens": 2048, "prefill_ms": 93.6}
    assert tandem_figures(str(tmp_path / "absent.json")) == {}
    (tmp_path / "llama.json").write_text("")                # llama-bench died before writing
    assert main([str(tmp_path / "llama.json"), str(log)]) == 1
    assert "wrote no result" in capsys.readouterr().out


def test_a_llama_bench_that_fell_back_to_the_cpu_is_no_comparison(tmp_path, capsys):
    """The build run here without a GPU: "ggml_cuda_init: failed to initialize CUDA", then the CPU
    (gpu_info ""), as it would on a machine whose driver is older than its CUDA runtime."""
    (tmp_path / "llama.json").write_text(json.dumps([record(512, 0, 1, 537.4, gpu=""), record(0, 128, 0, 112.4, gpu="")]))
    (tmp_path / "bench.json").write_text(json.dumps({"engines": {"graphs": {"decode": {"1": 450.0}}}}))
    assert main([str(tmp_path / "llama.json"), str(tmp_path / "bench.json")]) == 1
    out = capsys.readouterr().out
    assert "ran on the CPU" in out and "450.0" not in out
