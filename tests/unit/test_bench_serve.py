"""`tandem bench serve`: arguments, rounds, the tables, the plot, the JSON file
(the statistics themselves: tests/unit/test_loadgen.py)."""

from __future__ import annotations

import argparse
import math

import pytest

from bench import report
from bench.loadgen import RequestResult, summarize
from bench.serve import add_arguments, check_arguments, merge_runs, parse_slos, split_rounds, tpot_ratio


def _run(system, c, tpot):
    return {"system": system, "concurrency": c, "requests": 4, "errors": 0, "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0,
            "tpot_p50_ms": tpot, "tpot_p99_ms": tpot * 2, "itl_p99_ms": 5.0, "throughput_tok_s": 100.0}


def test_table_and_ratio():
    runs = [_run("stack", 1, 22.0), _run("in-process", 1, 20.0), _run("stack", 8, 50.0), _run("in-process", 8, 45.0)]
    assert tpot_ratio(runs) == pytest.approx(1.1)
    assert tpot_ratio(runs[:1]) is None
    table = report.markdown_table(runs).splitlines()
    assert table[0].startswith("| system | load |") and len(table) == 6
    assert table[2].startswith("| in-process | c=1 |") and table[3].startswith("| stack | c=1 |")
    pivot = report.pivot_table(runs, "tpot_p50_ms", "TPOT p50 ms").splitlines()
    assert pivot[0] == "| TPOT p50 ms | stack | in-process |"
    assert pivot[2] == "| 1 | 22.0 | 20.0 |" and pivot[3] == "| 8 | 50.0 | 45.0 |"


def test_arguments_default_to_compare():
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args([])
    assert a.url is None and a.concurrency == [1, 8] and a.max_tokens == 64 and a.num_requests == 16
    a = p.parse_args(["--url", "http://x:1", "--concurrency", "4", "--num-requests", "16", "--json", "o.json"])
    assert a.concurrency == [4] and a.num_requests == 16 and a.json == "o.json"


def test_merge_runs_pools_rounds():
    def part(ttfts, wall):
        rs = [RequestResult(ok=True, tokens=4, ttft=t, tpot=0.01, itl=[0.01] * 3, latency=t + 0.03) for t in ttfts]
        from dataclasses import asdict
        return {"system": "stack", "concurrency": 1, **summarize(rs, wall), "per_request": [asdict(r) for r in rs],
                "slos": None}
    m = merge_runs([part([0.1, 0.2], 1.0), part([0.3, 0.4], 3.0)])
    assert m["rounds"] == 2 and m["requests"] == 4 and m["wall_s"] == 4.0
    assert m["throughput_tok_s"] == 4.0                 # 16 tokens / 4 s
    assert m["ttft_p50_ms"] == pytest.approx(250.0)
    assert m["system"] == "stack" and len(m["per_request"]) == 4


def test_split_rounds():
    assert split_rounds(16, 2) == [8, 8]
    assert split_rounds(7, 3) == [3, 2, 2]
    assert split_rounds(1, 2) == [1]
    assert split_rounds(5, 1) == [5]


def test_bad_arguments_are_value_errors():
    p = argparse.ArgumentParser()
    add_arguments(p)
    for argv, msg in ((["--concurrency", "0"], "concurrency"), (["--mode", "open", "--rate", "0"], "rate"),
                      (["--tiers", "gold"], "tiers"), (["--slo", "standard=fast"], "slo"),
                      (["--num-requests", "0"], "num-requests")):
        with pytest.raises(ValueError, match=msg):
            check_arguments(p.parse_args(argv))


def test_parse_slos_overrides_defaults():
    slos = parse_slos(["interactive=500:50"])
    assert slos["interactive"] == (500.0, 50.0) and slos["batch"] == (60000.0, 1000.0)
    with pytest.raises(ValueError, match="unknown tier"):
        parse_slos(["gold=1:1"])


def _real_run(system, c, ttft_s):
    rs = [RequestResult(ok=True, tokens=4, ttft=ttft_s, tpot=0.01, itl=[0.01] * 3, latency=ttft_s + 0.03,
                        tier=t) for t in ("interactive", "batch")]
    return {"system": system, "concurrency": c, "mode": "closed", "slos": parse_slos(None),
            **summarize(rs, 1.0 + c)}


