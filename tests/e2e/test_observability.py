"""Observability of the real stack (`tandem up --topology disaggregated`: prefill and decode
pools, KV over the data plane): trace context on every hop's NATS message, the request id in
every service's log lines, and every service's /metrics with the named series after a request."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time

import httpx
import nats
import openai
import pytest

from bench.serve import Server
from shared import schemas, subjects, tracing
from services.up import engines
from shared.nats_server import free_port
from tests.e2e.conftest import secured_nats
from tests.e2e.test_stack import bus_denials

TID = "5c1ae3b1f0e2d4c6a8b9e0f1a2b3c4d5"
SERVICES = ("router", "prefill", "cpu-decode")


@pytest.fixture(scope="module")
def nats_url(nats_creds):
    """A server of this module's own (only its stack's messages), secured as `tandem up`'s."""
    with secured_nats(nats_creds) as url:
        yield url


@pytest.fixture(scope="module")
def stack(nats_url):
    port = free_port()
    env = dict(os.environ, TANDEM_PORT=str(port), TANDEM_NATS_URL=nats_url, TANDEM_KV_BUDGET_MB="64",
               TANDEM_HEARTBEAT_INTERVAL="0.5", PYTHONUNBUFFERED="1")
    s = Server("stack", [sys.executable, "-m", "services.cli", "up", "--topology", "disaggregated",
                         "--workers", "2", "--cores", "2"], env, port)
    try:
        s.wait_workers(engines("disaggregated", 2), 240)
        yield s
    finally:
        assert s.stop() == 0, s.tail()
        assert not bus_denials(s)


async def _traced_request(url: str, nats_url: str) -> tuple[str, list]:
    """One streamed chat completion with a client traceparent, and every bus message it caused."""
    nc = await nats.connect(nats_url)
    sub = await nc.subscribe(subjects.ALL)
    await nc.flush()
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = (await client.models.list()).data[0].id
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4, stream=True,
        extra_headers={"traceparent": f"00-{TID}-00f067aa0ba902b7-01", "X-Tandem-SLA": "standard"})
    rid = None
    async for chunk in stream:
        rid = chunk.id
    await asyncio.sleep(0.3)  # the last publishes reach the tap
    # what the tap holds, until 0.2 s pass without a message or 3 s in all: every service's
    # heartbeat shares the wildcard, and seven of them a second can leave no quiet 0.2 s (this
    # drain once never ended)
    msgs, end = [], time.monotonic() + 3.0
    while time.monotonic() < end:
        try:
            msgs.append(await asyncio.wait_for(sub.messages.__anext__(), 0.2))
        except asyncio.TimeoutError:
            break
    await nc.close()
    return rid, msgs


@pytest.fixture(scope="module")
def traced(stack, nats_url):
    return asyncio.run(_traced_request(stack.url, nats_url))


def test_trace_context_survives_every_hop(traced):
    rid, msgs = traced
    hops = {}
    for m in msgs:
        if m.subject.startswith(subjects.HEARTBEAT_ALL[:-1]):
            continue
        obj = schemas.decode(m.data)
        if getattr(obj, "request_id", None) != rid:
            continue
        parsed = tracing.parse_traceparent((m.headers or {}).get("traceparent"))
        assert parsed is not None, f"{m.subject} ({obj.SCHEMA}) carries no traceparent"
        assert parsed[0] == TID, m.subject
        assert m.headers["Tandem-Request-Id"] == rid
        hops.setdefault(type(obj).__name__, set()).add(m.subject.split(".")[1])
    # gateway -> router, gateway -> prefill, prefill -> decode, prefill's and decode's stream chunks
    assert {"RouteRequest", "PrefillRequest", "DecodeRequest", "StreamChunk", "TransferEvent"} <= set(hops), hops


def test_request_id_in_every_services_log_lines(stack, traced):
    rid, _ = traced
    lines = [ln for ln in stack.log if f"[{rid}]" in ln]
    prefixes = {re.split(r"\s*\|", ln, maxsplit=1)[0].strip() for ln in lines}
    assert {"gateway", "router", "prefill", "cpu-decode"} <= prefixes, stack.tail()


async def _metrics_ports(nats_url: str) -> dict[str, int]:
    nc = await nats.connect(nats_url)
    sub = await nc.subscribe(subjects.HEARTBEAT_ALL)
    ports: dict[str, int] = {}
    try:
        while not set(SERVICES) <= set(ports):     # (other roles' beats too: the KV pool's)
            beat = schemas.decode((await asyncio.wait_for(sub.messages.__anext__(), 10)).data)
            ports[beat.role] = beat.metrics_port
    finally:
        await nc.close()
    return ports


def _series(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _value(series: dict[str, float], name: str, **labels) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    hits = [v for k, v in series.items() if k.split("{")[0] == name and all(w in k for w in want)]
    assert hits, f"no {name}{labels}"
    return sum(hits)


def test_every_service_exposes_its_metrics_after_a_request(stack, nats_url, traced):
    gw = httpx.get(stack.url + "/metrics", timeout=5)
    assert gw.status_code == 200 and gw.headers["content-type"].startswith("text/plain")
    g = _series(gw.text)
    assert _value(g, "tandem_ttft_seconds_count", service="gateway", tier="standard") >= 1
    assert _value(g, "tandem_tpot_seconds_count", service="gateway", tier="standard") >= 1
    assert _value(g, "tandem_requests_total", service="gateway", tier="standard", outcome="ok") >= 1
    ports = asyncio.run(_metrics_ports(nats_url))
    assert all(p > 0 for p in ports.values()), ports
    text = {role: httpx.get(f"http://127.0.0.1:{p}/metrics", timeout=5).text for role, p in ports.items()}
    s = {role: _series(t) for role, t in text.items()}
    assert _value(s["router"], "tandem_routes_total", policy="sla", decode_role="cpu-decode", prefill="yes") >= 1
    for role in ("prefill", "cpu-decode"):
        for name in ("tandem_ttft_seconds_count", "tandem_queue_seconds_count", "tandem_generated_tokens_total"):
            assert _value(s[role], name, service=role, tier="standard") >= 1, (role, name)
        assert _value(s[role], "tandem_kv_blocks", service=role, state="free") > 0
        for name in ("tandem_queue_depth", "tandem_running_sequences"):
            _value(s[role], name, service=role)
    assert _value(s["cpu-decode"], "tandem_tpot_seconds_count", service="cpu-decode", tier="standard") >= 1
    assert _value(s["prefill"], "tandem_transfer_bytes_total") > 0
    assert _value(s["prefill"], "tandem_transfer_seconds_count") >= 1
    for name in ("tandem_pool_lookups", "tandem_pool_hit_bytes", "tandem_pool_bytes", "tandem_migrations",
                 "tandem_energy_joules"):  # declared everywhere; samples where a pool / RAPL exists
        assert f"# TYPE {name}" in text["cpu-decode"], name
