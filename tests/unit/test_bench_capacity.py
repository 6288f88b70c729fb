"""The node capacity ladder's pure parts (bench/capacity.py): a level's verdict, the next rate,
the capacity of the levels tried, the table."""

from __future__ import annotations

import math

from bench import capacity
from bench.capacity import Slo, judge, next_rate


def _summary(errors=0, ttft=100.0, tpot=20.0, inter=4):
    return {"requests": 12, "errors": errors,
            "per_tier": {"interactive": {"requests": inter, "ttft_p90_ms": ttft, "tpot_p90_ms": tpot},
                         "batch": {"requests": 8, "ttft_p90_ms": 9000.0, "tpot_p90_ms": 400.0}}}


def test_a_level_passes_on_the_interactive_slo_alone():
    ok, why = judge(_summary(), 12.0, 10, 15, Slo(500, 50))
    assert ok and "TTFT p90 100 ms" in why          # batch's slow TTFT / TPOT do not count


def test_a_level_fails_on_errors_backlog_ttft_or_tpot():
    slo = Slo(500, 50)
    assert judge(_summary(errors=1), 12.0, 10, 15, slo) == (False, "1 of 12 requests failed")
    assert not judge(_summary(), 26.0, 10, 15, slo)[0]                        # did not drain
    assert judge(_summary(), math.inf, 10, 15, slo) == (False, "did not drain: cut off past 10 + 15 s")
    assert "TTFT p90 600 ms > 500" in judge(_summary(ttft=600), 12, 10, 15, slo)[1]
    assert "TPOT p90 51.0 ms > 50" in judge(_summary(tpot=51), 12, 10, 15, slo)[1]
    assert not judge(_summary(inter=0), 12, 10, 15, slo)[0]
    assert judge(_summary(tpot=math.nan), 12, 10, 15, slo)[0]                 # one-token replies


def test_the_ladder_doubles_then_bisects_once():
    assert next_rate([], 1.0) == 1.0
    assert next_rate([(1, True), (2, True)], 1.0) == 4
    tried = [(1, True), (2, True), (4, True), (8, False)]
    mid = next_rate(tried, 1.0)
    assert mid == math.sqrt(32)
    assert next_rate(tried + [(mid, True)], 1.0) is None
    assert next_rate(tried + [(mid, False)], 1.0) is None
    assert capacity.capacity(tried + [(mid, True)]) == mid
    assert capacity.capacity(tried + [(mid, False)]) == 4


def test_a_fail_at_the_start_halves_once():
    assert next_rate([(1, False)], 1.0) == 0.5
    assert next_rate([(1, False), (0.5, False)], 1.0) is None
    assert next_rate([(1, False), (0.5, True)], 1.0) == math.sqrt(0.5)
    assert capacity.capacity([(1, False), (0.5, False)]) == 0.0


def test_the_table_states_the_slo_and_the_ratio():
    lv = [{"rate": 1, "passed": True, "why": "ok"}, {"rate": 2, "passed": False, "why": "TTFT"}]
    res = {"slo": Slo(500, 50).describe(), "mix": "interactive=1,batch=2", "max_tokens": 64, "level_s": 10,
           "drain_s": 15, "ratio": 1.5, "bracketed": False,
           "configs": {"gpu+cpu": {"capacity_req_s": 1.5, "first_fail_req_s": 2, "stopped": "", "levels": lv},
                       "gpu": {"capacity_req_s": 1, "first_fail_req_s": None, "stopped": "time budget", "levels": lv}}}
    t = capacity.table(res)
    assert "interactive TTFT p90 <= 500 ms and TPOT p90 <= 50 ms" in t
    assert "| gpu-decode + cpu-decode | 1.5 (fails at 2) |" in t and "| gpu-decode alone | ≥ 1 |" in t
    assert "GPU + CPU ÷ GPU alone at this SLO: 1.50 of lower bounds — not a capacity ratio" in t
    res["bracketed"] = True
    assert "GPU + CPU ÷ GPU alone at this SLO: 1.50\n" in capacity.table(res) + "\n"


def test_a_level_has_interactive_requests_whatever_the_draw():
    import pytest
    for seed in range(20):
        jobs = capacity.level_jobs(0.5, 6, "interactive=1,batch=9", 16, seed)
        assert len(jobs) == 6 and sum(j[0].tier == "interactive" for j in jobs) >= 2
    assert len(capacity.level_jobs(4, 10, "interactive=1,batch=2", 16, 0)) == 40
    with pytest.raises(ValueError, match="no interactive"):
        capacity.level_jobs(1, 10, "batch=1", 16, 0)


def test_the_ladder_serves_an_unjudged_warm_up_first(monkeypatch):
    """A warm-up level at the start rate runs before the ladder and never counts: a first level
    that failed only on first-use work (a GPU's kernel compiles) would end the ladder early."""
    from types import SimpleNamespace
    calls = []

    def level(url, rate, args, k, level_s=None):
        calls.append((rate, level_s))
        bad = level_s is not None        # the warm-up: as slow as a first use can be
        tier = {"requests": 3, "ttft_p90_ms": 900.0 if bad else 20.0, "tpot_p90_ms": 4.0}
        return {"requests": 9, "errors": 0, "per_tier": {"interactive": tier}}, 5.0
    monkeypatch.setattr(capacity, "_level", level)
    monkeypatch.setattr(capacity.time, "sleep", lambda s: None)
    args = SimpleNamespace(slo_ttft_ms=500, slo_tpot_ms=50, start_rate=2, max_rate=8, level_s=8, drain_s=10,
                           settle_s=5, warmup_s=4, mix="interactive=1,batch=2", cap_max_tokens=64)
    res = capacity.ladder("http://x", args, "t", deadline=capacity.time.monotonic() + 1e6)
    assert calls[0] == (2, 4) and [r for r, s in calls[1:]] == [2, 4, 8]
    assert res["warmup"]["interactive_ttft_p90_ms"] == 900 and all(lv["passed"] for lv in res["levels"])
    args.warmup_s = 0
    calls.clear()
    assert capacity.ladder("http://x", args, "t", capacity.time.monotonic() + 1e6)["warmup"] is None
    assert calls[0] == (2, None)
