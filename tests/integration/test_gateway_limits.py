"""The gateway's limits in a real gateway process (``tandem serve gateway``) on a real NATS
server, with a scripted router on the bus (no engine):

- a 200 MB chunked upload gets 413 ``body_too_large`` and the gateway's memory does not grow by
  it (its peak RSS, from /proc);
- a request whose bus message is over the limit (16 stop strings of 40 KB) gets 413
  ``request_too_large``, not a 500 — and the gateway keeps serving.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from shared import subjects
from shared.bus import Bus
from shared.nats_server import EmbeddedNats, free_port
from shared.schemas import RoutePlan, RouteRequest
from shared.settings import NatsSettings, Settings

pytestmark = pytest.mark.timeout(300)

LIMIT = 1 << 20
UPLOAD = 200 << 20


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


@pytest.fixture(scope="module")
def gateway():
    server = EmbeddedNats()
    nats_url = server.start()
    port = free_port()
    env = {**os.environ, "TANDEM_NATS_URL": nats_url, "TANDEM_MAX_BODY_BYTES": str(LIMIT), "TANDEM_PORT": str(port),
           "TANDEM_RESUME_WAIT_S": "2"}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "--log-level", "WARNING", "serve", "gateway"],
                            env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, "the gateway exited"
            assert time.monotonic() < deadline, "the gateway did not start"
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield proc, url, nats_url
    finally:
        proc.terminate()
        proc.wait(30)
        server.stop()


def test_a_200_mb_chunked_body_is_413_without_the_gateway_holding_it(gateway):
    proc, url, _ = gateway
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    for _ in range(3):   # settle the allocator on the ordinary paths first
        httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": []})
    before = max(_status_kib(proc.pid, "VmRSS"), _status_kib(proc.pid, "VmHWM"))
    sent = 0

    def body():  # no Content-Length: Transfer-Encoding chunked
        nonlocal sent
        chunk = b'{"model": "' + b"x" * ((1 << 20) - 11)
        while sent < UPLOAD:
            sent += len(chunk)
            yield chunk

    r = httpx.post(f"{url}/v1/chat/completions", content=body(), timeout=120)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "body_too_large"
    peak = _status_kib(proc.pid, "VmHWM")
    grew_mib = (peak - before) / 1024
    assert grew_mib < 2 * LIMIT / 2**20 + 16, f"the gateway's peak RSS grew by {grew_mib:.0f} MiB"
    assert sent < UPLOAD   # the connection was closed: the rest was never read
    assert httpx.get(f"{url}/v1/models").status_code == 200


async def test_an_oversized_bus_message_is_413_with_a_code(gateway):
    proc, url, nats_url = gateway
    router = await Bus.connect(Settings(nats=NatsSettings(url=nats_url)), name="router")
    routed: list[str] = []

    async def route(req: RouteRequest) -> RoutePlan:
        routed.append(req.request_id)
        return RoutePlan(request_id=req.request_id, prefill_worker=None, decode_worker="w",
                         decode_role=subjects.CPU_DECODE, reason="to w")

    await router.serve(subjects.ROUTE, route, expected=RouteRequest)
    try:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        model = (await client.models.list()).data[0].id
        stops = [chr(ord("a") + i) * 40_000 for i in range(16)]   # 640 KB: over the bus's message limit
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as info:
                out = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                           stop=stops, max_tokens=4, stream=stream)
                if stream:
                    async for _ in out:
                        pass
            assert info.value.status_code == 413
            err = info.value.response.json()["error"]
            assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error", err
        assert len(routed) == 2   # it was routed, then refused before anything was sent to a worker
        assert proc.poll() is None and httpx.get(f"{url}/v1/models").status_code == 200
    finally:
        await router.close()
