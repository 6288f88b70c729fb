"""`tandem bench chaos`'s accounting on made-up results: wrong text, silent and coded failures,
resumes, and the soak's RSS growth (the stack runs only in the bench itself)."""

from __future__ import annotations

import argparse

from bench import chaos


def result(prompt: str, text: str, ok: bool = True, resumes: int = 0, seconds: float = 1.0, **kw) -> dict:
    return {"prompt": prompt, "text": text, "ok": ok, "error": kw.pop("error", ""), "resumes": resumes,
            "reused": kw.pop("reused", 0), "recomputed": kw.pop("recomputed", 0), "seconds": seconds,
            "start": 0.0, "end": 1.0, **kw}


def test_summary_counts_what_the_clients_saw():
    args = argparse.Namespace(duration=10.0, concurrency=2, kill_every=0.0)
    refs = {"a": "alpha", "b": "beta"}
    results = [result("a", "alpha"), result("b", "beta", resumes=1, seconds=3.0, reused=32, recomputed=5),
               result("a", "alpHa"), result("b", "", ok=False, error="worker_lost: gone"),
               result("a", "", ok=False, silent=True, error="connection closed")]
    res = chaos.summarize_chaos(args, refs, results, [], {"cpu-decode": [(0.0, 100.0)] * 20}, 0.0)
    assert (res["requests"], res["completed"], res["resumed"], res["failed"]) == (5, 3, 1, 2)
    assert res["wrong_text"] == 1 and res["failed_silently"] == 1
    assert res["reused_tokens"] == 32 and res["recomputed_tokens"] == 5
    assert res["resumed_extra_s"]["p50"] == 2.0   # 3 s against the 1 s median of the others


def test_rss_growth_ignores_the_warm_up_and_finds_a_leak():
    flat = [50.0, 80.0] + [100.0] * 18          # grows while warming up, then flat
    leak = [100.0 + i for i in range(20)]       # 1 MiB per sample
    assert chaos.rss_growth(flat) == 0.0
    assert chaos.rss_growth(leak) == 16.0       # from sample 2 to sample 18


def test_report_prints_the_rss_table(capsys):
    args = argparse.Namespace(duration=10.0, concurrency=1, kill_every=0.0)
    res = chaos.summarize_chaos(args, {"a": "x"}, [result("a", "x")], [],
                                {"gateway": [(float(i), 100.0 + i) for i in range(20)]}, 0.0)
    chaos.print_report(res)
    out = capsys.readouterr().out
    assert "| gateway | 100 | 119 | 119 | +16.0 |" in out

