"""Prometheus series: the helpers feed the named series, and the gateway's /metrics exposes
its per-tier TTFT / TPOT and outcomes after a request (the fake backend of test_gateway)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared import metrics


def samples() -> dict[tuple, float]:
    body, ctype = metrics.render()
    assert ctype.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def value(name: str, **labels) -> float:
    return samples().get((name, tuple(sorted(labels.items()))), 0.0)


def test_helpers_feed_the_named_series():
    before = value("tandem_pool_lookups_total", tier="disk", result="hit")
    metrics.pool_lookup("disk", hit=True)
    metrics.pool_lookup("none", hit=False)
    metrics.pool_hit_bytes("disk", 4096)
    assert value("tandem_pool_lookups_total", tier="disk", result="hit") == before + 1
    assert value("tandem_pool_lookups_total", tier="none", result="miss") >= 1
    assert value("tandem_pool_hit_bytes_total", tier="disk") >= 4096
    metrics.pool_stored("disk", 123)
    assert value("tandem_pool_bytes", tier="disk") == 123
    n = value("tandem_transfer_seconds_count", path="test-path")
    metrics.transfer("test-path", nbytes=1000, seconds=0.002)
    assert value("tandem_transfer_seconds_count", path="test-path") == n + 1
    assert value("tandem_transfer_bytes_total", path="test-path") >= 1000
    metrics.migration("gpu-decode", "cpu-decode", "ok", 0.02)
    assert value("tandem_migrations_total", source_role="gpu-decode", target_role="cpu-decode", outcome="ok") >= 1
    assert value("tandem_migration_seconds_count", source_role="gpu-decode", target_role="cpu-decode") >= 1
    metrics.set_engine_load("test-role", queue_depth=3, running=5, kv_used=10, kv_free=90)
    assert value("tandem_queue_depth", service="test-role") == 3
    assert value("tandem_running_sequences", service="test-role") == 5
    assert value("tandem_kv_blocks", service="test-role", state="free") == 90
    metrics.observe_request("test-role", "batch", ttft=0.2, tpot=0.01, queue=0.003, tokens=7, outcome="ok")
    assert value("tandem_ttft_seconds_bucket", service="test-role", tier="batch", le="0.25") >= 1
    assert value("tandem_queue_seconds_count", service="test-role", tier="batch") >= 1
    assert value("tandem_generated_tokens_total", service="test-role", tier="batch") >= 7


def test_serve_http_binds_a_free_port_or_stays_off():
    import httpx

    assert metrics.serve_http(-1) is None
    port = metrics.serve_http(0)
    assert port and "tandem_ttft_seconds" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


def test_gateway_metrics_after_a_request():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from services.gateway.app import create_app
    from tests.unit.test_gateway import MODEL, FakeBackend

    backend = FakeBackend()
    client = TestClient(create_app(backend))
    ok = value("tandem_requests_total", service="gateway", tier="interactive", outcome="ok")
    r = client.post("/v1/chat/completions", headers={"X-Tandem-SLA": "interactive"},
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200
    bad = client.post("/v1/chat/completions", json={"model": "nope", "messages": []})
    assert bad.status_code in (400, 404)
    m = client.get("/metrics")
    assert m.status_code == 200 and "tandem_ttft_seconds_bucket" in m.text
    assert 'tandem_ready{service="gateway"} 1.0' in m.text     # what /health says (an alert on min(tandem_ready))
    backend.ready = False
    assert 'tandem_ready{service="gateway"} 0.0' in client.get("/metrics").text
    backend.ready = True
    assert value("tandem_requests_total", service="gateway", tier="interactive", outcome="ok") == ok + 1
    assert value("tandem_ttft_seconds_count", service="gateway", tier="interactive") >= 1
    assert value("tandem_tpot_seconds_count", service="gateway", tier="interactive") >= 1
    assert value("tandem_generated_tokens_total", service="gateway", tier="interactive") >= 4
    assert value("tandem_requests_total", service="gateway", tier="none", outcome="rejected") >= 1
    # a client's mistakes (a path that does not exist, a bad body) are not the server's errors
    before = {k: v for k, v in samples().items() if k[0] == "tandem_requests_total"}
    assert client.get("/wp-login.php").status_code == 404
    assert client.post("/v1/chat/completions", content=b"{nope").status_code == 400
    after = {k: v for k, v in samples().items() if k[0] == "tandem_requests_total"}
    moved = {dict(k[1])["outcome"]: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert moved == {"rejected": 2}


def test_a_stream_that_ends_early_still_counts_its_first_token():
    """A stream that fails mid-stream (or whose client leaves) after its first token: its TTFT
    is observed (it was left out: the TTFT of every such stream went missing)."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from services.gateway.app import create_app
    from services.gateway.backend import BackendError
    from tests.unit.test_gateway import MODEL, FakeBackend

    backend = FakeBackend()
    backend.mid_error = BackendError("worker_lost", "lost", 502)
    client = TestClient(create_app(backend))
    ttft = value("tandem_ttft_seconds_count", service="gateway", tier="batch")
    errors = value("tandem_requests_total", service="gateway", tier="batch", outcome="error")
    with client.stream("POST", "/v1/chat/completions", headers={"X-Tandem-SLA": "batch"},
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
        body = "".join(r.iter_text())
    assert r.status_code == 200 and "worker_lost" in body, body
    assert value("tandem_requests_total", service="gateway", tier="batch", outcome="error") == errors + 1
    assert value("tandem_ttft_seconds_count", service="gateway", tier="batch") == ttft + 1


def test_session_kv_series():
    """Sessions resident (heartbeat load), evicted (the connector's spill), cached tokens per turn."""
    from collections import OrderedDict

    from shared.kv_connector import KVConnector
    metrics.set_engine_load("test-sessions", queue_depth=0, running=0, kv_used=1, kv_free=1, sessions_resident=3)
    assert value("tandem_sessions_resident", service="test-sessions") == 3
    conn = object.__new__(KVConnector)     # the spill path alone: no bus, no pool
    conn.role, conn.pool = "test-sessions", None
    conn._spilled_heads = OrderedDict()
    conn.engine = type("E", (), {"layout": type("L", (), {"block_size": 16})})()
    n = value("tandem_sessions_evicted_total", service="test-sessions")
    conn._spilled([1] * 16, b"", "", "24h")
    assert value("tandem_sessions_evicted_total", service="test-sessions") == n + 1
    r = value("tandem_sessions_reloaded_total", service="test-sessions")
    metrics.SESSIONS_RELOADED.labels("test-sessions").inc()   # KVConnector.fetch_prefix, on a session tail hit
    assert value("tandem_sessions_reloaded_total", service="test-sessions") == r + 1
    c = value("tandem_session_turn_cached_tokens_count", tier="batch")
    metrics.observe_session_turn("batch", prompt_tokens=300, cached_tokens=256)
    assert value("tandem_session_turn_cached_tokens_count", tier="batch") == c + 1
    assert value("tandem_session_turn_cached_tokens_sum", tier="batch") >= 256


def test_a_picked_port_is_never_one_a_bind_to_port_0_gets():
    """A test stack's gateway port is picked, released, then bound by the child: a /metrics server on
    port 0 in between must not be able to take it (it did once, and /health answered Prometheus text)."""
    import socket

    from shared.nats_server import _ephemeral_range, free_port

    low, high = _ephemeral_range()
    picked = {free_port() for _ in range(50)}
    assert all(p < low for p in picked), sorted(picked)
    with socket.socket() as s:                   # what serve_http(0) does
        s.bind(("127.0.0.1", 0))
        assert low <= s.getsockname()[1] <= high


def test_every_metric_the_docs_name_is_exported_under_that_name():
    """docs named two counters without the ``_total`` prometheus_client exports them with: a
    PromQL query on the documented name finds nothing."""
    import re
    from pathlib import Path
    from prometheus_client import REGISTRY
    from shared import bus_auth
    exported = {bus_auth.RESPONSES_BUCKET, bus_auth.SESSIONS_BUCKET, bus_auth.PREFIX_BUCKET}  # not metrics
    for family in REGISTRY.collect():   # a counter's family name is no series: its _total is
        exported |= {family.name + "_total" if family.type == "counter" else family.name,
                     *(s.name for s in family.samples)}
    root = Path(__file__).resolve().parents[2]
    named = {(path.name, m) for path in [root / "README.md", *(root / "docs").glob("*.md")]
             for m in re.findall(r"\btandem_[a-z0-9_]+", path.read_text())}
    assert len(named) > 40
    assert sorted(n for n in named if n[1] not in exported) == []
