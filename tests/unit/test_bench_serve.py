"""The serving benchmark's pure parts: percentiles, per-request metrics, summaries, the table."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.serve import (
    RequestResult,
    add_arguments,
    markdown_table,
    merge_runs,
    percentile,
    request_metrics,
    split_rounds,
    summarize,
    tpot_ratio,
)


def test_percentile_exact_values():
    xs = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert percentile(xs, 50) == 5.5
    assert percentile(xs, 0) == 1
    assert percentile(xs, 100) == 10
    assert percentile(xs, 99) == pytest.approx(9.91)   # 1 + 0.99 * 9 = 9.91 -> 9 + 0.91
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(list(range(101)), 99) == 99      # order statistics land exactly


def test_percentile_order_and_edge_cases():
    assert percentile([5, 1, 3], 50) == 3              # unsorted input
    assert percentile([7], 99) == 7
    assert percentile([0, 10], 25) == 2.5
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    xs = [0.3, 12.0, 4.5, 4.5, 7.25, 100.0, 0.0, 3.0, 9.0]
    for q in (1, 10, 50, 90, 99):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_request_metrics():
    # sent at 10.0; first token at 10.5; 4 more tokens every 0.1 s; stream ends at 11.0
    r = request_metrics(10.0, [10.5, 10.6, 10.7, 10.8, 10.9], 11.0, tokens=5)
    assert r.ok and r.tokens == 5
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.1)
    assert r.itl == pytest.approx([0.1] * 4)
    assert r.latency == pytest.approx(1.0)
    # usage counts more tokens than chunks (a chunk carried two tokens): TPOT uses the tokens
    r2 = request_metrics(0.0, [1.0, 2.0], 2.5, tokens=3)
    assert r2.tpot == pytest.approx(0.5) and r2.tokens == 3
    # no usage chunk: the chunk count stands in
    assert request_metrics(0.0, [1.0, 1.2, 1.4], 1.5, tokens=None).tokens == 3
    assert math.isnan(request_metrics(0.0, [1.0], 1.0, tokens=1).tpot)
    assert not request_metrics(0.0, [], 1.0, tokens=None).ok


def test_summarize():
    rs = [RequestResult(ok=True, tokens=10, ttft=t, tpot=t / 10, itl=[t / 10], latency=2 * t)
          for t in (0.1, 0.2, 0.3, 0.4, 0.5)]
    rs.append(RequestResult(ok=False, error="boom"))
    s = summarize(rs, wall_s=2.0)
    assert s["requests"] == 6 and s["errors"] == 1
    assert s["output_tokens"] == 50
    assert s["throughput_tok_s"] == 25.0
    assert s["ttft_p50_ms"] == pytest.approx(300.0)
    assert s["ttft_p99_ms"] == pytest.approx(496.0)    # 0.4 + 0.96 * 0.1
    assert s["tpot_p50_ms"] == pytest.approx(30.0)
    assert s["latency_p50_ms"] == pytest.approx(600.0)


def _run(system, c, tpot):
    return {"system": system, "concurrency": c, "requests": 4, "errors": 0, "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0,
            "tpot_p50_ms": tpot, "tpot_p99_ms": tpot * 2, "itl_p99_ms": 5.0, "throughput_tok_s": 100.0}


def test_table_and_ratio():
    runs = [_run("stack", 1, 22.0), _run("in-process", 1, 20.0), _run("stack", 8, 50.0), _run("in-process", 8, 45.0)]
    assert tpot_ratio(runs) == pytest.approx(1.1)
    assert tpot_ratio(runs[:1]) is None
    table = markdown_table(runs).splitlines()
    assert table[0].startswith("| system |") and len(table) == 6
    assert table[2].startswith("| in-process | 1 |") and table[3].startswith("| stack | 1 |")


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
        return {"system": "stack", "concurrency": 1, **summarize(rs, wall), "per_request": [asdict(r) for r in rs]}
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