def test_tier_table_plot_and_json(tmp_path):
    runs = [_real_run(s, c, 0.1 * c) for s in ("single", "replicated") for c in (1, 2, 4)]
    tiers = report.tier_table(runs).splitlines()
    assert len(tiers) == 2 + 12 and "| single | c=1 | interactive | 1000/100 | 1 |" in tiers[2]
    png = report.plot(runs, str(tmp_path / "p.png"), "test")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.endswith("p.png")
    runs[0]["tpot_p50_ms"] = math.nan
    report.write_json(str(tmp_path / "r.json"), {"runs": runs})
    import json
    back = json.loads((tmp_path / "r.json").read_text())
    assert back["runs"][0]["tpot_p50_ms"] is None and back["runs"][1]["per_tier"]["batch"]["requests"] == 1
    assert not (tmp_path / "r.json.tmp").exists()


def test_tiers_counts_batch_tokens_streamed_within_the_mixed_window():
    from bench.loadgen import RequestResult
    from bench.tiers import tokens_by
    r = RequestResult(ok=True, tokens=4, ttft=1.0, itl=[0.5, 0.5, 0.5], start=10.0)  # tokens at 11 .. 12.5
    assert [tokens_by(r, t) for t in (5.0, 11.0, 12.0, 13.0)] == [0, 1, 3, 4]
    two_per_chunk = RequestResult(ok=True, tokens=4, ttft=1.0, itl=[1.0], start=0.0)
    assert tokens_by(two_per_chunk, 1.5) == 2
    assert tokens_by(RequestResult(ok=False, error="x"), 99.0) == 0


def test_tiers_compares_interactive_ttft_idle_and_under_flood():
    from bench.loadgen import RequestResult
    from bench.tiers import summarize, table, verdicts

    def load(idle_ttfts, flood_ttfts, batch_tokens):
        res = lambda t: RequestResult(ok=True, tokens=2, ttft=t, tpot=0.02, itl=[0.02])  # noqa: E731
        return {"idle": [res(t) for t in idle_ttfts], "interactive": [res(t) for t in flood_ttfts],
                "batch": [RequestResult(ok=True, tokens=batch_tokens, ttft=0.1, itl=[0.0] * (batch_tokens - 1))],
                "mixed": 10.0, "window": 10.0}
    idle = [0.040 + 0.001 * i for i in range(11)]                     # p90 0.049, p99 ~0.0499
    by = {"fifo": summarize("fifo", load(idle, [0.5] * 11, 100)),
          "sla-os-off": summarize("sla-os-off", load(idle, [0.2] * 11, 100)),
          "sla": summarize("sla", load(idle, [0.06] * 10 + [0.14], 95))}
    assert by["sla"]["idle_ttft_p90_ms"] == pytest.approx(49.0)
    assert by["sla"]["flood_over_idle_p90"] == pytest.approx(by["sla"]["interactive_ttft_p90_ms"] / 49.0)
    lines = verdicts(by)
    assert lines[0].startswith("sla-os-off:") and "p90 4.08x (target <= 2: NOT met)" in lines[0]
    assert "p90 1.22x (target <= 2: met)" in lines[1] and "p99 2.65x (target <= 3: met)" in lines[1]
    assert "95 % of FIFO's (target >= 90 %: met)" not in lines[2] and "batch throughput 95% of FIFO's" in lines[2]
    assert "95% of what it was without any OS priority knob (target >= 90 %: met)" in lines[3]
    rows = table(list(by.values())).splitlines()
    assert rows[0] == "| metric | fifo | sla-os-off | sla |" and len(rows) == 2 + 18


def test_a_json_destination_that_cannot_be_written_is_said_before_the_run(tmp_path):
    """`tandem bench serve --json /nonexistent/dir/x.json` ran the whole benchmark, then lost its
    results to a FileNotFoundError traceback."""
    import subprocess
    import sys
    from pathlib import Path
    from bench.cli import json_destination_problem
    assert json_destination_problem(str(tmp_path / "x.json")) is None
    assert "a directory" in json_destination_problem(str(tmp_path))
    assert "no directory" in json_destination_problem(str(tmp_path / "no" / "x.json"))
    out = subprocess.run([sys.executable, "-m", "services.cli", "bench", "serve", "--url", "http://127.0.0.1:1",
                          "--json", str(tmp_path / "no" / "x.json")], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "said before the run" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("argv, said", [
    (["engine", "--threads", "-2"], "must be at least 1"),
    (["grammar", "--rounds", "0"], "must be at least 1"),
    (["kernels", "--model", "/nonexistent.gguf", "--no-matmuls"], "cannot load model /nonexistent.gguf"),
])
def test_a_bench_given_nonsense_says_so_in_one_line(argv, said):
    """Each was a traceback (set_num_threads, a KeyError after the run, ModelLoadError)."""
    import subprocess
    import sys
    from pathlib import Path
    out = subprocess.run([sys.executable, "-m", "services.cli", "bench", *argv], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, out.stderr
