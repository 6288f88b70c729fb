"""`tandem health` (the containers' health check) reads tandem_ready from a real /metrics."""

from __future__ import annotations

import argparse

from services import health
from shared import metrics


def test_check_wants_every_ready_series_at_one():
    assert health.check("# HELP x\nother 1.0\n") == (False, "no tandem_ready series yet (still starting)")
    ok, why = health.check('tandem_ready{service="cpu-decode"} 1.0\n')
    assert ok and "cpu-decode" in why
    ok, why = health.check('tandem_ready{service="cpu-decode"} 0.0\ntandem_ready{service="router"} 1.0\n')
    assert not ok and why == 'not ready: tandem_ready{service="cpu-decode"}'


def test_health_against_a_live_metrics_endpoint(capsys):
    port = metrics.serve_http(0)
    args = argparse.Namespace(url=f"http://127.0.0.1:{port}/metrics", timeout=3.0)
    metrics.READY.clear()  # only this test's series (others may be left by earlier tests)
    metrics.set_ready("health-test", False)
    assert health.main(args) == 1 and "not ready" in capsys.readouterr().err
    metrics.set_ready("health-test", True)
    assert health.main(args) == 0
    assert health.main(argparse.Namespace(url="http://127.0.0.1:1/metrics", timeout=1.0)) == 1
