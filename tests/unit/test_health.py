"""`tandem health` (the containers' health check) reads tandem_ready from a real /metrics."""

from __future__ import annotations

import argparse

import pytest

from services import health
from shared import metrics


def test_check_wants_every_ready_series_at_one():
    ok, why = health.check("# HELP x\nother 1.0\n")
    assert not ok and "still starting, or exports none (the gateway's check is its /health" in why
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
    capsys.readouterr()
    assert health.main(argparse.Namespace(url="http://127.0.0.1:1/metrics", timeout=1.0)) == 1
    assert "TANDEM_METRICS_PORT" in capsys.readouterr().err   # where the metrics are, and the gateway's --url


def test_a_bad_url_port_or_timeout_is_one_line_not_a_traceback(capsys):
    """They were tracebacks (ValueError, http.client.InvalidURL)."""
    for url in ("notaurl", "http://127.0.0.1:abc/metrics"):
        assert health.main(argparse.Namespace(url=url, timeout=1.0)) == 1
        assert url in capsys.readouterr().err
    p = argparse.ArgumentParser()
    health.add_arguments(p)
    for bad in ("-1", "0", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--timeout", bad])
    assert "is not a number of seconds > 0" in capsys.readouterr().err


def test_the_gateway_s_health_names_the_roles_with_no_worker():
    """`tandem health --url http://gw:8000` said "ready: gateway (cpu-decode, gpu-decode, prefill,
    router)" when the stack had no prefill or gpu-decode worker: the roles are now said apart."""
    import json

    from services.health import check_gateway
    body = json.dumps({"status": "ready", "details": {
        "router": {"ready": True, "workers": ["r"]}, "prefill": {"ready": False, "workers": []},
        "gpu-decode": {"ready": False, "workers": []}, "cpu-decode": {"ready": True, "workers": ["c"]}}}).encode()
    assert check_gateway(200, body) == (True, "ready: gateway (cpu-decode, router); none of gpu-decode, prefill")
    ok, why = check_gateway(503, body.replace(b'"router": {"ready": true', b'"router": {"ready": false'))
    assert not ok and "no ready" in why and "router" in why
