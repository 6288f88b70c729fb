"""`tandem bench chaos`'s accounting on made-up results: every answer in one class (exact, clear
error, a finish outside OpenAI's, cut short, drifted, silent), resumes, and the soak's RSS growth
(the stack runs only in the bench itself)."""

from __future__ import annotations

import pytest

import argparse

from bench import chaos


def result(prompt: str, text: str, finish: str | None = "length", resumes: int = 0, seconds: float = 1.0,
           **kw) -> dict:
    return {"prompt": prompt, "text": text, "finish": finish, "error": kw.pop("error", ""), "resumes": resumes,
            "reused": kw.pop("reused", 0), "recomputed": kw.pop("recomputed", 0), "seconds": seconds,
            "start": 0.0, "end": 1.0, "id": "", "tier": "standard", "stream": kw.pop("stream", True), **kw}


def test_summary_counts_what_the_clients_saw():
    args = argparse.Namespace(duration=10.0, concurrency=2, kill_every=0.0)
    refs = {"a": "alpha", "b": "beta"}
    results = [result("a", "alpha"), result("b", "beta", resumes=1, seconds=3.0, reused=32, recomputed=5),
               result("a", "alpHa"), result("b", "", finish=None, error="error event: worker_lost"),
               result("a", "", finish=None, silent=True, error="connection closed"),
               result("b", "be", finish="abort", stream=False),   # a cut text under a finish no client knows
               result("a", "al", finish="length"),                 # cut short: a prefix, a normal finish
               result("a", "alpha", finish="stop")]                # the text, but not as asked (ignore_eos)
    res = chaos.summarize_chaos(args, refs, results, [], {"cpu-decode": [(0.0, 100.0)] * 20}, 0.0)
    assert res["requests"] == 8 and res["streamed"] == 7 and res["resumed"] == 1
    assert res["counts"] == {"exact": 2, "error": 1, "abort": 1, "cut_short": 2, "drifted": 1, "silent": 1}
    assert sorted(b["class"] for b in res["bad"]) == ["abort", "cut_short", "cut_short", "drifted", "silent"]
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


def test_report_separates_errors_from_wrong_answers(capsys):
    args = argparse.Namespace(duration=10.0, concurrency=1, kill_every=10.0)
    results = [result("a", "x")] * 998 + [result("a", "", finish=None, error="HTTP 504"), result("a", "", "abort")]
    kills = [{"t": 5.0, "name": "nats", "role": "nats", "back_s": 1.0, "heal_s": 2.5}]
    res = chaos.summarize_chaos(args, {"a": "x"}, results, kills, {}, 0.0)
    chaos.print_report(res)
    out = capsys.readouterr().out
    assert "| clear errors (an error status / error event) | 1 (1.00 per 1,000) |" in out
    assert "| finish_reason outside OpenAI's (\"abort\") | 1 |" in out
    assert "| an exact answer served after the last kill (s) | 2.5 |" in out and "nats ×1" in out


def test_a_kill_picks_among_every_role():
    assert {chaos.role_of(n) for n in ("prefill-7", "gpu-decode-7-2", "cpu-decode-2-7", "kvpool-7", "router-7-1",
                                        "nats")} == set(chaos.ROLES)


def test_arguments_out_of_range_are_refused():
    """``--duration -5`` or ``--concurrency 0`` ran anyway (and one such run left a stack behind)."""
    import argparse

    from bench import chaos
    p = argparse.ArgumentParser()
    chaos.add_arguments(p)
    for argv in (["--duration", "-5"], ["--concurrency", "0"], ["--kill-every", "-3"], ["--max-tokens", "x"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    a = p.parse_args(["--duration", "30", "--concurrency", "2", "--kill-every", "0"])
    assert (a.duration, a.concurrency, a.kill_every) == (30.0, 2, 0.0)
