"""``tandem bench agents``' arithmetic (bench/agents.py): what a turn re-prefilled, the summary's
shares and the flood's rate. The bench itself runs a whole stack: docs/benchmarks.md."""

import argparse
import math
import os
import subprocess
import sys
import time

import pytest

from bench import agents, cpu_time
from bench.loadgen import RequestResult


def _turn(k, t, known, cached, inp=100, ttft=0.1):
    return agents.Turn(session=k, turn=t, ttft=ttft, input_tokens=inp, cached_tokens=cached, output_tokens=64,
                       known=known)


def test_reprefilled_counts_the_conversation_computed_again():
    assert _turn(0, 0, known=0, cached=32).reprefilled == 0          # a first turn: nothing known yet
    assert _turn(0, 1, known=153, cached=144).reprefilled == 9       # the reply's last partial block
    assert _turn(0, 1, known=153, cached=0).reprefilled == 153       # everything again


def test_summary_shares_and_errors():
    turns = [_turn(0, 0, 0, 0, ttft=1.0), _turn(0, 1, 153, 144, inp=200), _turn(0, 2, 300, 250, inp=350),
             agents.Turn(session=1, turn=1, error="RuntimeError: boom")]
    s = agents.summarize(turns)
    assert s["turns"] == 4 and s["errors"] == 1
    assert s["turns_within_32_share"] == 0.5                 # 9 tokens again: within; 50: not
    assert s["reprefilled_max"] == 50
    assert s["cached_share"] == pytest.approx((144 + 250) / (200 + 350))


def test_flood_rate_counts_finished_requests_only():
    ok = RequestResult(ok=True, tokens=16, prompt_tokens=1000)
    bad = RequestResult(ok=False, error="HTTP 503")
    r = agents._flood_rate([ok, ok, bad], 10.0)
    assert r == {"flood_requests": 2, "flood_errors": 1, "seconds": 10.0, "flood_tok_s": 203.2}
    assert math.isnan(agents._flood_rate([], 0.0)["flood_tok_s"])


def test_bad_arguments_are_refused_before_a_stack_starts():
    p = argparse.ArgumentParser()
    agents.add_arguments(p)
    for bad in (["--turns", "1"], ["--sessions", "0"]):
        with pytest.raises(ValueError):
            agents.run(p.parse_args(bad))
    with pytest.raises(SystemExit):          # refused by argparse itself (bench.cli.at_least)
        p.parse_args(["--rounds", "0"])


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads Linux's /proc")
def test_cpu_time_counts_a_session_by_service():
    busy = "import time\nt = time.time()\nwhile time.time() - t < 20: pass"
    p = subprocess.Popen([sys.executable, "-c", busy, "serve", "busy"], start_new_session=True)
    try:
        time.sleep(0.2)
        for _ in range(10):   # a second in which the busy loop got some CPU (a loaded machine may starve it)
            a, t0 = cpu_time.by_service(p.pid), time.monotonic()
            time.sleep(1.0)
            b, t1 = cpu_time.by_service(p.pid), time.monotonic()
            c = cpu_time.cores(a, b, t1 - t0)
            if c.get("busy", 0) > 0.1:
                break
        assert set(c) == {"busy"} and 0.1 < c["busy"] <= 1.5   # one busy thread: at most a core
        assert cpu_time.by_service(os.getpid() + 10**7) == {}   # no such session
    finally:
        p.kill()
        p.wait()
